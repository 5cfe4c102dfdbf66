package dataplane

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

const (
	testLease = "lease-1"
	testToken = "token-1"
	// otherLease is another lease on the same host, with otherToken.
	otherLease = "lease-2"
	otherToken = "token-2"
	// testGPU is the CUDA_VISIBLE_DEVICES of testLease.
	testGPU = "GPU-0b9c2f4e-5a1d-4c3b-9e8f-7a6b5c4d3e2f"
)

// fakeAuth knows a fixed set of tokens.
type fakeAuth struct {
	leases  map[string]string // token → lease id
	refusal map[string]string // token → why it is refused
}

func (a *fakeAuth) Authorize(token string) (string, error) {
	if lease, ok := a.leases[token]; ok {
		return lease, nil
	}
	if why, ok := a.refusal[token]; ok {
		return "", errors.New(why)
	}
	return "", errors.New("token not signed by a known broker key")
}

// fakeLeases is the agent's view of its leases, for tests.
type fakeLeases struct {
	mu      sync.Mutex
	env     map[string][]string // guarded by mu; a lease is enforced while it has an entry
	dirs    map[string]string   // guarded by mu
	usage   map[string]*gpupoolv1.LeaseUsage
	started chan int // receives each pid Started reports
}

func (l *fakeLeases) Env(leaseID string) ([]string, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	env, ok := l.env[leaseID]
	return env, ok
}

func (l *fakeLeases) Dir(leaseID string) (string, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	dir, ok := l.dirs[leaseID]
	if !ok {
		return "", fmt.Errorf("no directory for lease %s", leaseID)
	}
	return dir, nil
}

func (l *fakeLeases) Started(leaseID string, pid int) {
	l.started <- pid
}

func (l *fakeLeases) Sandbox(string, *exec.Cmd) error { return nil }
func (l *fakeLeases) Listens(string, int) bool        { return true }

func (l *fakeLeases) Usage(leaseID string) (*gpupoolv1.LeaseUsage, bool) {
	if _, ok := l.Env(leaseID); !ok {
		return nil, false
	}
	return l.usage[leaseID], true
}

// end stops enforcing the lease, as the agent does before Revoke.
func (l *fakeLeases) end(leaseID string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	delete(l.env, leaseID)
}

// testAgent is a Server serving testLease, whose directory is dir.
type testAgent struct {
	srv    *Server
	leases *fakeLeases
	dir    string
	certFP string

	cancel   context.CancelFunc
	served   chan error
	stopOnce sync.Once
}

// newTestAgent starts a Server on a free loopback port; it stops at the
// end of the test.
func newTestAgent(t *testing.T) *testAgent {
	t.Helper()
	return newTestAgentCuda(t, nil)
}

// newTestAgentCuda is newTestAgent whose cuda operation starts cuda.
func newTestAgentCuda(t *testing.T, cuda CudaServerFunc) *testAgent {
	t.Helper()
	return newTestAgentWith(t, func(c *ServerConfig) { c.CudaServer = cuda })
}

// newTestAgentWith is newTestAgent whose config opts changes first.
func newTestAgentWith(t *testing.T, opts func(*ServerConfig)) *testAgent {
	t.Helper()
	base := t.TempDir()
	cert, fp, err := LoadOrCreateCert(filepath.Join(base, "cert"))
	if err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(base, "lease")
	otherDir := filepath.Join(base, "other-lease")
	for _, d := range []string{dir, otherDir} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	leases := &fakeLeases{
		env: map[string][]string{
			testLease:  {"GPUPOOL_LEASE_ID=" + testLease, "CUDA_VISIBLE_DEVICES=" + testGPU},
			otherLease: {"GPUPOOL_LEASE_ID=" + otherLease},
		},
		dirs: map[string]string{testLease: dir, otherLease: otherDir},
		usage: map[string]*gpupoolv1.LeaseUsage{testLease: {
			LeaseId: testLease,
			Host:    "host-a",
		}},
		started: make(chan int, 16),
	}
	auth := &fakeAuth{
		leases:  map[string]string{testToken: testLease, otherToken: otherLease},
		refusal: map[string]string{"expired": "token expired at 2026-01-02T03:04:05Z"},
	}
	cfg := ServerConfig{
		Addr:   "127.0.0.1:0",
		Cert:   cert,
		Auth:   auth,
		Leases: leases,
		Logger: slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelDebug})),
	}
	opts(&cfg)
	srv, err := NewServer(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	a := &testAgent{srv: srv, leases: leases, dir: dir, certFP: fp, cancel: cancel, served: make(chan error, 1)}
	go func() { a.served <- srv.Serve(ctx) }()
	t.Cleanup(func() { a.stop(t) })
	return a
}

// stop stops the agent and waits for Serve to return.
func (a *testAgent) stop(t *testing.T) {
	a.stopOnce.Do(func() {
		a.cancel()
		if err := <-a.served; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
}

// dial connects to the agent; the connection closes at the end of the
// test.
func (a *testAgent) dial(t *testing.T) *Conn {
	t.Helper()
	c, err := Dial(t.Context(), a.srv.Addr().String(), a.certFP)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// wantRefused fails the test unless err is a RefusedError with code
// whose message contains msg.
func wantRefused(t *testing.T, err error, code gpupoolv1.AcceptCode, msg string) {
	t.Helper()
	var refused *RefusedError
	if !errors.As(err, &refused) {
		t.Fatalf("got error %v, want a refusal %s", err, codeName(code))
	}
	if refused.Code != code || !strings.Contains(refused.Message, msg) {
		t.Fatalf("got refusal %q (code %v), want code %v with %q in the message", refused, refused.Code, code, msg)
	}
}

// rawStream opens a stream on c for tests that speak the protocol by hand.
func rawStream(t *testing.T, c *Conn) *clientStream {
	t.Helper()
	qs, err := c.qc.OpenStreamSync(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	cs := &clientStream{qs: qs, ctx: t.Context(), op: "raw", fr: frameReader{r: qs}, fw: frameWriter{w: qs}, stopReset: func() bool { return true }}
	t.Cleanup(cs.abort)
	return cs
}

// readAccept reads a StreamAccept from cs.
func readAccept(t *testing.T, cs *clientStream) *gpupoolv1.StreamAccept {
	t.Helper()
	var acc gpupoolv1.StreamAccept
	if err := cs.fr.read(&acc); err != nil {
		t.Fatalf("reading the StreamAccept: %v", err)
	}
	return &acc
}

// watchWriter collects what is written to it and closes seen once the
// output contains want.
type watchWriter struct {
	want string
	seen chan struct{}

	mu   sync.Mutex
	buf  bytes.Buffer // guarded by mu
	once sync.Once
}

func newWatchWriter(want string) *watchWriter {
	return &watchWriter{want: want, seen: make(chan struct{})}
}

func (w *watchWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.buf.Write(p)
	if strings.Contains(w.buf.String(), w.want) {
		w.once.Do(func() { close(w.seen) })
	}
	return len(p), nil
}

func (w *watchWriter) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.buf.String()
}

// waitFor polls cond until it holds, for conditions no event announces
// (the state of another process). It fails the test after a minute.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	timeout := time.NewTimer(time.Minute)
	defer timeout.Stop()
	for !cond() {
		select {
		case <-tick.C:
		case <-timeout.C:
			t.Fatalf("gave up waiting for %s", what)
		}
	}
}

// mustMarshal is proto.Marshal for messages that always encode.
func mustMarshal(t testing.TB, m proto.Message) []byte {
	t.Helper()
	b, err := proto.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	return b
}
