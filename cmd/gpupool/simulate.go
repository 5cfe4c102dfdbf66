package main

import (
	"fmt"
	"os"
	"path/filepath"

	"github.com/spf13/cobra"

	"github.com/gpupool/gpupool/agent/device"
	"github.com/gpupool/gpupool/internal/quantity"
)

func newAgentSimulateCmd() *cobra.Command {
	var socket string
	cmd := newGroupCmd(&cobra.Command{
		Use:   "simulate --socket PATH COMMAND",
		Short: "Drive the simulated GPUs of a running 'gpupool agent --simulate'",
		Long: `Simulate talks to the control socket of an agent started with --simulate and
changes what its simulated GPUs report through NVML: the memory a process
uses, utilisation, Xid and ECC errors, and GPUs falling off the bus. The agent
reacts as it would on real GPUs: its watchdog stops a lease that uses more
memory than its slice, and health errors make GPUs unhealthy.

The socket is DATA_DIR/simulate.sock of the agent ('gpupool dev' prints each
host's). GPUs are named by index.`,
		Example: `  S=/tmp/gpupool-dev-123/host-1/simulate.sock
  # make process 4242 use 30 GiB on GPU 0
  gpupool agent simulate --socket $S process --gpu 0 --pid 4242 --memory 30GiB
  gpupool agent simulate --socket $S utilization --gpu 0 --percent 85
  gpupool agent simulate --socket $S xid --gpu 3 --code 79
  gpupool agent simulate --socket $S ecc --gpu 3
  gpupool agent simulate --socket $S lost`,
	},
		simProcessCmd(&socket),
		simUtilizationCmd(&socket),
		simXidCmd(&socket),
		simECCCmd(&socket),
		simLostCmd(&socket),
	)
	cmd.PersistentFlags().StringVar(&socket, "socket", "", "the agent's simulation control socket (required)")
	return cmd
}

// simClient checks --socket and dials it.
func simClient(socket string) (*device.SimClient, error) {
	if socket == "" {
		return nil, usagef("--socket is required: the agent's DATA_DIR/simulate.sock ('gpupool dev' prints it)")
	}
	if _, err := os.Stat(socket); err != nil {
		return nil, fmt.Errorf("--socket %s: %w (is the agent running with --simulate?)", filepath.Clean(socket), err)
	}
	return device.DialSimControl(socket), nil
}

// simDone reports a change on stdout.
func simDone(cmd *cobra.Command, format string, a ...any) error {
	_, err := fmt.Fprintf(cmd.OutOrStdout(), format+"\n", a...)
	return err
}

func simProcessCmd(socket *string) *cobra.Command {
	var (
		gpu, pid int
		memory   string
	)
	cmd := &cobra.Command{
		Use:   "process --gpu N --pid PID --memory SIZE",
		Short: "Make a process use GPU memory (0 removes it)",
		Long: `Process makes the simulated NVML report that PID uses SIZE of GPU N's memory,
as a compute process. The agent attributes the process to the lease whose
cgroup holds it (on a host without cgroups, through its GPUPOOL_LEASE_ID
environment variable). --memory 0 removes the process.`,
		Example: `  gpupool agent simulate --socket $S process --gpu 0 --pid 4242 --memory 30GiB`,
		Args:    noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			mib, err := quantity.ParseMemoryMiB(memory)
			if err != nil && memory != "0" {
				return usagef("--memory %v", err)
			}
			if pid <= 0 {
				return usagef("--pid %d: must be a positive process id", pid)
			}
			c, err := simClient(*socket)
			if err != nil {
				return err
			}
			if err := c.SetProcess(gpu, pid, mib); err != nil {
				return err
			}
			return simDone(cmd, "GPU %d: process %d uses %s", gpu, pid, quantity.FormatMiB(mib))
		},
	}
	cmd.Flags().IntVar(&gpu, "gpu", 0, "GPU index")
	cmd.Flags().IntVar(&pid, "pid", 0, "process id (required)")
	cmd.Flags().StringVar(&memory, "memory", "", "GPU memory the process uses, e.g. 8GiB or 512MiB; 0 removes it (required)")
	return cmd
}

func simUtilizationCmd(socket *string) *cobra.Command {
	var gpu, percent int
	cmd := &cobra.Command{
		Use:     "utilization --gpu N --percent P",
		Short:   "Set a GPU's utilisation",
		Example: `  gpupool agent simulate --socket $S utilization --gpu 0 --percent 85`,
		Args:    noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := simClient(*socket)
			if err != nil {
				return err
			}
			if err := c.SetUtilization(gpu, percent); err != nil {
				return err
			}
			return simDone(cmd, "GPU %d: %d%% utilised", gpu, percent)
		},
	}
	cmd.Flags().IntVar(&gpu, "gpu", 0, "GPU index")
	cmd.Flags().IntVar(&percent, "percent", 0, "utilisation, 0 to 100")
	return cmd
}

func simXidCmd(socket *string) *cobra.Command {
	var (
		gpu  int
		code uint64
	)
	cmd := &cobra.Command{
		Use:   "xid --gpu N --code XID",
		Short: "Deliver an Xid error event",
		Long: `Xid delivers an Xid critical-error event for GPU N. Application Xids (13, 31,
43, 45, 68, 109) are logged and ignored; any other makes the GPU unhealthy.`,
		Example: `  gpupool agent simulate --socket $S xid --gpu 3 --code 79`,
		Args:    noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if code == 0 {
				return usagef("--code is required: the Xid number, e.g. 79 (GPU fell off the bus)")
			}
			c, err := simClient(*socket)
			if err != nil {
				return err
			}
			if err := c.InjectXid(gpu, code); err != nil {
				return err
			}
			return simDone(cmd, "GPU %d: Xid %d delivered", gpu, code)
		},
	}
	cmd.Flags().IntVar(&gpu, "gpu", 0, "GPU index")
	cmd.Flags().Uint64Var(&code, "code", 0, "Xid number (required)")
	return cmd
}

func simECCCmd(socket *string) *cobra.Command {
	var (
		gpu       int
		singleBit bool
	)
	cmd := &cobra.Command{
		Use:     "ecc --gpu N [--single-bit]",
		Short:   "Deliver an ECC error event (double-bit unless --single-bit)",
		Long:    `ECC delivers an ECC error event for GPU N. A double-bit error makes the GPU unhealthy; a single-bit (corrected) one is ignored.`,
		Example: `  gpupool agent simulate --socket $S ecc --gpu 3`,
		Args:    noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := simClient(*socket)
			if err != nil {
				return err
			}
			if err := c.InjectECC(gpu, !singleBit); err != nil {
				return err
			}
			kind := "double-bit"
			if singleBit {
				kind = "single-bit"
			}
			return simDone(cmd, "GPU %d: %s ECC error delivered", gpu, kind)
		},
	}
	cmd.Flags().IntVar(&gpu, "gpu", 0, "GPU index")
	cmd.Flags().BoolVar(&singleBit, "single-bit", false, "a corrected single-bit error instead of a double-bit one")
	return cmd
}

func simLostCmd(socket *string) *cobra.Command {
	return &cobra.Command{
		Use:     "lost",
		Short:   "Make every GPU fail as lost (fallen off the bus)",
		Example: `  gpupool agent simulate --socket $S lost`,
		Args:    noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := simClient(*socket)
			if err != nil {
				return err
			}
			if err := c.LoseGPUs(); err != nil {
				return err
			}
			return simDone(cmd, "every GPU is lost")
		},
	}
}
