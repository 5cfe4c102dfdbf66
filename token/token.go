// Package token signs and verifies lease tokens: what a lease holder shows
// the agent of a pool host to use its slices there.
//
// A token is "gpt1." + base64url(claims) + "." + base64url(signature),
// where claims is the protobuf encoding of gpupoolv1.LeaseTokenClaims and
// the signature is Ed25519 over everything before the last dot. The
// brokers sign with the key their Raft state marks current; agents verify
// offline with the public keys the brokers hand them.
package token

import (
	"crypto/ed25519"
	"encoding/base64"
	"errors"
	"fmt"
	"strings"
	"time"

	"google.golang.org/protobuf/proto"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// prefix names the token format.
const prefix = "gpt1."

// MaxLen bounds a token's length; longer ones are refused unread.
const MaxLen = 16 << 10

// Reasons a token is refused. Verify's errors wrap one of them.
var (
	ErrMalformed    = errors.New("malformed token")
	ErrUnknownKey   = errors.New("signed by an unknown key")
	ErrKeyRetired   = errors.New("signed by a retired key")
	ErrBadSignature = errors.New("bad signature")
	ErrExpired      = errors.New("expired")
)

var b64 = base64.RawURLEncoding

// Sign returns the token of c, signed by key (whose id c.KeyId must name).
func Sign(key ed25519.PrivateKey, c *gpupoolv1.LeaseTokenClaims) (string, error) {
	if len(key) != ed25519.PrivateKeySize {
		return "", fmt.Errorf("token: signing key of %d bytes, want %d", len(key), ed25519.PrivateKeySize)
	}
	if c.GetKeyId() == "" || c.GetLeaseId() == "" || c.GetHostId() == "" {
		return "", errors.New("token: claims need key_id, lease_id and host_id")
	}
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(c)
	if err != nil {
		return "", fmt.Errorf("token: encode claims: %w", err)
	}
	signed := prefix + b64.EncodeToString(b)
	return signed + "." + b64.EncodeToString(ed25519.Sign(key, []byte(signed))), nil
}

// Verify checks tok against keys at now and returns its claims. The error
// wraps one of the Err values and says why in words fit for a user, e.g.
// "token for lease l-1: expired 3s ago".
func Verify(keys []*gpupoolv1.PublicKey, tok string, now time.Time) (*gpupoolv1.LeaseTokenClaims, error) {
	c, signed, sig, err := parse(tok)
	if err != nil {
		return nil, err
	}
	var key *gpupoolv1.PublicKey
	for _, k := range keys {
		if k.GetId() == c.KeyId {
			key = k
			break
		}
	}
	switch {
	case key == nil:
		return nil, fmt.Errorf("token for lease %s: %w %q", c.LeaseId, ErrUnknownKey, c.KeyId)
	case len(key.PublicKey) != ed25519.PublicKeySize:
		return nil, fmt.Errorf("token for lease %s: key %q: %w", c.LeaseId, c.KeyId, ErrUnknownKey)
	case key.VerifyUntilMs != 0 && now.UnixMilli() > key.VerifyUntilMs:
		return nil, fmt.Errorf("token for lease %s: %w %q (retired %s ago)", c.LeaseId, ErrKeyRetired, c.KeyId, ago(now, key.VerifyUntilMs))
	case !ed25519.Verify(key.PublicKey, []byte(signed), sig):
		return nil, fmt.Errorf("token for lease %s: %w", c.LeaseId, ErrBadSignature)
	case now.UnixMilli() > c.ExpiresAtMs:
		return nil, fmt.Errorf("token for lease %s: %w %s ago; renew the lease for a fresh one", c.LeaseId, ErrExpired, ago(now, c.ExpiresAtMs))
	}
	return c, nil
}

// Peek returns a token's claims without checking them, for a holder that
// wants to know what it carries (expiry, host). Never trust its result.
func Peek(tok string) (*gpupoolv1.LeaseTokenClaims, error) {
	c, _, _, err := parse(tok)
	return c, err
}

func parse(tok string) (c *gpupoolv1.LeaseTokenClaims, signed string, sig []byte, err error) {
	malformed := func(why string) error { return fmt.Errorf("token: %w: %s", ErrMalformed, why) }
	if len(tok) > MaxLen {
		return nil, "", nil, malformed(fmt.Sprintf("%d bytes, more than %d", len(tok), MaxLen))
	}
	if !strings.HasPrefix(tok, prefix) {
		return nil, "", nil, malformed(`does not start with "` + prefix + `"`)
	}
	dot := strings.LastIndexByte(tok, '.')
	if dot < len(prefix) {
		return nil, "", nil, malformed("no signature")
	}
	signed = tok[:dot]
	body, err := b64.DecodeString(tok[len(prefix):dot])
	if err != nil {
		return nil, "", nil, malformed("claims are not base64url")
	}
	if sig, err = b64.DecodeString(tok[dot+1:]); err != nil || len(sig) != ed25519.SignatureSize {
		return nil, "", nil, malformed("signature is not a base64url Ed25519 signature")
	}
	c = &gpupoolv1.LeaseTokenClaims{}
	if err := proto.Unmarshal(body, c); err != nil {
		return nil, "", nil, malformed("claims do not decode")
	}
	if c.LeaseId == "" || c.HostId == "" || c.KeyId == "" {
		return nil, "", nil, malformed("claims lack lease_id, host_id or key_id")
	}
	return c, signed, sig, nil
}

func ago(now time.Time, ms int64) time.Duration {
	return now.Sub(time.UnixMilli(ms)).Round(time.Second)
}
