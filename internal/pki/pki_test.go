package pki_test

import (
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/gpupool/gpupool/internal/pki"
	"github.com/gpupool/gpupool/internal/pki/pkitest"
)

func parseCert(t *testing.T, path string) *x509.Certificate {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	blk, _ := pem.Decode(b)
	if blk == nil {
		t.Fatalf("%s: no PEM", path)
	}
	c, err := x509.ParseCertificate(blk.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func TestInitCAWritesKeyPrivateAndRefusesToOverwrite(t *testing.T) {
	for _, alg := range pki.Algorithms {
		t.Run(string(alg), func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "ca")
			if _, err := pki.InitCA(dir, alg, "test", time.Now(), time.Hour); err != nil {
				t.Fatal(err)
			}
			fi, err := os.Stat(filepath.Join(dir, pki.CAKeyFile))
			if err != nil {
				t.Fatal(err)
			}
			if fi.Mode().Perm() != 0o600 {
				t.Errorf("CA key mode %v, want 0600", fi.Mode().Perm())
			}
			ca, err := pki.LoadCA(dir)
			if err != nil {
				t.Fatal(err)
			}
			if !ca.Cert.IsCA {
				t.Error("loaded CA certificate is not a CA")
			}
			_, err = pki.InitCA(dir, alg, "test", time.Now(), time.Hour)
			if !errors.Is(err, pki.ErrCAExists) {
				t.Errorf("second init: got %v, want ErrCAExists", err)
			}
		})
	}
}

func TestLoadCAOfEmptyDirSaysHowToCreateOne(t *testing.T) {
	dir := t.TempDir()
	_, err := pki.LoadCA(dir)
	if !errors.Is(err, pki.ErrNoCA) || !strings.Contains(err.Error(), "operator tls init") {
		t.Fatalf("got %v, want ErrNoCA naming 'operator tls init'", err)
	}
}

func TestIssuedCertificatesCarryRoleHostsAndUsage(t *testing.T) {
	ca := pkitest.NewCA(t)
	now := time.Now()
	tests := []struct {
		name    string
		req     pki.Request
		wantEKU []x509.ExtKeyUsage
	}{
		{"a broker serves and dials", pki.Request{Name: "broker-1", Role: pki.RoleBroker, Hosts: []string{"127.0.0.1", "broker-1.example"}},
			[]x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth, x509.ExtKeyUsageServerAuth}},
		{"an agent only dials and is bound to its host", pki.Request{Name: "agent-1", Role: pki.RoleAgent, HostID: "host-1"},
			[]x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}},
		{"a client only dials", pki.Request{Name: "alice", Role: pki.RoleClient},
			[]x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tt.req.NotBefore, tt.req.NotAfter = now, now.Add(time.Hour)
			files := ca.IssueRequest(t, tt.req)
			cert := parseCert(t, files.Cert)
			if !slices.Equal(cert.ExtKeyUsage, tt.wantEKU) {
				t.Errorf("ext key usage %v, want %v", cert.ExtKeyUsage, tt.wantEKU)
			}
			id, err := pki.IdentityOf(cert)
			if err != nil {
				t.Fatal(err)
			}
			want := pki.Identity{Name: tt.req.Name, Role: tt.req.Role, HostID: tt.req.HostID}
			if id != want {
				t.Errorf("identity %+v, want %+v", id, want)
			}
			var hosts []string
			for _, ip := range cert.IPAddresses {
				hosts = append(hosts, ip.String())
			}
			for _, n := range cert.DNSNames {
				if n != pki.BrokerPeerName {
					hosts = append(hosts, n)
				}
			}
			if wantPeer := tt.req.Role == pki.RoleBroker; slices.Contains(cert.DNSNames, pki.BrokerPeerName) != wantPeer {
				t.Errorf("DNS names %v: want %s only on brokers", cert.DNSNames, pki.BrokerPeerName)
			}
			if !slices.Equal(hosts, tt.req.Hosts) {
				t.Errorf("SANs %v, want %v", hosts, tt.req.Hosts)
			}
			fi, err := os.Stat(files.Key)
			if err != nil {
				t.Fatal(err)
			}
			if fi.Mode().Perm() != 0o600 {
				t.Errorf("key mode %v, want 0600", fi.Mode().Perm())
			}
		})
	}
}

func TestIssueRefusesBadRequestsNamingTheField(t *testing.T) {
	ca := pkitest.NewCA(t)
	now := time.Now()
	ok := pki.Request{Name: "b", Role: pki.RoleBroker, Hosts: []string{"127.0.0.1"}, NotBefore: now, NotAfter: now.Add(time.Hour)}
	tests := []struct {
		name   string
		change func(*pki.Request)
		want   string
	}{
		{"an unknown role", func(r *pki.Request) { r.Role = "admin" }, `role "admin": must be one of broker, agent, client`},
		{"a name that is no file name", func(r *pki.Request) { r.Name = "../x" }, `name "../x"`},
		{"a broker without an address", func(r *pki.Request) { r.Hosts = nil }, "host: a broker certificate needs"},
		{"a client with an address", func(r *pki.Request) { r.Role = pki.RoleClient }, "host: only broker certificates"},
		{"a host that is neither IP nor DNS name", func(r *pki.Request) { r.Hosts = []string{"bad host"} }, `host "bad host": must be an IP address or a DNS name`},
		{"a broker bound to a host id", func(r *pki.Request) { r.HostID = "h1" }, "host-id: only agent certificates"},
		{"an empty validity", func(r *pki.Request) { r.NotAfter = r.NotBefore }, "validity"},
		{"a validity beyond the CA's", func(r *pki.Request) { r.NotAfter = now.Add(48 * time.Hour) }, "after the CA itself"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			req := ok
			tt.change(&req)
			_, _, err := ca.CA.Issue(req)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("got %v, want an error containing %q", err, tt.want)
			}
		})
	}
}

func TestNewSourceRefusesUnusableFiles(t *testing.T) {
	ca := pkitest.NewCA(t)
	other := pkitest.NewCA(t)
	good := ca.Issue(t, "c", pki.RoleClient)
	foreign := other.Issue(t, "f", pki.RoleClient)
	now := time.Now()
	expired := ca.IssueRequest(t, pki.Request{Name: "old", Role: pki.RoleClient, NotBefore: now.Add(-2 * time.Hour), NotAfter: now.Add(-time.Hour)})
	otherKey := ca.Issue(t, "d", pki.RoleClient)
	tests := []struct {
		name  string
		files pki.Files
		want  string
	}{
		{"a missing CA file", pki.Files{CA: filepath.Join(t.TempDir(), "none.pem"), Cert: good.Cert, Key: good.Key}, "tls-ca"},
		{"a certificate of another CA", pki.Files{CA: good.CA, Cert: foreign.Cert, Key: foreign.Key}, "certificate signed by unknown authority"},
		{"an expired certificate", expired, "expired"},
		{"a key of another certificate", pki.Files{CA: good.CA, Cert: good.Cert, Key: otherKey.Key}, "private key does not match"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := pki.NewSource(tt.files, nil)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("got %v, want an error containing %q", err, tt.want)
			}
		})
	}
}

// tlsServer accepts TLS connections with cfg and answers each handshake
// that succeeds with one byte, then waits for the client to hang up.
func tlsServer(t *testing.T, cfg *tls.Config) string {
	t.Helper()
	l, err := tls.Listen("tcp", "127.0.0.1:0", cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				if c.(*tls.Conn).Handshake() == nil {
					c.Write([]byte("k"))
					io.Copy(io.Discard, c) // until the client hangs up
				}
			}()
		}
	}()
	return l.Addr().String()
}

// handshake dials addr and returns the server's certificate, or why the
// connection failed on either side.
func handshake(addr string, cfg *tls.Config) (*x509.Certificate, error) {
	cfg = cfg.Clone()
	cfg.ServerName = "127.0.0.1"
	c, err := tls.DialWithDialer(&net.Dialer{Timeout: 5 * time.Second}, "tcp", addr, cfg)
	if err != nil {
		return nil, err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Read(make([]byte, 1)); err != nil {
		return nil, err
	}
	return c.ConnectionState().PeerCertificates[0], nil
}

func staticClient(t *testing.T, files pki.Files, withCert bool) *tls.Config {
	t.Helper()
	pool := x509.NewCertPool()
	b, err := os.ReadFile(files.CA)
	if err != nil {
		t.Fatal(err)
	}
	pool.AppendCertsFromPEM(b)
	cfg := &tls.Config{RootCAs: pool}
	if withCert {
		pair, err := tls.LoadX509KeyPair(files.Cert, files.Key)
		if err != nil {
			t.Fatal(err)
		}
		cfg.Certificates = []tls.Certificate{pair}
	}
	return cfg
}

func TestServerRefusesPeersWithoutAGoodCertificate(t *testing.T) {
	for _, alg := range pki.Algorithms {
		t.Run(string(alg), func(t *testing.T) { testServerRefuses(t, alg) })
	}
}

func testServerRefuses(t *testing.T, alg pki.Algorithm) {
	ca := pkitest.NewCAWith(t, alg)
	other := pkitest.NewCAWith(t, alg)
	server := pkitest.Source(t, ca.Issue(t, "broker-1", pki.RoleBroker, "127.0.0.1"))
	addr := tlsServer(t, server.ServerConfig(pki.RoleBroker, pki.RoleClient))
	now := time.Now()
	good := ca.Issue(t, "alice", pki.RoleClient)
	tests := []struct {
		name string
		cfg  *tls.Config
		want string // "" accepts
	}{
		{"a client of the CA is accepted", pkitest.Source(t, good).ClientConfig(), ""},
		{"a client without a certificate is refused", staticClient(t, good, false), "handshake failure"},
		{"a client of another CA is refused", func() *tls.Config {
			c := staticClient(t, other.Issue(t, "mallory", pki.RoleClient), true)
			c.RootCAs = staticClient(t, good, false).RootCAs
			return c
		}(), "unknown certificate authority"},
		{"an expired client certificate is refused", staticClient(t, ca.IssueRequest(t, pki.Request{
			Name: "old", Role: pki.RoleClient, NotBefore: now.Add(-2 * time.Hour), NotAfter: now.Add(-time.Hour)}), true), "expired certificate"},
		{"an agent is refused where only brokers and clients may connect", pkitest.Source(t, ca.Issue(t, "agent-1", pki.RoleAgent)).ClientConfig(), "bad certificate"},
		{"a client that does not trust the CA refuses the server", pkitest.Source(t, other.Issue(t, "eve", pki.RoleClient)).ClientConfig(), "certificate signed by unknown authority"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := handshake(addr, tt.cfg)
			switch {
			case tt.want == "" && err != nil:
				t.Fatalf("got %v, want accepted", err)
			case tt.want != "" && (err == nil || !strings.Contains(err.Error(), tt.want)):
				t.Fatalf("got %v, want an error containing %q", err, tt.want)
			}
		})
	}
}

func TestClientRefusesAServerThatIsNoBroker(t *testing.T) {
	ca := pkitest.NewCA(t)
	files := ca.Issue(t, "b", pki.RoleBroker, "127.0.0.1")
	server := pkitest.Source(t, files)
	addr := tlsServer(t, server.ServerConfig())
	if _, err := handshake(addr, pkitest.Source(t, ca.Issue(t, "alice", pki.RoleClient)).ClientConfig()); err != nil {
		t.Fatalf("a broker: %v", err)
	}
	// A client certificate names no address (and has no server auth
	// usage): a client cannot pose as a broker.
	fake := pkitest.Source(t, ca.Issue(t, "mallory", pki.RoleClient))
	addr = tlsServer(t, fake.ServerConfig())
	_, err := handshake(addr, pkitest.Source(t, ca.Issue(t, "bob", pki.RoleClient)).ClientConfig())
	if err == nil || !strings.Contains(err.Error(), "x509: cannot validate certificate for 127.0.0.1") {
		t.Fatalf("a client posing as a broker: got %v, want a certificate validation error", err)
	}
}

func TestRotatedCertificateIsServedWithoutRestart(t *testing.T) {
	ca := pkitest.NewCA(t)
	files := ca.Issue(t, "broker-1", pki.RoleBroker, "127.0.0.1")
	server := pkitest.Source(t, files)
	addr := tlsServer(t, server.ServerConfig())
	client := pkitest.Source(t, ca.Issue(t, "alice", pki.RoleClient)).ClientConfig()

	first, err := handshake(addr, client)
	if err != nil {
		t.Fatal(err)
	}

	// A half-done rotation: the new certificate with the old key. The
	// server keeps serving the old certificate.
	now := time.Now()
	certPEM, keyPEM, err := ca.CA.Issue(pki.Request{Name: "broker-1", Role: pki.RoleBroker, Hosts: []string{"127.0.0.1"}, NotBefore: now.Add(-time.Minute), NotAfter: now.Add(2 * time.Hour)})
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(files.Cert, certPEM, 0o644); err != nil {
		t.Fatal(err)
	}
	got, err := handshake(addr, client)
	if err != nil {
		t.Fatalf("during a half-done rotation: %v", err)
	}
	if got.SerialNumber.Cmp(first.SerialNumber) != 0 {
		t.Fatalf("during a half-done rotation the server served serial %v, want the old %v", got.SerialNumber, first.SerialNumber)
	}

	// The key follows: from the next handshake on, the new certificate.
	if err := os.WriteFile(files.Key, keyPEM, 0o600); err != nil {
		t.Fatal(err)
	}
	want := parseCert(t, files.Cert)
	deadline := time.Now().Add(5 * time.Second)
	for {
		got, err = handshake(addr, client)
		if err == nil && got.SerialNumber.Cmp(want.SerialNumber) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after rotation the server still serves serial %v (err %v), want %v", got.SerialNumber, err, want.SerialNumber)
		}
	}
	if server.NotAfter().Equal(first.NotAfter) {
		t.Errorf("source NotAfter %v did not change", server.NotAfter())
	}
}
