package client_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/gpupool/gpupool/client"
	"github.com/gpupool/gpupool/dataplane"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

func sampleTokenFile() *client.TokenFile {
	return &client.TokenFile{Leases: []client.TokenFileLease{
		{LeaseID: "l-1", MemoryMiB: 8192, ComputePercent: 25, Tokens: []*gpupoolv1.HostToken{
			{Host: "h1", Token: "gpt1.a.b", Address: "10.0.0.7:7650", CertSha256: "9f86d0"},
		}},
		{LeaseID: "l-2", Tokens: []*gpupoolv1.HostToken{{Host: "h2", Token: "gpt1.c.d", Address: "10.0.0.8:7650"}}},
	}}
}

func TestTokenFileRoundTripsInItsDocumentedFormat(t *testing.T) {
	path := filepath.Join(t.TempDir(), "token.json")
	tf := sampleTokenFile()
	if err := client.WriteTokenFile(path, tf); err != nil {
		t.Fatal(err)
	}
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	// The names other tools rely on, as in the TokenFile doc comment.
	for _, want := range []string{`"version": 1`, `"lease_id": "l-1"`, `"memory_mib": 8192`, `"compute_percent": 25`,
		`"host": "h1"`, `"token": "gpt1.a.b"`, `"address": "10.0.0.7:7650"`, `"cert_sha256": "9f86d0"`} {
		if !bytes.Contains(raw, []byte(want)) {
			t.Errorf("file lacks %s:\n%s", want, raw)
		}
	}
	if st, _ := os.Stat(path); st.Mode().Perm() != 0o644 {
		t.Errorf("mode %v, want 0644 (a container's non-root user reads it)", st.Mode().Perm())
	}
	got, err := client.ReadTokenFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if got.Version != client.TokenFileVersion || len(got.Leases) != 2 {
		t.Fatalf("read back version %d with %d leases, want %d with 2", got.Version, len(got.Leases), client.TokenFileVersion)
	}
	for i, l := range got.Leases {
		want := tf.Leases[i]
		if l.LeaseID != want.LeaseID || l.MemoryMiB != want.MemoryMiB || l.ComputePercent != want.ComputePercent ||
			len(l.Tokens) != 1 || !proto.Equal(l.Tokens[0], want.Tokens[0]) {
			t.Errorf("lease %d read back as %+v, want %+v", i, l, want)
		}
	}
}

func TestReadTokenFileSaysWhatIsWrong(t *testing.T) {
	good, err := os.ReadFile(writeSample(t))
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name    string
		content string // "" with missing: no file at all
		missing bool
		want    string
	}{
		{"a missing file", "", true, "no such file"},
		{"an empty file", "", false, "empty"},
		{"a truncated file", string(good[:len(good)/2]), false, "not valid JSON (truncated?)"},
		{"a JSON array", `[]`, false, "not a token file"},
		{"a file without a version", `{"leases": []}`, false, "no version: not a gpupool token file"},
		{"a newer version", `{"version": 2, "leases": [{"lease_id": "l-1", "tokens": [{"host": "h1", "token": "t"}]}]}`, false, "version 2: this gpupool reads version 1 only"},
		{"no leases", `{"version": 1, "leases": []}`, false, "holds no lease"},
		{"a lease without an id", `{"version": 1, "leases": [{"tokens": [{"host": "h1", "token": "t"}]}]}`, false, "lease 1 of 1 has no lease_id"},
		{"a lease without tokens", `{"version": 1, "leases": [{"lease_id": "l-1"}]}`, false, "lease l-1 has no tokens"},
		{"a token without a host", `{"version": 1, "leases": [{"lease_id": "l-1", "tokens": [{"token": "t"}]}]}`, false, "lease l-1: token 1 of 1 has no host"},
		{"a null token", `{"version": 1, "leases": [{"lease_id": "l-1", "tokens": [null]}]}`, false, "lease l-1: token 1 of 1 has no host"},
		{"a host without its token", `{"version": 1, "leases": [{"lease_id": "l-1", "tokens": [{"host": "h1"}]}]}`, false, "lease l-1: host h1 has no token"},
		{"a lease listed twice", `{"version": 1, "leases": [{"lease_id": "l-1", "tokens": [{"host": "h1", "token": "t"}]}, {"lease_id": "l-1", "tokens": [{"host": "h1", "token": "t"}]}]}`, false, "lease l-1 is listed twice"},
		{"a wrongly typed field", `{"version": "1"}`, false, "not a token file"},
		{"a huge file", `{"version": 1, "pad": "` + strings.Repeat("x", 1<<20) + `"}`, false, "larger than"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "token.json")
			if !tc.missing {
				if err := os.WriteFile(path, []byte(tc.content), 0o600); err != nil {
					t.Fatal(err)
				}
			}
			_, err := client.ReadTokenFile(path)
			if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), "token file "+path) {
				t.Fatalf("got %v, want an error naming the file and saying %q", err, tc.want)
			}
			if !tc.missing && !errors.Is(err, client.ErrBadTokenFile) {
				t.Errorf("got %v, want it to wrap ErrBadTokenFile", err)
			}
			if tc.missing && !errors.Is(err, fs.ErrNotExist) {
				t.Errorf("got %v, want it to wrap fs.ErrNotExist", err)
			}
		})
	}
}

func TestWriteTokenFileRefusesWhatReadWouldRefuse(t *testing.T) {
	path := filepath.Join(t.TempDir(), "token.json")
	err := client.WriteTokenFile(path, &client.TokenFile{Leases: []client.TokenFileLease{{LeaseID: "l-1"}}})
	if !errors.Is(err, client.ErrBadTokenFile) || !strings.Contains(err.Error(), "lease l-1 has no tokens") {
		t.Fatalf("got %v, want a refusal naming the lease without tokens", err)
	}
	if _, err := os.Stat(path); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("a refused file was written: %v", err)
	}
}

func FuzzReadTokenFile(f *testing.F) {
	good, err := os.ReadFile(writeSample(f))
	if err != nil {
		f.Fatal(err)
	}
	f.Add(good)
	f.Add(good[:len(good)/3])
	f.Add([]byte(`{"version": 1, "leases": [{"lease_id": "l-1", "tokens": [{"host": "h1", "token": "t"}]}]}`))
	f.Add([]byte(`{"version": 1, "leases": [{"lease_id": "l-1", "tokens": [null]}]}`))
	f.Add([]byte(`null`))
	dir := f.TempDir()
	f.Fuzz(func(t *testing.T, data []byte) {
		path := filepath.Join(dir, "token.json")
		if err := os.WriteFile(path, data, 0o600); err != nil {
			t.Fatal(err)
		}
		tf, err := client.ReadTokenFile(path)
		if err != nil {
			if !errors.Is(err, client.ErrBadTokenFile) {
				t.Fatalf("a file that exists failed with %v, want ErrBadTokenFile", err)
			}
			return
		}
		// Whatever is accepted can be written back and read again.
		again := filepath.Join(dir, "again.json")
		if err := client.WriteTokenFile(again, tf); err != nil {
			t.Fatalf("accepted a file WriteTokenFile refuses: %v", err)
		}
		if _, err := client.ReadTokenFile(again); err != nil {
			t.Fatalf("rewritten file refused: %v", err)
		}
	})
}

// writeSample writes sampleTokenFile to a temporary file and returns its
// path.
func writeSample(tb testing.TB) string {
	tb.Helper()
	path := filepath.Join(tb.TempDir(), "token.json")
	if err := client.WriteTokenFile(path, sampleTokenFile()); err != nil {
		tb.Fatal(err)
	}
	return path
}

func TestFromEnvNeedsTheVariable(t *testing.T) {
	t.Setenv(client.TokenFileEnv, "")
	if _, err := client.FromEnv(); !errors.Is(err, client.ErrNoTokenFile) || !strings.Contains(err.Error(), "GPUPOOL_TOKEN_FILE") {
		t.Fatalf("FromEnv without the variable: %v, want ErrNoTokenFile naming GPUPOOL_TOKEN_FILE", err)
	}
	t.Setenv(client.TokenFileEnv, filepath.Join(t.TempDir(), "absent.json"))
	if _, err := client.FromEnv(); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("FromEnv with a missing file: %v, want fs.ErrNotExist", err)
	}
}

func TestOpenTokenFilePicksTheLease(t *testing.T) {
	path := writeSample(t)
	for _, tc := range []struct{ ask, want, err string }{
		{"", "l-1", ""},
		{"l-2", "l-2", ""},
		{"l-9", "", "has no lease l-9"},
	} {
		l, err := client.OpenTokenFile(path, tc.ask)
		switch {
		case tc.err != "" && (err == nil || !strings.Contains(err.Error(), tc.err)):
			t.Errorf("OpenTokenFile(%q) = %v, want an error with %q", tc.ask, err, tc.err)
		case tc.err == "" && (err != nil || l.ID() != tc.want):
			t.Errorf("OpenTokenFile(%q) = %v, %v; want lease %s", tc.ask, l, err, tc.want)
		}
	}
}

// rotatingAuth accepts the tokens in valid, which a test changes.
type rotatingAuth struct {
	mu    sync.Mutex
	valid map[string]string // guarded by mu; token → lease id
}

func (a *rotatingAuth) Authorize(token string) (string, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if id, ok := a.valid[token]; ok {
		return id, nil
	}
	return "", fmt.Errorf("token %q expired", token)
}

func (a *rotatingAuth) only(token, leaseID string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.valid = map[string]string{token: leaseID}
}

// oneLeaseAgent serves lease l-1, whose directory is dir.
type oneLeaseAgent struct{ dir string }

func (a oneLeaseAgent) Env(string) ([]string, bool) { return []string{"GPUPOOL_LEASE_ID=l-1"}, true }
func (a oneLeaseAgent) Dir(string) (string, error)  { return a.dir, nil }
func (a oneLeaseAgent) Started(string, int)         {}
func (a oneLeaseAgent) Usage(id string) (*gpupoolv1.LeaseUsage, bool) {
	return &gpupoolv1.LeaseUsage{LeaseId: id, Host: "h1"}, true
}
func (oneLeaseAgent) Sandbox(string, *exec.Cmd) error { return nil }
func (oneLeaseAgent) Listens(string, int) bool        { return true }

// startAgent runs a data-plane server for lease l-1 and returns its
// address, certificate fingerprint and lease directory.
func startAgent(t *testing.T, auth dataplane.Authorizer) (addr, certSHA256, dir string) {
	t.Helper()
	base := t.TempDir()
	cert, fp, err := dataplane.LoadOrCreateCert(filepath.Join(base, "tls"))
	if err != nil {
		t.Fatal(err)
	}
	dir = filepath.Join(base, "lease")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	srv, err := dataplane.NewServer(dataplane.ServerConfig{Addr: "127.0.0.1:0", Cert: cert, Auth: auth,
		Leases: oneLeaseAgent{dir: dir}, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-served; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	return srv.Addr().String(), fp, dir
}

func TestFileLeaseUsesTheTokenTheFileHoldsAtEachCall(t *testing.T) {
	auth := &rotatingAuth{}
	auth.only("token-1", "l-1")
	addr, fp, dir := startAgent(t, auth)
	path := filepath.Join(t.TempDir(), "token.json")
	write := func(token string) {
		t.Helper()
		if err := client.WriteTokenFile(path, &client.TokenFile{Leases: []client.TokenFileLease{
			{LeaseID: "l-1", Tokens: []*gpupoolv1.HostToken{{Host: "h1", Token: token, Address: addr, CertSha256: fp}}},
		}}); err != nil {
			t.Fatal(err)
		}
	}
	write("token-1")
	t.Setenv(client.TokenFileEnv, path)
	l, err := client.FromEnv()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(l.Close)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()

	if _, err := l.Put(ctx, strings.NewReader("first"), 5, "a.txt", 0o644); err != nil {
		t.Fatalf("Put with the first token: %v", err)
	}
	// A renewal: the node plugin rewrites the file and the old token
	// stops working. The same session carries on with the new one.
	write("token-2")
	auth.only("token-2", "l-1")
	var got bytes.Buffer
	if _, err := l.Get(ctx, "a.txt", &got); err != nil || got.String() != "first" {
		t.Fatalf("Get after the rewrite: %q, %v; want the file written before", got.String(), err)
	}
	if b, _ := os.ReadFile(filepath.Join(dir, "a.txt")); string(b) != "first" {
		t.Fatalf("the agent's lease directory holds %q", b)
	}
	var usage []*gpupoolv1.LeaseUsage
	uctx, ucancel := context.WithCancel(ctx)
	err = l.Usage(uctx, 100*time.Millisecond, func(u *gpupoolv1.LeaseUsage) { usage = append(usage, u); ucancel() })
	if len(usage) == 0 || usage[0].LeaseId != "l-1" {
		t.Fatalf("Usage reported %v (%v), want l-1's usage", usage, err)
	}

	// The file is gone (the claim was unprepared): calls say so.
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	if _, err := l.Put(ctx, strings.NewReader("x"), 1, "b.txt", 0o644); err == nil || !strings.Contains(err.Error(), "token file "+path) {
		t.Fatalf("Put without the file: %v, want an error naming the token file", err)
	}
}

func TestFileLeaseDialSaysWhichHostItLacks(t *testing.T) {
	l, err := client.OpenTokenFile(writeSample(t), "l-2")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := l.Dial(ctx, "h9"); err == nil || !strings.Contains(err.Error(), "no token of lease l-2 for host h9") {
		t.Fatalf("Dial(h9) = %v, want an error naming the lease and host", err)
	}
}
