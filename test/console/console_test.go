// Package console_test drives the web console in a real headless Chromium
// against a real cluster: three broker processes with TLS and ACL on, and
// two agents with simulated GPUs. Leases, drains and quotas are made with
// the gpupool CLI, as an operator would.
//
// Chromium is Debian's package ('make test-console' installs it). Without
// it the suite skips, saying so, unless CI is set, when it fails.
// Screenshots of every page go to GPUPOOL_CONSOLE_ARTIFACTS (default
// .bin/console-screenshots at the repository root); with
// GPUPOOL_CONSOLE_UPDATE_DOCS=1 the pool page's also goes to
// docs/img/console-pool.png.
package console_test

import (
	"bufio"
	"context"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"html"
	"io"
	"net"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/chromedp/chromedp"

	"github.com/gpupool/gpupool/internal/pki"
	"github.com/gpupool/gpupool/internal/pki/pkitest"
)

var binary string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "gpupool-console-test-")
	if err != nil {
		panic(err)
	}
	binary = filepath.Join(dir, "gpupool")
	if out, err := exec.Command("go", "build", "-o", binary, "github.com/gpupool/gpupool/cmd/gpupool").CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "build gpupool: %v\n%s", err, out)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// chromium finds Debian's Chromium, or skips (fails under CI).
func chromium(t *testing.T) string {
	for _, name := range []string{"chromium", "chromium-browser"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	if os.Getenv("CI") != "" {
		t.Fatal("chromium is not installed: 'make test-console' installs Debian's package")
	}
	t.Skip("chromium is not installed: run 'make test-console', which installs Debian's package")
	return ""
}

func freePort(t *testing.T, ip string) string {
	l, err := net.Listen("tcp", net.JoinHostPort(ip, "0"))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// proc is one gpupool child process, killed when the test ends.
type proc struct {
	name string
	cmd  *exec.Cmd
	log  string
	done chan struct{}
}

func start(t *testing.T, dir, name string, args ...string) *proc {
	t.Helper()
	log := filepath.Join(dir, name+".log")
	f, err := os.Create(log)
	if err != nil {
		t.Fatal(err)
	}
	p := &proc{name: name, log: log, done: make(chan struct{}), cmd: exec.Command(binary, args...)}
	p.cmd.Stdout, p.cmd.Stderr = f, f
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { p.cmd.Wait(); f.Close(); close(p.done) }()
	t.Cleanup(func() {
		p.cmd.Process.Kill()
		<-p.done
		if t.Failed() {
			b, _ := os.ReadFile(log)
			if len(b) > 3000 {
				b = b[len(b)-3000:]
			}
			t.Logf("---- %s log (tail) ----\n%s", name, b)
		}
	})
	return p
}

// pool is the cluster under test.
type pool struct {
	t      *testing.T
	dir    string
	addrs  []string
	ui     []string // each broker's console URL
	client pki.Files
	mgmt   string
}

// cli runs a gpupool command against the pool and returns its stdout.
func (p *pool) cli(args ...string) string {
	p.t.Helper()
	args = append(args, "--addr", strings.Join(p.addrs, ","), "--timeout", "60s",
		"--tls-ca", p.client.CA, "--tls-cert", p.client.Cert, "--tls-key", p.client.Key)
	cmd := exec.Command(binary, args...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		p.t.Fatalf("gpupool %s: %v: %s", strings.Join(args[:min(len(args), 8)], " "), err, stderr.String())
	}
	return string(out)
}

// background starts a gpupool command that keeps running (a waiting
// acquire); it is killed when the test ends.
func (p *pool) background(name string, args ...string) {
	args = append(args, "--addr", strings.Join(p.addrs, ","), "--timeout", "60s",
		"--tls-ca", p.client.CA, "--tls-cert", p.client.Cert, "--tls-key", p.client.Key)
	start(p.t, p.dir, name, args...)
}

type secret struct {
	Token struct {
		AccessorID string `json:"accessor_id"`
	} `json:"token"`
	Secret string `json:"secret"`
}

func (p *pool) token(args ...string) secret {
	p.t.Helper()
	var s secret
	out := p.cli(append(args, "-o", "json")...)
	if err := json.Unmarshal([]byte(out), &s); err != nil || s.Secret == "" {
		p.t.Fatalf("token: %v in %q", err, out)
	}
	return s
}

type leaseJSON struct {
	ID     string `json:"id"`
	Tenant string `json:"tenant"`
	Slices []struct {
		Host        string `json:"host"`
		Device      string `json:"device"`
		DeviceIndex int    `json:"device_index"`
	} `json:"slices"`
}

func (p *pool) acquire(args ...string) leaseJSON {
	p.t.Helper()
	var l leaseJSON
	out := p.cli(append([]string{"lease", "acquire", "-o", "json"}, args...)...)
	if err := json.Unmarshal([]byte(out), &l); err != nil || l.ID == "" {
		p.t.Fatalf("acquire: %v in %q", err, out)
	}
	return l
}

func startPool(t *testing.T) *pool {
	t.Helper()
	ca := pkitest.NewCA(t)
	p := &pool{t: t, dir: t.TempDir()}
	var raft []string
	for i := range 3 {
		ip := fmt.Sprintf("127.0.0.%d", i+2)
		p.addrs = append(p.addrs, freePort(t, ip))
		raft = append(raft, freePort(t, ip))
		p.ui = append(p.ui, freePort(t, ip))
	}
	for i := range 3 {
		name := fmt.Sprintf("broker-%d", i+1)
		var join []string
		for j, a := range p.addrs {
			if j != i {
				join = append(join, a)
			}
		}
		f := ca.IssueRequest(t, pki.Request{Name: name, Role: pki.RoleBroker, Hosts: []string{fmt.Sprintf("127.0.0.%d", i+2)},
			NotBefore: time.Now().Add(-time.Minute), NotAfter: time.Now().Add(time.Hour)})
		start(t, p.dir, name, "broker", "--node-id", name, "--data-dir", filepath.Join(p.dir, name), "--bind", p.addrs[i], "--raft-bind", raft[i],
			"--bootstrap-expect", "3", "--join", strings.Join(join, ","), "--heartbeat-interval", "500ms", "--heartbeat-ttl", "5s",
			"--ui-bind", p.ui[i], "--tls-ca", f.CA, "--tls-cert", f.Cert, "--tls-key", f.Key)
	}
	p.client = ca.Issue(t, "console-test", pki.RoleClient)
	boot := p.token("operator", "acl", "bootstrap")
	p.mgmt = boot.Secret
	for i := range 2 {
		host := fmt.Sprintf("host-%d", i+1)
		agent := p.token("operator", "acl", "token", "create", "--kind", "agent", "--host-id", host, "--token", p.mgmt)
		f := ca.Issue(t, host, pki.RoleAgent)
		args := []string{"agent", "--broker", strings.Join(p.addrs, ","), "--simulate", "4xA100-80GB", "--host-id", host,
			"--data-dir", filepath.Join(p.dir, host), "--data-bind", "127.0.0.1:0", "--token", agent.Secret,
			"--tls-ca", f.CA, "--tls-cert", f.Cert, "--tls-key", f.Key}
		if i == 1 {
			args = append(args, "--label", "zone=<script>alert('zone')</script>")
		}
		start(t, p.dir, host, args...)
	}
	deadline := time.Now().Add(60 * time.Second)
	for !strings.Contains(p.cli("host", "ls", "--token", p.mgmt), "host-2") || !strings.Contains(p.cli("host", "ls", "--token", p.mgmt), "host-1") {
		if time.Now().After(deadline) {
			t.Fatal("the hosts did not register in 60s")
		}
		time.Sleep(200 * time.Millisecond)
	}
	return p
}

// follower is the index of a broker that does not lead.
func (p *pool) follower() int {
	p.t.Helper()
	var peers struct {
		LeaderID string `json:"leader_id"`
	}
	out := p.cli("operator", "raft", "peers", "-o", "json", "--token", p.mgmt)
	if err := json.Unmarshal([]byte(out), &peers); err != nil || peers.LeaderID == "" {
		p.t.Fatalf("raft peers: %v in %q", err, out)
	}
	for i := range p.ui {
		if fmt.Sprintf("broker-%d", i+1) != peers.LeaderID {
			return i
		}
	}
	p.t.Fatal("no follower")
	return 0
}

// artifacts is where screenshots go.
func artifacts(t *testing.T) string {
	dir := os.Getenv("GPUPOOL_CONSOLE_ARTIFACTS")
	if dir == "" {
		dir = filepath.Join("..", "..", ".bin", "console-screenshots")
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	return dir
}

func newBrowser(t *testing.T, exe string) context.Context {
	opts := []chromedp.ExecAllocatorOption{
		chromedp.ExecPath(exe), chromedp.Headless, chromedp.NoSandbox, chromedp.DisableGPU, chromedp.NoFirstRun,
		chromedp.Flag("disable-quic", true), chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-component-update", true), chromedp.Flag("disable-sync", true),
		chromedp.Flag("disable-dev-shm-usage", true),
		// The brokers' certificates come from the test's own CA.
		chromedp.Flag("ignore-certificate-errors", true),
		chromedp.UserDataDir(t.TempDir()), chromedp.WindowSize(1400, 900),
	}
	actx, cancel := chromedp.NewExecAllocator(context.Background(), opts...)
	t.Cleanup(cancel)
	bctx, cancel2 := chromedp.NewContext(actx)
	t.Cleanup(cancel2)
	// The first run starts the browser, for as long as bctx lives.
	if err := chromedp.Do(bctx); err != nil {
		t.Fatalf("start chromium: %v", err)
	}
	tctx, cancel3 := context.WithTimeout(bctx, 150*time.Second)
	t.Cleanup(cancel3)
	return tctx
}

func run(t *testing.T, ctx context.Context, what string, actions ...chromedp.Action[chromedp.Void]) {
	t.Helper()
	sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := chromedp.Do(sctx, actions...); err != nil {
		body, _ := chromedp.Run(ctx, chromedp.Evaluate[string](`document.documentElement.outerHTML.slice(0, 3000)`))
		t.Fatalf("%s: %v; the page is:\n%s", what, err, body)
	}
}

// until evaluates a JavaScript condition until it is true.
func until(t *testing.T, ctx context.Context, what, js string) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		ok, err := chromedp.Run(ctx, chromedp.Evaluate[bool](js))
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		if ok {
			return
		}
		if time.Now().After(deadline) {
			body, _ := chromedp.Run(ctx, chromedp.Evaluate[string](`document.body.innerText.slice(0, 1500)`))
			t.Fatalf("timed out waiting for %s; the page says:\n%s", what, body)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func screenshot(t *testing.T, ctx context.Context, dir, name string) string {
	t.Helper()
	png, err := chromedp.Run(ctx, chromedp.FullScreenshot(100))
	if err != nil {
		t.Fatalf("screenshot %s: %v", name, err)
	}
	path := filepath.Join(dir, name+".png")
	if err := os.WriteFile(path, png, 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

func signIn(t *testing.T, ctx context.Context, base, secret string) {
	t.Helper()
	run(t, ctx, "sign in",
		chromedp.Navigate(base+"signin"),
		chromedp.WaitVisible(chromedp.ID(`token`)),
		chromedp.SendKeys(chromedp.ID(`token`), secret),
		chromedp.Click(chromedp.ID(`signin`)),
		chromedp.WaitVisible(chromedp.ID(`who`)),
	)
}

func TestConsoleInABrowser(t *testing.T) {
	if testing.Short() {
		t.Skip("starts real processes and a browser")
	}
	exe := chromium(t)
	p := startPool(t)
	shots := artifacts(t)
	// A follower's console: measured usage and heartbeats are leader
	// memory, which it must get from the leader.
	base := "https://" + p.ui[p.follower()] + "/"
	ctx := newBrowser(t, exe)

	// A missing token gets the sign-in page with the reason.
	run(t, ctx, "open without a token", chromedp.Navigate(base))
	reason, err := chromedp.Run(ctx, chromedp.Text(chromedp.ID(`reason`)))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(reason, "Sign in") {
		t.Errorf("without a token: got %q, want the sign-in page's reason", reason)
	}
	screenshot(t, ctx, shots, "signin")
	checkCrossSiteSignIn(t, ctx, p, base)
	signIn(t, ctx, base, p.mgmt)

	// A lease granted from the CLI appears on the pool page without a reload.
	run(t, ctx, "pool page", chromedp.Navigate(base), chromedp.WaitVisible(chromedp.ID(`row-host-1`)),
		chromedp.Func(func(ctx context.Context, tg *chromedp.Target) error {
			_, err := chromedp.Evaluate[bool](`window.noReload = true`)(ctx, tg)
			return err
		}))
	lease := p.acquire("--memory", "20GiB", "--compute", "25", "--ttl", "10m", "--tenant", "team-a",
		"--holder", "<script>alert('holder')</script>", "--token", p.mgmt)
	until(t, ctx, "the new lease's GPU marked on the pool page",
		fmt.Sprintf(`window.noReload === true && document.querySelector('#row-%s .cells > i[data-gpu="%d"]')?.dataset.leases === "1"`, lease.Slices[0].Host, lease.Slices[0].DeviceIndex))
	screenshot(t, ctx, shots, "pool-first-lease")
	proto, err := chromedp.Run(ctx, chromedp.Evaluate[string](`performance.getEntriesByType("navigation")[0].nextHopProtocol`))
	if err != nil || proto != "h2" {
		t.Errorf("protocol of the page: got %q (%v), want h2 over the broker's TLS", proto, err)
	}

	// A drain's countdown moves (the host keeps the lease until then).
	drained := lease.Slices[0].Host
	p.cli("host", "drain", drained, "--deadline", "1h", "--reason", "<script>alert('reason')</script>", "--token", p.mgmt)
	run(t, ctx, "host page", chromedp.Navigate(base+"hosts/"+drained), chromedp.WaitVisible(chromedp.ID(`drain-countdown`)))
	// Read by script, not through a node id: a live update may replace
	// the element between the wait and the read.
	first, err := chromedp.Run(ctx, chromedp.Evaluate[string](`document.getElementById("drain-countdown").textContent`))
	if err != nil {
		t.Fatal(err)
	}
	until(t, ctx, "the countdown to move from "+first, fmt.Sprintf(`document.getElementById("drain-countdown").textContent !== %q`, first))
	until(t, ctx, "the leader's readings and heartbeat age on a follower's console",
		`document.querySelector("[data-since]") !== null && !document.getElementById("live").textContent.includes("no reading")`)
	screenshot(t, ctx, shots, "host")

	// A why-pending text shows on the queue page.
	p.cli("operator", "quota", "set", "team-b", "--gpus", "1", "--token", p.mgmt)
	leaseB := p.acquire("--exclusive", "--ttl", "10m", "--tenant", "team-b", "--token", p.mgmt)
	p.background("waiting-acquire", "lease", "acquire", "--exclusive", "--ttl", "10m", "--tenant", "team-b", "--wait", "5m",
		"--holder", "<script>alert('waiter')</script>", "--token", p.mgmt)
	run(t, ctx, "queue page", chromedp.Navigate(base+"queue"))
	until(t, ctx, "a why-pending text naming the quota", `[...document.querySelectorAll("#pending .why")].some(e => e.textContent.includes("quota"))`)
	screenshot(t, ctx, shots, "queue")
	run(t, ctx, "pool page again", chromedp.Navigate(base), chromedp.WaitVisible(chromedp.ID(`row-host-1`)))
	pool := screenshot(t, ctx, shots, "pool")
	if os.Getenv("GPUPOOL_CONSOLE_UPDATE_DOCS") == "1" {
		b, _ := os.ReadFile(pool)
		if err := os.WriteFile(filepath.Join("..", "..", "docs", "img", "console-pool.png"), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}

	for _, page := range []struct{ name, path string }{{"leases", "leases"}, {"lease", "leases/" + lease.ID}, {"tenants", "tenants"}, {"cluster", "cluster"}} {
		run(t, ctx, page.name, chromedp.Navigate(base+page.path), chromedp.WaitVisible(chromedp.ID(`live`)))
		screenshot(t, ctx, shots, page.name)
	}
	run(t, ctx, "tenants", chromedp.Navigate(base+"tenants"))
	until(t, ctx, "team-a, which holds a lease but has no quota, on the tenants page", `document.querySelector('[data-tenant="team-a"]') !== null`)
	scripts, err := chromedp.Run(ctx, chromedp.Evaluate[int](`document.querySelectorAll("script:not([src])").length`))
	if err != nil {
		t.Fatal(err)
	}
	if scripts != 0 {
		t.Errorf("inline scripts on the page: got %d, want 0 (user strings are escaped)", scripts)
	}

	// Tenant A's client token sees none of tenant B's leases, on the page
	// or in its stream.
	a := p.token("operator", "acl", "token", "create", "--kind", "client", "--tenant", "team-a", "--token", p.mgmt)
	run(t, ctx, "sign out", chromedp.Navigate(base), chromedp.Click(chromedp.CSS(`header form button`)), chromedp.WaitVisible(chromedp.ID(`token`)))
	signIn(t, ctx, base, a.Secret)
	for _, page := range []string{"leases", "queue", "hosts/host-1", "tenants"} {
		run(t, ctx, page+" as team-a", chromedp.Navigate(base+page), chromedp.WaitVisible(chromedp.ID(`live`)))
		html, err := chromedp.Run(ctx, chromedp.OuterHTML(chromedp.CSS(`html`)))
		if err != nil {
			t.Fatal(err)
		}
		if strings.Contains(html, leaseB.ID) || strings.Contains(html, "team-b") {
			t.Errorf("%s as team-a shows team-b's lease or tenant", page)
		}
	}
	screenshot(t, ctx, shots, "leases-as-team-a")
	checkStream(t, p, base, a.Secret, leaseB.ID)
	t.Logf("screenshots in %s", shots)
}

// checkCrossSiteSignIn submits a sign-in form with an attacker's token
// from a page of another site (login CSRF): the console refuses it, and
// the browser stays signed out.
func checkCrossSiteSignIn(t *testing.T, ctx context.Context, p *pool, base string) {
	t.Helper()
	attacker := p.token("operator", "acl", "token", "create", "--kind", "client", "--tenant", "team-x", "--token", p.mgmt)
	evil := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		fmt.Fprintf(w, `<!doctype html><form method="post" action="%ssignin"><input type="hidden" name="token" value="%s"><button id="go">win a prize</button></form>`,
			base, html.EscapeString(attacker.Secret))
	}))
	t.Cleanup(evil.Close)
	run(t, ctx, "a sign-in form on another site", chromedp.Navigate(evil.URL), chromedp.Click(chromedp.ID(`go`)))
	until(t, ctx, "the console to refuse the other site's sign-in", `document.body.innerText.includes("sign-in refused")`)
	run(t, ctx, "the console after the other site's form", chromedp.Navigate(base), chromedp.WaitVisible(chromedp.ID(`token`)))
	if who, _ := chromedp.Run(ctx, chromedp.Evaluate[bool](`document.getElementById("who") !== null`)); who {
		t.Error("another site's form signed the browser in, want it refused")
	}
}

// signInHTTP signs hc in as the console's own sign-in form does, and
// checks the session cookie over TLS: Secure, __Host-, not the secret.
func signInHTTP(t *testing.T, ctx context.Context, hc *http.Client, base, secret string) {
	t.Helper()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, base+"signin", nil)
	resp, err := hc.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	page, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	m := regexp.MustCompile(`name="csrf" value="([^"]+)"`).FindSubmatch(page)
	if m == nil {
		t.Fatalf("the sign-in page has no CSRF token: %.300s", page)
	}
	form := url.Values{"token": {secret}, "csrf": {string(m[1])}}
	req, _ = http.NewRequestWithContext(ctx, http.MethodPost, base+"signin", strings.NewReader(form.Encode()))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	req.Header.Set("Origin", strings.TrimSuffix(base, "/"))
	req.Header.Set("Sec-Fetch-Site", "same-origin")
	hc.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
	resp, err = hc.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	var session *http.Cookie
	for _, c := range resp.Cookies() {
		if c.Name == "__Host-gpupool_console_session" {
			session = c
		}
	}
	if resp.StatusCode != http.StatusSeeOther || session == nil || !session.Secure || !session.HttpOnly || strings.Contains(session.Value, secret) {
		t.Fatalf("sign-in over TLS: got %d and session cookie %+v, want 303 and a Secure, HttpOnly __Host- cookie without the secret", resp.StatusCode, session)
	}
}

// checkStream reads team-a's live leases stream while team-b and team-a
// each take a lease: team-a's shows up, team-b's never does.
func checkStream(t *testing.T, p *pool, base, secretA, otherID string) {
	t.Helper()
	jar, _ := cookiejar.New(nil)
	hc := &http.Client{Jar: jar, Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	signInHTTP(t, ctx, hc, base, secretA)
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, base+"events?page=leases", nil)
	resp, err := hc.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var once sync.Once
	var ownID, newOther string
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 16<<20)
	for sc.Scan() {
		line := sc.Text()
		if strings.Contains(line, otherID) || strings.Contains(line, "team-b") || strings.Contains(line, "team-c") ||
			(newOther != "" && strings.Contains(line, newOther)) {
			t.Fatalf("team-a's stream carries another tenant's lease: %.200s", line)
		}
		if !strings.HasPrefix(line, "data: ") {
			continue
		}
		once.Do(func() {
			newOther = p.acquire("--memory", "1GiB", "--compute", "5", "--ttl", "10m", "--tenant", "team-c", "--token", p.mgmt).ID
			ownID = p.acquire("--memory", "1GiB", "--compute", "5", "--ttl", "10m", "--token", secretA).ID
		})
		if ownID != "" && strings.Contains(line, ownID) {
			return
		}
	}
	t.Fatalf("team-a's stream ended before showing its own new lease %s: %v", ownID, sc.Err())
}
