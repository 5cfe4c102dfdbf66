package main

import (
	"context"
	"fmt"
	"io"
	"sort"
	"strconv"
	"strings"

	"github.com/spf13/cobra"

	"github.com/gpupool/gpupool/client"
	"github.com/gpupool/gpupool/internal/quantity"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
	"github.com/gpupool/gpupool/protocol"
)

func newStatusCmd() *cobra.Command {
	var stale bool
	cmd := &cobra.Command{
		Use:   "status",
		Short: "Show the pool at a glance: hosts, GPUs, allocation, leases, leader",
		Long: `Status sums the pool: hosts ready and down, GPUs, memory and compute
allocated, leases by state and the Raft leader. The table below counts, per
GPU model, the healthy GPUs of eligible ready hosts and what is still free;
LARGEST FREE SLICE is the most memory free on any one GPU of that model, the
biggest --memory a new slice of that model can get.`,
		Example: `  gpupool status
  gpupool status --stale
  gpupool status -o json`,
		Args: exactArgs(0),
		RunE: func(cmd *cobra.Command, _ []string) error {
			return withClient(cmd, func(ctx context.Context, c *client.Client) error {
				resp, err := c.Pool.Status(ctx, &gpupoolv1.StatusRequest{Stale: stale})
				if err != nil {
					return err
				}
				return render(cmd.OutOrStdout(), resp, func(w io.Writer) error { return printStatus(w, resp) })
			})
		},
	}
	addStaleFlag(cmd, &stale)
	return cmd
}

// percentOf is part/total as a percentage with one decimal ("0.8%"),
// "0%" when total is 0.
func percentOf(part, total int64) string {
	if total <= 0 {
		return "0%"
	}
	return strconv.FormatFloat(float64(part)*100/float64(total), 'f', 1, 64) + "%"
}

// printStatus prints the pool totals, then one row per GPU model. The
// model rows count only GPUs that can take leases: healthy, on ready and
// eligible hosts.
func printStatus(w io.Writer, s *gpupoolv1.StatusResponse) error {
	leader := orDash(s.GetLeaderId())
	if s.GetLeaderAddress() != "" {
		leader += " (" + s.GetLeaderAddress() + ")"
	}
	kv := newTable(w, "LEADER", leader)
	kv.row("ANSWERED BY", fmt.Sprintf("%s at index %d", orDash(s.GetServerId()), s.GetAppliedIndex()))
	kv.row("HOSTS", fmt.Sprintf("%d (%d ready, %d down, %d ineligible)", s.GetHosts(), s.GetHostsReady(), s.GetHostsDown(), s.GetHostsIneligible()))
	gpus := fmt.Sprint(s.GetGpus())
	if n := s.GetGpusUnhealthy(); n > 0 {
		gpus += fmt.Sprintf(" (%d unhealthy: see 'gpupool host ls')", n)
	}
	kv.row("GPUS", gpus)
	kv.row("MEMORY", fmt.Sprintf("%s of %s allocated (%s)", quantity.FormatMiB(s.GetAllocatedMemoryMib()),
		quantity.FormatMiB(s.GetMemoryMib()), percentOf(s.GetAllocatedMemoryMib(), s.GetMemoryMib())))
	kv.row("COMPUTE", fmt.Sprintf("%d%% of %d%% allocated (%s)", s.GetAllocatedComputePercent(),
		s.GetComputePercent(), percentOf(s.GetAllocatedComputePercent(), s.GetComputePercent())))
	kv.row("LEASES", leasesByState(s.GetLeasesByState()))
	if err := kv.flush(); err != nil {
		return err
	}
	fmt.Fprintln(w)
	t := newTable(w, "MODEL", "GPUS", "FREE GPUS", "MEMORY FREE", "COMPUTE FREE", "LARGEST FREE SLICE")
	for _, m := range s.GetModels() {
		t.row(orDash(m.GetModel()), m.GetGpus(), m.GetFreeGpus(),
			quantity.FormatMiB(m.GetMemoryMib()-m.GetAllocatedMemoryMib()),
			fmt.Sprintf("%d%%", m.GetComputePercent()-m.GetAllocatedComputePercent()),
			quantity.FormatMiB(m.GetLargestFreeMemoryMib()))
	}
	return t.flush()
}

// leasesByState formats StatusResponse.leases_by_state as
// "granted 3, releasing 1", in lifecycle order. Keys may be labels
// ("granted") or enum names ("LEASE_STATE_GRANTED").
func leasesByState(counts map[string]int32) string {
	if len(counts) == 0 {
		return "none"
	}
	order := enumLabels[gpupoolv1.LeaseState]()
	rank := func(label string) int {
		for i, l := range order {
			if l == label {
				return i
			}
		}
		return len(order)
	}
	type entry struct {
		label string
		n     int32
	}
	var entries []entry
	states := gpupoolv1.LeaseState(0).Descriptor()
	for k, n := range counts {
		entries = append(entries, entry{protocol.EnumNameLabel(states, k), n})
	}
	sort.Slice(entries, func(i, j int) bool {
		ri, rj := rank(entries[i].label), rank(entries[j].label)
		if ri != rj {
			return ri < rj
		}
		return entries[i].label < entries[j].label
	})
	parts := make([]string, len(entries))
	for i, e := range entries {
		parts[i] = fmt.Sprintf("%s %d", e.label, e.n)
	}
	return strings.Join(parts, ", ")
}
