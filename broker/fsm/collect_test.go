package fsm

import (
	"bytes"
	"errors"
	"io"
	"slices"
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/gpupool/gpupool/broker/state"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

func release(id string, atMs int64) []proto.Message {
	return []proto.Message{
		&gpupoolv1.EndLeaseCommand{LeaseId: id, EndState: gpupoolv1.LeaseState_LEASE_STATE_RELEASED, Reason: "done", NowMs: atMs - 50},
		&gpupoolv1.FreeLeaseCommand{LeaseId: id, Reason: "agent confirmed teardown", NowMs: atMs},
	}
}

func collect(cutoffMs int64, ids ...string) *gpupoolv1.CollectEndedLeasesCommand {
	return &gpupoolv1.CollectEndedLeasesCommand{LeaseIds: ids, EndedAtOrBeforeMs: cutoffMs}
}

func leaseIDs(r *state.Reader) []string {
	var ids []string
	for _, l := range r.Leases() {
		ids = append(ids, l.Id)
	}
	return ids
}

func TestCollectEndedLeases(t *testing.T) {
	// l-1 ended at 3000, l-2 at 4000, l-3 is granted, p-1 was pending and
	// ended at once (4500).
	setup := slices.Concat([]proto.Message{
		host("h1", 2),
		grant("l-1", "h1", 0, 1024, 10),
		grant("l-2", "h1", 0, 1024, 10),
		grant("l-3", "h1", 1, 1024, 10),
		pendingLease("p-1", "r1"),
		&gpupoolv1.EndLeaseCommand{LeaseId: "p-1", EndState: gpupoolv1.LeaseState_LEASE_STATE_REVOKED, Reason: "cancelled", NowMs: 4500},
	}, release("l-1", 3000), release("l-2", 4000))
	tests := []struct {
		name          string
		cmd           *gpupoolv1.CollectEndedLeasesCommand
		wantErr       error
		wantCollected int
		wantLeft      []string
	}{
		{"ended at or before the cutoff are removed", collect(4000, "l-1", "l-2"), nil, 2, []string{"l-3", "p-1"}},
		{"an ended lease after the cutoff stays", collect(3999, "l-1", "l-2"), nil, 1, []string{"l-2", "l-3", "p-1"}},
		{"a granted lease is never removed", collect(9000, "l-3"), nil, 0, []string{"l-1", "l-2", "l-3", "p-1"}},
		{"a pending lease that ended is removed", collect(9000, "p-1"), nil, 1, []string{"l-1", "l-2", "l-3"}},
		{"an unknown or repeated id is skipped", collect(9000, "l-9", "l-1", "l-1"), nil, 1, []string{"l-2", "l-3", "p-1"}},
		{"no ids is refused", collect(9000), ErrInvalid, 0, []string{"l-1", "l-2", "l-3", "p-1"}},
		{"no cutoff is refused", collect(0, "l-1"), ErrInvalid, 0, []string{"l-1", "l-2", "l-3", "p-1"}},
		{"too many ids are refused", collect(9000, slices.Repeat([]string{"l-1"}, MaxCollectedPerCommand+1)...), ErrInvalid, 0, []string{"l-1", "l-2", "l-3", "p-1"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := New(nil)
			applyAll(t, f, setup)
			auditBefore := len(f.State().AuditLog(0))
			res := applyAll(t, f, append(slices.Clone(setup), tt.cmd))[len(setup)]
			if !errors.Is(res.Err, tt.wantErr) {
				t.Fatalf("err = %v, want %v", res.Err, tt.wantErr)
			}
			if res.Collected != tt.wantCollected {
				t.Fatalf("collected %d, want %d", res.Collected, tt.wantCollected)
			}
			if got := leaseIDs(f.State()); !slices.Equal(got, tt.wantLeft) {
				t.Fatalf("leases left %v, want %v", got, tt.wantLeft)
			}
			if got := len(f.State().AuditLog(0)); got < auditBefore {
				t.Fatalf("the audit log shrank from %d to %d entries", auditBefore, got)
			}
		})
	}
}

func TestCollectKeepsTheParentOfAnExtraThatHolds(t *testing.T) {
	parent := grant("e-1", "h1", 0, 1024, 10)
	parent.Lease.Request = &gpupoolv1.LeaseRequest{Count: 1, MemoryMib: 1024, ComputePercent: 10, ElasticMax: 2}
	extra := grant("e-1-x", "h1", 1, 1024, 10)
	extra.Lease.Parent, extra.Lease.Class = "e-1", gpupoolv1.LeaseClass_LEASE_CLASS_PREEMPTIBLE
	f := New(nil)
	applyAll(t, f, slices.Concat([]proto.Message{host("h1", 2), parent, extra}, release("e-1", 3000)))
	if res := f.apply(100, collect(9000, "e-1")); res.Err != nil || res.Collected != 0 {
		t.Fatalf("collect with an extra holding: collected %d, err %v; want 0, nil", res.Collected, res.Err)
	}
	for _, m := range release("e-1-x", 4000) {
		if res := f.apply(101, m); res.Err != nil {
			t.Fatal(res.Err)
		}
	}
	if res := f.apply(102, collect(9000, "e-1", "e-1-x")); res.Err != nil || res.Collected != 2 {
		t.Fatalf("collect once the extra ended: collected %d, err %v; want 2, nil", res.Collected, res.Err)
	}
}

func TestCollectPublishesNoEvent(t *testing.T) {
	// Watchers were told ENDED when the lease ended; nothing about it
	// changes when it leaves the state (see docs/architecture.md).
	f := New(nil)
	applyAll(t, f, slices.Concat([]proto.Message{host("h1", 1), grant("l-1", "h1", 0, 1024, 10)}, release("l-1", 3000)))
	events, cancel := f.Subscribe()
	t.Cleanup(cancel)
	if res := f.apply(100, collect(9000, "l-1")); res.Err != nil || res.Collected != 1 {
		t.Fatalf("collected %d, err %v; want 1, nil", res.Collected, res.Err)
	}
	select {
	case e := <-events:
		t.Fatalf("the collection published %+v", e)
	default:
	}
}

func TestEndedLeasesAreReadOldestFirstAndSurviveASnapshot(t *testing.T) {
	f := New(nil)
	applyAll(t, f, slices.Concat([]proto.Message{
		host("h1", 1), grant("l-a", "h1", 0, 1024, 10), grant("l-b", "h1", 0, 1024, 10), grant("l-c", "h1", 0, 1024, 10),
	}, release("l-b", 3000), release("l-c", 3000), release("l-a", 5000)))
	restored := New(nil)
	if err := restored.Restore(io.NopCloser(bytes.NewReader(snapshotBytes(t, f)))); err != nil {
		t.Fatal(err)
	}
	for name, fsm := range map[string]*FSM{"applied": f, "restored": restored} {
		var got []string
		fsm.State().EndedLeases(func(l *gpupoolv1.Lease) bool { got = append(got, l.Id); return true })
		if want := []string{"l-b", "l-c", "l-a"}; !slices.Equal(got, want) {
			t.Errorf("%s: ended leases %v, want %v (oldest end first, ties by id)", name, got, want)
		}
	}
	// A collection applied to both leaves the same state.
	for _, fsm := range []*FSM{f, restored} {
		if res := fsm.apply(100, collect(3000, "l-b", "l-c", "l-a")); res.Collected != 2 {
			t.Fatalf("collected %d, want 2", res.Collected)
		}
	}
	if !bytes.Equal(snapshotBytes(t, f), snapshotBytes(t, restored)) {
		t.Fatal("the applied and the restored FSM differ after the same collection")
	}
}

func TestCollectEndedLeasesNeedsCommandSetVersion3(t *testing.T) {
	if v, ok := CommandVersion(CollectEndedLeasesType); !ok || v != 3 {
		t.Fatalf("CommandVersion(CollectEndedLeases) = %d, %t; want 3, true: older brokers do not know it", v, ok)
	}
}
