package fsm

import (
	"bytes"
	"fmt"
	"io"
	"strings"
	"testing"

	"github.com/hashicorp/raft"
	"google.golang.org/protobuf/proto"

	"github.com/gpupool/gpupool/broker/state"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// wantEntry is an audit entry as a test expects it; detail is a substring.
type wantEntry struct {
	kind    gpupoolv1.AuditKind
	actor   string // the actor's name
	subject string
	tenant  string
	atMs    int64
	detail  string
}

func (w wantEntry) String() string {
	return fmt.Sprintf("%s by %s of %s (tenant %q) at %d: ...%s...", AuditKindName(w.kind), w.actor, w.subject, w.tenant, w.atMs, w.detail)
}

func entryText(e *gpupoolv1.AuditEntry) string {
	return fmt.Sprintf("%s by %s of %s (tenant %q) at %d: %s", AuditKindName(e.Kind), e.Actor.GetName(), e.Subject, e.Tenant, e.AtMs, e.Detail)
}

func matches(e *gpupoolv1.AuditEntry, w wantEntry) bool {
	return e.Kind == w.kind && e.Actor.GetName() == w.actor && e.Subject == w.subject && e.Tenant == w.tenant &&
		e.AtMs == w.atMs && strings.Contains(e.Detail, w.detail)
}

func TestEveryAuditedCommandRecordsWhoDidIt(t *testing.T) {
	ops := &gpupoolv1.Actor{AccessorId: "t-ops", Name: "ops"}
	alice := &gpupoolv1.Actor{AccessorId: "t-alice", Name: "alice"}
	byAlice := func(g *gpupoolv1.GrantLeaseCommand) *gpupoolv1.GrantLeaseCommand {
		g.Lease.GrantedBy = alice
		return g
	}
	end := func(id string, s gpupoolv1.LeaseState, by *gpupoolv1.Actor, reason string) *gpupoolv1.EndLeaseCommand {
		return &gpupoolv1.EndLeaseCommand{LeaseId: id, EndState: s, Reason: reason, NowMs: 3000, Actor: by}
	}
	drain := func(c *gpupoolv1.DrainHostCommand) *gpupoolv1.DrainHostCommand {
		c.HostId, c.NowMs = "h1", 5000
		return c
	}
	quota := setQuota("sim", 4, 0, 0)
	quota.Actor, quota.NowMs = ops, 6000
	unquota := removeQuota("sim")
	unquota.Actor, unquota.NowMs = ops, 7000
	boot := bootstrapToken("t-boot", 1)
	boot.Token.CreatedBy = &gpupoolv1.Actor{Name: "bootstrap"}
	client := createToken(clientTok("t-a", 2, "a"))
	client.Token.CreatedBy = ops
	revoke := &gpupoolv1.RevokeAclTokenCommand{AccessorId: "t-a", NowMs: 9500, Actor: ops}
	const deadline = 100_000

	g1 := grant("l-1", "h1", 0, 1024, 10) // guaranteed, by the broker
	for _, tc := range []struct {
		name string
		log  []proto.Message // after host h1 registers with 2 GPUs
		want []wantEntry     // written by the last command
	}{
		{"a grant records the token that asked for it",
			[]proto.Message{byAlice(grant("l-1", "h1", 0, 1024, 10))},
			[]wantEntry{{gpupoolv1.AuditKind_AUDIT_KIND_LEASE_GRANTED, "alice", "l-1", "default", 2000, "1 slice on host h1, guaranteed"}}},
		{"a grant without an actor records the broker",
			[]proto.Message{g1},
			[]wantEntry{{gpupoolv1.AuditKind_AUDIT_KIND_LEASE_GRANTED, "broker", "l-1", "default", 2000, "slice"}}},
		{"a grant from the queue says how long it waited",
			[]proto.Message{pendingLease("l-1", "r1"), func() proto.Message {
				g := grant("l-1", "h1", 1, 81920, 100)
				g.Lease.RequestId, g.Lease.CreatedAtMs, g.NowMs = "r1", 1500, 9500
				return g
			}()},
			[]wantEntry{{gpupoolv1.AuditKind_AUDIT_KIND_LEASE_GRANTED, "broker", "l-1", "default", 9500, "granted from the queue after 8s"}}},
		{"a release records who released",
			[]proto.Message{g1, end("l-1", gpupoolv1.LeaseState_LEASE_STATE_RELEASED, alice, "released by its holder")},
			[]wantEntry{{gpupoolv1.AuditKind_AUDIT_KIND_LEASE_RELEASED, "alice", "l-1", "default", 3000, "released by its holder"}}},
		{"an expiry is the broker's",
			[]proto.Message{g1, end("l-1", gpupoolv1.LeaseState_LEASE_STATE_EXPIRED, nil, "not renewed")},
			[]wantEntry{{gpupoolv1.AuditKind_AUDIT_KIND_LEASE_EXPIRED, "broker", "l-1", "default", 3000, "not renewed"}}},
		{"a pending lease that leaves the queue is recorded",
			[]proto.Message{pendingLease("l-1", "r1"), end("l-1", gpupoolv1.LeaseState_LEASE_STATE_EXPIRED, nil, "not granted within the wait")},
			[]wantEntry{{gpupoolv1.AuditKind_AUDIT_KIND_LEASE_EXPIRED, "broker", "l-1", "default", 3000, "not granted within the wait"}}},
		{"a revocation is recorded",
			[]proto.Message{g1, end("l-1", gpupoolv1.LeaseState_LEASE_STATE_REVOKED, nil, "host h1 refused the lease")},
			[]wantEntry{{gpupoolv1.AuditKind_AUDIT_KIND_LEASE_REVOKED, "broker", "l-1", "default", 3000, "refused"}}},
		{"a preempted lease revoked at its deadline is a preemption",
			[]proto.Message{preemptible("v-1", "h1", 0), pendingLease("p-1", "r1"),
				&gpupoolv1.PreemptLeasesCommand{LeaseIds: []string{"v-1"}, ForLease: "p-1", DeadlineMs: 9000, Reason: "room"},
				func() proto.Message {
					c := end("v-1", gpupoolv1.LeaseState_LEASE_STATE_REVOKED, nil, "preempted for p-1")
					c.Preempted = true
					return c
				}()},
			[]wantEntry{{gpupoolv1.AuditKind_AUDIT_KIND_LEASE_PREEMPTED, "broker", "v-1", "default", 3000, "preempted for p-1"}}},
		{"a preempted lease revoked for another reason is a revocation",
			[]proto.Message{preemptible("v-1", "h1", 0), pendingLease("p-1", "r1"),
				&gpupoolv1.PreemptLeasesCommand{LeaseIds: []string{"v-1"}, ForLease: "p-1", DeadlineMs: 9000, Reason: "room"},
				end("v-1", gpupoolv1.LeaseState_LEASE_STATE_REVOKED, nil, "host h1 refused the lease")},
			[]wantEntry{{gpupoolv1.AuditKind_AUDIT_KIND_LEASE_REVOKED, "broker", "v-1", "default", 3000, "refused"}}},
		{"a host going down revokes its leases as the broker",
			[]proto.Message{g1, &gpupoolv1.SetHostStatusCommand{HostId: "h1", Status: gpupoolv1.HostStatus_HOST_STATUS_DOWN, Reason: "no heartbeat", NowMs: 4000}},
			[]wantEntry{{gpupoolv1.AuditKind_AUDIT_KIND_LEASE_REVOKED, "broker", "l-1", "default", 4000, "host h1 down: no heartbeat"}}},
		{"a drain records who drains, then each lease it revokes",
			[]proto.Message{g1, preemptible("v-1", "h1", 1), drain(&gpupoolv1.DrainHostCommand{Reason: "kernel", DeadlineMs: deadline, Actor: ops})},
			[]wantEntry{
				{gpupoolv1.AuditKind_AUDIT_KIND_HOST_DRAIN_STARTED, "ops", "h1", "", 5000, "kernel; deadline 1970-01-01T00:01:40Z"},
				{gpupoolv1.AuditKind_AUDIT_KIND_LEASE_REVOKED, "ops", "v-1", "default", 5000, "host h1 drained: preemptible leases are revoked at once"},
			}},
		{"a drain of an empty host drains it at once",
			[]proto.Message{drain(&gpupoolv1.DrainHostCommand{Actor: ops})},
			[]wantEntry{
				{gpupoolv1.AuditKind_AUDIT_KIND_HOST_DRAIN_STARTED, "ops", "h1", "", 5000, "drain requested; no deadline"},
				{gpupoolv1.AuditKind_AUDIT_KIND_HOST_DRAINED, "broker", "h1", "", 5000, "no lease on the host"},
			}},
		{"a new deadline is an update",
			[]proto.Message{g1, drain(&gpupoolv1.DrainHostCommand{Actor: ops}), drain(&gpupoolv1.DrainHostCommand{DeadlineMs: deadline, Actor: alice})},
			[]wantEntry{{gpupoolv1.AuditKind_AUDIT_KIND_HOST_DRAIN_UPDATED, "alice", "h1", "", 5000, "deadline 1970"}}},
		{"the drain deadline passing is the broker's",
			[]proto.Message{g1, drain(&gpupoolv1.DrainHostCommand{DeadlineMs: deadline, Actor: ops}), drain(&gpupoolv1.DrainHostCommand{Force: true, IfDeadlineMs: deadline})},
			[]wantEntry{
				{gpupoolv1.AuditKind_AUDIT_KIND_HOST_DRAIN_UPDATED, "broker", "h1", "", 5000, "deadline passed"},
				{gpupoolv1.AuditKind_AUDIT_KIND_LEASE_REVOKED, "broker", "l-1", "default", 5000, "the drain deadline passed"},
			}},
		{"the last lease freed on a draining host drains it",
			[]proto.Message{g1, drain(&gpupoolv1.DrainHostCommand{Actor: ops}), end("l-1", gpupoolv1.LeaseState_LEASE_STATE_RELEASED, alice, "done"),
				&gpupoolv1.FreeLeaseCommand{LeaseId: "l-1", NowMs: 3500}},
			[]wantEntry{{gpupoolv1.AuditKind_AUDIT_KIND_HOST_DRAINED, "broker", "h1", "", 3500, "the last lease on the host ended"}}},
		{"a cancelled drain records who cancelled",
			[]proto.Message{g1, drain(&gpupoolv1.DrainHostCommand{Actor: ops}), drain(&gpupoolv1.DrainHostCommand{Cancel: true, Actor: alice})},
			[]wantEntry{{gpupoolv1.AuditKind_AUDIT_KIND_HOST_DRAIN_CANCELLED, "alice", "h1", "", 5000, "drain cancelled"}}},
		{"eligibility records who changed it",
			[]proto.Message{&gpupoolv1.SetHostEligibilityCommand{HostId: "h1", NowMs: 5000, Actor: ops}},
			[]wantEntry{{gpupoolv1.AuditKind_AUDIT_KIND_HOST_ELIGIBILITY, "ops", "h1", "", 5000, "not eligible for new leases"}}},
		{"enabling a drained host says its drain is over",
			[]proto.Message{drain(&gpupoolv1.DrainHostCommand{Actor: ops}), &gpupoolv1.SetHostEligibilityCommand{HostId: "h1", Eligible: true, NowMs: 6000}},
			[]wantEntry{{gpupoolv1.AuditKind_AUDIT_KIND_HOST_ELIGIBILITY, "broker", "h1", "", 6000, "eligible for new leases; its drain is over"}}},
		{"a quota set records who set it and the limits",
			[]proto.Message{quota},
			[]wantEntry{{gpupoolv1.AuditKind_AUDIT_KIND_QUOTA_SET, "ops", "sim", "sim", 6000, "gpus 4, memory unlimited, compute unlimited"}}},
		{"a quota removed records the limits it had",
			[]proto.Message{quota, unquota},
			[]wantEntry{{gpupoolv1.AuditKind_AUDIT_KIND_QUOTA_REMOVED, "ops", "sim", "sim", 7000, "was gpus 4"}}},
		{"the ACL bootstrap is recorded",
			[]proto.Message{boot},
			[]wantEntry{{gpupoolv1.AuditKind_AUDIT_KIND_ACL_BOOTSTRAP, "bootstrap", "t-boot", "", 5000, `management token "t-boot"`}}},
		{"a token created records its creator and scope, never its secret",
			[]proto.Message{boot, client},
			[]wantEntry{{gpupoolv1.AuditKind_AUDIT_KIND_ACL_TOKEN_CREATED, "ops", "t-a", "", 5000, `client token "t-a" for tenants a`}}},
		{"a token revoked records who revoked it",
			[]proto.Message{boot, client, revoke},
			[]wantEntry{{gpupoolv1.AuditKind_AUDIT_KIND_ACL_TOKEN_REVOKED, "ops", "t-a", "", 9500, `client token "t-a"`}}},
		{"a retried release writes nothing",
			[]proto.Message{g1, end("l-1", gpupoolv1.LeaseState_LEASE_STATE_RELEASED, alice, "done"), end("l-1", gpupoolv1.LeaseState_LEASE_STATE_RELEASED, alice, "done")},
			nil},
		{"a refused grant writes nothing",
			[]proto.Message{grant("l-1", "h1", 0, 81920, 100), grant("l-2", "h1", 0, 1024, 10)},
			nil},
		{"a second revocation writes nothing",
			[]proto.Message{boot, client, revoke, revoke},
			nil},
		{"a drain repeated as it is writes nothing",
			[]proto.Message{g1, drain(&gpupoolv1.DrainHostCommand{Actor: ops}), drain(&gpupoolv1.DrainHostCommand{Actor: ops})},
			nil},
		{"a late deadline timer of a cancelled drain writes nothing",
			[]proto.Message{g1, drain(&gpupoolv1.DrainHostCommand{DeadlineMs: deadline, Actor: ops}), drain(&gpupoolv1.DrainHostCommand{Cancel: true, Actor: ops}),
				drain(&gpupoolv1.DrainHostCommand{Force: true, IfDeadlineMs: deadline})},
			nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := New(nil)
			log := append([]proto.Message{host("h1", 2)}, tc.log...)
			applyAll(t, f, log)
			last := uint64(len(log))
			got := f.State().AuditLog(last - 1)
			if len(got) != len(tc.want) {
				var lines []string
				for _, e := range got {
					lines = append(lines, entryText(e))
				}
				t.Fatalf("got %d entries:\n%s\nwant %d: %v", len(got), strings.Join(lines, "\n"), len(tc.want), tc.want)
			}
			for i, e := range got {
				if !matches(e, tc.want[i]) {
					t.Errorf("entry %d: got %s, want %s", i, entryText(e), tc.want[i])
				}
				if e.Index != last || e.Seq != uint32(i) {
					t.Errorf("entry %d: got index %d seq %d, want %d and %d", i, e.Index, e.Seq, last, i)
				}
			}
		})
	}
}

func TestAuditEntriesArePublishedAfterTheChange(t *testing.T) {
	f := New(nil)
	applyAll(t, f, []proto.Message{host("h1", 1)})
	events, cancel := f.Subscribe()
	defer cancel()
	q := setQuota("sim", 2, 0, 0)
	q.NowMs = 6000
	b, err := Encode(q)
	if err != nil {
		t.Fatal(err)
	}
	applyLog(f, 2, b)
	ev := <-events
	if ev.Audit == nil || ev.Index != 2 || ev.Audit.Kind != gpupoolv1.AuditKind_AUDIT_KIND_QUOTA_SET || ev.Audit.Index != 2 {
		t.Fatalf("got event %+v, want the quota's audit entry at index 2", ev)
	}
}

func TestTheAuditLogSurvivesSnapshotAndRestore(t *testing.T) {
	f := New(nil)
	applyAll(t, f, testLog())
	want := f.State().AuditLog(0)
	if len(want) == 0 {
		t.Fatal("the test log wrote no audit entries")
	}
	restored := New(nil)
	if err := restored.Restore(io.NopCloser(bytes.NewReader(snapshotBytes(t, f)))); err != nil {
		t.Fatal(err)
	}
	got := restored.State().AuditLog(0)
	if len(got) != len(want) {
		t.Fatalf("restored %d entries, want %d", len(got), len(want))
	}
	for i := range want {
		if !proto.Equal(got[i], want[i]) {
			t.Fatalf("entry %d: restored %s, want %s", i, entryText(got[i]), entryText(want[i]))
		}
	}
	// Both go on to write the same entries from the same tail.
	tail := &gpupoolv1.EndLeaseCommand{LeaseId: "l-2", EndState: gpupoolv1.LeaseState_LEASE_STATE_RELEASED, NowMs: 9900}
	b, err := Encode(tail)
	if err != nil {
		t.Fatal(err)
	}
	next := uint64(len(testLog()) + 1)
	applyLog(f, next, b)
	applyLog(restored, next, b)
	if !bytes.Equal(snapshotBytes(t, f), snapshotBytes(t, restored)) {
		t.Fatal("after the same tail, the restored FSM's state differs from the original's")
	}
	if got := restored.State().AuditLog(next - 1); len(got) != 1 || got[0].Kind != gpupoolv1.AuditKind_AUDIT_KIND_LEASE_RELEASED {
		t.Fatalf("after the tail: got %d entries, want one lease-released", len(got))
	}
}

func TestAuditKindNamesRoundTrip(t *testing.T) {
	kinds := AuditKinds()
	if len(kinds) != len(gpupoolv1.AuditKind_name)-1 {
		t.Fatalf("AuditKinds has %d kinds, want every kind but UNSPECIFIED (%d)", len(kinds), len(gpupoolv1.AuditKind_name)-1)
	}
	for _, k := range kinds {
		got, ok := ParseAuditKind(AuditKindName(k))
		if !ok || got != k {
			t.Errorf("ParseAuditKind(%q): got %v %t, want %v", AuditKindName(k), got, ok, k)
		}
	}
	if _, ok := ParseAuditKind("lease-stolen"); ok {
		t.Error("ParseAuditKind accepted an unknown kind")
	}
}

// applyLog applies one encoded command at a log index.
func applyLog(f *FSM, index uint64, data []byte) *Result {
	return f.Apply(&raft.Log{Index: index, Type: raft.LogCommand, Data: data}).(*Result)
}

func TestTheAuditLogIsBoundedTheSameOnEveryReplay(t *testing.T) {
	n := state.AuditLimit + 10
	log := make([][]byte, n)
	for i := range log {
		q := setQuota("sim", int32(i%8+1), 0, 0)
		q.NowMs = int64(i)
		b, err := Encode(q)
		if err != nil {
			t.Fatal(err)
		}
		log[i] = b
	}
	whole, resumed := New(nil), New(nil)
	for i, b := range log {
		applyLog(whole, uint64(i+1), b)
	}
	// resumed applies the first half, restarts from its snapshot, then
	// applies the rest: as a server that restarted would.
	half := n / 2
	for i, b := range log[:half] {
		applyLog(resumed, uint64(i+1), b)
	}
	snap := snapshotBytes(t, resumed)
	resumed = New(nil)
	if err := resumed.Restore(io.NopCloser(bytes.NewReader(snap))); err != nil {
		t.Fatal(err)
	}
	for i, b := range log[half:] {
		applyLog(resumed, uint64(half+i+1), b)
	}
	got := whole.State().AuditLog(0)
	if len(got) != state.AuditLimit || got[0].Index != 11 || got[len(got)-1].Index != uint64(n) {
		t.Fatalf("got %d entries from index %d to %d, want %d from 11 to %d", len(got), got[0].Index, got[len(got)-1].Index, state.AuditLimit, n)
	}
	if !bytes.Equal(snapshotBytes(t, whole), snapshotBytes(t, resumed)) {
		t.Fatal("a server that restored a snapshot half way holds another state than one that applied the whole log")
	}
}
