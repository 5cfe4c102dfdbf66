package console

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/gpupool/gpupool/internal/clock"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// Defaults of Sessions.
const (
	DefaultSessionIdle     = 30 * time.Minute
	DefaultSessionLifetime = 12 * time.Hour
	DefaultMaxSessions     = 10000
	// sessionsPerToken bounds the sessions one ACL token holds: signing in
	// once more ends that token's idlest session.
	sessionsPerToken = 64
)

// Sessions configures the console's sign-in sessions.
type Sessions struct {
	// Idle ends a session that no request used for this long; default 30m.
	// An open page's live stream counts as use.
	Idle time.Duration
	// Lifetime ends a session this long after sign-in, used or not;
	// default 12h.
	Lifetime time.Duration
	// Max bounds the sessions kept at once; default 10000. A sign-in at
	// the bound ends the idlest session (its user signs in again).
	Max int
}

func (c *Sessions) setDefaults() {
	if c.Idle <= 0 {
		c.Idle = DefaultSessionIdle
	}
	if c.Lifetime <= 0 {
		c.Lifetime = DefaultSessionLifetime
	}
	if c.Max <= 0 {
		c.Max = DefaultMaxSessions
	}
}

// sessionIDBytes is the entropy of a session id: 256 bits from crypto/rand.
const sessionIDBytes = 32

// storedSession is what the console keeps for one signed-in browser: the
// ACL token's secret lives here, in this broker's memory only; the
// browser holds nothing but the session's random id.
type storedSession struct {
	secret  string
	key     string // the stream limiter's key of the token
	created time.Time
	used    time.Time
	// tokenExpires is the token's own expiry; zero: none.
	tokenExpires time.Time
}

// sessionStore maps session ids to signed-in tokens. It keeps ids only
// as their SHA-256, so that neither a dump of it nor the time a lookup
// takes tells a cookie. A session ends when it is idle for cfg.Idle,
// cfg.Lifetime after sign-in, when its token expires, on sign-out, or
// when the console finds its token refused (revoked); it never outlives
// the process. The store holds at most cfg.Max sessions, and at most
// sessionsPerToken of one token.
type sessionStore struct {
	cfg   Sessions
	clock clock.Clock

	mu   sync.Mutex
	byID map[string]*storedSession // guarded by mu; by hashID of the id
}

func newSessionStore(cfg Sessions, c clock.Clock) *sessionStore {
	return &sessionStore{cfg: cfg, clock: c, byID: map[string]*storedSession{}}
}

// shortDuration is d without its trailing zero units: 12h, 30m, 1h30m.
func shortDuration(d time.Duration) string {
	s := d.String()
	if strings.HasSuffix(s, "m0s") {
		s = s[:len(s)-2]
	}
	if strings.HasSuffix(s, "h0m") {
		s = s[:len(s)-2]
	}
	return s
}

func hashID(id string) string {
	sum := sha256.Sum256([]byte(id))
	return hex.EncodeToString(sum[:])
}

// create starts a session for a verified token and returns its id, the
// cookie's value.
func (st *sessionStore) create(secret, key string, tok *gpupoolv1.AclToken) string {
	var raw [sessionIDBytes]byte
	rand.Read(raw[:]) // never fails (crypto/rand)
	id := base64.RawURLEncoding.EncodeToString(raw[:])
	now := st.clock.Now()
	ss := &storedSession{secret: secret, key: key, created: now, used: now}
	if tok != nil && tok.ExpiresAtMs > 0 {
		ss.tokenExpires = time.UnixMilli(tok.ExpiresAtMs)
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	st.makeRoomLocked(key, now)
	st.byID[hashID(id)] = ss
	return id
}

// makeRoomLocked drops ended sessions, then the idlest session of key
// when key holds sessionsPerToken, then the idlest of all when the store
// holds cfg.Max.
func (st *sessionStore) makeRoomLocked(key string, now time.Time) {
	var idlest, idlestOfKey string
	ofKey := 0
	for h, ss := range st.byID {
		if st.endedLocked(ss, now) != "" {
			delete(st.byID, h)
			continue
		}
		if idlest == "" || ss.used.Before(st.byID[idlest].used) {
			idlest = h
		}
		if ss.key == key {
			ofKey++
			if idlestOfKey == "" || ss.used.Before(st.byID[idlestOfKey].used) {
				idlestOfKey = h
			}
		}
	}
	if ofKey >= sessionsPerToken {
		delete(st.byID, idlestOfKey)
		return
	}
	if len(st.byID) >= st.cfg.Max {
		delete(st.byID, idlest)
	}
}

// endedLocked says why ss has ended at now, or "" while it lives.
func (st *sessionStore) endedLocked(ss *storedSession, now time.Time) string {
	switch {
	case now.Sub(ss.created) >= st.cfg.Lifetime:
		return fmt.Sprintf("Your session ended %s after sign-in: sign in again.", shortDuration(st.cfg.Lifetime))
	case now.Sub(ss.used) >= st.cfg.Idle:
		return fmt.Sprintf("Your session ended after %s without use: sign in again.", shortDuration(st.cfg.Idle))
	case !ss.tokenExpires.IsZero() && !now.Before(ss.tokenExpires):
		return "Your token has expired: sign in with another."
	}
	return ""
}

// use returns the live session of id and marks it used now, or says why
// there is none (and forgets an ended one).
func (st *sessionStore) use(id string) (*storedSession, string) {
	h := hashID(id)
	now := st.clock.Now()
	st.mu.Lock()
	defer st.mu.Unlock()
	ss := st.byID[h]
	if ss == nil {
		return nil, "Your session is not known to this broker (it ended, or the broker restarted): sign in again."
	}
	if why := st.endedLocked(ss, now); why != "" {
		delete(st.byID, h)
		return nil, why
	}
	ss.used = now
	c := *ss
	return &c, ""
}

// end forgets the session of id; ending an unknown one does nothing.
func (st *sessionStore) end(id string) {
	st.mu.Lock()
	defer st.mu.Unlock()
	delete(st.byID, hashID(id))
}

// len is how many sessions the store holds, ended or not.
func (st *sessionStore) len() int {
	st.mu.Lock()
	defer st.mu.Unlock()
	return len(st.byID)
}
