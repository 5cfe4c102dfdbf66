package token

import (
	"crypto/ed25519"
	"crypto/rand"
	"errors"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

func newKey(t testing.TB, id string, verifyUntil int64) (*gpupoolv1.PublicKey, ed25519.PrivateKey) {
	pub, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	return &gpupoolv1.PublicKey{Id: id, PublicKey: pub, VerifyUntilMs: verifyUntil}, priv
}

var now = time.Unix(1_800_000_000, 0)

func claims(keyID string, expires time.Time) *gpupoolv1.LeaseTokenClaims {
	return &gpupoolv1.LeaseTokenClaims{LeaseId: "l-1", HostId: "host-1", KeyId: keyID, FencingToken: 42,
		IssuedAtMs: now.Add(-time.Minute).UnixMilli(), ExpiresAtMs: expires.UnixMilli(),
		Slices: []*gpupoolv1.Slice{{Host: "host-1", Device: "GPU-x", MemoryMib: 1024, ComputePercent: 10}}}
}

func TestVerify(t *testing.T) {
	current, currentPriv := newKey(t, "k2", 0)
	old, oldPriv := newKey(t, "k1", now.Add(time.Hour).UnixMilli())
	retired, retiredPriv := newKey(t, "k0", now.Add(-time.Hour).UnixMilli())
	_, strangerPriv := newKey(t, "k2", 0)
	keys := []*gpupoolv1.PublicKey{current, old, retired}
	sign := func(priv ed25519.PrivateKey, c *gpupoolv1.LeaseTokenClaims) string {
		tok, err := Sign(priv, c)
		if err != nil {
			t.Fatal(err)
		}
		return tok
	}
	good := sign(currentPriv, claims("k2", now.Add(time.Minute)))
	tests := []struct {
		name    string
		tok     string
		wantErr error
		want    string // in the message
	}{
		{"a token of the current key", good, nil, ""},
		{"a token of a rotated key still in its grace", sign(oldPriv, claims("k1", now.Add(time.Minute))), nil, ""},
		{"an expired token", sign(currentPriv, claims("k2", now.Add(-3*time.Second))), ErrExpired, "token for lease l-1: expired 3s ago"},
		{"a token of a retired key", sign(retiredPriv, claims("k0", now.Add(time.Minute))), ErrKeyRetired, `retired key "k0"`},
		{"a forged token", sign(strangerPriv, claims("k2", now.Add(time.Minute))), ErrBadSignature, "bad signature"},
		{"an unknown key", sign(currentPriv, claims("k9", now.Add(time.Minute))), ErrUnknownKey, `unknown key "k9"`},
		{"claims changed after signing", tamper(t, good), ErrBadSignature, ""},
		{"no prefix", strings.TrimPrefix(good, prefix), ErrMalformed, `does not start with "gpt1."`},
		{"no signature", good[:strings.LastIndexByte(good, '.')], ErrMalformed, ""},
		{"empty", "", ErrMalformed, ""},
		{"too long", prefix + strings.Repeat("A", MaxLen), ErrMalformed, "more than"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := Verify(keys, tt.tok, now)
			if tt.wantErr == nil {
				if err != nil {
					t.Fatalf("Verify: %v", err)
				}
				if c.LeaseId != "l-1" || c.FencingToken != 42 || len(c.Slices) != 1 {
					t.Fatalf("claims %v", c)
				}
				return
			}
			if !errors.Is(err, tt.wantErr) || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("Verify error %v, want %v containing %q", err, tt.wantErr, tt.want)
			}
		})
	}
}

// tamper raises the fencing token in a signed token's claims.
func tamper(t *testing.T, tok string) string {
	c, err := Peek(tok)
	if err != nil {
		t.Fatal(err)
	}
	c.FencingToken++
	b, err := proto.Marshal(c)
	if err != nil {
		t.Fatal(err)
	}
	return prefix + b64.EncodeToString(b) + tok[strings.LastIndexByte(tok, '.'):]
}

func TestSignRefusesIncompleteClaims(t *testing.T) {
	_, priv := newKey(t, "k", 0)
	if _, err := Sign(priv, &gpupoolv1.LeaseTokenClaims{LeaseId: "l-1"}); err == nil {
		t.Fatal("signed claims without host and key")
	}
	if _, err := Sign(priv[:10], claims("k", now)); err == nil {
		t.Fatal("signed with a short key")
	}
}

func FuzzVerify(f *testing.F) {
	pub, priv := newKey(f, "k", 0)
	tok, err := Sign(priv, claims("k", now.Add(time.Minute)))
	if err != nil {
		f.Fatal(err)
	}
	f.Add(tok)
	f.Add("gpt1..")
	f.Add("gpt1.AAAA.BBBB")
	f.Add("")
	f.Fuzz(func(t *testing.T, s string) {
		c, err := Verify([]*gpupoolv1.PublicKey{pub}, s, now)
		if err == nil && (c.LeaseId == "" || c.HostId == "") {
			t.Fatalf("accepted claims without lease or host: %v", c)
		}
		if err == nil && s != tok {
			// Ed25519 signatures are not malleable in this encoding only
			// if the base64 is canonical; a different string that
			// verifies must carry the same claims.
			if c2, _ := Peek(tok); !proto.Equal(c, c2) {
				t.Fatalf("a different token verified with other claims: %q", s)
			}
		}
	})
}
