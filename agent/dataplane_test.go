package agent

import (
	"crypto/ed25519"
	"crypto/rand"
	"os"
	"path/filepath"
	"slices"
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
	// L1 holds a slice of GPU 0 with fencing token 100.
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
		{"a fenced-out token", sign(priv, func(c *gpupoolv1.LeaseTokenClaims) { c.FencingToken = 99 }), "fenced out: fencing token 99 is older than 100 for its slice"},
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

// sliceLease is a lease of one slice of host-a's GPU 0 (80 GiB).
func sliceLease(id string, tok uint64, memMiB int64, compute int32, exclusive bool) *gpupoolv1.Assignment {
	return &gpupoolv1.Assignment{LeaseId: id, FencingToken: tok, State: gpupoolv1.LeaseState_LEASE_STATE_GRANTED, TtlMs: 60_000,
		Slices: []*gpupoolv1.Slice{{Host: "host-a", Device: hostAGPU0(), MemoryMib: memMiB, ComputePercent: compute, Exclusive: exclusive,
			Isolation: gpupoolv1.Isolation_ISOLATION_WATCHDOG}}}
}

func TestFencingIsPerSlice(t *testing.T) {
	tests := []struct {
		name string
		// leases are what the broker lists on host-a's GPU 0 (80 GiB).
		leases []*gpupoolv1.Assignment
		// refused maps each lease whose token is fenced out to a part of
		// the error; the others must be let in.
		refused map[string]string
	}{
		{"two slices that fit on the GPU together both keep access",
			[]*gpupoolv1.Assignment{sliceLease("L1", 100, 40960, 50, false), sliceLease("L2", 101, 40960, 50, false)}, nil},
		{"an older slice whose memory was granted again to a newer lease is fenced out",
			[]*gpupoolv1.Assignment{sliceLease("L1", 100, 61440, 30, false), sliceLease("L2", 101, 61440, 30, false)},
			map[string]string{"L1": "its capacity on " + hostAGPU0() + " was granted again to the newer lease L2 (fencing token 101), and fencing token 100 is older"}},
		{"an older slice whose compute was granted again to newer leases is fenced out",
			[]*gpupoolv1.Assignment{sliceLease("L1", 100, 1024, 60, false), sliceLease("L2", 101, 1024, 30, false), sliceLease("L3", 102, 1024, 30, false)},
			map[string]string{"L1": "granted again to the newer leases L2 (fencing token 101), L3 (fencing token 102)"}},
		{"a newer exclusive lease fences out an older slice",
			[]*gpupoolv1.Assignment{sliceLease("L1", 100, 1024, 10, false), sliceLease("L2", 101, 81920, 0, true)},
			map[string]string{"L1": "granted again to the newer lease L2"}},
		{"a newer slice fences out an older exclusive lease",
			[]*gpupoolv1.Assignment{sliceLease("L1", 100, 81920, 0, true), sliceLease("L2", 101, 1024, 10, false)},
			map[string]string{"L1": "granted again to the newer lease L2"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f, a, _ := enforcedAgent(t, nil)
			pub, priv, _ := ed25519.GenerateKey(rand.Reader)
			a.keys.setKeys([]*gpupoolv1.PublicKey{{Id: "k1", PublicKey: pub}})
			f.mu.Lock()
			f.enforce = tt.leases
			f.mu.Unlock()
			f.setAssignmentsRaw()
			var want []string
			for _, l := range tt.leases {
				want = append(want, l.LeaseId)
			}
			f.waitFor(t, "the agent enforces every lease", func() bool { return slices.Equal(leaseIDs(a.Assignments()), want) })
			for _, l := range tt.leases {
				tok, err := token.Sign(priv, &gpupoolv1.LeaseTokenClaims{LeaseId: l.LeaseId, HostId: "host-a", KeyId: "k1", FencingToken: l.FencingToken,
					ExpiresAtMs: time.Now().Add(time.Minute).UnixMilli(), Slices: l.Slices})
				if err != nil {
					t.Fatal(err)
				}
				id, err := a.Authorize(tok)
				wantErr, refused := tt.refused[l.LeaseId]
				switch {
				case refused && (err == nil || !strings.Contains(err.Error(), wantErr)):
					t.Errorf("Authorize(%s) = %q, %v; want an error containing %q", l.LeaseId, id, err, wantErr)
				case !refused && (err != nil || id != l.LeaseId):
					t.Errorf("Authorize(%s) = %q, %v; want %s let in", l.LeaseId, id, err, l.LeaseId)
				}
			}
		})
	}
}

func TestTheAgentsStateIsPrivateToIt(t *testing.T) {
	_, a, cfg := enforcedAgent(t, func(c *Config) { c.DataBind = "127.0.0.1:0" })
	dir, err := a.LeaseDir("L1")
	if err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct {
		path string
		want os.FileMode
	}{
		{cfg.DataDir, 0o700},
		{filepath.Join(cfg.DataDir, "leases"), 0o700},
		{filepath.Join(cfg.DataDir, "tls"), 0o700},
		{filepath.Join(cfg.DataDir, "tls", "dataplane-key.pem"), 0o600},
		{filepath.Join(cfg.DataDir, "leases", "L1.json"), 0o600},
		{dir, 0o700},
	} {
		fi, err := os.Stat(tt.path)
		if err != nil {
			t.Fatal(err)
		}
		if got := fi.Mode().Perm(); got != tt.want {
			t.Errorf("%s: mode %#o, want %#o", tt.path, got, tt.want)
		}
	}
}
