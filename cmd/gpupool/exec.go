package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"

	"github.com/spf13/cobra"

	"github.com/gpupool/gpupool/client"
)

// dashArgs checks arguments of the form "ID -- CMD ARGS...": exactly
// `before` of them before the dash, and a command after it.
func dashArgs(before int, example string) cobra.PositionalArgs {
	return func(cmd *cobra.Command, args []string) error {
		at := cmd.ArgsLenAtDash()
		if at != before || len(args) == before {
			return usagef("want %s", example)
		}
		return nil
	}
}

func newExecCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "exec LEASE_ID -- CMD [ARGS...]",
		Short: "Run a command on a lease you hold, without acquiring or releasing it",
		Long: `Exec runs CMD on the pool host of the lease's first slice, over the agent's
QUIC data plane, with live stdio, and exits with the remote exit code. Unlike
'gpupool run' it neither acquires nor releases: it renews the lease while the
command runs (which also fetches a fresh token), then leaves it granted. The
command runs in the lease's directory with its environment (GPUPOOL_LEASE_ID,
CUDA_VISIBLE_DEVICES and, on MPS hosts, the slice's limits). Ctrl-C is
forwarded as SIGINT.`,
		Example: `  gpupool exec l-5f0c2a9e1b7d3c48 -- nvidia-smi
  gpupool exec l-5f0c2a9e1b7d3c48 -- python3 serve.py --port 8000`,
		Args: dashArgs(1, "LEASE_ID -- CMD [ARGS...], e.g. gpupool exec l-5f0c2a9e1b7d3c48 -- nvidia-smi"),
		RunE: func(cmd *cobra.Command, args []string) error {
			return withClient(cmd, func(ctx context.Context, c *client.Client) error {
				l, err := c.Attach(ctx, args[0])
				if err != nil {
					return err
				}
				defer l.Close()
				base := context.WithoutCancel(cmd.Context())
				h, err := dialLease(base, l)
				if err != nil {
					return err
				}
				defer h.Close()
				return execOnLease(cmd, base, l, h, args[1:])
			})
		},
	}
}

func newForwardCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "forward LEASE_ID [LOCAL_ADDR:]LOCAL_PORT:REMOTE_PORT",
		Short: "Forward a local TCP port to a port on the lease's pool host",
		Long: `Forward listens on a local TCP port and carries every connection to a port on
the loopback of the lease's pool host (e.g. an inference server the workload
runs there), over the agent's QUIC data plane. It renews the lease while it
runs and stops on Ctrl-C; the lease stays granted. The local side listens on
127.0.0.1 unless an address is given.`,
		Example: `  gpupool forward l-5f0c2a9e1b7d3c48 8000:8000
  gpupool forward l-5f0c2a9e1b7d3c48 127.0.0.1:9000:8000`,
		Args: exactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			local, remote, err := parseForward(args[1])
			if err != nil {
				return err
			}
			return withClient(cmd, func(ctx context.Context, c *client.Client) error {
				l, err := c.Attach(ctx, args[0])
				if err != nil {
					return err
				}
				defer l.Close()
				h, err := dialLease(context.WithoutCancel(ctx), l)
				if err != nil {
					return err
				}
				defer h.Close()
				lis, err := net.Listen("tcp", local)
				if err != nil {
					return fmt.Errorf("listen on %s: %w", local, err)
				}
				defer lis.Close()
				fmt.Fprintf(cmd.ErrOrStderr(), "gpupool: forwarding %s to port %d of the pool host of %s; Ctrl-C stops\n", lis.Addr(), remote, l.ID())
				run := cmd.Context()
				go func() {
					select {
					case <-run.Done():
					case <-l.Done():
					}
					lis.Close()
				}()
				for {
					conn, err := lis.Accept()
					if err != nil {
						if lerr := l.Err(); lerr != nil && !errors.Is(lerr, context.Canceled) {
							return lerr
						}
						return nil // Ctrl-C
					}
					go func() {
						if err := h.Forward(run, remote, conn); err != nil && run.Err() == nil {
							fmt.Fprintf(cmd.ErrOrStderr(), "gpupool: forward %s: %s\n", conn.RemoteAddr(), err)
						}
					}()
				}
			})
		},
	}
}

// parseForward reads "[ADDR:]LOCAL:REMOTE".
func parseForward(s string) (local string, remote int, err error) {
	parts := strings.Split(s, ":")
	bad := usagef("%q: want LOCAL_PORT:REMOTE_PORT or LOCAL_ADDR:LOCAL_PORT:REMOTE_PORT, e.g. 8000:8000", s)
	var addr, lp, rp string
	switch len(parts) {
	case 2:
		addr, lp, rp = "127.0.0.1", parts[0], parts[1]
	case 3:
		addr, lp, rp = parts[0], parts[1], parts[2]
	default:
		return "", 0, bad
	}
	l, err1 := strconv.Atoi(lp)
	r, err2 := strconv.Atoi(rp)
	if err1 != nil || err2 != nil || l < 0 || l > 65535 || r < 1 || r > 65535 {
		return "", 0, usagef("%q: ports must be numbers, the local one 0-65535 (0: any), the remote one 1-65535", s)
	}
	return net.JoinHostPort(addr, lp), r, nil
}
