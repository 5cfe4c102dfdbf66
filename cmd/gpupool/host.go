package main

import (
	"context"
	"fmt"
	"io"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/gpupool/gpupool/client"
	"github.com/gpupool/gpupool/internal/quantity"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
	"github.com/gpupool/gpupool/protocol"
)

func newHostCmd() *cobra.Command {
	return newGroupCmd(&cobra.Command{
		Use:   "host",
		Short: "Inspect the pool hosts and their GPUs",
		Long: `Pool hosts run 'gpupool agent', which registers their GPUs with the brokers
and heartbeats. A host is ready, draining, drained or down; only eligible
hosts take new leases.`,
		Example: `  gpupool host ls
  gpupool host get gpu-node-3
  gpupool host drain gpu-node-3 --deadline 30m --reason "kernel upgrade"
  gpupool host eligibility gpu-node-3 --enable
  gpupool host reset-identity gpu-node-3 --reason "new NIC"`,
	},
		newHostListCmd(),
		newHostGetCmd(),
		newHostDrainCmd(),
		newHostEligibilityCmd(),
		newHostResetIdentityCmd(),
		newHostGPUHealthCmd(),
	)
}

func newHostListCmd() *cobra.Command {
	var stale bool
	cmd := &cobra.Command{
		Use:     "ls",
		Aliases: []string{"list"},
		Short:   "List pool hosts with their GPUs, allocation and heartbeat",
		Long: `Ls lists every registered pool host. MEMORY and COMPUTE are allocated/total
over the host's GPUs; SLICES counts the lease slices placed on them. HEARTBEAT is
how long ago the leader last heard the host ("-" when the answering server
does not know, e.g. with --stale on a follower).`,
		Example: `  gpupool host ls
  gpupool host ls --stale -o json`,
		Args: exactArgs(0),
		RunE: func(cmd *cobra.Command, _ []string) error {
			return withClient(cmd, func(ctx context.Context, c *client.Client) error {
				resp, err := c.Pool.ListHosts(ctx, &gpupoolv1.ListHostsRequest{Stale: stale})
				if err != nil {
					return err
				}
				ids := idsOf(resp.GetHosts(), (*gpupoolv1.Host).GetId)
				return renderList(cmd.OutOrStdout(), resp, "hosts", ids, func(w io.Writer) error { return printHosts(w, resp.GetHosts()) })
			})
		},
	}
	addStaleFlag(cmd, &stale)
	return cmd
}

func newHostGetCmd() *cobra.Command {
	var stale bool
	cmd := &cobra.Command{
		Use:   "get HOST_ID",
		Short: "Show one pool host: status, GPUs and the leases on it",
		Long:  `Get shows a pool host, each of its GPUs with what is allocated on it, and the leases holding slices there.`,
		Example: `  gpupool host get gpu-node-3
  gpupool host get gpu-node-3 -o json`,
		Args: exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return withClient(cmd, func(ctx context.Context, c *client.Client) error {
				resp, err := c.Pool.GetHost(ctx, &gpupoolv1.GetHostRequest{HostId: args[0], Stale: stale})
				if err != nil {
					return err
				}
				return render(cmd.OutOrStdout(), resp, func(w io.Writer) error { return printHostDetail(w, resp, time.Now()) })
			})
		},
	}
	addStaleFlag(cmd, &stale)
	return cmd
}

// hostTotals sums a host's devices.
type hostTotals struct {
	gpus, unhealthy          int
	models                   []string // distinct, sorted
	memory, allocMemory      int64
	allocCompute, sliceCount int64
}

func sumHost(h *gpupoolv1.Host) hostTotals {
	var t hostTotals
	for _, d := range h.GetDevices() {
		t.gpus++
		if d.GetHealth() == gpupoolv1.DeviceHealth_DEVICE_HEALTH_UNHEALTHY {
			t.unhealthy++
		}
		if !slices.Contains(t.models, d.GetModel()) {
			t.models = append(t.models, d.GetModel())
		}
		t.memory += d.GetMemoryMib()
		t.allocMemory += d.GetAllocatedMemoryMib()
		t.allocCompute += int64(d.GetAllocatedComputePercent())
		t.sliceCount += int64(d.GetLeaseCount())
	}
	sort.Strings(t.models)
	return t
}

// heartbeatAge formats Host.last_heartbeat_age_ms: "-" when unknown (-1).
func heartbeatAge(ms int64) string {
	if ms < 0 {
		return "-"
	}
	return humanDuration(time.Duration(ms) * time.Millisecond)
}

// yesNo formats a bool for a table cell.
func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}

// gpuCount is "4", or "4 (1 unhealthy)".
func (t hostTotals) gpuCount() string {
	if t.unhealthy > 0 {
		return fmt.Sprintf("%d (%d unhealthy)", t.gpus, t.unhealthy)
	}
	return fmt.Sprint(t.gpus)
}

// printHosts prints one row per host.
func printHosts(w io.Writer, hosts []*gpupoolv1.Host) error {
	t := newTable(w, "HOST", "STATUS", "ELIGIBLE", "GPUS", "MODELS", "MEMORY", "COMPUTE", "SLICES", "TOPOLOGY", "HEALTH", "HEARTBEAT", "ADDRESS", "VERSION")
	odd := versionOutliers(idsOf(hosts, (*gpupoolv1.Host).GetAgentVersion))
	for _, h := range hosts {
		ver := orDash(h.GetAgentVersion())
		if odd[h.GetAgentVersion()] {
			ver += " *"
		}
		s := sumHost(h)
		t.row(h.GetId(), enumLabel(h.GetStatus()), yesNo(h.GetEligible()), s.gpuCount(),
			orDash(strings.Join(s.models, ",")),
			quantity.FormatMiB(s.allocMemory)+"/"+quantity.FormatMiB(s.memory),
			fmt.Sprintf("%d%%/%d%%", s.allocCompute, 100*s.gpus),
			s.sliceCount, topologySummary(h.GetDevices()), healthSummary(h), heartbeatAge(h.GetLastHeartbeatAgeMs()), orDash(h.GetAddress()), ver)
	}
	if err := t.flush(); err != nil {
		return err
	}
	if len(odd) > 0 {
		_, err := fmt.Fprintln(w, "* agent version differs from the others")
		return err
	}
	return nil
}

// topologySummary is "nvlink 8, pcie 4": the sizes of the host's NVLink
// domains and how many PCIe roots its GPUs hang off; "-" without GPUs.
func topologySummary(devs []*gpupoolv1.Device) string {
	if len(devs) == 0 {
		return "-"
	}
	var groups []string
	for _, g := range nvlinkGroups(devs) {
		groups = append(groups, strconv.Itoa(len(g)))
	}
	nvl := "nvlink none"
	if len(groups) > 0 {
		nvl = "nvlink " + strings.Join(groups, "+")
	}
	roots := map[string]bool{}
	for _, d := range devs {
		if r := d.GetPcieRoot(); r != "" {
			roots[r] = true
		}
	}
	return fmt.Sprintf("%s, pcie %d", nvl, len(roots))
}

// nvlinkGroups returns the host's NVLink domains of two or more GPUs, as
// device indexes, in order of their lowest index.
func nvlinkGroups(devs []*gpupoolv1.Device) [][]int32 {
	byUUID := map[string]*gpupoolv1.Device{}
	for _, d := range devs {
		byUUID[d.GetUuid()] = d
	}
	seen := map[string]bool{}
	var out [][]int32
	for _, d := range devs {
		if seen[d.GetUuid()] || len(d.GetNvlinkPeers()) == 0 {
			continue
		}
		var group []int32
		stack := []*gpupoolv1.Device{d}
		seen[d.GetUuid()] = true
		for len(stack) > 0 {
			x := stack[len(stack)-1]
			stack = stack[:len(stack)-1]
			group = append(group, x.GetIndex())
			for _, p := range x.GetNvlinkPeers() {
				if y := byUUID[p]; y != nil && !seen[p] {
					seen[p] = true
					stack = append(stack, y)
				}
			}
		}
		if len(group) > 1 {
			slices.Sort(group)
			out = append(out, group)
		}
	}
	return out
}

// healthSummary is "ok", "1 unhealthy: Xid 79" or "8 unhealthy: GPU is
// lost", with the backend's note for a host without GPUs.
func healthSummary(h *gpupoolv1.Host) string {
	if len(h.GetDevices()) == 0 {
		if n := h.GetBackendNote(); n != "" {
			return "no GPUs: " + n
		}
		return "-"
	}
	var sick int
	var why []string
	for _, d := range h.GetDevices() {
		if d.GetHealth() == gpupoolv1.DeviceHealth_DEVICE_HEALTH_UNHEALTHY {
			sick++
			if r := d.GetHealthReason(); r != "" && !slices.Contains(why, r) {
				why = append(why, r)
			}
		}
	}
	if sick == 0 {
		return "ok"
	}
	out := fmt.Sprintf("%d unhealthy", sick)
	if len(why) > 0 {
		out += ": " + strings.Join(why, ", ")
	}
	return out
}

// indexRanges is "0-3,6" for the sorted indexes 0,1,2,3,6.
func indexRanges(idx []int32) string {
	var parts []string
	for i := 0; i < len(idx); {
		j := i
		for j+1 < len(idx) && idx[j+1] == idx[j]+1 {
			j++
		}
		if j == i {
			parts = append(parts, strconv.Itoa(int(idx[i])))
		} else {
			parts = append(parts, fmt.Sprintf("%d-%d", idx[i], idx[j]))
		}
		i = j + 1
	}
	return strings.Join(parts, ",")
}

// deviceTopology is the NUMA node, PCIe root and NVLink peers (as
// indexes) of d among devs.
func deviceTopology(d *gpupoolv1.Device, devs []*gpupoolv1.Device) (numa, pcie, nvlink string) {
	numa = "-"
	if d.GetNumaNode() >= 0 {
		numa = strconv.Itoa(int(d.GetNumaNode()))
	}
	index := map[string]int32{}
	for _, x := range devs {
		index[x.GetUuid()] = x.GetIndex()
	}
	var peers []int32
	for _, p := range d.GetNvlinkPeers() {
		if i, ok := index[p]; ok {
			peers = append(peers, i)
		}
	}
	slices.Sort(peers)
	nvlink = "-"
	if len(peers) > 0 {
		nvlink = indexRanges(peers)
	}
	return numa, orDash(d.GetPcieRoot()), nvlink
}

// liveReading formats a device's last reported used memory and
// utilisation, "-" each when unknown.
func liveReading(d *gpupoolv1.Device) (used, util string) {
	used, util = "-", "-"
	if d.GetUsedMemoryMib() >= 0 {
		used = quantity.FormatMiB(d.GetUsedMemoryMib())
	}
	if d.GetUtilizationPercent() >= 0 {
		util = fmt.Sprintf("%d%%", d.GetUtilizationPercent())
	}
	return used, util
}

// printHostDetail prints a host, a table of its devices and a table of the
// leases on it.
func printHostDetail(w io.Writer, resp *gpupoolv1.GetHostResponse, now time.Time) error {
	h := resp.GetHost()
	kv := newTable(w, "HOST", h.GetId())
	status := enumLabel(h.GetStatus())
	if h.GetStatusReason() != "" {
		status += " (" + h.GetStatusReason() + ")"
	}
	kv.row("STATUS", status)
	kv.row("ELIGIBLE", yesNo(h.GetEligible()))
	if d := h.GetDrain(); d != nil {
		kv.row("DRAIN", fmt.Sprintf("%s; started %s ago; %s", d.GetReason(), ageSince(now, d.GetStartedAtMs()), deadlineText(d, now)))
		if d.GetBy() != nil {
			kv.row("DRAINED BY", protocol.ActorText(d.GetBy()))
		}
	}
	kv.row("ADDRESS", orDash(h.GetAddress()))
	kv.row("HEARTBEAT", heartbeatAge(h.GetLastHeartbeatAgeMs()))
	kv.row("AGENT", orDash(h.GetAgentVersion()))
	backend := orDash(h.GetBackend())
	if h.GetBackendNote() != "" {
		backend += " (" + h.GetBackendNote() + ")"
	}
	kv.row("BACKEND", backend)
	kv.row("LABELS", formatLabels(h.GetLabels()))
	if h.GetCpuMillicores() != 0 || h.GetMemoryMib() != 0 {
		kv.row("HOST CPU", fmt.Sprintf("%dm/%dm", h.GetAllocatedCpuMillicores(), h.GetCpuMillicores()))
		kv.row("HOST MEMORY", quantity.FormatMiB(h.GetAllocatedMemoryMib())+"/"+quantity.FormatMiB(h.GetMemoryMib()))
	}
	if h.GetRegisteredAtMs() > 0 {
		kv.row("REGISTERED", ageSince(now, h.GetRegisteredAtMs())+" ago")
	}
	if err := kv.flush(); err != nil {
		return err
	}
	fmt.Fprintln(w)
	dt := newTable(w, "INDEX", "DEVICE", "MODEL", "HEALTH", "MEMORY", "COMPUTE", "EXCLUSIVE", "SLICES", "USED", "UTIL", "NUMA", "PCIE", "NVLINK")
	for _, d := range h.GetDevices() {
		health := enumLabel(d.GetHealth())
		if d.GetHealthReason() != "" {
			health += " (" + d.GetHealthReason() + ")"
		}
		used, util := liveReading(d)
		numa, pcie, nvlink := deviceTopology(d, h.GetDevices())
		dt.row(d.GetIndex(), d.GetUuid(), orDash(d.GetModel()), health,
			quantity.FormatMiB(d.GetAllocatedMemoryMib())+"/"+quantity.FormatMiB(d.GetMemoryMib()),
			fmt.Sprintf("%d%%", d.GetAllocatedComputePercent()), yesNo(d.GetAllocatedExclusive()), d.GetLeaseCount(),
			used, util, numa, pcie, nvlink)
	}
	if err := dt.flush(); err != nil {
		return err
	}
	fmt.Fprintln(w)
	if len(resp.GetLeases()) == 0 {
		_, err := fmt.Fprintln(w, "no leases on this host")
		return err
	}
	return printLeases(w, resp.GetLeases(), now)
}

// formatLabels is "k1=v1,k2=v2" in key order, or "-".
func formatLabels(labels map[string]string) string {
	if len(labels) == 0 {
		return "-"
	}
	keys := make([]string, 0, len(labels))
	for k := range labels {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for i, k := range keys {
		keys[i] = k + "=" + labels[k]
	}
	return strings.Join(keys, ",")
}
