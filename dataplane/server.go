package dataplane

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os/exec"
	"sync"
	"time"

	"github.com/quic-go/quic-go"
	"google.golang.org/protobuf/proto"

	"github.com/gpupool/gpupool/internal/limits"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// Authorizer checks lease tokens for the agent.
type Authorizer interface {
	// Authorize checks a token: signature, expiry, host, fencing, and that
	// the lease is enforced on this host. It returns the lease's id, or an
	// error whose message says why the token is refused; the client sees
	// that message with UNAUTHENTICATED.
	Authorize(token string) (leaseID string, err error)
}

// Leases is what the server needs from the agent about authorized leases.
// Its methods are called concurrently.
type Leases interface {
	// Env is the environment a process of the lease runs with
	// (GPUPOOL_LEASE_ID, CUDA_VISIBLE_DEVICES, MPS limits), as KEY=VALUE
	// entries. It returns false once the lease is no longer enforced on
	// this host; the server then refuses new streams of the lease.
	Env(leaseID string) ([]string, bool)
	// Dir is the lease's working directory, which the agent created.
	Dir(leaseID string) (string, error)
	// Started registers a process the server started for the lease, so
	// that the watchdog tracks it and teardown stops it. The process is
	// the leader of its own process group.
	Started(leaseID string, pid int)
	// Usage returns the lease's current usage, or false once the lease is
	// no longer enforced on this host. The server only reads the message,
	// possibly after Usage returns, so it must not be modified afterwards.
	Usage(leaseID string) (*gpupoolv1.LeaseUsage, bool)
	// Sandbox makes cmd, which exec built for the lease (absolute Path,
	// Dir in the lease's directory, a process group of its own), run in
	// the lease's sandbox, or says why it may not run at all; the client
	// sees that message with PERMISSION_DENIED.
	Sandbox(leaseID string, cmd *exec.Cmd) error
	// Listens reports whether a process of the lease listens on the TCP
	// port of the pool host's loopback: forward reaches nothing else.
	Listens(leaseID string, port int) bool
}

// ServerConfig configures a Server.
type ServerConfig struct {
	// Addr is the UDP address to listen on, e.g. ":7443"; port 0 picks a
	// free one (see Server.Addr).
	Addr string
	// Cert is the agent's certificate (see LoadOrCreateCert). Clients pin
	// the SHA-256 of its DER.
	Cert tls.Certificate
	// Auth checks the token of every stream.
	Auth Authorizer
	// Leases tells the server about the leases Auth lets in.
	Leases Leases
	// Logger receives the server's logs; nil discards them.
	Logger *slog.Logger
	// MaxStreamsPerConn bounds the operations one connection runs at once;
	// 0 means 64.
	MaxStreamsPerConn int
	// Limits bounds what one client may make the server do; nil is
	// DefaultLimits.
	Limits *Limits
	// LimitSet counts the refusals of Limits (for the agent's /metrics);
	// nil counts them in a set of the server's own.
	LimitSet *limits.Set
	// CudaServer is the command line of a lease's CUDA server, which the
	// cuda operation starts on the lease's first cuda stream and Revoke
	// stops; nil refuses cuda streams (NOT_FOUND).
	CudaServer CudaServerFunc
}

const (
	defaultMaxStreams = 64
	// openTimeout is how long a new stream may take to send its StreamOpen.
	openTimeout = 10 * time.Second
	// chunkSize is the most data a DataChunk or an exec output frame
	// carries; the receiver's MaxFrame is the hard limit.
	chunkSize = 64 << 10
)

// Server is the agent's end of the data plane. It serves every client
// connection on one UDP socket and runs each stream's operation for the
// lease its token names.
type Server struct {
	auth   Authorizer
	leases Leases
	log    *slog.Logger
	udp    *net.UDPConn
	tr     *quic.Transport
	ln     *quic.Listener

	connRate     *limits.RateLimiter
	clientConns  *limits.Concurrency
	leaseStreams *limits.Concurrency

	mu      sync.Mutex
	conns   map[*quic.Conn]struct{}               // guarded by mu
	byLease map[string]map[*serverStream]struct{} // guarded by mu

	cuda cudaServers

	wg sync.WaitGroup // connections and streams being served
}

// NewServer listens on cfg.Addr. Serve serves the connections.
func NewServer(cfg ServerConfig) (*Server, error) {
	switch {
	case cfg.Auth == nil:
		return nil, errors.New("dataplane: ServerConfig.Auth: must be set")
	case cfg.Leases == nil:
		return nil, errors.New("dataplane: ServerConfig.Leases: must be set")
	case len(cfg.Cert.Certificate) == 0:
		return nil, errors.New("dataplane: ServerConfig.Cert: must hold a certificate (see LoadOrCreateCert)")
	case cfg.MaxStreamsPerConn < 0:
		return nil, fmt.Errorf("dataplane: ServerConfig.MaxStreamsPerConn %d: must be 0 (the default, %d) or more", cfg.MaxStreamsPerConn, defaultMaxStreams)
	}
	lim := DefaultLimits()
	if cfg.Limits != nil {
		lim = *cfg.Limits
	}
	if err := lim.Validate(); err != nil {
		return nil, err
	}
	set := cfg.LimitSet
	if set == nil {
		set = limits.NewSet(nil)
	}
	maxStreams := cfg.MaxStreamsPerConn
	if maxStreams == 0 {
		maxStreams = defaultMaxStreams
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	addr, err := net.ResolveUDPAddr("udp", cfg.Addr)
	if err != nil {
		return nil, fmt.Errorf("dataplane: ServerConfig.Addr %q: %w", cfg.Addr, err)
	}
	udp, err := net.ListenUDP("udp", addr)
	if err != nil {
		return nil, fmt.Errorf("dataplane: %w", err)
	}
	tr := &quic.Transport{Conn: udp}
	ln, err := tr.Listen(serverTLS(cfg.Cert), quicConfig(true, int64(maxStreams)))
	if err != nil {
		tr.Close()
		udp.Close()
		return nil, fmt.Errorf("dataplane: %w", err)
	}
	return &Server{
		auth:    cfg.Auth,
		leases:  cfg.Leases,
		log:     log.With("component", "dataplane"),
		udp:     udp,
		tr:      tr,
		ln:      ln,
		conns:   make(map[*quic.Conn]struct{}),
		byLease: make(map[string]map[*serverStream]struct{}),
		cuda:    cudaServers{newCmd: cfg.CudaServer},

		connRate:     set.Rate(LimitClientConnRate, FlagClientConnRate, lim.ClientConnRate),
		clientConns:  set.Concurrency(LimitClientConns, FlagClientConns, lim.ClientConns, "connections open at once"),
		leaseStreams: set.Concurrency(LimitLeaseStreams, FlagLeaseStreams, lim.LeaseStreams, "streams open at once"),
	}, nil
}

// Addr is the UDP address the server listens on.
func (s *Server) Addr() net.Addr {
	return s.ln.Addr()
}

// Serve serves connections until ctx is done, then closes every
// connection (clients see ErrAgentShutdown), stops the processes exec
// started and the leases' CUDA servers, closes the socket and returns nil. It returns an error only
// when the socket fails. Call it once.
func (s *Server) Serve(ctx context.Context) error {
	var err error
	for {
		conn, aerr := s.ln.Accept(ctx)
		if aerr != nil {
			if ctx.Err() == nil {
				err = fmt.Errorf("dataplane: accepting connections: %w", aerr)
			}
			break
		}
		release, lerr := s.admit(conn)
		if lerr != nil {
			s.log.Info("connection refused", "remote", conn.RemoteAddr().String(), "err", lerr)
			conn.CloseWithError(connLimited, lerr.Error())
			continue
		}
		s.mu.Lock()
		s.conns[conn] = struct{}{}
		s.mu.Unlock()
		s.wg.Go(func() {
			defer release()
			s.serveConn(conn)
		})
	}
	s.ln.Close()
	s.mu.Lock()
	for conn := range s.conns {
		conn.CloseWithError(connShutdown, "agent shutting down")
	}
	s.mu.Unlock()
	s.wg.Wait()
	s.cuda.shutdown()
	s.tr.Close()
	s.udp.Close()
	return err
}

// Revoke ends the lease on the data plane: it resets every stream of the
// lease at once (clients see ErrLeaseEnded) and stops the processes exec
// started for it and its CUDA server, each process group getting SIGTERM
// and then SIGKILL. It returns when they are gone, or after at most a
// second.
//
// Call it after Leases stops reporting the lease as enforced, so that a
// stream authorized concurrently cannot outlive it.
func (s *Server) Revoke(leaseID string) {
	s.mu.Lock()
	streams := s.byLease[leaseID]
	delete(s.byLease, leaseID)
	s.mu.Unlock()
	var procs []*process
	for st := range streams {
		if p := st.revoke(); p != nil {
			procs = append(procs, p)
		}
	}
	var wg sync.WaitGroup
	for _, p := range procs {
		wg.Go(p.stop)
	}
	cuda := false
	wg.Go(func() { cuda = s.cuda.stop(leaseID) })
	wg.Wait()
	if len(streams) > 0 || cuda {
		s.log.Info("lease revoked", "lease", leaseID, "streams", len(streams), "processes", len(procs), "cuda_server", cuda)
	}
}

func (s *Server) serveConn(conn *quic.Conn) {
	defer func() {
		s.mu.Lock()
		delete(s.conns, conn)
		s.mu.Unlock()
	}()
	for {
		qs, err := conn.AcceptStream(context.Background())
		if err != nil {
			return
		}
		s.wg.Go(func() { s.serveStream(qs) })
	}
}

// serveStream runs the operation of one stream, from its StreamOpen to its
// end.
func (s *Server) serveStream(qs *quic.Stream) {
	ctx, cancel := context.WithCancelCause(context.Background())
	st := &serverStream{
		srv:    s,
		qs:     qs,
		ctx:    ctx,
		cancel: cancel,
		fr:     frameReader{r: qs},
		fw:     frameWriter{w: qs},
		log:    s.log.With("stream", int64(qs.StreamID())),
	}
	defer cancel(nil)
	// Our send direction ends early when the client resets its receive
	// direction or the connection closes: the client is gone.
	stopWatch := context.AfterFunc(qs.Context(), func() {
		if cause := context.Cause(qs.Context()); !errors.Is(cause, quic.ErrStreamClosed) {
			cancel(fmt.Errorf("client gone: %w", cause))
		}
	})
	defer stopWatch()
	defer st.finish()

	var open gpupoolv1.StreamOpen
	qs.SetReadDeadline(time.Now().Add(openTimeout))
	if err := st.fr.read(&open); err != nil {
		if isMalformed(err) {
			st.refuse(refusef(gpupoolv1.AcceptCode_ACCEPT_CODE_INVALID_ARGUMENT, "first frame: %v", err))
		} else {
			st.log.Debug("stream ended before its StreamOpen", "err", err)
		}
		return
	}
	qs.SetReadDeadline(time.Time{})

	leaseID, err := s.auth.Authorize(open.GetToken())
	if err != nil {
		st.log.Info("token refused", "err", err)
		st.refuse(refusef(gpupoolv1.AcceptCode_ACCEPT_CODE_UNAUTHENTICATED, "%v", err))
		return
	}
	st.leaseID = leaseID
	st.log = st.log.With("lease", leaseID)
	release, lerr := s.leaseStreams.Acquire(leaseID, "lease "+leaseID)
	if lerr != nil {
		st.log.Info("stream refused", "err", lerr)
		st.refuse(refusef(gpupoolv1.AcceptCode_ACCEPT_CODE_RESOURCE_EXHAUSTED, "%v", lerr))
		return
	}
	defer release()
	s.register(st)
	defer s.unregister(st)
	// After register: a Revoke from now on finds the stream, and one that
	// came before has already made Env report the lease as not enforced.
	if _, ok := s.leases.Env(leaseID); !ok {
		st.refuse(refusef(gpupoolv1.AcceptCode_ACCEPT_CODE_PERMISSION_DENIED, "lease %s is not enforced on this host", leaseID))
		return
	}

	var refused *RefusedError
	switch op := open.GetOp().(type) {
	case *gpupoolv1.StreamOpen_Exec:
		refused = st.exec(op.Exec)
	case *gpupoolv1.StreamOpen_Put:
		refused = st.put(op.Put)
	case *gpupoolv1.StreamOpen_Get:
		refused = st.get(op.Get)
	case *gpupoolv1.StreamOpen_Forward:
		refused = st.forward(op.Forward)
	case *gpupoolv1.StreamOpen_Usage:
		refused = st.usage(op.Usage)
	case *gpupoolv1.StreamOpen_Cuda:
		refused = st.cuda(op.Cuda)
	default:
		refused = refusef(gpupoolv1.AcceptCode_ACCEPT_CODE_INVALID_ARGUMENT, "op: must be one of exec, put, get, forward, usage, cuda")
	}
	if refused != nil {
		st.log.Info("stream refused", "err", refused)
		st.refuse(refused)
	}
}

func (s *Server) register(st *serverStream) {
	s.mu.Lock()
	defer s.mu.Unlock()
	set := s.byLease[st.leaseID]
	if set == nil {
		set = make(map[*serverStream]struct{})
		s.byLease[st.leaseID] = set
	}
	set[st] = struct{}{}
}

func (s *Server) unregister(st *serverStream) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if set := s.byLease[st.leaseID]; set != nil {
		delete(set, st)
		if len(set) == 0 {
			delete(s.byLease, st.leaseID)
		}
	}
}

// serverStream is the server's side of one stream. Its operation handler
// runs on one goroutine and may start helpers; every write to qs goes
// through send or closeSend.
type serverStream struct {
	srv     *Server
	qs      *quic.Stream
	leaseID string // set once authorized, then constant
	log     *slog.Logger
	fr      frameReader // used by one goroutine at a time

	// ctx is canceled, with the cause, when the operation must end early:
	// the lease was revoked, the client is gone or broke the protocol.
	ctx    context.Context
	cancel context.CancelCauseFunc

	wmu        sync.Mutex  // serializes writes and the close of qs's send direction
	fw         frameWriter // guarded by wmu
	sendClosed bool        // guarded by wmu

	mu   sync.Mutex // orders revoke against starting a process
	proc *process   // the process exec started; guarded by mu
}

// send writes one frame. It blocks while the client does not read (QUIC
// flow control), which is the server's back-pressure.
func (st *serverStream) send(m proto.Message) error {
	st.wmu.Lock()
	defer st.wmu.Unlock()
	if st.sendClosed {
		return errors.New("dataplane: send direction already closed")
	}
	return st.fw.write(m)
}

// closeSend ends the server's direction of the stream cleanly (FIN).
func (st *serverStream) closeSend() {
	st.wmu.Lock()
	defer st.wmu.Unlock()
	if !st.sendClosed {
		st.sendClosed = true
		st.qs.Close()
	}
}

// accept tells the client its stream is accepted.
func (st *serverStream) accept() error {
	return st.send(&gpupoolv1.StreamAccept{})
}

// refuse tells the client why its stream is refused and ends the stream.
func (st *serverStream) refuse(r *RefusedError) {
	st.send(&gpupoolv1.StreamAccept{Code: r.Code, Error: r.Message})
	st.closeSend()
}

// abort ends the stream at once in both directions with code, and the
// operation with cause. The resets come first, so that what ending the
// operation does to the stream cannot reach the client before code does.
// It never waits for a blocked send.
func (st *serverStream) abort(code quic.StreamErrorCode, cause error) {
	st.qs.CancelRead(code)
	st.qs.CancelWrite(code)
	st.cancel(cause)
}

// protocolError aborts a stream whose client broke the protocol.
func (st *serverStream) protocolError(err error) {
	st.log.Info("client broke the protocol", "err", err)
	st.abort(codeProtocol, fmt.Errorf("%w: %v", ErrProtocol, err))
}

// revoke aborts the stream because its lease ended, and returns the
// process exec started on it, if any. After revoke, exec starts none.
func (st *serverStream) revoke() *process {
	st.mu.Lock()
	defer st.mu.Unlock()
	st.abort(codeLeaseEnded, ErrLeaseEnded)
	return st.proc
}

// finish releases the stream once its operation is over: it closes the
// send direction if still open and stops reading whatever the client
// still sends.
func (st *serverStream) finish() {
	st.closeSend()
	st.qs.CancelRead(codeCanceled)
}
