package console

import (
	"context"
	"crypto/sha256"
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

// cookieName holds the signed-in user's ACL token secret: HttpOnly (no
// script reads it), SameSite=Strict (no other site's page sends it), Secure
// over TLS.
const cookieName = "gpupool_console_token"

// maxSecretLen bounds what sign-in accepts as a token secret.
const maxSecretLen = 512

// session is who asks: a verified token, or anyone when ACL is off.
type session struct {
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
// the sign-in page.
func (s *Server) authenticate(r *http.Request) (*session, *authFailure) {
	if !s.cfg.ACL {
		host, _, _ := net.SplitHostPort(r.RemoteAddr)
		return &session{key: "addr:" + host}, nil
	}
	c, err := r.Cookie(cookieName)
	if err != nil || c.Value == "" {
		return nil, &authFailure{why: "Sign in with an ACL token to use the console."}
	}
	return s.verify(r.Context(), c.Value)
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
	s.renderSignIn(w, http.StatusOK, "", safeNext(r.URL.Query().Get("next")))
}

func (s *Server) signIn(w http.ResponseWriter, r *http.Request) {
	if !s.cfg.ACL {
		http.Redirect(w, r, "/", http.StatusSeeOther)
		return
	}
	if err := r.ParseForm(); err != nil {
		s.renderSignIn(w, http.StatusBadRequest, "The form could not be read (at most 16 KiB): "+err.Error(), "/")
		return
	}
	next := safeNext(r.PostForm.Get("next"))
	secret := strings.TrimSpace(r.PostForm.Get("token"))
	if secret == "" {
		s.renderSignIn(w, http.StatusBadRequest, "token: is required", next)
		return
	}
	if _, fail := s.verify(r.Context(), secret); fail != nil {
		s.renderSignIn(w, fail.status(), fail.why, next)
		return
	}
	http.SetCookie(w, s.cookie(secret, 0))
	http.Redirect(w, r, next, http.StatusSeeOther)
}

func (s *Server) signOut(w http.ResponseWriter, r *http.Request) {
	http.SetCookie(w, s.cookie("", -1))
	s.renderSignIn(w, http.StatusOK, "You are signed out.", "/")
}

func (s *Server) cookie(secret string, maxAge int) *http.Cookie {
	return &http.Cookie{Name: cookieName, Value: secret, Path: "/", MaxAge: maxAge,
		HttpOnly: true, SameSite: http.SameSiteStrictMode, Secure: s.cfg.TLS != nil}
}

// safeNext keeps a redirect on this console: a path, never another site.
func safeNext(next string) string {
	if !strings.HasPrefix(next, "/") || strings.HasPrefix(next, "//") || strings.HasPrefix(next, "/\\") || strings.ContainsAny(next, "\r\n") {
		return "/"
	}
	return next
}

func (s *Server) renderSignIn(w http.ResponseWriter, code int, reason, next string) {
	if code == http.StatusUnauthorized || strings.HasPrefix(reason, "Your token") {
		http.SetCookie(w, s.cookie("", -1))
	}
	s.renderTemplate(w, code, "signin", map[string]any{"Reason": reason, "Next": next, "ServerID": s.cfg.ServerID})
}

// status is the HTTP status of a page refused for f.
func (f *authFailure) status() int {
	if f.unchecked {
		return http.StatusServiceUnavailable
	}
	return http.StatusUnauthorized
}
