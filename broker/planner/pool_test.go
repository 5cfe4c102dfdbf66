package planner

import (
	"fmt"
	"maps"
	"slices"
	"testing"

	"github.com/gpupool/gpupool/broker/placement"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// testPool builds ready hosts of 80 GiB GPUs (name → GPU count) and
// allocates the leases on them.
func testPool(gpus map[string]int, leases ...*gpupoolv1.Lease) *Pool {
	var hosts []*gpupoolv1.Host
	for _, id := range slices.Sorted(maps.Keys(gpus)) {
		h := &gpupoolv1.Host{Id: id, Status: gpupoolv1.HostStatus_HOST_STATUS_READY, Eligible: true}
		for i := range gpus[id] {
			h.Devices = append(h.Devices, &gpupoolv1.Device{Uuid: gpuID(id, i), HostId: id, Index: int32(i), Model: "A100", MemoryMib: 81920,
				Health: gpupoolv1.DeviceHealth_DEVICE_HEALTH_HEALTHY})
		}
		hosts = append(hosts, h)
	}
	p := NewPool(hosts)
	for _, l := range leases {
		p.Allocate(l)
	}
	return p
}

// policy places with one of placement's policies, as the broker's placer
// does without FGD's learned mix or a window.
type policy string

func (p policy) Place(hosts []*gpupoolv1.Host, r *gpupoolv1.LeaseRequest) ([]*gpupoolv1.Slice, error) {
	return placement.Place(hosts, r, string(p))
}

const binpack = policy(placement.Binpack)

func gpuID(host string, i int) string { return fmt.Sprintf("%s-gpu%d", host, i) }

// held is a granted lease of the class and priority holding slices:
// "h1/0" a whole GPU, "h1/0:10240" a 10 GiB, 10% slice.
func held(id string, class gpupoolv1.LeaseClass, prio int32, created int64, slices ...string) *gpupoolv1.Lease {
	l := &gpupoolv1.Lease{Id: id, Class: class, Priority: prio, CreatedAtMs: created, State: gpupoolv1.LeaseState_LEASE_STATE_GRANTED}
	for _, s := range slices {
		var host string
		var gpu int
		var mem int64
		if n, _ := fmt.Sscanf(s, "%2s/%d:%d", &host, &gpu, &mem); n == 3 {
			l.Slices = append(l.Slices, &gpupoolv1.Slice{Host: host, Device: gpuID(host, gpu), MemoryMib: mem, ComputePercent: 10})
			continue
		}
		fmt.Sscanf(s, "%2s/%d", &host, &gpu)
		l.Slices = append(l.Slices, &gpupoolv1.Slice{Host: host, Device: gpuID(host, gpu), MemoryMib: 81920, ComputePercent: 100, Exclusive: true})
	}
	return l
}

const (
	pre = gpupoolv1.LeaseClass_LEASE_CLASS_PREEMPTIBLE
	gua = gpupoolv1.LeaseClass_LEASE_CLASS_GUARANTEED
)

func TestChooseVictimsLowestPriorityThenYoungestAndNoMore(t *testing.T) {
	// Three whole GPUs held by preemptible leases: a (priority 1, oldest),
	// b (priority 0, old) and c (priority 0, youngest).
	a := held("a", pre, 1, 100, "h1/0")
	b := held("b", pre, 0, 200, "h1/1")
	c := held("c", pre, 0, 300, "h1/2")
	whole := func(n int32) *gpupoolv1.LeaseRequest { return &gpupoolv1.LeaseRequest{Count: n, Exclusive: true} }
	tests := []struct {
		name string
		req  *gpupoolv1.LeaseRequest
		want []string
	}{
		{"one GPU takes the youngest of the lowest priority", whole(1), []string{"c"}},
		{"two take both of priority 0, youngest first", whole(2), []string{"c", "b"}},
		{"three take all", whole(3), []string{"c", "b", "a"}},
		{"four cannot fit: nothing is preempted", whole(4), []string{}},
		{"a small slice needs one GPU emptied", &gpupoolv1.LeaseRequest{Count: 1, MemoryMib: 1024, ComputePercent: 10}, []string{"c"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := testPool(map[string]int{"h1": 3}, a, b, c)
			victims, ss := Victims(p, tt.req, binpack, []*gpupoolv1.Lease{a, b, c})
			if got := IDs(victims); !slices.Equal(got, tt.want) {
				t.Fatalf("victims %v, want %v", got, tt.want)
			}
			if len(tt.want) > 0 && len(ss) != int(tt.req.Count) {
				t.Fatalf("%d slices for a request of %d", len(ss), tt.req.Count)
			}
			if len(tt.want) == 0 && ss != nil {
				t.Fatalf("slices %v without victims", ss)
			}
		})
	}
}

func TestChooseVictimsDropsVictimsTheFitDoesNotNeed(t *testing.T) {
	// h1's GPU: a guaranteed slice g and the youngest preemptible slice v1.
	// h2's GPU: the older preemptible whole GPU v2. A whole GPU needs h2:
	// v1 is tried first, but freeing it alone leaves g, so only v2 goes.
	g := held("g", gua, 0, 50, "h1/0:10240")
	v1 := held("v1", pre, 0, 300, "h1/0:10240")
	v2 := held("v2", pre, 0, 100, "h2/0")
	p := testPool(map[string]int{"h1": 1, "h2": 1}, g, v1, v2)
	victims, ss := Victims(p, &gpupoolv1.LeaseRequest{Count: 1, Exclusive: true}, binpack, []*gpupoolv1.Lease{v1, v2})
	if got := IDs(victims); !slices.Equal(got, []string{"v2"}) {
		t.Fatalf("victims %v, want [v2]", got)
	}
	if ss[0].Host != "h2" {
		t.Fatalf("placed on %s, want h2", ss[0].Host)
	}
	// The pool itself is untouched.
	if d := p.Host("h2").Devices[0]; !d.AllocatedExclusive {
		t.Fatal("Victims changed the pool it was given")
	}
}

func TestVictimOrder(t *testing.T) {
	ls := []*gpupoolv1.Lease{
		held("old-high", pre, 5, 100), held("young-high", pre, 5, 900),
		held("old-low", pre, 1, 100), held("young-low", pre, 1, 900),
		held("tie-b", pre, 1, 500), held("tie-a", pre, 1, 500),
	}
	slices.SortFunc(ls, VictimOrder)
	want := []string{"young-low", "tie-a", "tie-b", "old-low", "young-high", "old-high"}
	if got := IDs(ls); !slices.Equal(got, want) {
		t.Fatalf("order %v, want %v", got, want)
	}
}
