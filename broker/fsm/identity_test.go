package fsm

import (
	"errors"
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// withIdentity is host h1 registering with a data-plane address and a
// certificate fingerprint.
func withIdentity(addr, sha string) *gpupoolv1.RegisterHostCommand {
	c := host("h1", 1)
	c.Host.Address, c.Host.CertSha256 = addr, sha
	return c
}

func TestAHostsIdentityChangesOnlyWithoutLiveLeasesOrAfterAReset(t *testing.T) {
	const sha1, sha2 = "1111111111111111aaaa", "2222222222222222bbbb"
	tests := []struct {
		name string
		log  []proto.Message
		// wantErr is a part of the last command's error, "" for none.
		wantErr string
		// wantKind is the kind of the last audit entry, wantDetail a part
		// of its detail.
		wantKind   gpupoolv1.AuditKind
		wantDetail string
		// wantAddr is h1's address after the log.
		wantAddr string
	}{
		{"a new host's identity is recorded",
			[]proto.Message{withIdentity("10.0.0.1:7650", sha1)}, "",
			gpupoolv1.AuditKind_AUDIT_KIND_HOST_REGISTERED, `data-plane address "10.0.0.1:7650", certificate fingerprint 1111111111111111…`, "10.0.0.1:7650"},
		{"a host without live leases may move, and it is recorded",
			[]proto.Message{withIdentity("10.0.0.1:7650", sha1), withIdentity("10.0.0.2:7650", sha1)}, "",
			gpupoolv1.AuditKind_AUDIT_KIND_HOST_IDENTITY_CHANGED, `new data-plane address "10.0.0.2:7650" (was "10.0.0.1:7650")`, "10.0.0.2:7650"},
		{"a new fingerprint under a live lease is refused, and the refusal recorded",
			[]proto.Message{withIdentity("10.0.0.1:7650", sha1), grant("l-1", "h1", 0, 1024, 10), withIdentity("10.0.0.1:7650", sha2)},
			"host h1 registered with a new certificate fingerprint 2222222222222222… (was 1111111111111111…) while it holds 1 live lease: refused; if the host really changed, an operator confirms with 'gpupool host reset-identity h1'",
			gpupoolv1.AuditKind_AUDIT_KIND_HOST_IDENTITY_REFUSED, "1 live lease", "10.0.0.1:7650"},
		{"an operator's reset forgets the identity",
			[]proto.Message{withIdentity("10.0.0.1:7650", sha1), grant("l-1", "h1", 0, 1024, 10),
				&gpupoolv1.ResetHostIdentityCommand{HostId: "h1", Reason: "new NIC", NowMs: 5000, Actor: &gpupoolv1.Actor{Name: "ops"}}}, "",
			gpupoolv1.AuditKind_AUDIT_KIND_HOST_IDENTITY_RESET, `forgot data-plane address "10.0.0.1:7650" and certificate fingerprint 1111111111111111…: new NIC`, ""},
		{"after a reset a new identity applies under live leases",
			[]proto.Message{withIdentity("10.0.0.1:7650", sha1), grant("l-1", "h1", 0, 1024, 10),
				&gpupoolv1.ResetHostIdentityCommand{HostId: "h1", NowMs: 5000}, withIdentity("10.0.0.9:7650", sha2)}, "",
			gpupoolv1.AuditKind_AUDIT_KIND_HOST_IDENTITY_CHANGED, "after an operator's reset", "10.0.0.9:7650"},
		{"a reset of an unknown host is refused",
			[]proto.Message{&gpupoolv1.ResetHostIdentityCommand{HostId: "h7", NowMs: 5000}}, `host "h7": not found`,
			0, "", ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := New(nil)
			res := applyAll(t, f, tt.log)
			last := res[len(res)-1]
			if tt.wantErr == "" && last.Err != nil || tt.wantErr != "" && (last.Err == nil || !strings.Contains(last.Err.Error(), tt.wantErr)) {
				t.Fatalf("last command: got error %v, want %q", last.Err, tt.wantErr)
			}
			var ie *IdentityError
			if tt.wantKind == gpupoolv1.AuditKind_AUDIT_KIND_HOST_IDENTITY_REFUSED && !errors.As(last.Err, &ie) {
				t.Fatalf("got %T, want an *IdentityError", last.Err)
			}
			if h := f.State().Host("h1"); h != nil && h.Address != tt.wantAddr {
				t.Fatalf("h1's address: got %q, want %q", h.Address, tt.wantAddr)
			}
			if tt.wantKind == 0 {
				return
			}
			entries := f.State().AuditLog(0)
			if len(entries) == 0 {
				t.Fatal("no audit entry")
			}
			e := entries[len(entries)-1]
			if e.Kind != tt.wantKind || !strings.Contains(e.Detail, tt.wantDetail) || e.Subject != "h1" {
				t.Fatalf("last audit entry: got %v %s %q, want %v h1 containing %q", e.Kind, e.Subject, e.Detail, tt.wantKind, tt.wantDetail)
			}
		})
	}
}
