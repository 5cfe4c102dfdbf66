package fsm

import (
	"bytes"
	"crypto/sha256"
	"errors"
	"io"
	"slices"
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// secretHash is a distinct 32-byte hash per seed.
func secretHash(seed byte) []byte {
	h := sha256.Sum256([]byte{seed})
	return h[:]
}

func mgmtTok(id string, seed byte) *gpupoolv1.AclToken {
	return &gpupoolv1.AclToken{AccessorId: id, Name: id, Kind: gpupoolv1.TokenKind_TOKEN_KIND_MANAGEMENT, SecretSha256: secretHash(seed), CreatedAtMs: 5000}
}

func clientTok(id string, seed byte, tenants ...string) *gpupoolv1.AclToken {
	return &gpupoolv1.AclToken{AccessorId: id, Name: id, Kind: gpupoolv1.TokenKind_TOKEN_KIND_CLIENT, Tenants: tenants, SecretSha256: secretHash(seed), CreatedAtMs: 5000}
}

func bootstrapToken(id string, seed byte) *gpupoolv1.CreateAclTokenCommand {
	return &gpupoolv1.CreateAclTokenCommand{Token: mgmtTok(id, seed), Bootstrap: true}
}

func createToken(t *gpupoolv1.AclToken) *gpupoolv1.CreateAclTokenCommand {
	return &gpupoolv1.CreateAclTokenCommand{Token: t}
}

func TestACLTokenCommands(t *testing.T) {
	agentNoHost := &gpupoolv1.AclToken{AccessorId: "t-x", Name: "x", Kind: gpupoolv1.TokenKind_TOKEN_KIND_AGENT, SecretSha256: secretHash(9)}
	shortHash := clientTok("t-x", 9, "a")
	shortHash.SecretSha256 = shortHash.SecretSha256[:16]
	revokedAtBirth := clientTok("t-x", 9, "a")
	revokedAtBirth.Revoked = true
	clientBootstrap := &gpupoolv1.CreateAclTokenCommand{Token: clientTok("t-x", 9, "a"), Bootstrap: true}

	tests := []struct {
		name string
		cmd  proto.Message
		// want is a fragment of the error, or "" for success.
		want string
	}{
		{"a second bootstrap", bootstrapToken("t-boot2", 9), "already bootstrapped (log index 1)"},
		{"a bootstrap of a client token", clientBootstrap, "must be a management token"},
		{"a token whose accessor id exists", createToken(clientTok("t-a", 9, "a")), "accessor id t-a already exists"},
		{"a token whose secret hash exists", createToken(clientTok("t-y", 2, "a")), "secret hash is already stored"},
		{"a token with a short secret hash", createToken(shortHash), "32-byte secret hash"},
		{"an agent token without a host", createToken(agentNoHost), "host_id"},
		{"a token created revoked", createToken(revokedAtBirth), "cannot be revoked or expired"},
		{"revoking an unknown token", &gpupoolv1.RevokeAclTokenCommand{AccessorId: "t-none"}, "not found"},
		{"a valid client token", createToken(clientTok("t-b", 3, "b", "c")), ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := New(nil)
			applyAll(t, f, []proto.Message{bootstrapToken("t-boot", 1), createToken(clientTok("t-a", 2, "a"))})
			before := snapshotBytes(t, f)
			b, err := Encode(tt.cmd)
			if err != nil {
				t.Fatal(err)
			}
			res := f.apply(3, mustDecode(t, b))
			if tt.want == "" {
				if res.Err != nil {
					t.Fatalf("got %v, want success", res.Err)
				}
				return
			}
			if res.Err == nil || !strings.Contains(res.Err.Error(), tt.want) {
				t.Fatalf("got %v, want an error mentioning %q", res.Err, tt.want)
			}
			// Refused whole: the state (but for nothing) is unchanged.
			if got := snapshotBytes(t, f); !bytes.Equal(got, before) {
				t.Error("a refused command changed the state")
			}
		})
	}
}

func mustDecode(t *testing.T, b []byte) proto.Message {
	t.Helper()
	_, m, err := Decode(b)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

func TestRevokeKeepsTheFirstRevocation(t *testing.T) {
	f := New(nil)
	first := &gpupoolv1.Actor{AccessorId: "t-boot", Name: "bootstrap"}
	res := applyAll(t, f, []proto.Message{
		bootstrapToken("t-boot", 1),
		createToken(clientTok("t-a", 2, "a")),
		&gpupoolv1.RevokeAclTokenCommand{AccessorId: "t-a", NowMs: 7000, Actor: first},
		&gpupoolv1.RevokeAclTokenCommand{AccessorId: "t-a", NowMs: 8000},
	})
	for i, r := range res {
		if r.Err != nil {
			t.Fatalf("command %d: %v", i, r.Err)
		}
	}
	got := f.State().ACLToken("t-a")
	if !got.Revoked || got.RevokedAtMs != 7000 || !proto.Equal(got.RevokedBy, first) {
		t.Errorf("got revoked=%t at %d by %v, want the first revocation at 7000 by %v", got.Revoked, got.RevokedAtMs, got.RevokedBy, first)
	}
	if f.State().ACLTokenBySecret(secretHash(2)).GetAccessorId() != "t-a" {
		t.Error("the token is not found by its secret hash")
	}
}

func TestSnapshotRoundTripsTokensAndTheBootstrap(t *testing.T) {
	f := New(nil)
	applyAll(t, f, []proto.Message{bootstrapToken("t-boot", 1), createToken(clientTok("t-a", 2, "a"))})
	restored := New(nil)
	if err := restored.Restore(io.NopCloser(bytes.NewReader(snapshotBytes(t, f)))); err != nil {
		t.Fatal(err)
	}
	st := restored.State()
	if st.ACLBootstrapIndex() != 1 || st.ACLTokenBySecret(secretHash(2)).GetAccessorId() != "t-a" || len(st.ACLTokens()) != 2 {
		t.Fatalf("restored: bootstrap index %d, %d tokens; want 1 and 2, t-a found by hash", st.ACLBootstrapIndex(), len(st.ACLTokens()))
	}
	// The bootstrap stays done after a restore.
	b, _ := Encode(bootstrapToken("t-boot2", 9))
	if res := restored.apply(3, mustDecode(t, b)); res.Err == nil {
		t.Error("a bootstrap after restoring a bootstrapped state was accepted")
	} else if pe := (*PreconditionError)(nil); !errors.As(res.Err, &pe) {
		t.Errorf("got %T %v, want a *PreconditionError", res.Err, res.Err)
	}
}

func TestAuditActorsDefaultToTheBroker(t *testing.T) {
	f := New(nil)
	alice := &gpupoolv1.Actor{AccessorId: "t-a", Name: "alice"}
	g := grant("l-1", "h1", 0, 1024, 10)
	g.Lease.GrantedBy = alice
	res := applyAll(t, f, []proto.Message{
		host("h1", 1),
		g,
		grant("l-2", "h1", 0, 1024, 10),
		&gpupoolv1.EndLeaseCommand{LeaseId: "l-1", EndState: gpupoolv1.LeaseState_LEASE_STATE_RELEASED, NowMs: 3000, Actor: alice},
		&gpupoolv1.EndLeaseCommand{LeaseId: "l-2", EndState: gpupoolv1.LeaseState_LEASE_STATE_EXPIRED, NowMs: 3000},
	})
	for i, r := range res {
		if r.Err != nil {
			t.Fatalf("command %d: %v", i, r.Err)
		}
	}
	st := f.State()
	broker := BrokerActor()
	for _, c := range []struct {
		what      string
		got, want *gpupoolv1.Actor
	}{
		{"l-1 granted_by", st.Lease("l-1").GrantedBy, alice},
		{"l-1 ended_by", st.Lease("l-1").EndedBy, alice},
		{"l-2 granted_by", st.Lease("l-2").GrantedBy, broker},
		{"l-2 ended_by (expiry)", st.Lease("l-2").EndedBy, broker},
	} {
		if !proto.Equal(c.got, c.want) {
			t.Errorf("%s: got %v, want %v", c.what, c.got, c.want)
		}
	}
}

func TestRevokingATokenRevokesTheLeasesItAcquiredUnlessKept(t *testing.T) {
	byA := &gpupoolv1.Actor{AccessorId: "t-a", Name: "t-a"}
	mine := grant("l-a", "h1", 0, 1024, 1)
	mine.Lease.GrantedBy = byA
	other := grant("l-b", "h1", 0, 1024, 1)
	other.Lease.GrantedBy = &gpupoolv1.Actor{AccessorId: "t-b", Name: "t-b"}
	tests := []struct {
		name        string
		revoke      *gpupoolv1.RevokeAclTokenCommand
		wantEnded   []string
		wantAState  gpupoolv1.LeaseState
		wantAReason string
	}{
		{"the token's leases are revoked with it",
			&gpupoolv1.RevokeAclTokenCommand{AccessorId: "t-a", NowMs: 9000, RevokeLeases: true}, []string{"l-a"},
			gpupoolv1.LeaseState_LEASE_STATE_RELEASING, "the ACL token that acquired it (t-a) was revoked"},
		{"kept leases run on",
			&gpupoolv1.RevokeAclTokenCommand{AccessorId: "t-a", NowMs: 9000}, nil, gpupoolv1.LeaseState_LEASE_STATE_GRANTED, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := New(nil)
			res := applyAll(t, f, []proto.Message{host("h1", 1), createToken(clientTok("t-a", 2, "default")), mine, other, tt.revoke})
			last := res[len(res)-1]
			if last.Err != nil || !slices.Equal(last.Ended, tt.wantEnded) {
				t.Fatalf("revoke: got ended %v, %v; want %v", last.Ended, last.Err, tt.wantEnded)
			}
			a, b := f.State().Lease("l-a"), f.State().Lease("l-b")
			if a.State != tt.wantAState || (tt.wantAReason != "" && a.Reason != tt.wantAReason) {
				t.Fatalf("l-a: got %v %q, want %v %q", a.State, a.Reason, tt.wantAState, tt.wantAReason)
			}
			if b.State != gpupoolv1.LeaseState_LEASE_STATE_GRANTED {
				t.Fatalf("l-b of another token: got %v, want granted", b.State)
			}
		})
	}
}
