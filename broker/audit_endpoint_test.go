package broker

import (
	"context"
	"errors"
	"io"
	"testing"

	"google.golang.org/grpc/codes"

	"github.com/gpupool/gpupool/client"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// auditLog reads an AuditLog stream to its end.
func auditLog(ctx context.Context, c *client.Client, req *gpupoolv1.AuditLogRequest) ([]*gpupoolv1.AuditEntry, error) {
	s, err := c.Operator.AuditLog(ctx, req)
	if err != nil {
		return nil, err
	}
	var out []*gpupoolv1.AuditEntry
	for {
		e, err := s.Recv()
		if errors.Is(err, io.EOF) {
			return out, nil
		}
		if err != nil {
			return out, err
		}
		out = append(out, e)
	}
}

func kindsOf(entries []*gpupoolv1.AuditEntry) []gpupoolv1.AuditKind {
	var out []gpupoolv1.AuditKind
	for _, e := range entries {
		out = append(out, e.Kind)
	}
	return out
}

func TestAuditLogNamesTheTokenThatDrainedAndSetAQuota(t *testing.T) {
	as := startACLServer(t)
	opsTok, opsSecret := as.token(t, &gpupoolv1.CreateAclTokenRequest{Name: "ops", Kind: gpupoolv1.TokenKind_TOKEN_KIND_MANAGEMENT})
	ops := as.clientWith(t, opsSecret)
	if _, err := ops.Operator.SetQuota(ctx(t), &gpupoolv1.SetQuotaRequest{Quota: &gpupoolv1.Quota{Tenant: "a", Gpus: 4}}); err != nil {
		t.Fatal(err)
	}
	if _, err := ops.Pool.DrainHost(ctx(t), &gpupoolv1.DrainHostRequest{HostId: "h1", Reason: "firmware"}); err != nil {
		t.Fatal(err)
	}
	got, err := auditLog(ctx(t), as.c, &gpupoolv1.AuditLogRequest{Kinds: []gpupoolv1.AuditKind{
		gpupoolv1.AuditKind_AUDIT_KIND_QUOTA_SET, gpupoolv1.AuditKind_AUDIT_KIND_HOST_DRAIN_STARTED}})
	if err != nil {
		t.Fatal(err)
	}
	want := []struct {
		kind    gpupoolv1.AuditKind
		subject string
	}{{gpupoolv1.AuditKind_AUDIT_KIND_QUOTA_SET, "a"}, {gpupoolv1.AuditKind_AUDIT_KIND_HOST_DRAIN_STARTED, "h1"}}
	if len(got) != len(want) {
		t.Fatalf("got kinds %v, want %v", kindsOf(got), want)
	}
	for i, w := range want {
		e := got[i]
		if e.Kind != w.kind || e.Subject != w.subject || e.Actor.GetAccessorId() != opsTok.AccessorId || e.Actor.GetName() != "ops" {
			t.Errorf("entry %d: got %v of %s by %v, want %v of %s by ops (%s)", i, e.Kind, e.Subject, e.Actor, w.kind, w.subject, opsTok.AccessorId)
		}
		if e.AtMs != as.clock.Now().UnixMilli() {
			t.Errorf("entry %d: at %d, want the server's clock %d", i, e.AtMs, as.clock.Now().UnixMilli())
		}
	}

	// limit keeps the newest.
	last, err := auditLog(ctx(t), as.c, &gpupoolv1.AuditLogRequest{Limit: 1})
	if err != nil {
		t.Fatal(err)
	}
	if len(last) != 1 || last[0].Kind != gpupoolv1.AuditKind_AUDIT_KIND_HOST_DRAINED {
		t.Fatalf("limit 1: got %v, want the newest entry, host-drained", kindsOf(last))
	}

	// follow streams what applies after the entries stored.
	fctx, cancel := context.WithCancel(ctx(t))
	defer cancel()
	s, err := as.c.Operator.AuditLog(fctx, &gpupoolv1.AuditLogRequest{SinceIndex: last[0].Index, Follow: true})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ops.Pool.DrainHost(ctx(t), &gpupoolv1.DrainHostRequest{HostId: "h1", Cancel: true}); err != nil {
		t.Fatal(err)
	}
	e, err := s.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if e.Kind != gpupoolv1.AuditKind_AUDIT_KIND_HOST_DRAIN_CANCELLED || e.Actor.GetName() != "ops" || e.Index <= last[0].Index {
		t.Fatalf("followed: got %v by %v at index %d, want host-drain-cancelled by ops after index %d", e.Kind, e.Actor, e.Index, last[0].Index)
	}
}

func TestAuditLogShowsAClientTokenItsTenantsOnly(t *testing.T) {
	as := startACLServer(t)
	_, secret := as.token(t, clientToken("a"))
	alice := as.clientWith(t, secret)
	if _, err := alice.Lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: slice(1024, 5)}); err != nil {
		t.Fatal(err)
	}
	other := slice(1024, 5)
	other.Tenant = "b"
	if _, err := as.c.Lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: other}); err != nil {
		t.Fatal(err)
	}
	if _, err := as.c.Operator.SetQuota(ctx(t), &gpupoolv1.SetQuotaRequest{Quota: &gpupoolv1.Quota{Tenant: "a", Gpus: 4}}); err != nil {
		t.Fatal(err)
	}
	if _, err := as.c.Pool.DrainHost(ctx(t), &gpupoolv1.DrainHostRequest{HostId: "h1"}); err != nil {
		t.Fatal(err)
	}

	all, err := auditLog(ctx(t), as.c, &gpupoolv1.AuditLogRequest{})
	if err != nil {
		t.Fatal(err)
	}
	seen, err := auditLog(ctx(t), alice, &gpupoolv1.AuditLogRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if len(all) <= len(seen) {
		t.Fatalf("management sees %d entries, the client %d: want the client to see fewer", len(all), len(seen))
	}
	want := []gpupoolv1.AuditKind{gpupoolv1.AuditKind_AUDIT_KIND_LEASE_GRANTED, gpupoolv1.AuditKind_AUDIT_KIND_QUOTA_SET}
	if got := kindsOf(seen); len(got) != len(want) || got[0] != want[0] || got[1] != want[1] {
		t.Fatalf("client of tenant a: got %v, want %v", got, want)
	}
	for _, e := range seen {
		if e.Tenant != "a" {
			t.Errorf("client of tenant a sees an entry of tenant %q: %v of %s", e.Tenant, e.Kind, e.Subject)
		}
	}

	tests := []struct {
		name      string
		c         *client.Client
		req       *gpupoolv1.AuditLogRequest
		code      codes.Code
		fragments []string
	}{
		{"a client asking for another tenant", alice, &gpupoolv1.AuditLogRequest{Tenant: "b"}, codes.PermissionDenied, []string{`not tenant "b"`}},
		{"an unknown kind", as.c, &gpupoolv1.AuditLogRequest{Kinds: []gpupoolv1.AuditKind{99}}, codes.InvalidArgument, []string{"kinds[0] 99", "lease-granted", "acl-token-revoked"}},
		{"the unspecified kind", as.c, &gpupoolv1.AuditLogRequest{Kinds: []gpupoolv1.AuditKind{gpupoolv1.AuditKind_AUDIT_KIND_QUOTA_SET, 0}}, codes.InvalidArgument, []string{"kinds[1] 0"}},
		{"a malformed tenant", as.c, &gpupoolv1.AuditLogRequest{Tenant: "Not A Tenant"}, codes.InvalidArgument, []string{"tenant"}},
		{"no token", as.clientWith(t, ""), &gpupoolv1.AuditLogRequest{}, codes.Unauthenticated, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := auditLog(ctx(t), tt.c, tt.req)
			wantStatus(t, err, tt.code, tt.fragments...)
		})
	}

	agentTok := &gpupoolv1.CreateAclTokenRequest{Kind: gpupoolv1.TokenKind_TOKEN_KIND_AGENT, HostId: "h1"}
	_, agentSecret := as.token(t, agentTok)
	_, err = auditLog(ctx(t), as.clientWith(t, agentSecret), &gpupoolv1.AuditLogRequest{})
	wantStatus(t, err, codes.PermissionDenied)
}

// A restore replaces the audit log with the snapshot's: a follow goes on
// with what applies after it.
func TestAuditLogFollowGoesOnAcrossASnapshotRestore(t *testing.T) {
	ts := startServer(t)
	setQuota := func(tenant string) {
		t.Helper()
		if _, err := ts.c.Operator.SetQuota(ctx(t), &gpupoolv1.SetQuotaRequest{Quota: &gpupoolv1.Quota{Tenant: tenant, Gpus: 1}}); err != nil {
			t.Fatal(err)
		}
	}
	setQuota("a")
	snap := saveSnapshot(t, ts.c)
	fctx, cancel := context.WithCancel(ctx(t))
	defer cancel()
	s, err := ts.c.Operator.AuditLog(fctx, &gpupoolv1.AuditLogRequest{SinceIndex: ts.s.fsm.State().Index(), Follow: true})
	if err != nil {
		t.Fatal(err)
	}
	recv := func(want string) {
		t.Helper()
		e, err := s.Recv()
		if err != nil {
			t.Fatal(err)
		}
		if e.Kind != gpupoolv1.AuditKind_AUDIT_KIND_QUOTA_SET || e.Subject != want {
			t.Fatalf("followed %v of %s, want quota-set of %s", e.Kind, e.Subject, want)
		}
	}
	setQuota("b")
	recv("b")
	if err := restoreSnapshot(t, ts.c, snap); err != nil {
		t.Fatal(err)
	}
	setQuota("c")
	recv("c")

	all, err := auditLog(ctx(t), ts.c, &gpupoolv1.AuditLogRequest{})
	if err != nil {
		t.Fatal(err)
	}
	var subjects []string
	for _, e := range all {
		subjects = append(subjects, e.Subject)
	}
	if len(subjects) != 2 || subjects[0] != "a" || subjects[1] != "c" {
		t.Fatalf("after the restore: got entries of %v, want a (in the snapshot) and c (after it)", subjects)
	}
}
