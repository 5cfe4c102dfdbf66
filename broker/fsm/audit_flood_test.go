package fsm

import (
	"bytes"
	"fmt"
	"strings"

	"google.golang.org/protobuf/encoding/protojson"
	"testing"

	"github.com/hashicorp/raft"
	"google.golang.org/protobuf/proto"

	"github.com/gpupool/gpupool/broker/state"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// TestNoVolumeOfLeaseEventsEvictsTheSecurityAuditEntries floods the audit
// log with 20,000 lease events of an ordinary tenant (10,000 acquires and
// their releases), twice the lease-churn limit, after the ACL bootstrap,
// a token and a host registration: those entries must all still be there.
func TestNoVolumeOfLeaseEventsEvictsTheSecurityAuditEntries(t *testing.T) {
	f := New(nil)
	var index uint64
	apply := func(m proto.Message) *Result {
		b, err := Encode(m)
		if err != nil {
			t.Fatal(err)
		}
		index++
		return f.Apply(&raft.Log{Index: index, Type: raft.LogCommand, Data: b}).(*Result)
	}
	for _, m := range []proto.Message{bootstrapToken("t-boot", 1), createToken(clientTok("t-a", 2, "a")), host("h1", 1)} {
		if res := apply(m); res.Err != nil {
			t.Fatal(res.Err)
		}
	}
	const leases = 10_000
	for i := range leases {
		id := fmt.Sprintf("l-%d", i)
		g := grant(id, "h1", 0, 1024, 1)
		g.Lease.Tenant = "a"
		if res := apply(g); res.Err != nil {
			t.Fatalf("grant %d: %v", i, res.Err)
		}
		if res := apply(&gpupoolv1.EndLeaseCommand{LeaseId: id, EndState: gpupoolv1.LeaseState_LEASE_STATE_RELEASED, NowMs: 3000}); res.Err != nil {
			t.Fatalf("release %d: %v", i, res.Err)
		}
		if res := apply(&gpupoolv1.FreeLeaseCommand{LeaseId: id, NowMs: 3100}); res.Err != nil {
			t.Fatalf("free %d: %v", i, res.Err)
		}
	}
	kinds := map[gpupoolv1.AuditKind]int{}
	for _, e := range f.State().AuditLog(0) {
		kinds[e.Kind]++
	}
	for _, k := range []gpupoolv1.AuditKind{gpupoolv1.AuditKind_AUDIT_KIND_ACL_BOOTSTRAP, gpupoolv1.AuditKind_AUDIT_KIND_ACL_TOKEN_CREATED, gpupoolv1.AuditKind_AUDIT_KIND_HOST_REGISTERED} {
		if kinds[k] != 1 {
			t.Errorf("%s entries after the flood: got %d, want 1", AuditKindName(k), kinds[k])
		}
	}
	churn := kinds[gpupoolv1.AuditKind_AUDIT_KIND_LEASE_GRANTED] + kinds[gpupoolv1.AuditKind_AUDIT_KIND_LEASE_RELEASED]
	if churn != state.AuditLimit {
		t.Errorf("lease entries after 2×%d: got %d, want the limit %d", leases, churn, state.AuditLimit)
	}
}

func TestTheAuditSinkGetsEveryCommittedEntryAsAJSONLine(t *testing.T) {
	var sink bytes.Buffer
	f := New(nil, WithAuditSink(&sink))
	applyAll(t, f, []proto.Message{bootstrapToken("t-boot", 1), host("h1", 1), grant("l-1", "h1", 0, 1024, 1), grant("l-2", "h9", 0, 1, 1)})
	var got []string
	for _, line := range strings.Split(strings.TrimSuffix(sink.String(), "\n"), "\n") {
		var e gpupoolv1.AuditEntry
		if err := protojson.Unmarshal([]byte(line), &e); err != nil {
			t.Fatalf("line %q: %v", line, err)
		}
		got = append(got, fmt.Sprintf("%d:%s:%s", e.Index, AuditKindName(e.Kind), e.Subject))
	}
	// The refused grant of l-2 wrote nothing.
	want := []string{"1:acl-bootstrap:t-boot", "2:host-registered:h1", "3:lease-granted:l-1"}
	if strings.Join(got, " ") != strings.Join(want, " ") {
		t.Fatalf("sink: got %v, want %v", got, want)
	}
}
