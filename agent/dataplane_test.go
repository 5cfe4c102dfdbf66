package agent

import (
	"crypto/ed25519"
	"crypto/rand"
	"path/filepath"
	"strings"
	"testing"
	"time"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
	"github.com/gpupool/gpupool/token"
)

func TestAuthorizeChecksEveryClaim(t *testing.T) {
	_, a, _ := enforcedAgent(t, nil)
	pub, priv, _ := ed25519.GenerateKey(rand.Reader)
	_, stranger, _ := ed25519.GenerateKey(rand.Reader)
	a.keys.setKeys([]*gpupoolv1.PublicKey{{Id: "k1", PublicKey: pub}})
	// L1 holds GPU 0 with fencing token 100; a newer lease was seen there.
	a.keys.sawFencing(&gpupoolv1.Assignment{FencingToken: 100, Slices: []*gpupoolv1.Slice{{Device: hostAGPU0()}}})
	sign := func(key ed25519.PrivateKey, edit func(*gpupoolv1.LeaseTokenClaims)) string {
		c := &gpupoolv1.LeaseTokenClaims{LeaseId: "L1", HostId: "host-a", KeyId: "k1", FencingToken: 100,
			ExpiresAtMs: time.Now().Add(time.Minute).UnixMilli(), Slices: []*gpupoolv1.Slice{{Host: "host-a", Device: hostAGPU0()}}}
		if edit != nil {
			edit(c)
		}
		tok, err := token.Sign(key, c)
		if err != nil {
			t.Fatal(err)
		}
		return tok
	}
	tests := []struct {
		name, tok, wantErr string
	}{
		{"a good token", sign(priv, nil), ""},
		{"an expired token", sign(priv, func(c *gpupoolv1.LeaseTokenClaims) { c.ExpiresAtMs = time.Now().Add(-time.Minute).UnixMilli() }), "expired"},
		{"a forged token", sign(stranger, nil), "bad signature"},
		{"a token for another host", sign(priv, func(c *gpupoolv1.LeaseTokenClaims) { c.HostId = "host-b" }), "is for host host-b, this is host host-a"},
		{"a lease this host does not enforce", sign(priv, func(c *gpupoolv1.LeaseTokenClaims) { c.LeaseId = "L7" }), "lease L7: lease not enforced on this host"},
		{"a fenced-out token", sign(priv, func(c *gpupoolv1.LeaseTokenClaims) { c.FencingToken = 99 }), "fenced out: fencing token 99 is older than 100"},
		{"a token for other slices", sign(priv, func(c *gpupoolv1.LeaseTokenClaims) { c.Slices[0].Device = "GPU-other" }), "does not match"},
		{"garbage", "gpt1.nope", "malformed"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			id, err := a.Authorize(tt.tok)
			if tt.wantErr == "" {
				if err != nil || id != "L1" {
					t.Fatalf("Authorize = %q, %v; want L1", id, err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("Authorize error %v, want one containing %q", err, tt.wantErr)
			}
		})
	}
	dir, err := a.LeaseDir("L1")
	if err != nil || !strings.HasSuffix(dir, filepath.Join("work", "L1")) {
		t.Fatalf("LeaseDir = %q, %v", dir, err)
	}
	if _, err := a.LeaseDir("L7"); err == nil {
		t.Fatal("a lease dir for a lease not enforced here")
	}
}
