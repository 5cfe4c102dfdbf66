package broker

import (
	"errors"
	"testing"
	"time"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
	"github.com/gpupool/gpupool/token"
)

func TestLeaseTokensVerifyAndSurviveAKeyRotation(t *testing.T) {
	ts := startServer(t)
	ts.registerHost(t, "h1", 1, 81920)
	waitFor(t, "a signing key", func() bool { return currentKey(ts.s.fsm.State()) != nil })
	keys := func() []*gpupoolv1.PublicKey {
		r, err := ts.c.Operator.ListSigningKeys(ctx(t), &gpupoolv1.ListSigningKeysRequest{})
		if err != nil {
			t.Fatal(err)
		}
		return r.Keys
	}
	acq, err := ts.c.Lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: slice(1024, 10)})
	if err != nil {
		t.Fatal(err)
	}
	if len(acq.Tokens) != 1 || acq.Tokens[0].Host != "h1" || acq.Tokens[0].Address != "127.0.0.1:1" {
		t.Fatalf("tokens %v: want one for h1 with its address", acq.Tokens)
	}
	old := acq.Tokens[0].Token
	now := ts.clock.Now()
	c, err := token.Verify(keys(), old, now)
	if err != nil {
		t.Fatal(err)
	}
	if c.LeaseId != acq.Lease.Id || c.HostId != "h1" || c.FencingToken != acq.Lease.FencingToken || len(c.Slices) != 1 ||
		c.ExpiresAtMs != now.Add(time.Minute).UnixMilli() {
		t.Fatalf("claims %v: want the lease, its host, fencing token, slice and expiry in 60s", c)
	}

	rot, err := ts.c.Operator.RotateSigningKey(ctx(t), &gpupoolv1.RotateSigningKeyRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if rot.KeyId == c.KeyId || len(rot.Keys) != 2 {
		t.Fatalf("after rotation: key %s, %d keys; want a new key and the old one still verifying", rot.KeyId, len(rot.Keys))
	}
	if _, err := token.Verify(rot.Keys, old, now); err != nil {
		t.Fatalf("a token of the rotated key: %v, want it accepted until it expires", err)
	}
	if _, err := token.Verify(rot.Keys, old, now.Add(time.Minute+time.Second)); !errors.Is(err, token.ErrExpired) {
		t.Fatalf("the old token after its lease's TTL: %v, want expired", err)
	}

	ka, err := ts.c.Lease.KeepAlive(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	renew := func() *gpupoolv1.LeaseTokenClaims {
		t.Helper()
		if err := ka.Send(&gpupoolv1.KeepAliveRequest{LeaseId: acq.Lease.Id}); err != nil {
			t.Fatal(err)
		}
		r, err := ka.Recv()
		if err != nil {
			t.Fatal(err)
		}
		if len(r.Tokens) != 1 {
			t.Fatalf("renewal carries %d tokens, want 1", len(r.Tokens))
		}
		c, err := token.Verify(rot.Keys, r.Tokens[0].Token, ts.clock.Now())
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	// Until agents have had two heartbeats to learn the new key, the old
	// one still signs.
	if c := renew(); c.KeyId != c0KeyID(t, old) {
		t.Fatalf("a renewal right after the rotation is signed by %s, want the old key until agents know the new one", c.KeyId)
	}
	ts.clock.Advance(2 * ts.s.cfg.HeartbeatInterval)
	if c := renew(); c.KeyId != rot.KeyId {
		t.Fatalf("a renewal after the warm-up is signed by %s, want the new key %s", c.KeyId, rot.KeyId)
	}
	reg, err := ts.c.Agent.Register(ctx(t), &gpupoolv1.RegisterRequest{Host: &gpupoolv1.Host{Id: "h2"}})
	if err != nil {
		t.Fatal(err)
	}
	if len(reg.Keys) != 2 {
		t.Fatalf("an agent registering gets %d keys, want both", len(reg.Keys))
	}
}

func c0KeyID(t *testing.T, tok string) string {
	c, err := token.Peek(tok)
	if err != nil {
		t.Fatal(err)
	}
	return c.KeyId
}
