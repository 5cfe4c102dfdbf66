package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/gpupool/gpupool/client"
	"github.com/gpupool/gpupool/cuda/proxy"
)

// shimDirEnv names the directory of libcuda.so.1 when --shim-dir does not.
const shimDirEnv = "GPUPOOL_CUDA_SHIM_DIR"

func newAttachCmd() *cobra.Command {
	var (
		f       acquireFlags
		leaseID string
		shimDir string
	)
	cmd := &cobra.Command{
		Use:   "attach [--memory 8GiB --compute 25 | --exclusive | --lease ID] [--shim-dir DIR] -- CMD [ARGS...]",
		Short: "Run a local command whose CUDA calls run on a leased GPU",
		Long: `Attach runs CMD here, on this machine, with a lease attached as its GPU: the
program's CUDA driver API calls run on the lease's pool host. Attach puts
gpupool's libcuda.so.1 (the shim) first on LD_LIBRARY_PATH, serves a local
proxy on a private unix socket (GPUPOOL_CUDA_SOCKET) and carries each of the
program's connections over the lease's QUIC data plane, authenticated with the
lease token, to the lease's CUDA server, which the agent starts on first use.
The program sees only the lease's GPUs, numbered from 0, each with its slice's
memory as its total memory; allocating more fails with
CUDA_ERROR_OUT_OF_MEMORY.

Attach acquires a lease with the same flags as 'gpupool run' and releases it
when CMD ends, or, with --lease ID, attaches to a lease you hold and leaves it
granted. It renews the lease while CMD runs. If the lease ends meanwhile,
CMD's next CUDA call fails with CUDA_ERROR_DEVICE_UNAVAILABLE. A lease with
slices on several pool hosts shows CMD the GPUs of its first host.

The shim is found in --shim-dir, else in $GPUPOOL_CUDA_SHIM_DIR, else in lib
next to the gpupool binary (where 'make build' puts it: bin/lib), else in
../lib (an installed prefix: /usr/local/bin and /usr/local/lib).
Programs that use the CUDA driver API run; programs that use the runtime API
(cudart) and the frameworks built on it do not yet (docs/remote-cuda.md).

Ctrl-C reaches CMD from the terminal; SIGTERM and SIGHUP sent to attach are
passed on to it. Attach exits with CMD's exit code.`,
		Example: `  # with 'gpupool dev' running in another terminal, after 'make examples'
  gpupool attach --memory 8GiB --compute 25 -- bin/examples/vecadd

  # a lease you already hold
  gpupool lease acquire --memory 20GiB --compute 50 --ttl 1h
  gpupool attach --lease l-5f0c2a9e1b7d3c48 -- ./my-cuda-program --size 4096

  # a shim installed elsewhere
  gpupool attach --shim-dir /opt/gpupool/lib --exclusive -- ./my-cuda-program`,
		Args: commandAfterDash("gpupool attach --memory 8GiB --compute 25 -- ./vecadd"),
		RunE: func(cmd *cobra.Command, args []string) error {
			if leaseID != "" {
				var set []string
				cmd.Flags().Visit(func(fl *pflag.Flag) {
					if fl.Name != "lease" && fl.Name != "shim-dir" && cmd.LocalFlags().Lookup(fl.Name) != nil {
						set = append(set, "--"+fl.Name)
					}
				})
				if len(set) > 0 {
					return usagef("--lease %s attaches to a lease you hold and conflicts with %s, which describe a lease to acquire: give one or the other", leaseID, strings.Join(set, ", "))
				}
			}
			lib, err := findShim(shimDir)
			if err != nil {
				return err
			}
			if leaseID != "" {
				return withLease(cmd, leaseID, func(_ context.Context, l heldLease) error {
					return attachRun(cmd, l, lib, args)
				})
			}
			req, err := f.leaseRequest()
			if err != nil {
				return err
			}
			return withClient(cmd, func(_ context.Context, c *client.Client) error {
				l, err := acquireForCommand(cmd, c, req, f.wait, f.acquireOptions(cmd.ErrOrStderr()))
				if err != nil {
					return err
				}
				defer releaseForCommand(cmd, l, "gpupool attach ended")
				return attachRun(cmd, l, lib, args)
			})
		},
	}
	f.register(cmd)
	f.registerWait(cmd)
	// attach renews its lease while the command runs, as run does.
	f.ttl = time.Minute
	cmd.Flags().Lookup("ttl").DefValue = f.ttl.String()
	cmd.Flags().StringVar(&leaseID, "lease", "", "attach to this lease you hold instead of acquiring one (left granted afterwards)")
	cmd.Flags().StringVar(&shimDir, "shim-dir", "", "the directory of gpupool's libcuda.so.1 (default $"+shimDirEnv+", else lib or ../lib next to the gpupool binary)")
	return cmd
}

// findShim returns the directory of the shim, libcuda.so.1: dir, else
// $GPUPOOL_CUDA_SHIM_DIR, else lib next to this binary (bin/lib of a
// build tree), else ../lib (an installed prefix).
func findShim(dir string) (string, error) {
	var from string
	switch {
	case dir != "":
		from = "--shim-dir"
	case os.Getenv(shimDirEnv) != "":
		dir, from = os.Getenv(shimDirEnv), shimDirEnv
	default:
		exe, err := os.Executable()
		if err != nil {
			return "", usagef("--shim-dir: not given, and the gpupool binary's own path is unknown (%v): give the directory of libcuda.so.1", err)
		}
		if real, err := filepath.EvalSymlinks(exe); err == nil {
			exe = real
		}
		near := []string{filepath.Join(filepath.Dir(exe), "lib"), filepath.Join(filepath.Dir(exe), "..", "lib")}
		for _, d := range near {
			if hasShim(d) {
				return filepath.Clean(d), nil
			}
		}
		return "", usagef("--shim-dir: not given, and no libcuda.so.1 in %s or %s next to the gpupool binary: give the directory of gpupool's CUDA shim ('make build' puts it in bin/lib)",
			near[0], filepath.Clean(near[1]))
	}
	dir, err := filepath.Abs(dir)
	if err != nil {
		return "", usagef("%s %s: %v", from, dir, err)
	}
	if !hasShim(dir) {
		return "", usagef("%s %s: no libcuda.so.1 there: give the directory of gpupool's CUDA shim ('make build' puts it in bin/lib)", from, dir)
	}
	return dir, nil
}

func hasShim(dir string) bool {
	st, err := os.Stat(filepath.Join(dir, "libcuda.so.1"))
	return err == nil && st.Mode().IsRegular()
}

// attachRun runs argv here with the lease's CUDA server behind the shim,
// and returns an *exitError for a non-zero exit code.
func attachRun(cmd *cobra.Command, l heldLease, lib string, argv []string) error {
	stderr := cmd.ErrOrStderr()
	// The command's own Ctrl-C must not end the session under it: the
	// proxy and the lease live until the command exits.
	base := context.WithoutCancel(cmd.Context())
	h, err := dialLease(base, l)
	if err != nil {
		return err
	}
	defer h.Close()
	carry := func(ctx context.Context, local net.Conn) error {
		err := h.Cuda(ctx, local)
		if err != nil && ctx.Err() == nil {
			fmt.Fprintf(stderr, "gpupool: cuda: %s\n", errorMessage(err))
		}
		return err
	}
	signals := make(chan os.Signal, 4)
	signal.Notify(signals, syscall.SIGTERM, syscall.SIGHUP)
	defer signal.Stop(signals)
	c := exec.Command(argv[0], argv[1:]...)
	c.Stdin, c.Stdout, c.Stderr = os.Stdin, cmd.OutOrStdout(), stderr
	err = proxy.Attach(base, carry, lib, c, signals)
	if lerr := l.Err(); lerr != nil && !errors.Is(lerr, context.Canceled) {
		fmt.Fprintf(stderr, "gpupool: the lease ended while the command ran: %s\n", errorMessage(lerr))
	}
	var ee *exec.ExitError
	switch {
	case errors.As(err, &ee):
		if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
			return &exitError{code: 128 + int(ws.Signal())}
		}
		return &exitError{code: ee.ExitCode()}
	case err != nil && errors.Is(err, exec.ErrNotFound):
		return usagef("%q: %v", argv[0], err)
	case err != nil:
		return fmt.Errorf("%s: %w", argv[0], err)
	}
	return nil
}
