package main

import (
	"context"
	"fmt"
	"io"

	"github.com/spf13/cobra"

	"github.com/gpupool/gpupool/agent"
	"github.com/gpupool/gpupool/client"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

func newHostResetIdentityCmd() *cobra.Command {
	var reason string
	cmd := &cobra.Command{
		Use:   "reset-identity HOST_ID [--reason TEXT]",
		Short: "Let a host register with a new data-plane address or certificate while it holds leases",
		Long: `Lease holders dial a host's data-plane address and pin its certificate, so
whoever changes them can capture lease tokens. The brokers therefore refuse a
registration that changes either while the host holds live leases, and record
it in the audit log ('gpupool operator audit --kind host-identity-refused').

If the host really changed (a new address, a reinstalled agent with a new
certificate), reset-identity is the operator's consent: the brokers forget the
host's address and fingerprint, and its next registration sets new ones. Holders
reach the host again through the new address once the agent registered. The
reset is audited.`,
		Example: `  gpupool host reset-identity gpu-node-3 --reason "moved to the new rack network"
  gpupool operator audit --kind host-identity-reset`,
		Args: exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := agent.CheckHostID(args[0]); err != nil {
				return usagef("HOST_ID %v", err)
			}
			if len(reason) > 256 {
				return usagef("--reason: %d bytes, must be at most 256", len(reason))
			}
			return withClient(cmd, func(ctx context.Context, c *client.Client) error {
				resp, err := c.Pool.ResetHostIdentity(ctx, &gpupoolv1.ResetHostIdentityRequest{HostId: args[0], Reason: reason})
				if err != nil {
					return err
				}
				return render(cmd.OutOrStdout(), resp, func(w io.Writer) error {
					_, err := fmt.Fprintf(w, "host %s: identity reset; its next registration sets its data-plane address and certificate (live leases: %d)\n",
						resp.GetHost().GetId(), resp.GetLeases())
					return err
				})
			})
		},
	}
	cmd.Flags().StringVar(&reason, "reason", "", "why, for the audit log (at most 256 bytes)")
	return cmd
}
