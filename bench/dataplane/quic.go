package dataplanebench

import (
	"context"
	"crypto/tls"
	"errors"
	"io"
	"os"
	"os/exec"

	"github.com/gpupool/gpupool/dataplane"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// The one lease the benchmark's agent serves, and its token.
const (
	benchLease = "bench-lease"
	benchToken = "bench-token"
)

// quicSide is the data plane under test: a real dataplane.Server, whose
// Authorizer and Leases are fakes for one lease, and a dataplane.Conn to
// it.
type quicSide struct {
	conn   *dataplane.Conn
	stop   context.CancelFunc
	served chan error // receives what Serve returned
}

// startQUIC starts a dataplane.Server on a free loopback port, serving
// benchLease with dir (which it creates) as its lease directory, and dials
// it.
func startQUIC(ctx context.Context, cert tls.Certificate, certSHA256, dir string) (*quicSide, error) {
	if err := os.Mkdir(dir, 0o755); err != nil {
		return nil, err
	}
	srv, err := dataplane.NewServer(dataplane.ServerConfig{
		Addr:   "127.0.0.1:0",
		Cert:   cert,
		Auth:   tokenAuth{},
		Leases: &oneLease{dir: dir},
	})
	if err != nil {
		return nil, err
	}
	serveCtx, stop := context.WithCancel(context.Background())
	s := &quicSide{stop: stop, served: make(chan error, 1)}
	go func() { s.served <- srv.Serve(serveCtx) }()
	s.conn, err = dataplane.Dial(ctx, srv.Addr().String(), certSHA256)
	if err != nil {
		stop()
		<-s.served
		return nil, err
	}
	return s, nil
}

func (s *quicSide) name() string { return "QUIC (ours)" }

func (s *quicSide) does() string {
	return "dataplane.Conn on one QUIC connection (quic-go, TLS 1.3 inside QUIC), one stream per operation, " +
		"each opened with the token and accepted by a real dataplane.Server before data flows. " +
		"Put: 64 KiB protobuf DataChunk frames, SHA-256 on both ends; the agent writes a temporary file " +
		"in the lease directory (os.Root), then chmods, fsyncs, renames it and fsyncs the directory. " +
		"Get: the agent streams the file in 64 KiB chunks with a SHA-256 at the end, checked by the client. " +
		"Exec: the agent starts the process in its own process group with stdin/stdout/stderr pipes, " +
		"relays them and sends the exit status."
}

func (s *quicSide) put(ctx context.Context, r io.Reader, size int64, name string) (string, error) {
	return s.conn.Put(ctx, benchToken, r, size, name, 0o644)
}

func (s *quicSide) get(ctx context.Context, name string, w io.Writer) (string, error) {
	return s.conn.Get(ctx, benchToken, name, w)
}

func (s *quicSide) exec(ctx context.Context, argv []string) (int, error) {
	st, err := s.conn.Exec(ctx, benchToken, &gpupoolv1.ExecStart{Argv: argv}, dataplane.ExecIO{})
	return st.Code, err
}

func (s *quicSide) close() error {
	s.conn.Close()
	s.stop()
	return <-s.served
}

// tokenAuth accepts benchToken, for benchLease, and nothing else.
type tokenAuth struct{}

func (tokenAuth) Authorize(token string) (string, error) {
	if token != benchToken {
		return "", errors.New("not the benchmark's token")
	}
	return benchLease, nil
}

// oneLease is the agent's view of benchLease, enforced throughout, with
// dir as its directory.
type oneLease struct {
	dir string
}

func (l *oneLease) Env(leaseID string) ([]string, bool) {
	return []string{"GPUPOOL_LEASE_ID=" + leaseID}, leaseID == benchLease
}

func (l *oneLease) Dir(leaseID string) (string, error) {
	if leaseID != benchLease {
		return "", errors.New("no such lease: " + leaseID)
	}
	return l.dir, nil
}

// Started does nothing: the benchmark has no watchdog.
func (l *oneLease) Started(string, int) {}

func (l *oneLease) Sandbox(string, *exec.Cmd) error { return nil }
func (l *oneLease) Listens(string, int) bool        { return true }

func (l *oneLease) Usage(leaseID string) (*gpupoolv1.LeaseUsage, bool) {
	return &gpupoolv1.LeaseUsage{LeaseId: leaseID}, leaseID == benchLease
}
