package console

import (
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"net"
	"net/http"
	"slices"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// The console's cookies. Both are HttpOnly (no script reads them),
// SameSite=Strict (no other site's request carries them) and Path=/; over
// TLS they are Secure and have the __Host- prefix, so that no other host
// of the site can set them.
const (
	// sessionCookie holds the random id of the browser's session; the
	// ACL token's secret stays in the console's memory (sessionStore).
	sessionCookie = "gpupool_console_session"
	// preSessionCookie binds the sign-in form's CSRF token to the browser
	// that was shown the form.
	preSessionCookie = "gpupool_console_signin"
)

// maxSecretLen bounds what sign-in accepts as a token secret.
const maxSecretLen = 512

// session is who asks: a verified token, or anyone when ACL is off.
type session struct {
	// id is the session's id (the cookie's value); "" when ACL is off.
	id     string
	secret string
	token  *gpupoolv1.AclToken // nil when ACL is off
	// key is what the stream limiter counts by.
	key string
}

// outgoing adds the session's token to a call to the broker.
func (s *session) outgoing(ctx context.Context) context.Context {
	if s.secret == "" {
		return ctx
	}
	return metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+s.secret)
}

// management reports whether the session sees everything.
func (s *session) management() bool {
	return s.token == nil || s.token.Kind == gpupoolv1.TokenKind_TOKEN_KIND_MANAGEMENT
}

// mayActFor reports whether the session sees tenant's leases.
func (s *session) mayActFor(tenant string) bool {
	return s.management() || slices.Contains(s.token.Tenants, tenant)
}

// Who is how the header names the session.
func (s *session) Who() string {
	if s.token == nil {
		return ""
	}
	kind := strings.ToLower(strings.TrimPrefix(s.token.Kind.String(), "TOKEN_KIND_"))
	if len(s.token.Tenants) > 0 {
		return s.token.Name + " (" + kind + ", tenants " + strings.Join(s.token.Tenants, ", ") + ")"
	}
	return s.token.Name + " (" + kind + ")"
}

// authenticate returns the request's session, or the reason to show on
// the sign-in page. A session whose token the broker refuses (revoked,
// expired) ends here, so the browser is signed out.
func (s *Server) authenticate(r *http.Request) (*session, *authFailure) {
	if !s.cfg.ACL {
		host, _, _ := net.SplitHostPort(r.RemoteAddr)
		return &session{key: "addr:" + host}, nil
	}
	c, err := r.Cookie(s.cookieName(sessionCookie))
	if err != nil || c.Value == "" {
		return nil, &authFailure{why: "Sign in with an ACL token to use the console."}
	}
	stored, why := s.sessions.use(c.Value)
	if stored == nil {
		return nil, &authFailure{why: why}
	}
	sess, fail := s.verify(r.Context(), stored.secret)
	if fail != nil {
		if !fail.unchecked {
			s.sessions.end(c.Value)
		}
		return nil, fail
	}
	sess.id = c.Value
	return sess, nil
}

// endSession ends sess's session because the broker refused its token.
func (s *Server) endSession(sess *session) {
	if sess.id != "" {
		s.sessions.end(sess.id)
	}
}

// authFailure says why a request has no session. unchecked is true when
// the broker could not check the token (unreachable, or the token is over
// one of its limits) rather than refusing it: the user stays signed in
// and may try again.
type authFailure struct {
	why       string
	unchecked bool
}

// verify asks the broker who a secret is.
func (s *Server) verify(ctx context.Context, secret string) (*session, *authFailure) {
	if len(secret) > maxSecretLen || strings.ContainsAny(secret, " \t\r\n") {
		return nil, &authFailure{why: "That is not an ACL token: a token is one word of at most 512 characters."}
	}
	sess := &session{secret: secret}
	resp, err := s.api.acl.WhoAmI(sess.outgoing(ctx), &gpupoolv1.WhoAmIRequest{})
	if err != nil {
		st := status.Convert(err)
		if st.Code() == codes.Unauthenticated {
			return nil, &authFailure{why: "Your token was refused: " + st.Message()}
		}
		return nil, &authFailure{why: "The broker could not check your token: " + st.Message(), unchecked: true}
	}
	if resp.Token == nil {
		return nil, &authFailure{why: "The broker did not say who this token is."}
	}
	if resp.Token.Kind == gpupoolv1.TokenKind_TOKEN_KIND_AGENT {
		return nil, &authFailure{why: "An agent's join token cannot use the console: sign in with a client or management token."}
	}
	sess.token = resp.Token
	sum := sha256.Sum256([]byte(secret))
	sess.key = "token:" + hex.EncodeToString(sum[:8])
	return sess, nil
}

func (s *Server) signInPage(w http.ResponseWriter, r *http.Request) {
	if !s.cfg.ACL {
		http.Redirect(w, r, "/", http.StatusSeeOther)
		return
	}
	s.renderSignIn(w, r, http.StatusOK, "", safeNext(r.URL.Query().Get("next")))
}

func (s *Server) signIn(w http.ResponseWriter, r *http.Request) {
	if !s.cfg.ACL {
		http.Redirect(w, r, "/", http.StatusSeeOther)
		return
	}
	if why := crossOrigin(r, s.cfg.TLS != nil); why != "" {
		refuse(w, "sign-in", why)
		return
	}
	if err := r.ParseForm(); err != nil {
		s.renderSignIn(w, r, http.StatusBadRequest, "The form could not be read (at most 16 KiB): "+err.Error(), "/")
		return
	}
	next := safeNext(r.PostForm.Get("next"))
	if why := s.csrfMissing(r, csrfSignIn, s.cookieName(preSessionCookie)); why != "" {
		s.renderSignIn(w, r, http.StatusForbidden, "Sign-in refused: "+why+". Sign in again with this form.", next)
		return
	}
	secret := strings.TrimSpace(r.PostForm.Get("token"))
	if secret == "" {
		s.renderSignIn(w, r, http.StatusBadRequest, "token: is required", next)
		return
	}
	sess, fail := s.verify(r.Context(), secret)
	if fail != nil {
		s.renderSignIn(w, r, fail.status(), fail.why, next)
		return
	}
	if old, err := r.Cookie(s.cookieName(sessionCookie)); err == nil {
		s.sessions.end(old.Value)
	}
	http.SetCookie(w, s.cookie(sessionCookie, s.sessions.create(secret, sess.key, sess.token), 0))
	http.Redirect(w, r, next, http.StatusSeeOther)
}

// signOut ends the browser's session on the server and forgets its
// cookie. Ending a session that has already ended changes nothing, so it
// needs no CSRF token (there is none to check it against).
func (s *Server) signOut(w http.ResponseWriter, r *http.Request) {
	if !s.cfg.ACL {
		http.Redirect(w, r, "/", http.StatusSeeOther)
		return
	}
	if why := crossOrigin(r, s.cfg.TLS != nil); why != "" {
		refuse(w, "sign-out", why)
		return
	}
	if err := r.ParseForm(); err != nil {
		http.Error(w, "console: the sign-out form could not be read (at most 16 KiB): "+err.Error(), http.StatusBadRequest)
		return
	}
	if c, err := r.Cookie(s.cookieName(sessionCookie)); err == nil {
		if live, _ := s.sessions.use(c.Value); live != nil {
			if why := s.csrfMissing(r, csrfSignOut, s.cookieName(sessionCookie)); why != "" {
				refuse(w, "sign-out", why)
				return
			}
			s.sessions.end(c.Value)
		}
	}
	http.SetCookie(w, s.cookie(sessionCookie, "", -1))
	s.renderSignIn(w, r, http.StatusOK, "You are signed out.", "/")
}

// csrfMissing says what is missing or wrong with the CSRF token of r's
// form for purpose, bound to the cookie named binding; "" when it is right.
func (s *Server) csrfMissing(r *http.Request, purpose csrfPurpose, binding string) string {
	got := r.PostForm.Get(csrfField)
	if got == "" {
		return "the form has no CSRF token (field " + csrfField + ")"
	}
	c, err := r.Cookie(binding)
	if err != nil || c.Value == "" {
		return "the request has no " + binding + " cookie to check the form's CSRF token against"
	}
	if !s.csrf.valid(purpose, c.Value, got) {
		return "the form's CSRF token does not match this browser's " + binding + " cookie (a form from another site, or from before the broker restarted)"
	}
	return ""
}

// refuse answers a state-changing request that failed a CSRF check.
func refuse(w http.ResponseWriter, what, why string) {
	w.Header().Set("Cache-Control", "no-store")
	http.Error(w, "console: "+what+" refused: "+why, http.StatusForbidden)
}

// cookieName is name as this console's cookie is called: with the
// __Host- prefix over TLS.
func (s *Server) cookieName(name string) string {
	if s.cfg.TLS != nil {
		return "__Host-" + name
	}
	return name
}

// cookie is the console's cookie name with value; maxAge < 0 deletes it.
// Both cookies last as long as the browser's session; the server ends
// sessions on its own clock.
func (s *Server) cookie(name, value string, maxAge int) *http.Cookie {
	return &http.Cookie{Name: s.cookieName(name), Value: value, Path: "/", MaxAge: maxAge,
		HttpOnly: true, SameSite: http.SameSiteStrictMode, Secure: s.cfg.TLS != nil}
}

// safeNext keeps a redirect on this console: a path, never another site.
func safeNext(next string) string {
	if !strings.HasPrefix(next, "/") || strings.HasPrefix(next, "//") || strings.HasPrefix(next, "/\\") || strings.ContainsAny(next, "\r\n") {
		return "/"
	}
	return next
}

// renderSignIn shows the sign-in form with the reason. It gives the
// browser a pre-session cookie when it has none, for the form's CSRF
// token, and forgets the session cookie when the session is gone (401).
func (s *Server) renderSignIn(w http.ResponseWriter, r *http.Request, code int, reason, next string) {
	if code == http.StatusUnauthorized {
		http.SetCookie(w, s.cookie(sessionCookie, "", -1))
	}
	pre := ""
	if c, err := r.Cookie(s.cookieName(preSessionCookie)); err == nil && len(c.Value) == base64.RawURLEncoding.EncodedLen(preSessionBytes) {
		pre = c.Value
	} else {
		pre = newPreSession()
		http.SetCookie(w, s.cookie(preSessionCookie, pre, 0))
	}
	s.renderTemplate(w, code, "signin", map[string]any{
		"Reason": reason, "Next": next, "ServerID": s.cfg.ServerID, "CSRF": s.csrf.token(csrfSignIn, pre),
		"Idle": shortDuration(s.cfg.Sessions.Idle), "Lifetime": shortDuration(s.cfg.Sessions.Lifetime),
	})
}

// status is the HTTP status of a page refused for f.
func (f *authFailure) status() int {
	if f.unchecked {
		return http.StatusServiceUnavailable
	}
	return http.StatusUnauthorized
}
