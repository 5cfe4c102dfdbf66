package cluster_test

import (
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/gpupool/gpupool/internal/pki"
	"github.com/gpupool/gpupool/internal/pki/pkitest"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// bundle writes a CA file that trusts the cluster's CA and other's, so
// that a certificate of other passes the CLI's own check and reaches the
// brokers, which must refuse it.
func bundle(t *testing.T, cl *cluster, other *pkitest.CA) string {
	t.Helper()
	var b []byte
	for _, f := range []string{filepath.Join(cl.ca.Dir, pki.CACertFile), filepath.Join(other.Dir, pki.CACertFile)} {
		pemBytes, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		b = append(b, pemBytes...)
	}
	path := filepath.Join(t.TempDir(), "bundle.pem")
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

// logContains polls p's log until it contains s.
func logContains(t *testing.T, p *proc, s string) {
	t.Helper()
	eventually(t, fmt.Sprintf("%s to log %q", p.name, s), 30*time.Second, func() error {
		b, err := os.ReadFile(p.log.Name())
		if err != nil {
			return err
		}
		if !strings.Contains(string(b), s) {
			return fmt.Errorf("not yet")
		}
		return nil
	})
}

func TestTLSClusterRefusesStrangersAndServesRotatedCertificates(t *testing.T) {
	if testing.Short() {
		t.Skip("starts real processes")
	}
	cl := newCluster(t, 1, withTLS)
	addr := "--addr=" + strings.Join(cl.addrs, ",")
	other := pkitest.NewCA(t)
	foreignCA := bundle(t, cl, other)

	t.Run("a client of the CA is served", func(t *testing.T) {
		out, stderr, code := gpupool(t, append([]string{"host", "ls", addr}, cl.clientFlags()...)...)
		if code != 0 || !strings.Contains(out, "host-1") {
			t.Fatalf("exit %d, stdout %q, stderr %q; want host-1 listed", code, out, stderr)
		}
	})

	t.Run("a plaintext client is told to use TLS", func(t *testing.T) {
		_, stderr, code := gpupool(t, "status", addr, "--timeout", "5s")
		if code != 1 || !strings.Contains(stderr, "without TLS") || !strings.Contains(stderr, "--tls-ca") {
			t.Fatalf("exit %d, stderr %q; want exit 1 naming TLS and --tls-ca", code, stderr)
		}
	})

	t.Run("a client with a certificate of another CA is refused by the brokers", func(t *testing.T) {
		mallory := other.Issue(t, "mallory", pki.RoleClient)
		_, stderr, code := gpupool(t, "status", addr, "--timeout", "5s", "--tls-ca", foreignCA, "--tls-cert", mallory.Cert, "--tls-key", mallory.Key)
		if code != 1 || !strings.Contains(stderr, "unknown certificate authority") {
			t.Fatalf("exit %d, stderr %q; want exit 1 and unknown certificate authority", code, stderr)
		}
	})

	t.Run("a client that does not trust the brokers' CA refuses them", func(t *testing.T) {
		mallory := other.Issue(t, "mallory2", pki.RoleClient)
		_, stderr, code := gpupool(t, "status", addr, "--timeout", "5s", "--tls-ca", mallory.CA, "--tls-cert", mallory.Cert, "--tls-key", mallory.Key)
		if code != 1 || !strings.Contains(stderr, "certificate signed by unknown authority") {
			t.Fatalf("exit %d, stderr %q; want exit 1 and certificate signed by unknown authority", code, stderr)
		}
	})

	t.Run("an expired client certificate is refused before dialing", func(t *testing.T) {
		old := cl.ca.IssueRequest(t, pki.Request{Name: "old", Role: pki.RoleClient, NotBefore: time.Now().Add(-2 * time.Hour), NotAfter: time.Now().Add(-time.Hour)})
		_, stderr, code := gpupool(t, "status", addr, "--tls-ca", old.CA, "--tls-cert", old.Cert, "--tls-key", old.Key)
		if code != 2 || !strings.Contains(stderr, "expired") || !strings.Contains(stderr, "--tls-cert") {
			t.Fatalf("exit %d, stderr %q; want exit 2 naming --tls-cert and the expiry", code, stderr)
		}
	})

	t.Run("an agent with a certificate of another CA cannot register", func(t *testing.T) {
		f := other.IssueRequest(t, pki.Request{Name: "host-x", Role: pki.RoleAgent, HostID: "host-x", NotBefore: time.Now().Add(-time.Minute), NotAfter: time.Now().Add(time.Hour)})
		p := cl.newProc("host-x", "agent", "--broker", strings.Join(cl.addrs, ","), "--simulate", "1xA100-80GB", "--data-dir", filepath.Join(cl.dir, "host-x"),
			"--data-bind", "127.0.0.1:0", "--tls-ca", foreignCA, "--tls-cert", f.Cert, "--tls-key", f.Key)
		cl.agents = append(cl.agents, p) // stopped with the cluster
		p.start(t)
		logContains(t, p, "unknown certificate authority")
		if _, err := cl.c.Pool.GetHost(ctxFor(t, 5*time.Second), &gpupoolv1.GetHostRequest{HostId: "host-x"}); err == nil {
			t.Fatal("host-x registered with a certificate of another CA")
		}
	})

	t.Run("a broker of another CA cannot join the Raft cluster", func(t *testing.T) {
		f := other.Issue(t, "broker-x", pki.RoleBroker, "127.0.0.1")
		p := cl.newProc("broker-x", "broker", "--data-dir", filepath.Join(cl.dir, "broker-x"), "--bind", freePort(t, "127.0.0.1"),
			"--join", strings.Join(cl.addrs, ","), "--log-level", "debug", "--tls-ca", f.CA, "--tls-cert", f.Cert, "--tls-key", f.Key)
		cl.agents = append(cl.agents, p)
		p.start(t)
		logContains(t, p, "certificate signed by unknown authority")
		out, stderr, code := gpupool(t, append([]string{"operator", "raft", "peers", addr, "-o", "json"}, cl.clientFlags()...)...)
		if code != 0 {
			t.Fatalf("raft peers: exit %d: %s", code, stderr)
		}
		var peers struct{ Peers []map[string]any }
		if err := json.Unmarshal([]byte(out), &peers); err != nil {
			t.Fatalf("%v: %s", err, out)
		}
		if len(peers.Peers) != 3 {
			t.Fatalf("the cluster has %d Raft peers, want 3: %s", len(peers.Peers), out)
		}
	})

	t.Run("a rotated broker certificate is served without a restart", func(t *testing.T) {
		serial := func() string {
			src := pkitest.Source(t, cl.clientFiles())
			cfg := src.ClientConfig()
			cfg.ServerName = "127.0.0.2"
			conn, err := tls.DialWithDialer(&net.Dialer{Timeout: 5 * time.Second}, "tcp", cl.addrs[0], cfg)
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			return conn.ConnectionState().PeerCertificates[0].SerialNumber.String()
		}
		before := serial()
		cl.security("broker-1", pki.RoleBroker) // issues broker-1's certificate again, into the same files
		certPath, _ := pki.KeyPairPaths(cl.ca.Dir, "broker-1")
		b, err := os.ReadFile(certPath)
		if err != nil {
			t.Fatal(err)
		}
		blk, _ := pem.Decode(b)
		cert, err := x509.ParseCertificate(blk.Bytes)
		if err != nil {
			t.Fatal(err)
		}
		want := cert.SerialNumber.String()
		if want == before {
			t.Fatal("the new certificate has the old serial")
		}
		eventually(t, "broker-1 to serve its new certificate", 10*time.Second, func() error {
			if got := serial(); got != want {
				return fmt.Errorf("serves serial %s, want %s", got, want)
			}
			return nil
		})
		if !cl.brokers[0].running() {
			t.Fatal("broker-1 restarted")
		}
		// The cluster still works with it.
		if _, err := cl.c.Lease.Acquire(ctxFor(t, 30*time.Second), fractional(1024, 5, "after-rotation")); err != nil {
			t.Fatalf("acquire after rotation: %v", err)
		}
	})
}
