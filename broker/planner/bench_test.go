package planner

import (
	"fmt"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// benchWorld is 2000 hosts of 8 GPUs, all but the last host full of
// guaranteed leases, and a queue of 10 requests of 2 GPUs: one is granted
// on the last host, the others wait (no victims to choose from).
func benchWorld() world {
	gpus := map[string]int{}
	var leases []*gpupoolv1.Lease
	for h := range 2000 {
		id := fmt.Sprintf("h%04d", h)
		gpus[id] = 8
		if h == 1999 {
			continue
		}
		for g := range 8 {
			l := &gpupoolv1.Lease{Id: fmt.Sprintf("%s-l%d", id, g), Class: gua, State: gpupoolv1.LeaseState_LEASE_STATE_GRANTED,
				Slices: []*gpupoolv1.Slice{{Host: id, Device: gpuID(id, g), MemoryMib: 81920, ComputePercent: 100, Exclusive: true}}}
			leases = append(leases, l)
		}
	}
	for i := range 10 {
		leases = append(leases, waiting(fmt.Sprintf("q%d", i), gua, 0, 2))
	}
	return world{gpus: gpus, leases: leases}
}

// BenchmarkPlan measures one pass of the queue over a 16000-GPU pool; a
// pass copies only the hosts it changes. BenchmarkDeepCopyOfThePool is
// what every pass paid before the planner, before it placed anything.
func BenchmarkPlan(b *testing.B) {
	st := benchWorld().state(b)
	hosts := st.HostsWithDevices()
	b.ReportAllocs()
	for b.Loop() {
		Make(Input{State: st, Hosts: hosts, Placer: binpack, Now: time.UnixMilli(0), NewID: func() string { return "x" }})
	}
}

func BenchmarkDeepCopyOfThePool(b *testing.B) {
	st := benchWorld().state(b)
	hosts := st.HostsWithDevices()
	b.ReportAllocs()
	for b.Loop() {
		out := make([]*gpupoolv1.Host, len(hosts))
		for i, h := range hosts {
			out[i] = proto.CloneOf(h)
		}
	}
}
