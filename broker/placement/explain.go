package placement

import (
	"fmt"
	"maps"
	"slices"
	"strings"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// The explain functions run only after a request failed to fit, so they favour clear numbers
// over speed.

// explainNever says which limit of the pool's shape the request exceeds. empty is the pool
// under viewEmpty, in which the request did not fit.
func explainNever(hosts []*gpupoolv1.Host, rq *request, empty *pool) string {
	var (
		devs             int
		largest          *gpupoolv1.Device
		cpuMost, memMost hostMost
		roomy            int
	)
	for _, h := range hosts {
		if h == nil || !rq.hostMatches(h) {
			continue
		}
		matched := false
		for _, d := range h.GetDevices() {
			if d == nil || !rq.deviceMatches(d) {
				continue
			}
			devs++
			matched = true
			if largest == nil || d.GetMemoryMib() > largest.GetMemoryMib() {
				largest = d
			}
		}
		if matched {
			cpuMost.see(h, h.GetCpuMillicores())
			memMost.see(h, h.GetMemoryMib())
			if rq.hostRoomy(viewEmpty, h) {
				roomy++
			}
		}
	}
	switch {
	case devs == 0 && constraintsText(rq) != "":
		return fmt.Sprintf("no host matches constraints (%s)", constraintsText(rq))
	case devs == 0 && len(hosts) == 0:
		return "the pool has no hosts"
	case devs == 0:
		return "the pool has no GPUs"
	case !rq.exclusive && rq.mem > largest.GetMemoryMib():
		return fmt.Sprintf("memory %d MiB: larger than any matching GPU (largest %s has %d MiB)",
			rq.mem, largest.GetModel(), largest.GetMemoryMib())
	case rq.hostCPU > cpuMost.n:
		return fmt.Sprintf("host cpu %d millicores: more than any matching host offers (most: %d on %s)",
			rq.hostCPU, cpuMost.n, cpuMost.id)
	case rq.hostMem > memMost.n:
		return fmt.Sprintf("host memory %d MiB: more than any matching host offers (most: %d on %s)",
			rq.hostMem, memMost.n, memMost.id)
	case rq.hostRes() && roomy == 0:
		return fmt.Sprintf("host cpu %d millicores and memory %d MiB: no matching host offers both",
			rq.hostCPU, rq.hostMem)
	}
	return empty.explainCount(false)
}

// explainNow says what blocks the request in the pool as it is, and which hosts and GPUs are
// out of service. now is the pool under viewNow, in which the request did not fit.
func explainNow(hosts []*gpupoolv1.Host, rq *request, now *pool) string {
	var main string
	switch {
	case len(now.cands) == 0:
		main = explainShortage(hosts, rq)
	case rq.hostRes() && !slices.ContainsFunc(now.hosts, func(hs hostState) bool { return hs.roomy }):
		main = now.explainHostShortage()
	default:
		main = now.explainCount(true)
	}
	return strings.Join(append([]string{main}, explainOutOfService(hosts, rq)...), "; ")
}

// explainShortage explains why no usable GPU fits even one slice.
func explainShortage(hosts []*gpupoolv1.Host, rq *request) string {
	var (
		usable, held, inUse int    // usable matching GPUs; held exclusively; with anything on them
		model               string // the one model of the usable GPUs, or ""
		mostFree            int64  // the most free memory on a GPU not held exclusively
		withMostFree        int    // GPUs with mostFree
		withMem             int    // GPUs with the requested memory free
		mostCompute         int32  // the most free compute among those
	)
	mostFree = -1
	for _, h := range hosts {
		if h == nil || !viewNow.hostUsable(h) || !rq.hostMatches(h) {
			continue
		}
		for _, d := range h.GetDevices() {
			if d == nil || !viewNow.deviceUsable(d) || !rq.deviceMatches(d) {
				continue
			}
			if usable == 0 {
				model = d.GetModel()
			} else if model != d.GetModel() {
				model = ""
			}
			usable++
			if !viewNow.idle(d) {
				inUse++
			}
			if viewNow.heldExclusive(d) {
				held++
				continue
			}
			switch free := viewNow.freeMem(d); {
			case free > mostFree:
				mostFree, withMostFree = free, 1
			case free == mostFree:
				withMostFree++
			}
			if viewNow.freeMem(d) >= rq.mem {
				withMem++
				mostCompute = max(mostCompute, viewNow.freeCompute(d))
			}
		}
	}
	name := "matching GPU"
	if model != "" {
		name = model
	}
	switch {
	case usable == 0:
		return "no matching GPU is in service"
	case rq.exclusive:
		return fmt.Sprintf("no idle %s (all %d in use)", name, inUse)
	}
	want := fmt.Sprintf("no %s with %s and %d%% compute free", name, memText(rq.mem), rq.compute)
	switch {
	case held == usable:
		return fmt.Sprintf("%s (all %d held exclusively)", want, usable)
	case mostFree < rq.mem:
		return fmt.Sprintf("%s (%s %s free)", want, count(withMostFree, "has", "have"), memText(mostFree))
	}
	return fmt.Sprintf("%s (%s the memory but at most %d%% compute free)", want,
		count(withMem, "has", "have"), mostCompute)
}

// explainHostShortage explains why no host with a GPU free has the host CPU and memory.
func (p *pool) explainHostShortage() string {
	var cpuMost, memMost hostMost
	for _, hs := range p.hosts {
		cpuMost.see(hs.h, p.v.hostFreeCPU(hs.h))
		memMost.see(hs.h, p.v.hostFreeMem(hs.h))
	}
	rq := p.rq
	switch {
	case rq.hostCPU > cpuMost.n:
		return fmt.Sprintf("host cpu %d millicores: no host with a free matching GPU has that much free (most: %d on %s)",
			rq.hostCPU, cpuMost.n, cpuMost.id)
	case rq.hostMem > memMost.n:
		return fmt.Sprintf("host memory %d MiB: no host with a free matching GPU has that much free (most: %d on %s)",
			rq.hostMem, memMost.n, memMost.id)
	}
	return fmt.Sprintf("host cpu %d millicores and memory %d MiB: no host with a free matching GPU has both free",
		rq.hostCPU, rq.hostMem)
}

// explainCount explains why the pool cannot take count slices together although it can take
// one: the topology or the count is the limit. now says whether p is the pool as it is.
func (p *pool) explainCount(now bool) string {
	rq := p.rq
	label := countLabel(rq)
	if !rq.oneHost {
		total := p.capacity(0, len(p.cands), "", noLimit)
		switch {
		case rq.sharing() && now:
			return fmt.Sprintf("count %d%s: matching GPUs have room for only %d more", rq.count, label, total)
		case rq.sharing():
			return fmt.Sprintf("count %d%s: matching GPUs have room for only %d", rq.count, label, total)
		case now:
			return fmt.Sprintf("count %d%s: only %s free", rq.count, label, count(int(total), "matching GPU is", "matching GPUs are"))
		}
		return fmt.Sprintf("count %d%s: the pool has only %s", rq.count, label, count(int(total), "matching GPU", "matching GPUs"))
	}
	var most hostMost
	for h := range p.hosts {
		if hs := &p.hosts[h]; hs.roomy {
			most.see(hs.h, p.hostCapacity(hs, noLimit))
		}
	}
	gpus := "matching GPUs"
	if now {
		gpus = "free matching GPUs"
	}
	var what string
	switch {
	case rq.topo == gpupoolv1.Topology_TOPOLOGY_SAME_NVLINK:
		what = fmt.Sprintf("%d %s that are all NVLink peers", rq.count, gpus)
	case rq.topo == gpupoolv1.Topology_TOPOLOGY_SAME_PCIE_ROOT:
		what = fmt.Sprintf("%d %s under one PCIe root", rq.count, gpus)
	case rq.sharing() && now:
		what = fmt.Sprintf("room for %d more slices", rq.count)
	case rq.sharing():
		what = fmt.Sprintf("room for %d slices", rq.count)
	default:
		what = fmt.Sprintf("%d %s", rq.count, gpus)
	}
	if most.id == "" { // no host with the host cpu and memory has a GPU that fits a slice
		return fmt.Sprintf("%s: no host with a matching GPU that fits the slice has that much", hostResText(rq))
	}
	if most.n == 0 {
		return fmt.Sprintf("count %d%s: no host has %s", rq.count, label, what)
	}
	return fmt.Sprintf("count %d%s: no host has %s (most: %d on %s)", rq.count, label, what, most.n, most.id)
}

// explainOutOfService counts the hosts and GPUs that match the constraints but take no
// leases now: "1 host down", "2 hosts ineligible", "1 GPU unhealthy".
func explainOutOfService(hosts []*gpupoolv1.Host, rq *request) []string {
	var byStatus [5][]string // host ids, indexed by HostStatus
	var ineligible []string
	var unhealthy int
	for _, h := range hosts {
		if h == nil || !rq.hostMatches(h) {
			continue
		}
		var matched, sick int
		for _, d := range h.GetDevices() {
			if d != nil && rq.deviceMatches(d) {
				matched++
				if !viewNow.deviceUsable(d) {
					sick++
				}
			}
		}
		switch st := h.GetStatus(); {
		case matched == 0:
		case st != gpupoolv1.HostStatus_HOST_STATUS_READY:
			if int(st) >= len(byStatus) {
				st = gpupoolv1.HostStatus_HOST_STATUS_UNSPECIFIED
			}
			byStatus[st] = append(byStatus[st], h.GetId())
		case !h.GetEligible():
			ineligible = append(ineligible, h.GetId())
		default:
			unhealthy += sick
		}
	}
	var out []string
	add := func(ids []string, what string) {
		if len(ids) > 0 {
			out = append(out, hostsText(ids)+" "+what)
		}
	}
	add(byStatus[gpupoolv1.HostStatus_HOST_STATUS_DOWN], "down")
	add(byStatus[gpupoolv1.HostStatus_HOST_STATUS_DRAINING], "draining")
	add(byStatus[gpupoolv1.HostStatus_HOST_STATUS_DRAINED], "drained")
	add(byStatus[gpupoolv1.HostStatus_HOST_STATUS_UNSPECIFIED], "not ready")
	add(ineligible, "ineligible")
	if unhealthy > 0 {
		out = append(out, count(unhealthy, "GPU unhealthy", "GPUs unhealthy"))
	}
	return out
}

// hostsText names up to three hosts ("host h1", "hosts h1, h2"), and
// counts more ("5 hosts").
func hostsText(ids []string) string {
	switch {
	case len(ids) == 1:
		return "host " + ids[0]
	case len(ids) <= 3:
		slices.Sort(ids)
		return "hosts " + strings.Join(ids, ", ")
	}
	return count(len(ids), "host", "hosts")
}

// memText renders MiB as GiB when whole ("40 GiB"), else in MiB.
func memText(mib int64) string {
	if mib != 0 && mib%1024 == 0 {
		return fmt.Sprintf("%d GiB", mib/1024)
	}
	return fmt.Sprintf("%d MiB", mib)
}

// countLabel qualifies a count in a message: " exclusive with same-nvlink and host cpu/memory".
func countLabel(rq *request) string {
	var s string
	if rq.exclusive {
		s = " exclusive"
	}
	var with []string
	if rq.topo != gpupoolv1.Topology_TOPOLOGY_UNSPECIFIED {
		with = append(with, topologyName(rq.topo))
	}
	if rq.hostRes() {
		with = append(with, "host cpu/memory")
	}
	if len(with) > 0 {
		s += " with " + strings.Join(with, " and ")
	}
	return s
}

// constraintsText lists the constraints that are set: `model "H100*", labels zone=b`.
func constraintsText(rq *request) string {
	c := rq.cons
	var parts []string
	if c.GetModel() != "" {
		parts = append(parts, fmt.Sprintf("model %q", c.GetModel()))
	}
	if c.GetMinMemoryMib() > 0 {
		parts = append(parts, fmt.Sprintf("min memory %d MiB", c.GetMinMemoryMib()))
	}
	if c.GetHost() != "" {
		parts = append(parts, fmt.Sprintf("host %q", c.GetHost()))
	}
	if len(c.GetDevices()) > 0 {
		parts = append(parts, "devices "+strings.Join(c.GetDevices(), ","))
	}
	if len(c.GetLabels()) > 0 {
		var kv []string
		for _, k := range slices.Sorted(maps.Keys(c.GetLabels())) {
			kv = append(kv, k+"="+c.GetLabels()[k])
		}
		parts = append(parts, "labels "+strings.Join(kv, ","))
	}
	return strings.Join(parts, ", ")
}

// hostResText names the host resources rq asks for: "host cpu 8000 millicores and memory 1024 MiB".
func hostResText(rq *request) string {
	var parts []string
	if rq.hostCPU > 0 {
		parts = append(parts, fmt.Sprintf("cpu %d millicores", rq.hostCPU))
	}
	if rq.hostMem > 0 {
		parts = append(parts, fmt.Sprintf("memory %d MiB", rq.hostMem))
	}
	return "host " + strings.Join(parts, " and ")
}

// count formats n with the singular or plural noun: "1 host", "2 hosts".
func count(n int, one, many string) string {
	if n == 1 {
		return "1 " + one
	}
	return fmt.Sprintf("%d %s", n, many)
}

// hostMost tracks the host with the largest n; ties go to the smaller host id.
type hostMost struct {
	n  int64
	id string
}

func (m *hostMost) see(h *gpupoolv1.Host, n int64) {
	if m.id == "" || n > m.n || (n == m.n && h.GetId() < m.id) {
		m.n, m.id = n, h.GetId()
	}
}
