package broker

import (
	"context"
	"crypto/tls"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/gpupool/gpupool/client"
	"github.com/gpupool/gpupool/internal/pki"
	"github.com/gpupool/gpupool/internal/pki/pkitest"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// logLines collects a server's log messages with their errors, so that a
// test can wait for one.
type logLines struct {
	mu    sync.Mutex
	lines []string
}

func (l *logLines) Enabled(context.Context, slog.Level) bool { return true }
func (l *logLines) Handle(_ context.Context, r slog.Record) error {
	line := r.Message
	r.Attrs(func(a slog.Attr) bool {
		line += " " + a.Key + "=" + a.Value.String()
		return true
	})
	l.mu.Lock()
	defer l.mu.Unlock()
	l.lines = append(l.lines, line)
	return nil
}
func (l *logLines) WithAttrs([]slog.Attr) slog.Handler { return l }
func (l *logLines) WithGroup(string) slog.Handler      { return l }

func (l *logLines) contains(s string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, line := range l.lines {
		if strings.Contains(line, s) {
			return true
		}
	}
	return false
}

// startTLSServer starts an in-process broker that serves with src; join
// empty forms a single-server cluster.
func startTLSServer(t *testing.T, src *pki.Source, logs *logLines, join ...string) *Server {
	t.Helper()
	cfg := Config{DataDir: t.TempDir(), BindAddr: "127.0.0.1:0", RaftBindAddr: "127.0.0.1:0", TLS: src, Join: join}
	if len(join) == 0 {
		cfg.BootstrapExpect = 1
	}
	if logs != nil {
		cfg.Logger = slog.New(logs)
	}
	s, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Shutdown() })
	return s
}

func raftServers(t *testing.T, s *Server) int {
	t.Helper()
	f := s.raft.GetConfiguration()
	if err := f.Error(); err != nil {
		t.Fatal(err)
	}
	return len(f.Configuration().Servers)
}

func TestTLSBrokersFormAClusterOverRaftAndGRPC(t *testing.T) {
	ca := pkitest.NewCA(t)
	first := startTLSServer(t, pkitest.Source(t, ca.Issue(t, "broker-1", pki.RoleBroker, "127.0.0.1")), nil)
	waitFor(t, "leadership", first.IsLeader)
	second := startTLSServer(t, pkitest.Source(t, ca.Issue(t, "broker-2", pki.RoleBroker, "127.0.0.1")), nil, first.Addr())
	// The joiner has the leader's state: Raft replicated it over TLS.
	waitFor(t, "the second server to replicate the log", func() bool {
		return raftServers(t, first) == 2 && second.fsm.State().Server(second.ID()) != nil
	})

	// A client write on the follower is forwarded to the leader over TLS.
	c, err := client.DialWith([]string{second.Addr()}, client.Options{TLS: pkitest.Source(t, ca.Issue(t, "alice", pki.RoleClient)).ClientConfig()})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Operator.RotateSigningKey(ctx(t), &gpupoolv1.RotateSigningKeyRequest{}); err != nil {
		t.Fatalf("forwarded write: %v", err)
	}
}

func TestTLSBrokerOfAnotherCACannotJoin(t *testing.T) {
	ca := pkitest.NewCA(t)
	other := pkitest.NewCA(t)
	leader := startTLSServer(t, pkitest.Source(t, ca.Issue(t, "broker-1", pki.RoleBroker, "127.0.0.1")), nil)
	waitFor(t, "leadership", leader.IsLeader)

	// It trusts only its own CA: it refuses the cluster's certificate.
	logs := &logLines{}
	startTLSServer(t, pkitest.Source(t, other.Issue(t, "intruder", pki.RoleBroker, "127.0.0.1")), logs, leader.Addr())
	waitFor(t, "the intruder to fail the handshake", func() bool { return logs.contains("certificate signed by unknown authority") })
	if n := raftServers(t, leader); n != 1 {
		t.Fatalf("the cluster has %d servers, want 1", n)
	}

	// Its Raft transport cannot reach the cluster's either, in both
	// directions: it does not trust the cluster, and the cluster does not
	// trust it.
	intruder := pkitest.Source(t, other.Issue(t, "intruder-raft", pki.RoleBroker, "127.0.0.1"))
	stream := &tlsStreamLayer{src: intruder}
	_, err := stream.Dial(leader.transport.LocalAddr(), 5*time.Second)
	if err == nil || !strings.Contains(err.Error(), "certificate signed by unknown authority") {
		t.Fatalf("raft dial from another CA: got %v, want unknown authority", err)
	}
	trusting := intruder.PeerConfig()
	trusting.RootCAs = pkitest.Source(t, ca.Issue(t, "x", pki.RoleClient)).ClientConfig().RootCAs
	if err := raftHandshake(string(leader.transport.LocalAddr()), trusting); err == nil || !strings.Contains(err.Error(), "unknown certificate authority") {
		t.Fatalf("raft from a certificate of another CA: got %v, want unknown certificate authority", err)
	}
}

// raftHandshake dials a Raft address with cfg and returns the handshake's
// error.
func raftHandshake(addr string, cfg *tls.Config) error {
	conn, err := tls.Dial("tcp", addr, cfg)
	if err != nil {
		return err
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(5 * time.Second))
	_, err = conn.Read(make([]byte, 1))
	return err
}

func TestTLSRaftAcceptsOnlyBrokerCertificates(t *testing.T) {
	ca := pkitest.NewCA(t)
	s := startTLSServer(t, pkitest.Source(t, ca.Issue(t, "broker-1", pki.RoleBroker, "127.0.0.1")), nil)
	for _, role := range []pki.Role{pki.RoleClient, pki.RoleAgent} {
		cfg := pkitest.Source(t, ca.Issue(t, "not-a-broker-"+string(role), role)).PeerConfig()
		if err := raftHandshake(string(s.transport.LocalAddr()), cfg); err == nil || !strings.Contains(err.Error(), "bad certificate") {
			t.Errorf("raft from a %s certificate: got %v, want bad certificate", role, err)
		}
	}
	var _ raft.StreamLayer = (*tlsStreamLayer)(nil)
}

func TestTLSClientsWithoutAGoodCertificateAreRefused(t *testing.T) {
	ca := pkitest.NewCA(t)
	other := pkitest.NewCA(t)
	s := startTLSServer(t, pkitest.Source(t, ca.Issue(t, "broker-1", pki.RoleBroker, "127.0.0.1")), nil)
	waitFor(t, "leadership", s.IsLeader)
	good := pkitest.Source(t, ca.Issue(t, "alice", pki.RoleClient)).ClientConfig()
	now := time.Now()
	expired, err := tls.LoadX509KeyPair(func() (string, string) {
		f := ca.IssueRequest(t, pki.Request{Name: "old", Role: pki.RoleClient, NotBefore: now.Add(-2 * time.Hour), NotAfter: now.Add(-time.Hour)})
		return f.Cert, f.Key
	}())
	if err != nil {
		t.Fatal(err)
	}
	foreign := pkitest.Source(t, other.Issue(t, "mallory", pki.RoleClient)).ClientConfig()
	tests := []struct {
		name string
		tls  *tls.Config // nil: plaintext
		want string
	}{
		{"a client of the CA is served", good, ""},
		{"a plaintext client", nil, "this client dials without TLS"},
		{"a client without a certificate", &tls.Config{RootCAs: good.RootCAs, GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
			return &tls.Certificate{}, nil
		}}, "handshake failure"},
		{"a client that does not trust the CA", foreign, "certificate signed by unknown authority"},
		{"a client with a certificate of another CA", &tls.Config{RootCAs: good.RootCAs, GetClientCertificate: foreign.GetClientCertificate}, "unknown certificate authority"},
		{"a client with an expired certificate", &tls.Config{RootCAs: good.RootCAs, Certificates: []tls.Certificate{expired}}, "expired certificate"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := client.DialWith([]string{s.Addr()}, client.Options{TLS: tt.tls})
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			cctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
			defer cancel()
			_, err = c.Pool.Status(cctx, &gpupoolv1.StatusRequest{})
			if tt.want == "" && err != nil {
				t.Fatalf("got %v, want served", err)
			}
			if tt.want != "" && (err == nil || !strings.Contains(err.Error(), tt.want)) {
				t.Fatalf("got %v, want an error containing %q", err, tt.want)
			}
		})
	}
}

func TestTLSDialRefusesTLSWithoutAClientCertificate(t *testing.T) {
	_, err := client.DialWith([]string{"127.0.0.1:1"}, client.Options{TLS: &tls.Config{}})
	if !errors.Is(err, client.ErrNoClientCert) {
		t.Fatalf("got %v, want ErrNoClientCert", err)
	}
}

func TestTLSServicesOfServersAndAgentsNeedTheirRole(t *testing.T) {
	ca := pkitest.NewCA(t)
	s := startTLSServer(t, pkitest.Source(t, ca.Issue(t, "broker-1", pki.RoleBroker, "127.0.0.1")), nil)
	waitFor(t, "leadership", s.IsLeader)
	dial := func(role pki.Role) *client.Client {
		c, err := client.DialWith([]string{s.Addr()}, client.Options{TLS: pkitest.Source(t, ca.Issue(t, "a-"+string(role), role)).ClientConfig()})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	cl, agent := dial(pki.RoleClient), dial(pki.RoleAgent)
	join := &gpupoolv1.JoinRequest{Id: "evil", RaftAddress: "127.0.0.1:1", RpcAddress: "127.0.0.1:1"}
	_, err := gpupoolv1.NewClusterServiceClient(cl.Conn()).Join(ctx(t), join)
	if status.Code(err) != codes.PermissionDenied || !strings.Contains(err.Error(), "role client") {
		t.Errorf("a client joining a server: got %v, want PermissionDenied naming the role", err)
	}
	_, err = cl.Agent.Register(ctx(t), &gpupoolv1.RegisterRequest{Host: &gpupoolv1.Host{Id: "h1"}})
	if status.Code(err) != codes.PermissionDenied {
		t.Errorf("a client registering a host: got %v, want PermissionDenied", err)
	}
	if _, err := agent.Agent.Register(ctx(t), &gpupoolv1.RegisterRequest{Host: &gpupoolv1.Host{Id: "h1", Address: "127.0.0.1:1"}}); err != nil {
		t.Errorf("an agent registering: %v", err)
	}
	if _, err := agent.Pool.Status(ctx(t), &gpupoolv1.StatusRequest{}); err != nil {
		t.Errorf("an agent reading the pool: %v", err)
	}
}
