package console

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"net/http"
	"net/url"
	"strings"
)

// Every request that changes state (POST: sign-in, sign-out) must pass
// two checks, each of which stops a cross-site form on its own:
//
//   - the browser says it comes from this console's own pages:
//     Sec-Fetch-Site, when sent, is "same-origin", and Origin, when sent,
//     is this console's scheme and host. Cross-site and same-site (a
//     sibling host or port) requests are refused. A request with neither
//     header (not a browser's: curl) passes on to the second check;
//   - the form carries the CSRF token of this browser: an HMAC, under a
//     key of this process, of the pre-session cookie for sign-in (there
//     is no session yet) and of the session id for sign-out. Another
//     site can read neither cookie (HttpOnly, SameSite=Strict), so it
//     cannot compute the token.

// csrfField is the hidden form field that carries the CSRF token.
const csrfField = "csrf"

// preSessionBytes is the entropy of a pre-session cookie: 128 bits.
const preSessionBytes = 16

// csrfPurpose separates the tokens of the two forms, so that a sign-in
// token never passes as a sign-out token.
type csrfPurpose string

const (
	csrfSignIn  csrfPurpose = "signin"
	csrfSignOut csrfPurpose = "signout"
)

// csrfKeys makes and checks CSRF tokens. The key is random per process,
// like the sessions: a form from before a restart is refused and shown
// again.
type csrfKeys struct{ key [32]byte }

func newCSRFKeys() *csrfKeys {
	k := &csrfKeys{}
	rand.Read(k.key[:])
	return k
}

// token is the CSRF token of a form for purpose, bound to binding (a
// pre-session cookie or a session id).
func (k *csrfKeys) token(purpose csrfPurpose, binding string) string {
	m := hmac.New(sha256.New, k.key[:])
	m.Write([]byte(purpose))
	m.Write([]byte{0})
	m.Write([]byte(binding))
	return base64.RawURLEncoding.EncodeToString(m.Sum(nil))
}

// valid reports whether got is the token of purpose and binding; an empty
// binding (no cookie) has none.
func (k *csrfKeys) valid(purpose csrfPurpose, binding, got string) bool {
	if binding == "" || got == "" {
		return false
	}
	return hmac.Equal([]byte(k.token(purpose, binding)), []byte(got))
}

// newPreSession is a fresh pre-session cookie's value.
func newPreSession() string {
	var raw [preSessionBytes]byte
	rand.Read(raw[:])
	return base64.RawURLEncoding.EncodeToString(raw[:])
}

// crossOrigin says why the browser's headers show r comes from another
// origin than this console's, or "" when they do not (same origin, or no
// such header at all). tls says whether the console serves HTTPS.
func crossOrigin(r *http.Request, tls bool) string {
	if site := r.Header.Get("Sec-Fetch-Site"); site != "" && site != "same-origin" {
		return "Sec-Fetch-Site is " + quoteHeader(site) + ", want same-origin: the console accepts forms only from its own pages"
	}
	origin := r.Header.Get("Origin")
	if origin == "" {
		return ""
	}
	scheme := "http"
	if tls {
		scheme = "https"
	}
	want := scheme + "://" + r.Host
	u, err := url.Parse(origin)
	if err != nil || u.Scheme+"://"+u.Host != origin || !strings.EqualFold(origin, want) {
		return "Origin is " + quoteHeader(origin) + ", want " + want + ": the console accepts forms only from its own pages"
	}
	return ""
}

// quoteHeader quotes a header's value for a message, cut to 100 bytes.
func quoteHeader(v string) string {
	if len(v) > 100 {
		v = v[:100] + "..."
	}
	return "\"" + strings.Map(func(r rune) rune {
		if r < 0x20 || r == 0x7f || r == '"' {
			return '?'
		}
		return r
	}, v) + "\""
}
