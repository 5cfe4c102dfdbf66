package placement

import (
	"fmt"
	"strings"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// Pool fixtures. Builders return fresh protos, so a test may modify what it builds.

const (
	a100    = "A100-SXM4-80GB"
	a100Mem = 81920
)

// gpu is an idle, healthy A100 80GB with index i.
func gpu(i int32, opts ...func(*gpupoolv1.Device)) *gpupoolv1.Device {
	d := &gpupoolv1.Device{
		Index: i, Model: a100, MemoryMib: a100Mem, SmCount: 108,
		Health: gpupoolv1.DeviceHealth_DEVICE_HEALTH_HEALTHY,
	}
	for _, o := range opts {
		o(d)
	}
	return d
}

// model makes the device another model with mem MiB.
func model(name string, mem int64) func(*gpupoolv1.Device) {
	return func(d *gpupoolv1.Device) { d.Model, d.MemoryMib = name, mem }
}

// used gives the device one lease of mem MiB and compute %.
func used(mem int64, compute int32) func(*gpupoolv1.Device) {
	return func(d *gpupoolv1.Device) {
		d.AllocatedMemoryMib, d.AllocatedComputePercent, d.LeaseCount = mem, compute, 1
	}
}

// held gives the device one exclusive lease.
func held(d *gpupoolv1.Device) {
	d.AllocatedMemoryMib, d.AllocatedComputePercent, d.AllocatedExclusive, d.LeaseCount = d.MemoryMib, 100, true, 1
}

func unhealthy(d *gpupoolv1.Device) { d.Health = gpupoolv1.DeviceHealth_DEVICE_HEALTH_UNHEALTHY }

func pcie(root string) func(*gpupoolv1.Device) {
	return func(d *gpupoolv1.Device) { d.PcieRoot = root }
}

// host is a ready, eligible host with 32 cores and 256 GiB free. It names its devices
// GPU-<id>-<index>.
func host(id string, devs ...*gpupoolv1.Device) *gpupoolv1.Host {
	for _, d := range devs {
		d.HostId = id
		d.Uuid = fmt.Sprintf("GPU-%s-%d", id, d.Index)
	}
	return &gpupoolv1.Host{
		Id: id, Status: gpupoolv1.HostStatus_HOST_STATUS_READY, Eligible: true,
		CpuMillicores: 32000, MemoryMib: 262144, Devices: devs,
	}
}

// idle is a host with n idle A100s.
func idle(id string, n int) *gpupoolv1.Host {
	devs := make([]*gpupoolv1.Device, n)
	for i := range devs {
		devs[i] = gpu(int32(i))
	}
	return host(id, devs...)
}

// nvlinked links every pair of the listed device indexes of h, both ways.
func nvlinked(h *gpupoolv1.Host, idx ...int32) *gpupoolv1.Host {
	for _, i := range idx {
		for _, j := range idx {
			if i != j {
				h.Devices[i].NvlinkPeers = append(h.Devices[i].NvlinkPeers, h.Devices[j].Uuid)
			}
		}
	}
	return h
}

func status(h *gpupoolv1.Host, s gpupoolv1.HostStatus) *gpupoolv1.Host { h.Status = s; return h }
func down(h *gpupoolv1.Host) *gpupoolv1.Host                           { return status(h, gpupoolv1.HostStatus_HOST_STATUS_DOWN) }
func ineligible(h *gpupoolv1.Host) *gpupoolv1.Host                     { h.Eligible = false; return h }

func labels(h *gpupoolv1.Host, kv ...string) *gpupoolv1.Host {
	h.Labels = map[string]string{}
	for i := 0; i+1 < len(kv); i += 2 {
		h.Labels[kv[i]] = kv[i+1]
	}
	return h
}

// cpuUsed marks cpu millicores and mem MiB of h as allocated.
func cpuUsed(h *gpupoolv1.Host, cpu, mem int64) *gpupoolv1.Host {
	h.AllocatedCpuMillicores, h.AllocatedMemoryMib = cpu, mem
	return h
}

func poolOf(hs ...*gpupoolv1.Host) []*gpupoolv1.Host { return hs }

// rb builds a LeaseRequest: frac(20480, 25).n(2).topo(sameHost).req
type rb struct{ req *gpupoolv1.LeaseRequest }

func frac(mem int64, compute int32) rb {
	return rb{&gpupoolv1.LeaseRequest{Count: 1, MemoryMib: mem, ComputePercent: compute}}
}

func excl() rb { return rb{&gpupoolv1.LeaseRequest{Count: 1, Exclusive: true}} }

func (r rb) n(count int32) rb             { r.req.Count = count; return r }
func (r rb) topo(t gpupoolv1.Topology) rb { r.req.Topology = t; return r }
func (r rb) hostRes(cpu, mem int64) rb {
	r.req.HostCpuMillicores, r.req.HostMemoryMib = cpu, mem
	return r
}
func (r rb) where(c *gpupoolv1.Constraints) rb { r.req.Constraints = c; return r }

const (
	sameHost     = gpupoolv1.Topology_TOPOLOGY_SAME_HOST
	distinctGPUs = gpupoolv1.Topology_TOPOLOGY_DISTINCT_GPUS
	sameNVLink   = gpupoolv1.Topology_TOPOLOGY_SAME_NVLINK
	samePCIeRoot = gpupoolv1.Topology_TOPOLOGY_SAME_PCIE_ROOT
)

// placed shows where slices landed: "host-1/0 host-1/0 host-2/3".
func placed(ss []*gpupoolv1.Slice) string {
	parts := make([]string, len(ss))
	for i, s := range ss {
		parts[i] = fmt.Sprintf("%s/%d", s.Host, s.DeviceIndex)
	}
	return strings.Join(parts, " ")
}
