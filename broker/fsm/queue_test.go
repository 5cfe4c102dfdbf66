package fsm

import (
	"errors"
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

func pendingLease(id, reqID string) *gpupoolv1.EnqueueLeaseCommand {
	return &gpupoolv1.EnqueueLeaseCommand{Lease: &gpupoolv1.Lease{
		Id: id, Tenant: "default", RequestId: reqID, TtlMs: 60000, CreatedAtMs: 1500,
		Class:   gpupoolv1.LeaseClass_LEASE_CLASS_GUARANTEED,
		Request: &gpupoolv1.LeaseRequest{Count: 1, Exclusive: true, TtlMs: 60000, RequestId: reqID},
	}}
}

func preemptible(id, host string, dev int) *gpupoolv1.GrantLeaseCommand {
	g := grant(id, host, dev, 1024, 10)
	g.Lease.Class = gpupoolv1.LeaseClass_LEASE_CLASS_PREEMPTIBLE
	return g
}

func TestQueueCommands(t *testing.T) {
	granted := func(id, reqID string) *gpupoolv1.GrantLeaseCommand {
		g := grant(id, "h1", 1, 81920, 100)
		g.Lease.RequestId, g.Lease.CreatedAtMs, g.NowMs = reqID, 1500, 9500
		g.Lease.Slices[0].Exclusive = true
		return g
	}
	tests := []struct {
		name  string
		setup []proto.Message
		cmd   proto.Message
		check func(t *testing.T, f *FSM, res *Result)
	}{
		{"enqueue makes a pending lease with its arrival index", nil, pendingLease("p-1", "r1"), func(t *testing.T, f *FSM, res *Result) {
			l := f.State().Lease("p-1")
			if l.State != gpupoolv1.LeaseState_LEASE_STATE_PENDING || l.CreateIndex != 3 || len(f.State().PendingLeases()) != 1 {
				t.Fatalf("got %v create index %d", l.State, l.CreateIndex)
			}
		}},
		{"enqueue again with the request id returns the same lease", []proto.Message{pendingLease("p-1", "r1")}, pendingLease("p-2", "r1"), func(t *testing.T, f *FSM, res *Result) {
			if !res.Existing || res.Lease.Id != "p-1" || f.State().Lease("p-2") != nil {
				t.Fatalf("got %+v", res)
			}
		}},
		{"enqueue with slices is refused", nil, &gpupoolv1.EnqueueLeaseCommand{Lease: grant("p-1", "h1", 0, 1, 1).Lease}, func(t *testing.T, f *FSM, res *Result) {
			if !errors.Is(res.Err, ErrInvalid) {
				t.Fatalf("got %v", res.Err)
			}
		}},
		{"a grant of a pending lease keeps its arrival and says how long it waited", []proto.Message{pendingLease("p-1", "r1")}, granted("p-1", "r1"), func(t *testing.T, f *FSM, res *Result) {
			l := f.State().Lease("p-1")
			if res.Err != nil || l.State != gpupoolv1.LeaseState_LEASE_STATE_GRANTED || l.CreateIndex != 3 || l.FencingToken != 4 || l.Reason != "granted from the queue after 8s" {
				t.Fatalf("err %v: %v index %d token %d %q", res.Err, l.State, l.CreateIndex, l.FencingToken, l.Reason)
			}
			if len(f.State().PendingLeases()) != 0 {
				t.Fatal("still in the queue")
			}
		}},
		{"a grant of a pending lease under another request id is refused", []proto.Message{pendingLease("p-1", "r1")}, granted("p-1", "other"), func(t *testing.T, f *FSM, res *Result) {
			if !errors.Is(res.Err, ErrInvalid) || f.State().Lease("p-1").State != gpupoolv1.LeaseState_LEASE_STATE_PENDING {
				t.Fatalf("got %v", res.Err)
			}
		}},
		{"ending a pending lease ends it at once", []proto.Message{pendingLease("p-1", "r1")},
			&gpupoolv1.EndLeaseCommand{LeaseId: "p-1", EndState: gpupoolv1.LeaseState_LEASE_STATE_EXPIRED, Reason: "wait over", NowMs: 5000},
			func(t *testing.T, f *FSM, res *Result) {
				if l := f.State().Lease("p-1"); l.State != gpupoolv1.LeaseState_LEASE_STATE_EXPIRED || l.Reason != "wait over" {
					t.Fatalf("got %v %q", l.State, l.Reason)
				}
			}},
		{"the end of a wait does not undo a grant that came first", []proto.Message{pendingLease("p-1", "r1"), granted("p-1", "r1")},
			&gpupoolv1.EndLeaseCommand{LeaseId: "p-1", EndState: gpupoolv1.LeaseState_LEASE_STATE_EXPIRED, Reason: "wait over", NowMs: 5000, IfPending: true},
			func(t *testing.T, f *FSM, res *Result) {
				if l := f.State().Lease("p-1"); res.Err != nil || l.State != gpupoolv1.LeaseState_LEASE_STATE_GRANTED {
					t.Fatalf("err %v: %v", res.Err, l.State)
				}
			}},
		{"preemption marks the leases and notifies", []proto.Message{preemptible("v-1", "h1", 0), pendingLease("p-1", "r1")},
			&gpupoolv1.PreemptLeasesCommand{LeaseIds: []string{"v-1"}, ForLease: "p-1", DeadlineMs: 9000, Reason: "room for p-1"},
			func(t *testing.T, f *FSM, res *Result) {
				l := f.State().Lease("v-1")
				if res.Err != nil || l.PreemptAtMs != 9000 || l.PreemptedFor != "p-1" || len(f.State().PreemptedFor("p-1")) != 1 || len(f.State().Preemptible()) != 0 {
					t.Fatalf("err %v: %+v", res.Err, l)
				}
			}},
		{"preempting a guaranteed lease is refused whole", []proto.Message{preemptible("v-1", "h1", 0), grant("g-1", "h1", 0, 1024, 10), pendingLease("p-1", "r1")},
			&gpupoolv1.PreemptLeasesCommand{LeaseIds: []string{"v-1", "g-1"}, ForLease: "p-1", DeadlineMs: 9000},
			func(t *testing.T, f *FSM, res *Result) {
				var pe *PreconditionError
				if !errors.As(res.Err, &pe) || !strings.Contains(pe.Reason, "lease g-1 is granted and guaranteed") {
					t.Fatalf("got %v", res.Err)
				}
				if f.State().Lease("v-1").PreemptAtMs != 0 {
					t.Fatal("half applied: v-1 preempted")
				}
			}},
		{"preempting for a lease that does not wait is refused", []proto.Message{preemptible("v-1", "h1", 0)},
			&gpupoolv1.PreemptLeasesCommand{LeaseIds: []string{"v-1"}, ForLease: "nobody", DeadlineMs: 9000},
			func(t *testing.T, f *FSM, res *Result) {
				var pe *PreconditionError
				if !errors.As(res.Err, &pe) {
					t.Fatalf("got %v", res.Err)
				}
			}},
		{"a withdrawal clears the preemption", []proto.Message{preemptible("v-1", "h1", 0), pendingLease("p-1", "r1"),
			&gpupoolv1.PreemptLeasesCommand{LeaseIds: []string{"v-1"}, ForLease: "p-1", DeadlineMs: 9000}},
			&gpupoolv1.PreemptLeasesCommand{LeaseIds: []string{"v-1"}, ForLease: "p-1"},
			func(t *testing.T, f *FSM, res *Result) {
				if l := f.State().Lease("v-1"); res.Err != nil || l.PreemptAtMs != 0 || l.PreemptedFor != "" {
					t.Fatalf("err %v: %+v", res.Err, l)
				}
			}},
		{"an extra beyond its elastic lease's maximum is refused", []proto.Message{elasticParent("e-1", 1)}, extra("x-1", "e-1"),
			func(t *testing.T, f *FSM, res *Result) {
				var ce *ConflictError
				if !errors.As(res.Err, &ce) || !strings.Contains(ce.Reason, "already holds 1 of at most 1") {
					t.Fatalf("got %v", res.Err)
				}
			}},
		{"an extra within the maximum is granted", []proto.Message{elasticParent("e-1", 2)}, extra("x-1", "e-1"),
			func(t *testing.T, f *FSM, res *Result) {
				if res.Err != nil || len(f.State().Extras("e-1")) != 1 {
					t.Fatalf("got %v", res.Err)
				}
			}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := New(nil)
			log := append([]proto.Message{host("h1", 2), host("h2", 2)}, tt.setup...)
			results := applyAll(t, f, append(log, tt.cmd))
			for i, r := range results[:len(log)] {
				if r.Err != nil {
					t.Fatalf("setup %d: %v", i, r.Err)
				}
			}
			tt.check(t, f, results[len(log)])
		})
	}
}

func elasticParent(id string, max int32) *gpupoolv1.GrantLeaseCommand {
	g := grant(id, "h2", 0, 1024, 10)
	g.Lease.Request = &gpupoolv1.LeaseRequest{Count: 1, MemoryMib: 1024, ComputePercent: 10, ElasticMax: max}
	return g
}

func extra(id, parent string) *gpupoolv1.GrantLeaseCommand {
	g := preemptible(id, "h2", 1)
	g.Lease.Parent = parent
	return g
}
