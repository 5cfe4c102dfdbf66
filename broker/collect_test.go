package broker

import (
	"slices"
	"testing"
	"time"

	"github.com/gpupool/gpupool/broker/state"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

func TestEndedToCollectKeepsTheRecentUpToTheCount(t *testing.T) {
	// Leases e-1..e-5 ended at 1000..5000 ms; g-1 is granted.
	st := state.New()
	w := st.Write()
	for i := range 5 {
		w.PutLease(&gpupoolv1.Lease{Id: "e-" + string(rune('1'+i)), State: gpupoolv1.LeaseState_LEASE_STATE_RELEASED, StateChangedAtMs: int64(i+1) * 1000})
	}
	w.PutLease(&gpupoolv1.Lease{Id: "g-1", State: gpupoolv1.LeaseState_LEASE_STATE_GRANTED, StateChangedAtMs: 1})
	w.Commit(1)
	tests := []struct {
		name       string
		nowMs      int64
		retention  time.Duration
		keep       int
		limit      int
		wantIDs    []string
		wantCutoff int64
	}{
		{"nothing is old and the count is within bounds", 5000, time.Hour, 10, 100, nil, 0},
		{"those older than the retention", 7500, 4 * time.Second, 10, 100, []string{"e-1", "e-2", "e-3"}, 3000},
		{"an end exactly at the retention is kept", 7000, 4 * time.Second, 10, 100, []string{"e-1", "e-2", "e-3"}, 3000},
		{"the oldest beyond the count", 5000, time.Hour, 2, 100, []string{"e-1", "e-2", "e-3"}, 3000},
		{"the larger of the two", 7000, 5 * time.Second, 4, 100, []string{"e-1", "e-2"}, 2000},
		{"at most limit, oldest first", 9000, time.Second, 1, 2, []string{"e-1", "e-2"}, 2000},
		{"a granted lease is never chosen", 1 << 40, time.Second, 1, 100, []string{"e-1", "e-2", "e-3", "e-4", "e-5"}, 5000},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ids, cutoff := endedToCollect(st.Read(), tt.nowMs, tt.retention, tt.keep, tt.limit)
			if !slices.Equal(ids, tt.wantIDs) || cutoff != tt.wantCutoff {
				t.Fatalf("got %v up to %d ms, want %v up to %d ms", ids, cutoff, tt.wantIDs, tt.wantCutoff)
			}
		})
	}
}

func TestEndedToCollectPassesOverParentsOfLiveExtras(t *testing.T) {
	// p-1 and p-2 are the oldest ended leases, elastic parents of x-1
	// (granted) and x-2 (ended); e-1..e-3 ended after them.
	st := state.New()
	w := st.Write()
	ended := func(id string, atMs int64) *gpupoolv1.Lease {
		return &gpupoolv1.Lease{Id: id, State: gpupoolv1.LeaseState_LEASE_STATE_RELEASED, StateChangedAtMs: atMs}
	}
	w.PutLease(ended("p-1", 100))
	w.PutLease(ended("p-2", 200))
	for i, id := range []string{"e-1", "e-2", "e-3"} {
		w.PutLease(ended(id, int64(i+1)*1000))
	}
	w.PutLease(&gpupoolv1.Lease{Id: "x-1", Parent: "p-1", State: gpupoolv1.LeaseState_LEASE_STATE_GRANTED, StateChangedAtMs: 50})
	x2 := ended("x-2", 150)
	x2.Parent = "p-2"
	w.PutLease(x2)
	w.Commit(1)
	tests := []struct {
		name       string
		nowMs      int64
		retention  time.Duration
		keep       int
		limit      int
		wantIDs    []string
		wantCutoff int64
	}{
		{"past the retention, the parent of a live extra stays", 1 << 40, time.Second, 100, 100, []string{"x-2", "p-2", "e-1", "e-2", "e-3"}, 3000},
		{"a blocked parent takes no place in the limit", 1 << 40, time.Second, 100, 2, []string{"x-2", "p-2"}, 200},
		{"beyond the count, the next ones go instead", 1000, time.Hour, 2, 100, []string{"x-2", "p-2", "e-1", "e-2"}, 2000},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ids, cutoff := endedToCollect(st.Read(), tt.nowMs, tt.retention, tt.keep, tt.limit)
			if !slices.Equal(ids, tt.wantIDs) || cutoff != tt.wantCutoff {
				t.Fatalf("got %v up to %d ms, want %v up to %d ms", ids, cutoff, tt.wantIDs, tt.wantCutoff)
			}
		})
	}
}

func TestChurnDoesNotGrowTheState(t *testing.T) {
	const keep, cycles = 3, 25
	ts := startServer(t, func(c *Config) { c.EndedLeasesMax = keep })
	ts.registerHost(t, "h1", 1, 81920)
	beat := ts.heartbeater(t, "h1")
	var last string
	for i := range cycles {
		resp, err := ts.c.Lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: slice(8192, 10)})
		if err != nil {
			t.Fatalf("cycle %d: %v", i, err)
		}
		last = resp.Lease.Id
		ts.clock.Advance(time.Millisecond) // each lease ends later than the one before
		if _, err := ts.c.Lease.Release(ctx(t), &gpupoolv1.ReleaseRequest{LeaseId: last}); err != nil {
			t.Fatalf("cycle %d: %v", i, err)
		}
		beat(last)
		waitFor(t, "the lease freed", func() bool {
			l := ts.s.fsm.State().Lease(last)
			return l == nil || l.State == gpupoolv1.LeaseState_LEASE_STATE_RELEASED
		})
	}
	waitFor(t, "the ended leases collected down to the count kept", func() bool {
		return len(ts.s.fsm.State().Leases()) <= keep
	})
	st := ts.s.fsm.State()
	if l := st.Lease(last); l == nil || l.State != gpupoolv1.LeaseState_LEASE_STATE_RELEASED {
		t.Fatalf("the newest ended lease: got %v, want it kept, released", l)
	}
	granted := 0
	for _, e := range st.AuditLog(0) {
		if e.Kind == gpupoolv1.AuditKind_AUDIT_KIND_LEASE_GRANTED {
			granted++
		}
	}
	if granted != cycles {
		t.Fatalf("audit log: %d grants, want %d (collection must keep the audit)", granted, cycles)
	}
	if got := collectedTotal(t, ts.s); got < cycles-keep {
		t.Fatalf("gpupool_ended_leases_collected_total = %v, want at least %d", got, cycles-keep)
	}
}

// collectedTotal reads gpupool_ended_leases_collected_total.
func collectedTotal(t *testing.T, s *Server) float64 {
	t.Helper()
	families, err := s.Metrics().Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() == "gpupool_ended_leases_collected_total" {
			return f.GetMetric()[0].GetCounter().GetValue()
		}
	}
	t.Fatal("gpupool_ended_leases_collected_total is not exposed")
	return 0
}
