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

// execArgs checks the arguments of exec: "[LEASE_ID] -- CMD [ARGS...]".
func execArgs(cmd *cobra.Command, args []string) error {
	at := cmd.ArgsLenAtDash()
	if (at != 0 && at != 1) || len(args) == at {
		return usagef("want LEASE_ID -- CMD [ARGS...], e.g. gpupool exec l-5f0c2a9e1b7d3c48 -- nvidia-smi; inside a pod with a gpupool ResourceClaim, -- CMD [ARGS...]")
	}
	return nil
}

// heldLease is the lease exec and forward work on: attached through the
// brokers, or read from the token file of the pod they run in.
type heldLease interface {
	ID() string
	Dial(ctx context.Context, host string) (*client.Host, error)
	// Done is closed when the lease is no longer renewed; Err says why.
	Done() <-chan struct{}
	Err() error
}

// tokenFileLease is the lease of a pod's token file. Its renewal is the
// node plugin's business: as far as this process knows it never ends.
type tokenFileLease struct{ *client.FileLease }

func (tokenFileLease) Done() <-chan struct{} { return nil }
func (tokenFileLease) Err() error            { return nil }

// withLease calls fn with lease id, attached through the brokers named by
// --addr and renewed until fn returns; or, for id "", with the lease of
// the token file $GPUPOOL_TOKEN_FILE names, without any broker. ctx is
// bounded by --timeout.
func withLease(cmd *cobra.Command, id string, fn func(ctx context.Context, l heldLease) error) error {
	if id != "" {
		return withClient(cmd, func(ctx context.Context, c *client.Client) error {
			l, err := c.Attach(ctx, id)
			if err != nil {
				return err
			}
			defer l.Close()
			return fn(ctx, l)
		})
	}
	if err := checkOutput(); err != nil {
		return err
	}
	l, err := client.FromEnv()
	if errors.Is(err, client.ErrNoTokenFile) {
		return usagef("no lease: give a lease id, e.g. gpupool %s l-5f0c2a9e1b7d3c48 ..., or run inside a pod with a gpupool ResourceClaim, where %s names the claim's token file",
			cmd.Name(), client.TokenFileEnv)
	}
	if err != nil {
		return fmt.Errorf("%s: %w", client.TokenFileEnv, err)
	}
	defer l.Close()
	ctx, cancel := callCtx(cmd)
	defer cancel()
	return fn(ctx, tokenFileLease{l})
}

func newExecCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "exec [LEASE_ID] -- CMD [ARGS...]",
		Short: "Run a command on a lease you hold, or on your pod's, without acquiring or releasing it",
		Long: `Exec runs CMD on the pool host of the lease's first slice, over the agent's
QUIC data plane, with live stdio, and exits with the remote exit code. Unlike
'gpupool run' it neither acquires nor releases: it renews the lease while the
command runs (which also fetches a fresh token), then leaves it granted. The
command runs in the lease's directory with its environment (GPUPOOL_LEASE_ID,
CUDA_VISIBLE_DEVICES and, on MPS hosts, the slice's limits), in the lease's
sandbox: its own user, its own mount and PID namespaces in which only the
lease's directory (and a private /tmp) is writable, and its cgroup (see 'gpupool
lease get' and docs/security.md). When CMD exits, whatever it left running in
the sandbox is stopped. Ctrl-C is forwarded as SIGINT; a command killed by a
signal exits 128+N.

Without LEASE_ID, exec uses the lease of the pod it runs in. A container with a
gpupool ResourceClaim has GPUPOOL_TOKEN_FILE set to the claim's token file,
which the node plugin keeps fresh; exec reaches the agent with the token it
holds, without talking to the brokers (--addr is not needed). A claim with
several devices has one lease each; exec uses the first (GPUPOOL_LEASE_ID lists
them all).`,
		Example: `  gpupool exec l-5f0c2a9e1b7d3c48 -- nvidia-smi
  gpupool exec l-5f0c2a9e1b7d3c48 -- python3 serve.py --port 8000

  # inside a pod with a gpupool ResourceClaim
  gpupool exec -- nvidia-smi`,
		Args: execArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			id, argv := "", args // no LEASE_ID: the pod's lease
			if cmd.ArgsLenAtDash() == 1 {
				id, argv = args[0], args[1:]
			}
			return withLease(cmd, id, func(ctx context.Context, l heldLease) error {
				base := context.WithoutCancel(cmd.Context())
				h, err := dialLease(base, l)
				if err != nil {
					return err
				}
				defer h.Close()
				return execOnLease(cmd, base, l, h, argv)
			})
		},
	}
}

func newForwardCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "forward [LEASE_ID] [LOCAL_ADDR:]LOCAL_PORT:REMOTE_PORT",
		Short: "Forward a local TCP port to a port on the lease's pool host",
		Long: `Forward listens on a local TCP port and carries every connection to a port on
the loopback of the lease's pool host (e.g. an inference server the workload
runs there), over the agent's QUIC data plane. It renews the lease while it
runs and stops on Ctrl-C; the lease stays granted. The local side listens on
127.0.0.1 unless an address is given.

Without LEASE_ID, forward uses the lease of the pod it runs in, through the
token file GPUPOOL_TOKEN_FILE names, as 'gpupool exec' does.`,
		Example: `  gpupool forward l-5f0c2a9e1b7d3c48 8000:8000
  gpupool forward l-5f0c2a9e1b7d3c48 127.0.0.1:9000:8000

  # inside a pod with a gpupool ResourceClaim
  gpupool forward 8000:8000`,
		Args: usageArgs(cobra.RangeArgs(1, 2)),
		RunE: func(cmd *cobra.Command, args []string) error {
			id, ports := "", args[0]
			if len(args) == 2 {
				id, ports = args[0], args[1]
			}
			local, remote, err := parseForward(ports)
			if err != nil {
				return err
			}
			return withLease(cmd, id, func(ctx context.Context, l heldLease) error {
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
