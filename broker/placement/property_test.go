package placement

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"path"
	"slices"
	"testing"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

func newRand(seed uint64) *rand.Rand { return rand.New(rand.NewPCG(seed, 0x9e3779b97f4a7c15)) }

var randomModels = []struct {
	name string
	mem  int64
}{{a100, a100Mem}, {"A100-SXM4-40GB", 40960}, {"H100-SXM5-80GB", 81920}, {"L4", 24576}}

// randomPool is 3 to 10 hosts of 1 to 8 GPUs of one model, some unhealthy, some hosts down or
// ineligible, with NVLink all-to-all or in pairs and four GPUs per PCIe root.
func randomPool(r *rand.Rand) []*gpupoolv1.Host {
	hosts := make([]*gpupoolv1.Host, 3+r.IntN(8))
	for i := range hosts {
		m := randomModels[r.IntN(len(randomModels))]
		devs := make([]*gpupoolv1.Device, 1+r.IntN(8))
		for j := range devs {
			devs[j] = gpu(int32(j), model(m.name, m.mem), pcie(fmt.Sprintf("r%d", j/4)))
			if r.IntN(10) == 0 {
				unhealthy(devs[j])
			}
		}
		h := labels(host(fmt.Sprintf("host-%02d", i+1), devs...), "zone", string(rune('a'+r.IntN(2))))
		if r.IntN(2) == 0 {
			all := make([]int32, len(devs))
			for j := range all {
				all[j] = int32(j)
			}
			nvlinked(h, all...)
		} else {
			for j := int32(0); j+1 < int32(len(devs)); j += 2 {
				nvlinked(h, j, j+1)
			}
		}
		switch r.IntN(10) {
		case 0:
			down(h)
		case 1:
			ineligible(h)
		}
		hosts[i] = h
	}
	return hosts
}

func randomRequest(r *rand.Rand) *gpupoolv1.LeaseRequest {
	mems := []int64{1024, 5120, 10240, 20480, 40960, 81920, 98304}
	computes := []int32{5, 10, 25, 50, 100}
	req := &gpupoolv1.LeaseRequest{
		Count:          int32(1 + r.IntN(4)),
		Exclusive:      r.IntN(5) == 0,
		MemoryMib:      mems[r.IntN(len(mems))],
		ComputePercent: computes[r.IntN(len(computes))],
		Topology:       gpupoolv1.Topology(r.IntN(5)),
	}
	if req.Exclusive {
		req.MemoryMib, req.ComputePercent = 0, 0
	}
	if r.IntN(8) == 0 {
		req.Count += 8 // more than most hosts have
	}
	if r.IntN(5) == 0 {
		req.HostCpuMillicores, req.HostMemoryMib = int64(1000*r.IntN(16)), int64(8192*r.IntN(16))
	}
	c := &gpupoolv1.Constraints{}
	if r.IntN(6) == 0 {
		c.Model = "A100*"
	}
	if r.IntN(8) == 0 {
		c.Labels = map[string]string{"zone": "a"}
	}
	if r.IntN(10) == 0 {
		c.MinMemoryMib = 49152
	}
	req.Constraints = c
	return req
}

// emptied is a copy of hosts with nothing allocated and every host and GPU up.
func emptied(hosts []*gpupoolv1.Host) []*gpupoolv1.Host {
	out := cloneHosts(hosts)
	for _, h := range out {
		h.Status, h.Eligible, h.AllocatedCpuMillicores, h.AllocatedMemoryMib = gpupoolv1.HostStatus_HOST_STATUS_READY, true, 0, 0
		for _, d := range h.Devices {
			d.Health = gpupoolv1.DeviceHealth_DEVICE_HEALTH_HEALTHY
			d.AllocatedMemoryMib, d.AllocatedComputePercent, d.AllocatedExclusive, d.LeaseCount = 0, 0, false, 0
		}
	}
	return out
}

type testLease struct {
	req    *gpupoolv1.LeaseRequest
	slices []*gpupoolv1.Slice
}

func TestPlaceNeverOverCommits(t *testing.T) {
	for _, seed := range []uint64{1, 2, 3} {
		t.Run(fmt.Sprint("seed ", seed), func(t *testing.T) {
			r := newRand(seed)
			hosts := randomPool(r)
			hostByID := map[string]*gpupoolv1.Host{}
			devByUUID := map[string]*gpupoolv1.Device{}
			for _, h := range hosts {
				hostByID[h.Id] = h
				for _, d := range h.Devices {
					devByUUID[d.Uuid] = d
				}
			}
			var leases []testLease
			var granted, never, notNow int
			for step := range 2000 {
				req := randomRequest(r)
				policy := Policies[r.IntN(len(Policies))]
				got, err := Place(hosts, req, policy)
				if err != nil {
					var pe *Error
					if !errors.As(err, &pe) {
						t.Fatalf("step %d: got %v, want an *Error", step, err)
					}
					_, emptyErr := Place(emptied(hosts), req, policy)
					if pe.Never != (emptyErr != nil) {
						t.Fatalf("step %d: %v: got Never=%t (%s), but in an empty pool got %v",
							step, req, pe.Never, pe.Reason, emptyErr)
					}
					if pe.Never {
						never++
					} else {
						notNow++
					}
				} else {
					granted++
					checkGrant(t, step, hostByID, devByUUID, req, got)
					leases = append(leases, testLease{req, got})
				}
				if len(leases) > 0 && r.IntN(10) < 4 {
					i := r.IntN(len(leases))
					release(hostByID, devByUUID, leases[i])
					leases = slices.Delete(leases, i, i+1)
				}
				if r.IntN(30) == 0 {
					h := hosts[r.IntN(len(hosts))]
					h.Eligible = !h.Eligible
				}
				checkNotOverCommitted(t, step, hosts)
			}
			checkAllocationMatchesLeases(t, hosts, leases)
			if granted < 300 || never < 20 || notNow < 100 {
				t.Errorf("got %d granted, %d never, %d not now; want a mix of outcomes", granted, never, notNow)
			}
			t.Logf("%d granted, %d never, %d not now", granted, never, notNow)
		})
	}
}

// checkGrant checks a placement against the request and applies it as the FSM would.
func checkGrant(t *testing.T, step int, hostByID map[string]*gpupoolv1.Host, devByUUID map[string]*gpupoolv1.Device,
	req *gpupoolv1.LeaseRequest, got []*gpupoolv1.Slice) {
	t.Helper()
	fail := func(format string, args ...any) {
		t.Helper()
		t.Fatalf("step %d: %v: got %s: %s", step, req, placed(got), fmt.Sprintf(format, args...))
	}
	if len(got) != int(req.Count) {
		fail("want %d slices", req.Count)
	}
	oneHost := req.HostCpuMillicores > 0 || req.HostMemoryMib > 0 ||
		req.Topology == sameHost || req.Topology == sameNVLink || req.Topology == samePCIeRoot
	distinct := req.Exclusive || req.Topology == distinctGPUs || req.Topology == sameNVLink || req.Topology == samePCIeRoot
	seen := map[string]bool{}
	for i, s := range got {
		h, d := hostByID[s.Host], devByUUID[s.Device]
		switch {
		case h == nil || d == nil || d.HostId != h.Id:
			fail("slice %d names an unknown host or device", i)
		case h.Status != gpupoolv1.HostStatus_HOST_STATUS_READY || !h.Eligible:
			fail("slice %d is on a host out of service", i)
		case d.Health == gpupoolv1.DeviceHealth_DEVICE_HEALTH_UNHEALTHY:
			fail("slice %d is on an unhealthy GPU", i)
		case oneHost && s.Host != got[0].Host:
			fail("want one host")
		case distinct && seen[s.Device]:
			fail("want distinct GPUs")
		case req.Topology == samePCIeRoot && (d.PcieRoot == "" || d.PcieRoot != devByUUID[got[0].Device].PcieRoot):
			fail("want one PCIe root")
		case s.Exclusive != req.Exclusive:
			fail("slice %d: got exclusive %t", i, s.Exclusive)
		}
		if c := req.Constraints; c.Model != "" {
			if ok, _ := path.Match(c.Model, d.Model); !ok {
				fail("slice %d: model %s does not match %q", i, d.Model, c.Model)
			}
		}
		if d.MemoryMib < req.Constraints.MinMemoryMib || (len(req.Constraints.Labels) > 0 && h.Labels["zone"] != "a") {
			fail("slice %d breaks the constraints", i)
		}
		if req.Topology == sameNVLink {
			for _, o := range got[:i] {
				if !slices.Contains(d.NvlinkPeers, o.Device) || !slices.Contains(devByUUID[o.Device].NvlinkPeers, d.Uuid) {
					fail("slices %s and %s are not NVLink peers", s.Device, o.Device)
				}
			}
		}
		seen[s.Device] = true

		// Apply as the FSM does, and check independently of CheckSlice.
		if err := CheckSlice(d, s); err != nil {
			fail("CheckSlice: %v", err)
		}
		if s.Exclusive && d.LeaseCount != 0 || !s.Exclusive && d.AllocatedExclusive {
			fail("slice %d shares an exclusive GPU", i)
		}
		Allocate(d, s)
	}
	h := hostByID[got[0].Host]
	if req.HostCpuMillicores > 0 || req.HostMemoryMib > 0 {
		if h.CpuMillicores-h.AllocatedCpuMillicores < req.HostCpuMillicores || h.MemoryMib-h.AllocatedMemoryMib < req.HostMemoryMib {
			fail("host %s has not the cpu and memory free", h.Id)
		}
		h.AllocatedCpuMillicores += req.HostCpuMillicores
		h.AllocatedMemoryMib += req.HostMemoryMib
	}
}

func release(hostByID map[string]*gpupoolv1.Host, devByUUID map[string]*gpupoolv1.Device, l testLease) {
	for _, s := range l.slices {
		Free(devByUUID[s.Device], s)
	}
	h := hostByID[l.slices[0].Host]
	h.AllocatedCpuMillicores -= l.req.HostCpuMillicores
	h.AllocatedMemoryMib -= l.req.HostMemoryMib
}

func checkNotOverCommitted(t *testing.T, step int, hosts []*gpupoolv1.Host) {
	t.Helper()
	for _, h := range hosts {
		if h.AllocatedCpuMillicores > h.CpuMillicores || h.AllocatedMemoryMib > h.MemoryMib {
			t.Fatalf("step %d: host %s: got %d millicores and %d MiB allocated, want at most %d and %d",
				step, h.Id, h.AllocatedCpuMillicores, h.AllocatedMemoryMib, h.CpuMillicores, h.MemoryMib)
		}
		for _, d := range h.Devices {
			if d.AllocatedMemoryMib > d.MemoryMib || d.AllocatedComputePercent > 100 ||
				(d.AllocatedExclusive && d.LeaseCount != 1) {
				t.Fatalf("step %d: device %s: got %d MiB, %d%% compute, exclusive %t, %d leases; want within %d MiB, 100%%, one exclusive lease",
					step, d.Uuid, d.AllocatedMemoryMib, d.AllocatedComputePercent, d.AllocatedExclusive, d.LeaseCount, d.MemoryMib)
			}
		}
	}
}

// checkAllocationMatchesLeases recomputes every device's allocation from the live leases.
func checkAllocationMatchesLeases(t *testing.T, hosts []*gpupoolv1.Host, leases []testLease) {
	t.Helper()
	want := emptied(hosts)
	devs := map[string]*gpupoolv1.Device{}
	for _, h := range want {
		for _, d := range h.Devices {
			devs[d.Uuid] = d
		}
	}
	for _, l := range leases {
		for _, s := range l.slices {
			Allocate(devs[s.Device], s)
		}
	}
	for _, h := range hosts {
		for _, d := range h.Devices {
			w := devs[d.Uuid]
			if d.AllocatedMemoryMib != w.AllocatedMemoryMib || d.AllocatedComputePercent != w.AllocatedComputePercent ||
				d.AllocatedExclusive != w.AllocatedExclusive || d.LeaseCount != w.LeaseCount {
				t.Errorf("device %s: got %d MiB, %d%%, exclusive %t, %d leases; want %d MiB, %d%%, exclusive %t, %d leases",
					d.Uuid, d.AllocatedMemoryMib, d.AllocatedComputePercent, d.AllocatedExclusive, d.LeaseCount,
					w.AllocatedMemoryMib, w.AllocatedComputePercent, w.AllocatedExclusive, w.LeaseCount)
			}
		}
	}
}
