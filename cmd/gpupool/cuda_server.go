package main

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"runtime"
	"syscall"

	"github.com/spf13/cobra"

	"github.com/gpupool/gpupool/agent/cudaserver"
)

// newAgentCudaServerCmd is the per-lease CUDA server the agent starts as
// a workload of the lease; nobody runs it by hand.
func newAgentCudaServerCmd() *cobra.Command {
	var lease string
	cmd := &cobra.Command{
		Use:    "cuda-server --lease JSON",
		Short:  "Serve one lease's CUDA calls (started by the agent, on its stdin's listening socket)",
		Hidden: true,
		Args:   usageArgs(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, _ []string) error {
			if lease == "" {
				return usagef("--lease: required (the agent passes the lease's description)")
			}
			ls, err := cudaserver.ParseArg(lease)
			if err != nil {
				return usagef("--lease: %v", err)
			}
			l, err := net.FileListener(os.Stdin)
			if err != nil {
				return usagef("stdin must be a listening unix socket, as the agent passes it: %v", err)
			}
			ls.Logger = slog.New(slog.NewTextHandler(cmd.ErrOrStderr(), &slog.HandlerOptions{Level: slog.LevelInfo})).With("lease", ls.Lease.GetId())
			// A processor for each open session (at least one, at most
			// the runtime's own choice, which heeds the sandbox's CPU
			// limit): a session waits for its requests, and for the
			// driver, on its own thread, and runs little Go between; an
			// idle processor more only adds a wake-up of a spinning
			// thread to each of its round trips.
			procs := runtime.GOMAXPROCS(0)
			ls.OnSessions = func(open int) { runtime.GOMAXPROCS(min(procs, max(1, open))) }
			srv, err := ls.NewServer()
			if err != nil {
				l.Close()
				return err
			}
			ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
			defer stop()
			context.AfterFunc(ctx, func() { srv.Close(); l.Close() })
			fmt.Fprintf(cmd.ErrOrStderr(), "serving lease %s's CUDA calls (%s backend)\n", ls.Lease.GetId(), ls.Backend)
			if err := srv.Serve(l); err != nil && ctx.Err() == nil {
				return fmt.Errorf("cuda-server: %w", err)
			}
			return nil
		},
	}
	cmd.Flags().StringVar(&lease, "lease", "", "the lease's slices, this host's devices and the backend, as the agent encodes them")
	return cmd
}
