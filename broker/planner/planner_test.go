package planner

import (
	"fmt"
	"maps"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/gpupool/gpupool/broker/placement"
	"github.com/gpupool/gpupool/broker/state"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// world is a state built for one plan: hosts of 80 GiB GPUs (name → GPU
// count), the leases in it (granted ones hold their slices), quotas.
type world struct {
	gpus   map[string]int
	leases []*gpupoolv1.Lease
	quotas []*gpupoolv1.Quota
}

func (w world) state(t testing.TB) *state.Reader {
	t.Helper()
	devs := map[string]*gpupoolv1.Device{}
	st := state.New()
	tx := st.Write()
	for _, id := range slices.Sorted(maps.Keys(w.gpus)) {
		tx.PutHost(&gpupoolv1.Host{Id: id, Status: gpupoolv1.HostStatus_HOST_STATUS_READY, Eligible: true})
		for i := range w.gpus[id] {
			devs[gpuID(id, i)] = &gpupoolv1.Device{Uuid: gpuID(id, i), HostId: id, Index: int32(i), Model: "A100", MemoryMib: 81920,
				Health: gpupoolv1.DeviceHealth_DEVICE_HEALTH_HEALTHY}
		}
	}
	for i, l := range w.leases {
		l.CreateIndex = uint64(i + 1)
		if l.Tenant == "" {
			l.Tenant = "default"
		}
		if state.Holding(l.State) {
			for _, s := range l.Slices {
				placement.Allocate(devs[s.Device], s)
			}
		}
		tx.PutLease(l)
	}
	for _, d := range devs {
		tx.PutDevice(d)
	}
	for _, q := range w.quotas {
		tx.PutQuota(q)
	}
	tx.Commit(uint64(len(w.leases) + 1))
	return st.Read()
}

// waiting is a pending lease asking for n whole GPUs.
func waiting(id string, class gpupoolv1.LeaseClass, prio int32, n int32) *gpupoolv1.Lease {
	return &gpupoolv1.Lease{Id: id, Class: class, Priority: prio, State: gpupoolv1.LeaseState_LEASE_STATE_PENDING, Tenant: "default",
		Request: &gpupoolv1.LeaseRequest{Tenant: "default", Count: n, Exclusive: true, Class: class, Priority: prio, TtlMs: 60_000}}
}

// elastic is a granted elastic lease holding whole GPUs, up to max.
func elastic(id string, max int32, slices ...string) *gpupoolv1.Lease {
	l := held(id, gua, 0, 0, slices...)
	l.Tenant = "default"
	l.Request = &gpupoolv1.LeaseRequest{Tenant: "default", Count: int32(len(slices)), Exclusive: true, ElasticMax: max, TtlMs: 60_000}
	return l
}

// extra is a granted extra of elastic lease parent.
func extra(id, parent string, slices ...string) *gpupoolv1.Lease {
	l := held(id, pre, 0, 0, slices...)
	l.Parent = parent
	return l
}

func preempted(l *gpupoolv1.Lease, forLease string) *gpupoolv1.Lease {
	l.PreemptedFor, l.PreemptAtMs = forLease, 1
	return l
}

// summary reads a plan as sentences: "grant b", "preempt [p2] for g",
// "withdraw [p1] for g", "grow e2", "a waits: waiting for capacity".
func summary(p *Plan) []string {
	var out []string
	for _, g := range p.Grants {
		out = append(out, "grant "+g.Id)
	}
	for _, c := range p.Preemptions {
		out = append(out, fmt.Sprintf("preempt %v for %s", c.LeaseIds, c.ForLease))
	}
	for _, c := range p.Withdrawals {
		out = append(out, fmt.Sprintf("withdraw %v for %s", c.LeaseIds, c.ForLease))
	}
	for _, x := range p.Grows {
		out = append(out, "grow "+x.Parent)
	}
	for _, w := range p.Waiting {
		out = append(out, w.LeaseID+" waits: "+w.Outcome.String())
	}
	return out
}

func TestPlan(t *testing.T) {
	tests := []struct {
		name string
		w    world
		want []string
	}{
		{"an empty queue plans nothing", world{gpus: map[string]int{"h1": 1}}, nil},
		{"the queue grants by priority, then arrival",
			world{gpus: map[string]int{"h1": 1}, leases: []*gpupoolv1.Lease{waiting("a", gua, 0, 1), waiting("b", gua, 5, 1), waiting("c", gua, 5, 1)}},
			[]string{"grant b", "c waits: waiting for capacity", "a waits: waiting for capacity"}},
		{"a smaller request behind a head that does not fit is backfilled",
			world{gpus: map[string]int{"h1": 2}, leases: []*gpupoolv1.Lease{held("g", gua, 0, 1, "h1/0"), waiting("a", pre, 0, 2), waiting("b", pre, 0, 1)}},
			[]string{"grant b", "a waits: waiting for capacity"}},
		{"a guaranteed request preempts the youngest preemptible lease only",
			world{gpus: map[string]int{"h1": 2}, leases: []*gpupoolv1.Lease{held("p1", pre, 0, 100, "h1/0"), held("p2", pre, 0, 200, "h1/1"), waiting("g", gua, 0, 1)}},
			[]string{"preempt [p2] for g", "g waits: waiting for capacity"}},
		{"a preemptible lease of higher priority than the request is not a victim",
			world{gpus: map[string]int{"h1": 1}, leases: []*gpupoolv1.Lease{held("p", pre, 9, 100, "h1/0"), waiting("g", gua, 1, 1)}},
			[]string{"g waits: waiting for capacity"}},
		{"a preemptible request preempts nobody",
			world{gpus: map[string]int{"h1": 1}, leases: []*gpupoolv1.Lease{held("p", pre, 0, 100, "h1/0"), waiting("q", pre, 5, 1)}},
			[]string{"q waits: waiting for capacity"}},
		{"a request whose victims are leaving keeps their room from later requests",
			world{gpus: map[string]int{"h1": 1}, leases: []*gpupoolv1.Lease{preempted(held("p", pre, 0, 100, "h1/0"), "g"), waiting("g", gua, 5, 1), waiting("later", pre, 0, 1)}},
			[]string{"g waits: waiting for capacity", "later waits: waiting for capacity"}},
		{"victims that no longer make room are spared",
			world{gpus: map[string]int{"h1": 2}, leases: []*gpupoolv1.Lease{held("k", gua, 0, 50, "h1/0"), preempted(held("p", pre, 0, 100, "h1/1"), "g"), waiting("g", gua, 0, 2)}},
			[]string{"withdraw [p] for g", "g waits: waiting for capacity"}},
		{"elastic leases grow into free room, the fewest extras first",
			world{gpus: map[string]int{"h1": 4}, leases: []*gpupoolv1.Lease{elastic("e1", 3, "h1/0"), extra("x1", "e1", "h1/1"), elastic("e2", 2, "h1/2")}},
			[]string{"grow e2"}},
		{"elastic leases grow one slice per round until full",
			world{gpus: map[string]int{"h1": 5}, leases: []*gpupoolv1.Lease{elastic("e1", 3, "h1/0"), elastic("e2", 3, "h1/1")}},
			[]string{"grow e1", "grow e2", "grow e1"}},
		{"nothing grows while a request waits for capacity",
			world{gpus: map[string]int{"h1": 3}, leases: []*gpupoolv1.Lease{elastic("e", 3, "h1/0"), waiting("a", pre, 0, 3)}},
			[]string{"a waits: waiting for capacity"}},
		{"a request the pool can never hold waits without blocking growth",
			world{gpus: map[string]int{"h1": 2}, leases: []*gpupoolv1.Lease{elastic("e", 2, "h1/0"), waiting("huge", gua, 0, 3)}},
			[]string{"grow e", "huge waits: cannot fit the pool"}},
		{"the quota counts what the plan itself grants",
			world{gpus: map[string]int{"h1": 2}, leases: []*gpupoolv1.Lease{waiting("a", pre, 0, 1), waiting("b", pre, 0, 1)},
				quotas: []*gpupoolv1.Quota{{Tenant: "default", Gpus: 1}}},
			[]string{"grant a", "b waits: waiting for quota"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			st := tt.w.state(t)
			hosts := st.HostsWithDevices()
			before := make([]*gpupoolv1.Host, len(hosts))
			for i, h := range hosts {
				before[i] = proto.CloneOf(h)
			}
			n := 0
			p := Make(Input{State: st, Hosts: hosts, Placer: binpack, Now: time.UnixMilli(1_000), PreemptGrace: 30 * time.Second,
				NewID: func() string { n++; return fmt.Sprintf("x-%d", n) }})
			if got := summary(p); !slices.Equal(got, tt.want) {
				t.Fatalf("plan:\n got  %s\n want %s", strings.Join(got, "; "), strings.Join(tt.want, "; "))
			}
			for i, h := range hosts {
				if !proto.Equal(h, before[i]) {
					t.Fatalf("host %s changed by the plan: got %v, want %v", h.Id, h, before[i])
				}
			}
		})
	}
}

func TestPlannedLeasesAreReadyToPropose(t *testing.T) {
	w := world{gpus: map[string]int{"h1": 3}, leases: []*gpupoolv1.Lease{
		held("p", pre, 0, 100, "h1/0"), held("k", gua, 0, 100, "h1/1"), elastic("e", 2, "h1/2"), waiting("g", gua, 3, 1),
	}}
	p := Make(Input{State: w.state(t), Hosts: w.state(t).HostsWithDevices(), Placer: binpack, Now: time.UnixMilli(5_000), PreemptGrace: 30 * time.Second,
		NewID: func() string { return "x-1" }})
	if len(p.Preemptions) != 1 {
		t.Fatalf("preemptions: got %d, want 1", len(p.Preemptions))
	}
	c := p.Preemptions[0]
	if c.DeadlineMs != 35_000 || c.NowMs != 5_000 || !strings.Contains(c.Reason, "preempted for g (tenant default, guaranteed, priority 3): 1 whole GPU(s)") {
		t.Fatalf("preemption: got deadline %d now %d reason %q, want 35000, 5000 and why", c.DeadlineMs, c.NowMs, c.Reason)
	}
	if ss := p.Reserved["g"]; len(ss) != 1 || ss[0].Device != gpuID("h1", 0) {
		t.Fatalf("reserved for g: got %v, want h1's GPU 0", ss)
	}
	// e's extra must wait: g waits for capacity.
	if len(p.Grows) != 0 {
		t.Fatalf("grows while g waits: got %d, want 0", len(p.Grows))
	}

	w = world{gpus: map[string]int{"h1": 2}, leases: []*gpupoolv1.Lease{elastic("e", 2, "h1/0")}}
	p = Make(Input{State: w.state(t), Hosts: w.state(t).HostsWithDevices(), Placer: binpack, Now: time.UnixMilli(5_000), NewID: func() string { return "x-1" }})
	if len(p.Grows) != 1 {
		t.Fatalf("grows: got %d, want 1", len(p.Grows))
	}
	x := p.Grows[0]
	if x.Id != "x-1" || x.Parent != "e" || x.Class != pre || x.CreatedAtMs != 5_000 || x.TtlMs != 60_000 || x.Request.ElasticMax != 0 || x.Request.Count != 1 || len(x.Slices) != 1 || x.Slices[0].Isolation != gpupoolv1.Isolation_ISOLATION_EXCLUSIVE {
		t.Fatalf("extra: got %v, want x-1 of e, preemptible, created at 5000, one exclusive slice", x)
	}
}
