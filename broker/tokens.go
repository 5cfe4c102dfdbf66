package broker

import (
	"crypto/ed25519"
	"crypto/rand"
	"fmt"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/gpupool/gpupool/broker/state"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
	"github.com/gpupool/gpupool/token"
)

// verifySlack is added to how long a rotated key keeps verifying, for
// clock differences between brokers and agents.
const verifySlack = time.Minute

// currentKey returns the signing key that signs now, or nil.
func currentKey(st *state.Reader) *gpupoolv1.SigningKey {
	for _, k := range st.SigningKeys() {
		if k.VerifyUntilMs == 0 {
			return k
		}
	}
	return nil
}

// publicKeys returns the public halves of the keys agents must accept:
// the current one and the rotated ones still verifying at now.
func publicKeys(st *state.Reader, now time.Time) []*gpupoolv1.PublicKey {
	var out []*gpupoolv1.PublicKey
	for _, k := range st.SigningKeys() {
		if k.VerifyUntilMs == 0 || k.VerifyUntilMs >= now.UnixMilli() {
			out = append(out, &gpupoolv1.PublicKey{Id: k.Id, PublicKey: k.PublicKey, VerifyUntilMs: k.VerifyUntilMs})
		}
	}
	return out
}

// newSigningKey generates a key pair named after its creation time.
func newSigningKey(now time.Time) (*gpupoolv1.SigningKey, error) {
	pub, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("broker: generate signing key: %w", err)
	}
	return &gpupoolv1.SigningKey{Id: "k-" + randomHex(6), PublicKey: pub, PrivateKey: priv, CreatedAtMs: now.UnixMilli()}, nil
}

// ensureSigningKey gives a cluster without a signing key its first one.
// The leader calls it after its barrier, so the key is generated once and
// replicated.
func (sg *signing) ensureSigningKey() error {
	sg.keysMu.Lock()
	defer sg.keysMu.Unlock()
	if currentKey(sg.fsm.State()) != nil {
		return nil
	}
	k, err := newSigningKey(sg.cfg.Clock.Now())
	if err != nil {
		return err
	}
	if _, err := sg.apply(&gpupoolv1.SetSigningKeysCommand{Keys: []*gpupoolv1.SigningKey{k}}); err != nil {
		return err
	}
	sg.log.Info("generated the cluster's token signing key", "key", k.Id)
	return nil
}

// rotateSigningKey makes a new key sign. The old one keeps verifying
// until the tokens it signed have expired: tokens live at most a lease's
// TTL, so until now plus the longest TTL of a granted lease (plus slack).
// Keys past their verification time are dropped.
func (sg *signing) rotateSigningKey() (*gpupoolv1.SigningKey, time.Time, error) {
	sg.keysMu.Lock()
	defer sg.keysMu.Unlock()
	now := sg.cfg.Clock.Now()
	st := sg.fsm.State()
	var maxTTL time.Duration
	for _, l := range st.Leases() {
		if l.State == gpupoolv1.LeaseState_LEASE_STATE_GRANTED {
			maxTTL = max(maxTTL, time.Duration(l.TtlMs)*time.Millisecond)
		}
	}
	// The old key also signs for a while after the rotation (see
	// signingKey), so its tokens live that much longer.
	until := now.Add(sg.keyWarmup() + maxTTL + verifySlack)
	k, err := newSigningKey(now)
	if err != nil {
		return nil, time.Time{}, err
	}
	keys := []*gpupoolv1.SigningKey{k}
	for _, old := range st.SigningKeys() {
		switch {
		case old.VerifyUntilMs == 0:
			o := proto.CloneOf(old)
			o.VerifyUntilMs = until.UnixMilli()
			keys = append(keys, o)
		case old.VerifyUntilMs >= now.UnixMilli():
			keys = append(keys, old)
		}
	}
	if _, err := sg.apply(&gpupoolv1.SetSigningKeysCommand{Keys: keys}); err != nil {
		return nil, time.Time{}, err
	}
	return k, until, nil
}

// keyWarmup is how long a new key waits before it signs: agents learn
// keys from heartbeat responses, so after two intervals every connected
// agent knows it and no fresh token is refused for an unknown key.
func (sg *signing) keyWarmup() time.Duration { return 2 * sg.cfg.HeartbeatInterval }

// signingKey returns the key that signs at now: the current key once its
// warm-up has passed, else the newest key it replaced (still verifying).
func (sg *signing) signingKey(st *state.Reader, now time.Time) *gpupoolv1.SigningKey {
	cur := currentKey(st)
	if cur == nil || now.Sub(time.UnixMilli(cur.CreatedAtMs)) >= sg.keyWarmup() {
		return cur
	}
	var prev *gpupoolv1.SigningKey
	for _, k := range st.SigningKeys() {
		if k.VerifyUntilMs > now.UnixMilli() && (prev == nil || k.CreatedAtMs > prev.CreatedAtMs) {
			prev = k
		}
	}
	if prev == nil {
		return cur // the cluster's first key: nothing to wait for
	}
	return prev
}

// hostTokens signs one token per host of l, valid until expires.
func (sg *signing) hostTokens(st *state.Reader, l *gpupoolv1.Lease, expires time.Time) ([]*gpupoolv1.HostToken, error) {
	k := sg.signingKey(st, sg.cfg.Clock.Now())
	if k == nil {
		return nil, fmt.Errorf("broker: no signing key yet; retry in a moment")
	}
	now := sg.cfg.Clock.Now()
	var out []*gpupoolv1.HostToken
	for _, hostID := range state.LeaseHosts(l) {
		c := &gpupoolv1.LeaseTokenClaims{LeaseId: l.Id, HostId: hostID, FencingToken: l.FencingToken, Tenant: l.Tenant,
			IssuedAtMs: now.UnixMilli(), ExpiresAtMs: expires.UnixMilli(), KeyId: k.Id}
		for _, sl := range l.Slices {
			if sl.Host == hostID {
				c.Slices = append(c.Slices, sl)
			}
		}
		tok, err := token.Sign(k.PrivateKey, c)
		if err != nil {
			return nil, err
		}
		ht := &gpupoolv1.HostToken{Host: hostID, Token: tok}
		if h := st.Host(hostID); h != nil {
			ht.Address, ht.CertSha256 = h.Address, h.CertSha256
		}
		out = append(out, ht)
	}
	return out, nil
}
