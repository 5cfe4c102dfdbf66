package console_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/base64"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/cookiejar"
	"net/url"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"

	"github.com/gpupool/gpupool/broker"
	"github.com/gpupool/gpupool/broker/console"
	"github.com/gpupool/gpupool/internal/clock"
	"github.com/gpupool/gpupool/internal/limits"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// env is one in-process broker with ACL on, a host, and a console in
// front of it.
type env struct {
	b     *broker.Server
	conn  *grpc.ClientConn
	mgmt  string
	ui    *console.Server
	base  string
	acl   gpupoolv1.AclServiceClient
	lease gpupoolv1.LeaseServiceClient
}

func ctx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return c
}

func startEnv(t *testing.T, acl bool, cfg func(*console.Config)) *env {
	t.Helper()
	return startEnvLimited(t, acl, nil, cfg)
}

// startEnvLimited starts the broker with the given limits (nil: the
// defaults).
func startEnvLimited(t *testing.T, acl bool, lim *broker.Limits, cfg func(*console.Config)) *env {
	t.Helper()
	b, err := broker.New(broker.Config{DataDir: t.TempDir(), BindAddr: "127.0.0.1:0", RaftBindAddr: "127.0.0.1:0", BootstrapExpect: 1, ACL: acl, Limits: lim})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Shutdown() })
	conn, err := grpc.NewClient(b.Addr(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	e := &env{b: b, conn: conn, acl: gpupoolv1.NewAclServiceClient(conn), lease: gpupoolv1.NewLeaseServiceClient(conn)}
	deadline := time.Now().Add(30 * time.Second)
	for {
		if acl {
			boot, err := e.acl.Bootstrap(ctx(t), &gpupoolv1.AclBootstrapRequest{})
			if err == nil {
				e.mgmt = boot.Secret
				break
			}
		} else if _, err := gpupoolv1.NewPoolServiceClient(conn).Status(ctx(t), &gpupoolv1.StatusRequest{}); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the broker did not come up")
		}
		time.Sleep(50 * time.Millisecond)
	}
	h := &gpupoolv1.Host{Id: "h1", Address: "127.0.0.1:1", Labels: map[string]string{"zone": "<script>alert('label')</script>"}, CpuMillicores: 64000, MemoryMib: 256 << 10}
	for i := range 2 {
		h.Devices = append(h.Devices, &gpupoolv1.Device{Uuid: fmt.Sprintf("GPU-h1-%d", i), Index: int32(i), Model: "A100-SXM4-80GB", MemoryMib: 81920})
	}
	for {
		_, err := gpupoolv1.NewAgentServiceClient(conn).Register(e.as(t, e.mgmt), &gpupoolv1.RegisterRequest{Host: h})
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal(err)
		}
		time.Sleep(50 * time.Millisecond) // a new leader answers Unavailable until its barrier
	}
	c := console.Config{Bind: "127.0.0.1:0", Conn: conn, ACL: acl, ServerID: b.ID(), LiveInterval: 100 * time.Millisecond}
	if cfg != nil {
		cfg(&c)
	}
	ui, err := console.New(c)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ui.Close() })
	e.ui, e.base = ui, strings.TrimSuffix(ui.URL(), "/")
	return e
}

// as is a context that calls the broker with secret.
func (e *env) as(t *testing.T, secret string) context.Context {
	if secret == "" {
		return ctx(t)
	}
	return metadata.AppendToOutgoingContext(ctx(t), "authorization", "Bearer "+secret)
}

func (e *env) token(t *testing.T, req *gpupoolv1.CreateAclTokenRequest) (*gpupoolv1.AclToken, string) {
	t.Helper()
	if req.Name == "" {
		req.Name = "t-" + strings.Join(req.Tenants, "-")
	}
	resp, err := e.acl.CreateToken(e.as(t, e.mgmt), req)
	if err != nil {
		t.Fatal(err)
	}
	return resp.Token, resp.Secret
}

func clientToken(tenants ...string) *gpupoolv1.CreateAclTokenRequest {
	return &gpupoolv1.CreateAclTokenRequest{Kind: gpupoolv1.TokenKind_TOKEN_KIND_CLIENT, Tenants: tenants}
}

// browser is an HTTP client that keeps cookies and does not follow
// redirects.
func (e *env) browser(t *testing.T) *http.Client {
	jar, _ := cookiejar.New(nil)
	return &http.Client{Jar: jar, Timeout: 30 * time.Second, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
}

func (e *env) signIn(t *testing.T, secret string) *http.Client {
	t.Helper()
	c := e.browser(t)
	if code, body := e.submitSignIn(t, c, secret); code != http.StatusSeeOther {
		t.Fatalf("sign in: got %d %s, want 303", code, body)
	}
	return c
}

// submitSignIn signs in as a browser does: it opens the sign-in page and
// sends its form, from the console's own origin.
func (e *env) submitSignIn(t *testing.T, c *http.Client, secret string) (int, string) {
	t.Helper()
	_, page := get(t, c, e.base+"/signin")
	return e.post(t, c, "/signin", url.Values{"token": {secret}, "next": {"/leases"}, "csrf": {csrfOf(t, page)}}, e.sameOrigin())
}

// sameOrigin is what a browser sends with a form of the console's own page.
func (e *env) sameOrigin() http.Header {
	return http.Header{"Origin": {e.base}, "Sec-Fetch-Site": {"same-origin"}}
}

// post sends a form with the given headers.
func (e *env) post(t *testing.T, c *http.Client, path string, form url.Values, hdr http.Header) (int, string) {
	t.Helper()
	req, _ := http.NewRequestWithContext(ctx(t), http.MethodPost, e.base+path, strings.NewReader(form.Encode()))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	for k, v := range hdr {
		req.Header[k] = v
	}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

var csrfInput = regexp.MustCompile(`name="csrf" value="([^"]+)"`)

// csrfOf is the CSRF token of the (first) form on a page.
func csrfOf(t *testing.T, page string) string {
	t.Helper()
	m := csrfInput.FindStringSubmatch(page)
	if m == nil {
		t.Fatalf("no CSRF token on the page: %s", excerpt(page, "<form"))
	}
	return m[1]
}

// sessionID is the session cookie c holds for the console.
func (e *env) sessionID(t *testing.T, c *http.Client) string {
	t.Helper()
	u, _ := url.Parse(e.base)
	for _, k := range c.Jar.Cookies(u) {
		if k.Name == "gpupool_console_session" {
			return k.Value
		}
	}
	t.Fatal("no session cookie")
	return ""
}

// withSession is a new browser that holds only the session cookie id
// (a stolen or forged one).
func (e *env) withSession(t *testing.T, id string) *http.Client {
	c := e.browser(t)
	u, _ := url.Parse(e.base)
	c.Jar.SetCookies(u, []*http.Cookie{{Name: "gpupool_console_session", Value: id}})
	return c
}

func get(t *testing.T, c *http.Client, u string) (int, string) {
	t.Helper()
	resp, err := c.Get(u)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// events reads a live stream's events until stop returns true or 20 s pass.
func events(t *testing.T, c *http.Client, u string, stop func(event, data string) bool) {
	t.Helper()
	req, _ := http.NewRequestWithContext(ctx(t), http.MethodGet, u, nil)
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	done := make(chan struct{})
	go func() {
		defer close(done)
		sc := bufio.NewScanner(resp.Body)
		sc.Buffer(make([]byte, 1<<20), 16<<20)
		var ev string
		var data []string
		for sc.Scan() {
			line := sc.Text()
			switch {
			case strings.HasPrefix(line, "event: "):
				ev = strings.TrimPrefix(line, "event: ")
			case strings.HasPrefix(line, "data: "):
				data = append(data, strings.TrimPrefix(line, "data: "))
			case line == "" && ev != "":
				if stop(ev, strings.Join(data, "\n")) {
					return
				}
				ev, data = "", nil
			}
		}
	}()
	select {
	case <-done:
	case <-time.After(20 * time.Second):
		resp.Body.Close()
		<-done
		t.Fatalf("%s: timed out waiting for the event", u)
	}
}

func TestConsoleSignInKeepsOnlyARandomSessionIDInAStrictHttpOnlyCookie(t *testing.T) {
	var logs syncBuffer
	e := startEnv(t, true, func(c *console.Config) {
		c.Logger = slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	})
	_, secret := e.token(t, clientToken("a"))
	c := e.browser(t)
	_, page := get(t, c, e.base+"/signin")
	req, _ := http.NewRequestWithContext(ctx(t), http.MethodPost, e.base+"/signin", strings.NewReader(url.Values{"token": {secret}, "csrf": {csrfOf(t, page)}}.Encode()))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	req.Header.Set("Origin", e.base)
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	var ck *http.Cookie
	for _, k := range resp.Cookies() {
		if k.Name == "gpupool_console_session" {
			ck = k
		}
	}
	if ck == nil || !ck.HttpOnly || ck.SameSite != http.SameSiteStrictMode || ck.Path != "/" {
		t.Fatalf("session cookie: got %+v, want HttpOnly, SameSite=Strict, Path=/", ck)
	}
	raw, err := base64.RawURLEncoding.DecodeString(ck.Value)
	if err != nil || len(raw) < 16 {
		t.Errorf("session id %q: got %d random bytes (%v), want at least 16 (128 bits)", ck.Value, len(raw), err)
	}
	if ck.Value == secret || strings.Contains(ck.Value, secret) || strings.Contains(secret, ck.Value) {
		t.Errorf("session cookie %q holds the token's secret", ck.Value)
	}
	for _, path := range []string{"/", "/leases", "/cluster", "/signin"} {
		code, body := get(t, c, e.base+path)
		if strings.Contains(body, secret) {
			t.Errorf("%s: the page shows the token's secret", path)
		}
		if path == "/" && (code != 200 || !strings.Contains(body, "signed in as t-a (client, tenants a)") || !strings.Contains(body, `id="live"`)) {
			t.Errorf("pool page after sign-in: got %d, want 200 naming the user", code)
		}
	}
	if other := e.signIn(t, secret); e.sessionID(t, other) == ck.Value {
		t.Error("two sign-ins with one token got the same session id, want a random one each")
	}
	events(t, c, e.base+"/events?page=leases", func(ev, data string) bool { return ev == "parts" })
	if strings.Contains(logs.String(), secret) {
		t.Error("the console's log holds the token's secret")
	}
}

// syncBuffer is a bytes.Buffer that a logger and the test share.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

func TestConsoleSignInAndSignOutAcceptOnlyTheConsolesOwnForms(t *testing.T) {
	e := startEnv(t, true, nil)
	_, secret := e.token(t, clientToken("a"))
	port := e.base[strings.LastIndex(e.base, ":")+1:]
	otherPort := "http://127.0.0.1:1"
	if port == "1" {
		otherPort = "http://127.0.0.1:2"
	}
	for _, tc := range []struct {
		name string
		hdr  http.Header
		// csrf makes the form's CSRF token from the browser's sign-in page.
		csrf     func(page string) string
		code     int
		wantBody string
	}{
		{"a same-origin form signs in", e.sameOrigin(), func(p string) string { return csrfOf(t, p) }, http.StatusSeeOther, ""},
		{"a form without Origin or Sec-Fetch-Site (curl) and with its CSRF token signs in", nil, func(p string) string { return csrfOf(t, p) }, http.StatusSeeOther, ""},
		{"a form with Origin of another site is refused", http.Header{"Origin": {"https://evil.example"}}, func(p string) string { return csrfOf(t, p) }, http.StatusForbidden, `Origin is "https://evil.example"`},
		{"a form with Sec-Fetch-Site cross-site is refused", http.Header{"Sec-Fetch-Site": {"cross-site"}}, func(p string) string { return csrfOf(t, p) }, http.StatusForbidden, `Sec-Fetch-Site is "cross-site"`},
		{"a form from the same site but another origin is refused", http.Header{"Origin": {otherPort}, "Sec-Fetch-Site": {"same-site"}}, func(p string) string { return csrfOf(t, p) }, http.StatusForbidden, `Sec-Fetch-Site is "same-site"`},
		{"a form from another port of the host is refused", http.Header{"Origin": {otherPort}}, func(p string) string { return csrfOf(t, p) }, http.StatusForbidden, "Origin is"},
		{"a form from an opaque origin is refused", http.Header{"Origin": {"null"}}, func(p string) string { return csrfOf(t, p) }, http.StatusForbidden, `Origin is "null"`},
		{"a same-origin form without a CSRF token is refused", e.sameOrigin(), func(string) string { return "" }, http.StatusForbidden, "no CSRF token"},
		{"a same-origin form with a wrong CSRF token is refused", e.sameOrigin(), func(string) string { return "AAAA" }, http.StatusForbidden, "does not match"},
		{"a form with another browser's CSRF token is refused", nil, func(string) string {
			_, p := get(t, e.browser(t), e.base+"/signin")
			return csrfOf(t, p)
		}, http.StatusForbidden, "does not match"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := e.browser(t)
			_, page := get(t, c, e.base+"/signin")
			code, body := e.post(t, c, "/signin", url.Values{"token": {secret}, "csrf": {tc.csrf(page)}}, tc.hdr)
			if code != tc.code || !strings.Contains(body, tc.wantBody) {
				t.Fatalf("got %d %q, want %d saying %q", code, excerpt(body, "refused"), tc.code, tc.wantBody)
			}
			signedIn, _ := get(t, c, e.base+"/leases")
			if want := tc.code == http.StatusSeeOther; (signedIn == 200) != want {
				t.Errorf("signed in after the form: got %v (%d), want %v", signedIn == 200, signedIn, want)
			}
		})
	}
	t.Run("a sign-in without the pre-session cookie is refused", func(t *testing.T) {
		_, page := get(t, e.browser(t), e.base+"/signin")
		code, body := e.post(t, e.browser(t), "/signin", url.Values{"token": {secret}, "csrf": {csrfOf(t, page)}}, e.sameOrigin())
		if code != http.StatusForbidden || !strings.Contains(body, "no gpupool_console_signin cookie") {
			t.Errorf("got %d %q, want 403 naming the missing cookie", code, excerpt(body, "refused"))
		}
	})

	for _, tc := range []struct {
		name     string
		hdr      http.Header
		csrf     func(page string) string
		wantBody string
	}{
		{"a cross-site sign-out is refused", http.Header{"Origin": {"https://evil.example"}, "Sec-Fetch-Site": {"cross-site"}}, func(p string) string { return csrfOf(t, p) }, "Sec-Fetch-Site"},
		{"a same-site sign-out from another origin is refused", http.Header{"Origin": {otherPort}}, func(p string) string { return csrfOf(t, p) }, "Origin is"},
		{"a sign-out without a CSRF token is refused", e.sameOrigin(), func(string) string { return "" }, "no CSRF token"},
		{"a sign-out with the sign-in form's CSRF token is refused", nil, func(string) string {
			c := e.browser(t)
			_, p := get(t, c, e.base+"/signin")
			return csrfOf(t, p)
		}, "does not match"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := e.signIn(t, secret)
			_, page := get(t, c, e.base+"/")
			code, body := e.post(t, c, "/signout", url.Values{"csrf": {tc.csrf(page)}}, tc.hdr)
			if code != http.StatusForbidden || !strings.Contains(body, tc.wantBody) {
				t.Errorf("got %d %q, want 403 saying %q", code, body, tc.wantBody)
			}
			if code, _ := get(t, c, e.base+"/leases"); code != 200 {
				t.Errorf("after the refused sign-out: got %d, want 200 (still signed in)", code)
			}
		})
	}
}

func TestConsoleSignOutEndsTheSessionOnTheServer(t *testing.T) {
	e := startEnv(t, true, nil)
	_, secret := e.token(t, clientToken("a"))
	c := e.signIn(t, secret)
	id := e.sessionID(t, c)
	_, page := get(t, c, e.base+"/")
	if code, body := e.post(t, c, "/signout", url.Values{"csrf": {csrfOf(t, page)}}, e.sameOrigin()); code != 200 || !strings.Contains(body, "You are signed out") {
		t.Fatalf("sign out: got %d %q, want 200 saying so", code, excerpt(body, "reason"))
	}
	replay := e.withSession(t, id)
	if code, body := get(t, replay, e.base+"/leases"); code != http.StatusUnauthorized || !strings.Contains(body, "not known to this broker") {
		t.Errorf("the old cookie after sign-out: got %d %q, want 401, an unknown session", code, excerpt(body, "reason"))
	}
	events(t, replay, e.base+"/events?page=leases", func(ev, data string) bool {
		if ev != "signout" {
			t.Errorf("the old cookie's stream: got %s %q, want signout", ev, data)
		}
		return true
	})
}

func TestConsoleEndsTheStreamsOfASignedOutSession(t *testing.T) {
	e := startEnv(t, true, nil)
	_, secret := e.token(t, clientToken("a"))
	c := e.signIn(t, secret)
	_, page := get(t, c, e.base+"/")
	var once sync.Once
	var got string
	events(t, c, e.base+"/events?page=leases", func(ev, data string) bool {
		if ev == "parts" {
			once.Do(func() {
				if code, body := e.post(t, c, "/signout", url.Values{"csrf": {csrfOf(t, page)}}, e.sameOrigin()); code != 200 {
					t.Errorf("sign out in another tab: got %d %q, want 200", code, body)
				}
			})
		}
		got = ev + ": " + data
		return ev == "signout"
	})
	if !strings.Contains(got, "not known") {
		t.Errorf("last event: got %q, want a signout saying the session is gone", got)
	}
}

func TestConsoleRefusesForgedAndStolenSessionIDs(t *testing.T) {
	e := startEnv(t, true, nil)
	tok, secret := e.token(t, clientToken("a"))
	victim := e.signIn(t, secret)
	stolen := e.sessionID(t, victim)
	if _, err := e.acl.RevokeToken(e.as(t, e.mgmt), &gpupoolv1.RevokeAclTokenRequest{AccessorId: tok.AccessorId}); err != nil {
		t.Fatal(err)
	}
	_, other := e.token(t, clientToken("b"))
	for _, tc := range []struct{ name, cookie, want string }{
		{"a random id", base64.RawURLEncoding.EncodeToString([]byte("0123456789abcdef0123456789abcdef")), "not known"},
		{"the token's secret as the cookie", other, "not known"},
		{"an empty-looking id", "x", "not known"},
		{"a stolen id whose token was revoked", stolen, "revoked"},
		{"the stolen id once more: its session has ended", stolen, "not known"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			code, body := get(t, e.withSession(t, tc.cookie), e.base+"/leases")
			if code != http.StatusUnauthorized || !strings.Contains(body, tc.want) {
				t.Errorf("got %d %q, want 401 saying %q", code, excerpt(body, "reason"), tc.want)
			}
		})
	}
}

func TestConsoleEndsSessionsOnItsClock(t *testing.T) {
	const idle, lifetime = 30 * time.Minute, 2 * time.Hour
	for _, tc := range []struct {
		name string
		// uses are the gaps between sign-in and each use of the session.
		uses []time.Duration
		want string // "": still signed in after the last use
	}{
		{"a session used within its idle timeout lives on", []time.Duration{29 * time.Minute, 29 * time.Minute}, ""},
		{"a session unused for its idle timeout ends", []time.Duration{10 * time.Minute, idle}, "30m without use"},
		{"a session in use ends at its lifetime", []time.Duration{25 * time.Minute, 25 * time.Minute, 25 * time.Minute, 25 * time.Minute, 20 * time.Minute}, "2h after sign-in"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			clk := clock.NewFake(time.Unix(1_800_000_000, 0))
			e := startEnv(t, true, func(c *console.Config) {
				c.Clock = clk
				c.Sessions = console.Sessions{Idle: idle, Lifetime: lifetime}
			})
			_, secret := e.token(t, clientToken("a"))
			c := e.signIn(t, secret)
			for i, d := range tc.uses {
				clk.Advance(d)
				code, body := get(t, c, e.base+"/leases")
				last := i == len(tc.uses)-1
				switch {
				case !last || tc.want == "":
					if code != 200 {
						t.Fatalf("use %d after %v: got %d %q, want 200", i, d, code, excerpt(body, "reason"))
					}
				case code != http.StatusUnauthorized || !strings.Contains(body, tc.want):
					t.Fatalf("last use after %v: got %d %q, want 401 saying %q", d, code, excerpt(body, "reason"), tc.want)
				}
			}
		})
	}
}

func TestConsoleBoundsItsSessions(t *testing.T) {
	for _, tc := range []struct {
		name   string
		max    int
		tokens int // sign-ins go round these tokens
		signIn int
	}{
		{"a sign-in at the bound ends the idlest session", 3, 4, 4},
		{"a token's 65th session ends its idlest", 0, 1, 65},
	} {
		t.Run(tc.name, func(t *testing.T) {
			clk := clock.NewFake(time.Unix(1_800_000_000, 0))
			e := startEnv(t, true, func(c *console.Config) {
				c.Clock = clk
				c.Sessions.Max = tc.max
			})
			var secrets []string
			for i := range tc.tokens {
				_, s := e.token(t, clientToken(fmt.Sprintf("t%d", i)))
				secrets = append(secrets, s)
			}
			var browsers []*http.Client
			for i := range tc.signIn {
				clk.Advance(time.Second)
				browsers = append(browsers, e.signIn(t, secrets[i%len(secrets)]))
			}
			if code, body := get(t, browsers[0], e.base+"/leases"); code != http.StatusUnauthorized || !strings.Contains(body, "not known") {
				t.Errorf("the idlest session: got %d %q, want 401, ended", code, excerpt(body, "reason"))
			}
			for i, c := range browsers[1:] {
				if code, _ := get(t, c, e.base+"/leases"); code != 200 {
					t.Errorf("session %d of %d: got %d, want 200 (only the idlest ends)", i+2, len(browsers), code)
				}
			}
		})
	}
}

func TestConsoleSendsMissingUnknownRevokedAndExpiredTokensToSignIn(t *testing.T) {
	e := startEnv(t, true, nil)
	revoked, revokedSecret := e.token(t, clientToken("a"))
	_, expiring := e.token(t, &gpupoolv1.CreateAclTokenRequest{Kind: gpupoolv1.TokenKind_TOKEN_KIND_CLIENT, Tenants: []string{"a"}, TtlMs: 1000})
	signedIn := e.signIn(t, revokedSecret)
	signedInExpiring := e.signIn(t, expiring)
	if _, err := e.acl.RevokeToken(e.as(t, e.mgmt), &gpupoolv1.RevokeAclTokenRequest{AccessorId: revoked.AccessorId}); err != nil {
		t.Fatal(err)
	}
	// The token's own TTL runs on the broker's clock: wait until it says so.
	deadline := time.Now().Add(20 * time.Second)
	for {
		if _, err := e.acl.WhoAmI(e.as(t, expiring), &gpupoolv1.WhoAmIRequest{}); err != nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the 1s token did not expire in 20s")
		}
		time.Sleep(20 * time.Millisecond)
	}
	for _, tc := range []struct {
		name string
		c    *http.Client
		want string
	}{
		{"no cookie", e.browser(t), "Sign in with an ACL token"},
		{"a revoked token", signedIn, "revoked"},
		{"an expired token", signedInExpiring, "expired"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			code, body := get(t, tc.c, e.base+"/leases")
			if code != http.StatusUnauthorized || !strings.Contains(body, `id="reason"`) || !strings.Contains(body, tc.want) {
				t.Errorf("got %d %q, want 401 and the sign-in page saying %q", code, excerpt(body, "reason"), tc.want)
			}
		})
	}
	t.Run("an unknown token", func(t *testing.T) {
		code, b := e.submitSignIn(t, e.browser(t), "not-a-token")
		if code != http.StatusUnauthorized || !strings.Contains(b, "not recognised") {
			t.Errorf("got %d %q, want 401 saying the token is not recognised", code, excerpt(b, "reason"))
		}
	})
}

func excerpt(body, around string) string {
	i := strings.Index(body, around)
	if i < 0 {
		return body[:min(len(body), 200)]
	}
	return body[i:min(len(body), i+200)]
}

func TestConsoleEndsARevokedTokensStream(t *testing.T) {
	e := startEnv(t, true, nil)
	tok, secret := e.token(t, clientToken("a"))
	c := e.signIn(t, secret)
	var once sync.Once
	var got string
	events(t, c, e.base+"/events?page=leases", func(ev, data string) bool {
		if ev == "parts" {
			once.Do(func() {
				if _, err := e.acl.RevokeToken(e.as(t, e.mgmt), &gpupoolv1.RevokeAclTokenRequest{AccessorId: tok.AccessorId}); err != nil {
					t.Error(err)
				}
			})
		}
		got = ev + ": " + data
		return ev == "signout"
	})
	if !strings.Contains(got, "revoked") {
		t.Errorf("last event: got %q, want a signout saying the token was revoked", got)
	}
}

func TestConsoleEscapesEveryUserString(t *testing.T) {
	e := startEnv(t, false, nil)
	const evil = "<script>alert('x')</script>"
	resp, err := e.lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: &gpupoolv1.LeaseRequest{Count: 1, MemoryMib: 1024, ComputePercent: 10, TtlMs: 600_000, Holder: evil, Tenant: "a"}})
	if err != nil {
		t.Fatal(err)
	}
	id := resp.Lease.Id
	// A reason from a user: a drain's.
	if _, err := gpupoolv1.NewPoolServiceClient(e.conn).DrainHost(ctx(t), &gpupoolv1.DrainHostRequest{HostId: "h1", Reason: evil, DeadlineAfterMs: 3_600_000}); err != nil {
		t.Fatal(err)
	}
	// And a waiting request whose holder shows on the queue page.
	wctx, cancel := context.WithCancel(ctx(t))
	defer cancel()
	go e.lease.Acquire(wctx, &gpupoolv1.AcquireRequest{Request: &gpupoolv1.LeaseRequest{Count: 1, Exclusive: true, TtlMs: 60_000, Holder: evil, Tenant: "a"}, WaitMs: 60_000})
	c := e.browser(t)
	deadline := time.Now().Add(20 * time.Second)
	for {
		_, body := get(t, c, e.base+"/queue")
		if strings.Contains(body, "data-lease=") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the queue page never showed the waiting request within 20s: %s", excerpt(body, "queue"))
		}
		time.Sleep(50 * time.Millisecond)
	}
	for _, page := range []string{"/", "/?tenant=a", "/hosts/h1", "/leases", "/leases/" + id, "/queue", "/tenants", "/cluster", "/?label=zone%3D" + url.QueryEscape(evil)} {
		t.Run(page, func(t *testing.T) {
			code, body := get(t, c, e.base+page)
			if code != 200 {
				t.Fatalf("got %d %q, want 200", code, excerpt(body, "error"))
			}
			if strings.Contains(body, "<script>alert") {
				t.Errorf("the page has the raw %q: %s", evil, excerpt(body, "<script>alert"))
			}
		})
	}
	for _, page := range []string{"/hosts/h1", "/leases", "/leases/" + id, "/queue"} {
		if _, body := get(t, c, e.base+page); !strings.Contains(body, "&lt;script&gt;") {
			t.Errorf("%s: got no escaped holder, label or reason, want &lt;script&gt;", page)
		}
	}
	for _, page := range []string{"pool", "host&id=h1", "leases", "queue"} {
		events(t, c, e.base+"/events?page="+page, func(ev, data string) bool {
			if strings.Contains(data, "<script>alert") {
				t.Errorf("stream %s sends the raw %q", page, evil)
			}
			return ev == "parts"
		})
	}
}

func TestConsoleRejectsUnknownFiltersAndBadValues(t *testing.T) {
	e := startEnv(t, false, nil)
	c := e.browser(t)
	for _, tc := range []struct{ path, want string }{
		{"/?colour=red", `unknown filter &#34;colour&#34;: the pool page filters by model, label, tenant`},
		{"/leases?state=sleeping", "filter state"},
		{"/leases?class=gold", "filter class"},
		{"/?label=zone", "KEY=VALUE"},
		{"/?model=%5BA100", "filter model"},
		{"/?tenant=a&tenant=b", "give it once"},
		{"/?tenant=a%20b", "tenant"},
		{"/cluster?x=1", "takes no filters"},
	} {
		t.Run(tc.path, func(t *testing.T) {
			code, body := get(t, c, e.base+tc.path)
			if code != http.StatusBadRequest || !strings.Contains(body, tc.want) {
				t.Errorf("got %d %q, want 400 saying %q", code, excerpt(body, `class="error"`), tc.want)
			}
		})
	}
	t.Run("a stream of no page", func(t *testing.T) {
		events(t, c, e.base+"/events?page=nope", func(ev, data string) bool {
			if ev != "fail" || !strings.Contains(data, "must be one of") {
				t.Errorf("got %s %q, want fail naming the pages", ev, data)
			}
			return true
		})
	})
	if code, _ := get(t, c, e.base+"/hosts/nope"); code != http.StatusNotFound {
		t.Errorf("an unknown host: got %d, want 404", code)
	}
}

func TestConsoleWithoutACLSaysItIsOpen(t *testing.T) {
	e := startEnv(t, false, nil)
	_, body := get(t, e.browser(t), e.base+"/")
	if !strings.Contains(body, `id="open"`) || !strings.Contains(body, "read-only") {
		t.Errorf("header: got %q, want it to say the console is open and read-only", excerpt(body, "<header"))
	}
}

func TestConsoleShowsAClientTokenItsTenantsOnly(t *testing.T) {
	e := startEnv(t, true, nil)
	_, secretA := e.token(t, clientToken("a"))
	_, secretB := e.token(t, clientToken("b"))
	acquire := func(secret string) string {
		resp, err := e.lease.Acquire(e.as(t, secret), &gpupoolv1.AcquireRequest{Request: &gpupoolv1.LeaseRequest{Count: 1, MemoryMib: 1024, ComputePercent: 10, TtlMs: 600_000}})
		if err != nil {
			t.Fatal(err)
		}
		return resp.Lease.Id
	}
	leaseB := acquire(secretB)
	c := e.signIn(t, secretA)
	for _, page := range []string{"/leases", "/hosts/h1", "/queue", "/tenants", "/cluster"} {
		if code, body := get(t, c, e.base+page); code != 200 || strings.Contains(body, leaseB) {
			t.Errorf("%s as tenant a: got %d, and b's lease shown: %v; want 200 without it", page, code, strings.Contains(body, leaseB))
		}
	}
	// Another tenant's lease answers as a lease that does not exist, so a
	// tenant cannot learn whether an id is taken.
	if code, _ := get(t, c, e.base+"/leases/"+leaseB); code != http.StatusNotFound {
		t.Errorf("b's lease page as tenant a: got %d, want 404 (as a missing lease)", code)
	}
	if code, _ := get(t, c, e.base+"/leases/l-0000000000000000"); code != http.StatusNotFound {
		t.Errorf("a missing lease's page as tenant a: got %d, want 404", code)
	}
	if code, body := get(t, c, e.base+"/leases?tenant=b"); code != http.StatusForbidden || strings.Contains(body, leaseB) {
		t.Errorf("tenant b's leases as tenant a: got %d, want 403", code)
	}
	// The stream: a's own new lease makes the leases page change; b's
	// lease is in no event.
	updates := 0
	events(t, c, e.base+"/events?page=leases", func(ev, data string) bool {
		if strings.Contains(data, leaseB) {
			t.Errorf("tenant a's stream carries b's lease %s", leaseB)
		}
		if ev == "parts" {
			updates++
			if updates == 1 {
				acquire(secretB)
				acquire(secretA)
			}
		}
		return updates == 2
	})
}

func TestConsoleCapsStreamsPerTokenUnderAThousandOpenStreams(t *testing.T) {
	const limit, open = 8, 1000
	// The broker's own per-token limits would refuse some of the 1000
	// first; this test is about the console's cap.
	e := startEnvLimited(t, true, &broker.Limits{}, func(c *console.Config) { c.StreamsPerToken = limit })
	_, secret := e.token(t, clientToken("a"))
	c := e.signIn(t, secret)
	tr := &http.Transport{MaxConnsPerHost: 0, MaxIdleConnsPerHost: open}
	c.Transport = tr
	defer tr.CloseIdleConnections()
	var mu sync.Mutex
	first := map[string]int{}
	var bodies []io.Closer
	var wg sync.WaitGroup
	for range open {
		wg.Add(1)
		go func() {
			defer wg.Done()
			req, _ := http.NewRequestWithContext(ctx(t), http.MethodGet, e.base+"/events?page=cluster", nil)
			resp, err := c.Do(req)
			if err != nil {
				mu.Lock()
				first["error: "+err.Error()]++
				mu.Unlock()
				return
			}
			br := bufio.NewReader(resp.Body)
			line, _ := br.ReadString('\n')
			mu.Lock()
			first[strings.TrimSpace(line)]++
			bodies = append(bodies, resp.Body)
			mu.Unlock()
		}()
	}
	wg.Wait()
	if first[": live"] != limit || first["event: fail"] != open-limit {
		t.Errorf("first lines of %d streams: got %v, want %d live and %d refused", open, first, limit, open-limit)
	}
	if code, _ := get(t, e.signIn(t, secret), e.base+"/cluster"); code != 200 {
		t.Errorf("a page while the streams are open: got %d, want 200", code)
	}
	for _, b := range bodies {
		b.Close()
	}
}

func TestConsoleCutsOffASlowClient(t *testing.T) {
	e := startEnv(t, false, func(c *console.Config) { c.Timeouts.ReadHeader = 200 * time.Millisecond })
	conn, err := net.Dial("tcp", strings.TrimPrefix(e.base, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	// Half a request line, then nothing: the server must not wait forever.
	if _, err := conn.Write([]byte("GET / HT")); err != nil {
		t.Fatal(err)
	}
	conn.SetReadDeadline(time.Now().Add(20 * time.Second))
	_, err = io.ReadAll(conn)
	if ne, ok := err.(net.Error); ok && ne.Timeout() {
		t.Fatal("the console kept a slow client's connection open for 20s, want it closed after its header timeout")
	}
}

func TestConsoleCapsTheRequestBody(t *testing.T) {
	e := startEnv(t, true, nil)
	resp, err := e.browser(t).Post(e.base+"/signin", "application/x-www-form-urlencoded", strings.NewReader("token="+strings.Repeat("x", 64<<10)))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusBadRequest {
		t.Errorf("a 64 KiB sign-in form: got %d, want 400", resp.StatusCode)
	}
}

func TestConsoleLeasePageShowsNoticesLive(t *testing.T) {
	e := startEnv(t, false, nil)
	resp, err := e.lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: &gpupoolv1.LeaseRequest{Count: 1, MemoryMib: 1024, ComputePercent: 10, TtlMs: 600_000, Tenant: "a"}})
	if err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	var got string
	events(t, e.browser(t), e.base+"/events?page=lease&id="+resp.Lease.Id, func(ev, data string) bool {
		if ev != "parts" {
			return false
		}
		once.Do(func() {
			if _, err := gpupoolv1.NewPoolServiceClient(e.conn).DrainHost(ctx(t), &gpupoolv1.DrainHostRequest{HostId: "h1", DeadlineAfterMs: 3_600_000, Reason: "kernel"}); err != nil {
				t.Error(err)
			}
		})
		got = data
		return strings.Contains(data, "drain notice")
	})
	if !strings.Contains(got, "data-deadline") {
		t.Errorf("the drain notice: got %.300q, want it with its deadline's countdown", got)
	}
}

func TestConsoleKeepsAQuietStreamOpenPastItsWriteTimeout(t *testing.T) {
	e := startEnv(t, false, func(c *console.Config) {
		c.Timeouts.Write = 300 * time.Millisecond
		c.LiveInterval = 50 * time.Millisecond
	})
	req, _ := http.NewRequestWithContext(ctx(t), http.MethodGet, e.base+"/events?page=cluster", nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 16<<20)
	pings := 0
	for pings < 5 && sc.Scan() {
		if sc.Text() == ": ping" {
			pings++
		}
	}
	if pings < 5 {
		t.Fatalf("the quiet stream ended after %d keep-alives (%v), want it open past 5 write timeouts", pings, sc.Err())
	}
}

func TestATokenOverTheBrokersRateLimitIsToldSoAndStaysSignedIn(t *testing.T) {
	// A bucket of 30 requests that does not refill in the test's time:
	// the setup's management token uses a few of its own, and the client
	// token's streams exhaust theirs.
	e := startEnvLimited(t, true, &broker.Limits{TokenRate: limits.Rate{PerSecond: 0.001, Burst: 30}}, nil)
	_, secret := e.token(t, clientToken("a"))
	c := e.signIn(t, secret)
	for i := range 100 {
		req, _ := http.NewRequestWithContext(ctx(t), http.MethodGet, e.base+"/events?page=cluster", nil)
		resp, err := c.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		br := bufio.NewReader(resp.Body)
		line, _ := br.ReadString('\n')
		var data string
		if strings.HasPrefix(line, "event:") {
			data, _ = br.ReadString('\n')
		}
		resp.Body.Close()
		switch ev := strings.TrimSpace(line); ev {
		case ": live":
			continue
		case "event: fail":
			if !strings.Contains(data, "--limit-token-rate") {
				t.Errorf("stream %d: got fail %q, want it to name the token's rate limit", i, data)
			}
			return
		default:
			t.Fatalf("stream %d over the token's rate: got %q %q, want a fail event naming the limit (the token is still valid)", i, ev, data)
		}
	}
	t.Fatal("100 streams and the token's rate limit never refused one")
}
