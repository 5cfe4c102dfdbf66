package main

import (
	"context"
	"fmt"
	"io"

	"github.com/spf13/cobra"

	"github.com/gpupool/gpupool/client"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

func newHostGPUHealthCmd() *cobra.Command {
	var clearMark bool
	cmd := &cobra.Command{
		Use:   "gpu-health HOST_ID GPU --clear",
		Short: "Clear a GPU's unhealthy mark once it is repaired",
		Long: `An Xid error, a double-bit ECC error or a GPU lost from the bus marks a GPU
unhealthy: it takes no new leases. The mark survives agent restarts and lasts
until the agent's --healthy-after (default 24h) passes without another critical
event, or until an operator clears it with this command. GPU is the GPU's index
on the host or its uuid ('gpupool host get HOST_ID' lists them). The clear
reaches the agent with its next heartbeat; the agent forgets the events it saw
(a simulated Xid included) and reports the GPU healthy.

Clearing a GPU the host does not have, or one that is healthy, is refused.`,
		Example: `  gpupool host gpu-health gpu-node-3 2 --clear
  gpupool host gpu-health gpu-node-3 GPU-5b1c6e0e-0c0a-4f4e-9d1b-2f3a4b5c6d7e --clear`,
		Args: exactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			if !clearMark {
				return usagef("give --clear: clearing the unhealthy mark is the only change this command makes")
			}
			return withClient(cmd, func(ctx context.Context, c *client.Client) error {
				resp, err := c.Pool.ClearDeviceHealth(ctx, &gpupoolv1.ClearDeviceHealthRequest{HostId: args[0], Device: args[1]})
				if err != nil {
					return err
				}
				return render(cmd.OutOrStdout(), resp, func(w io.Writer) error {
					d := resp.GetDevice()
					_, err := fmt.Fprintf(w, "GPU %d (%s) of host %s: unhealthy mark (%s) cleared; the agent reports it healthy with its next heartbeat\n",
						d.GetIndex(), d.GetUuid(), args[0], d.GetHealthReason())
					return err
				})
			})
		},
	}
	cmd.Flags().BoolVar(&clearMark, "clear", false, "clear the GPU's unhealthy mark")
	return cmd
}
