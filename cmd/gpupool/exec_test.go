package main

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/gpupool/gpupool/client"
	"github.com/gpupool/gpupool/dataplane"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

func TestExecAndForwardWithoutALeaseIDNeedAPodsTokenFile(t *testing.T) {
	t.Setenv(client.TokenFileEnv, "")
	want := []string{"no lease: give a lease id", "gpupool ResourceClaim", "GPUPOOL_TOKEN_FILE"}
	checkUsageErrors(t, []usageCase{
		{"exec with neither lease id nor token file", []string{"exec", "--", "true"}, want},
		{"forward with neither lease id nor token file", []string{"forward", "8000:8000"}, want},
		{"exec with nothing after --", []string{"exec", "--"}, []string{"want LEASE_ID -- CMD"}},
		{"forward with too many arguments", []string{"forward", "l-1", "8000:8000", "9000:9000"}, []string{"accepts between 1 and 2 arg(s)"}},
	})
}

func TestExecSaysWhatIsWrongWithThePodsTokenFile(t *testing.T) {
	dir := t.TempDir()
	garbage := filepath.Join(dir, "garbage.json")
	if err := os.WriteFile(garbage, []byte(`{"version": 1, "leases": [`), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, path string
		want       []string
	}{
		{"a missing file", filepath.Join(dir, "absent.json"), []string{"GPUPOOL_TOKEN_FILE: token file " + filepath.Join(dir, "absent.json"), "no such file"}},
		{"a truncated file", garbage, []string{"GPUPOOL_TOKEN_FILE: token file " + garbage, "not valid JSON (truncated?)"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv(client.TokenFileEnv, tc.path)
			code, stdout, stderr := runOffline(t, "exec", "--", "true")
			if code != 1 || stdout != "" {
				t.Errorf("exit %d, stdout %q; want 1 and nothing", code, stdout)
			}
			for _, w := range tc.want {
				if !strings.Contains(stderr, w) {
					t.Errorf("stderr %q, want it to mention %q", stderr, w)
				}
			}
		})
	}
}

// podAgent is a data-plane server that serves lease l-1 to token "tok".
type podAgent struct{ dir string }

func (podAgent) Authorize(token string) (string, error) {
	if token != "tok" {
		return "", errors.New("unknown token")
	}
	return "l-1", nil
}
func (podAgent) Env(string) ([]string, bool)                { return []string{"GPUPOOL_LEASE_ID=l-1"}, true }
func (a podAgent) Dir(string) (string, error)               { return a.dir, nil }
func (podAgent) Started(string, int)                        {}
func (podAgent) Usage(string) (*gpupoolv1.LeaseUsage, bool) { return nil, false }
func (podAgent) Sandbox(string, *exec.Cmd) error            { return nil }
func (podAgent) Listens(string, int) bool                   { return true }

func TestExecWithoutALeaseIDRunsOnThePodsLeaseWithoutABroker(t *testing.T) {
	base := t.TempDir()
	cert, fp, err := dataplane.LoadOrCreateCert(filepath.Join(base, "tls"))
	if err != nil {
		t.Fatal(err)
	}
	agent := podAgent{dir: base}
	srv, err := dataplane.NewServer(dataplane.ServerConfig{Addr: "127.0.0.1:0", Cert: cert, Auth: agent, Leases: agent,
		Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ctx) }()
	t.Cleanup(func() { cancel(); <-served })

	path := filepath.Join(base, "token.json")
	if err := client.WriteTokenFile(path, &client.TokenFile{Leases: []client.TokenFileLease{
		{LeaseID: "l-1", Tokens: []*gpupoolv1.HostToken{{Host: "h1", Token: "tok", Address: srv.Addr().String(), CertSha256: fp}}},
	}}); err != nil {
		t.Fatal(err)
	}
	t.Setenv(client.TokenFileEnv, path)
	// runOffline points --addr where no broker listens: exec must not
	// need one.
	code, stdout, stderr := runOffline(t, "exec", "--", "sh", "-c", "echo on $GPUPOOL_LEASE_ID; exit 3")
	if code != 3 || stdout != "on l-1\n" {
		t.Fatalf("exit %d, stdout %q (stderr %q); want 3 and the remote output", code, stdout, stderr)
	}
}
