package cudaserver

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net"
	"os"
	"runtime"
	"slices"
	"sync"
	"syscall"
	"time"

	"github.com/gpupool/gpupool/cuda/wire"
)

// Backend runs driver calls for one session.
type Backend interface {
	Calls
	// Bind makes ctx current for the calls that follow: a context handle
	// the backend returned, or 0 for none. The session has checked it.
	Bind(ctx uint64) Result
	// Close frees every context, allocation, module, stream and event the
	// backend created. The backend is not used again.
	Close() error
}

// Device is one of the lease's devices.
type Device struct {
	// Index is the backend's ordinal of the device on the pool host.
	Index int
	// MemoryBytes is the lease's memory on the device (a slice's): the
	// total memory the client sees, and the most the lease's sessions may
	// hold allocated on it together. 0 means the whole device.
	MemoryBytes uint64
}

// Config is one lease's CUDA server.
type Config struct {
	// Devices are the lease's devices; the client sees Devices[i] as
	// device i. At least one.
	Devices []Device
	// NewBackend opens the backend of one session.
	NewBackend func() (Backend, error)
	// Logger gets session starts, ends and refusals; nil discards them.
	Logger *slog.Logger
	// Limits bound what each session may hold; nil is
	// DefaultSessionLimits.
	Limits *SessionLimits
	// OnSessions, when set, hears how many sessions are open each time
	// that changes, in order (the cuda-server command sizes GOMAXPROCS
	// with it). It runs under the server's lock: it must not call back.
	OnSessions func(open int)
	// CloseWait is how long Close waits for the sessions to end once it
	// has closed their connections; 0 is DefaultCloseWait.
	CloseWait time.Duration
}

// DefaultCloseWait is Config.CloseWait's default: a session that ends
// takes milliseconds to free its backend, so one still running after it
// is stuck in a driver call.
const DefaultCloseWait = 5 * time.Second

// Server serves the CUDA calls of one lease. Its methods are safe for
// concurrent use.
type Server struct {
	cfg    Config
	log    *slog.Logger
	limits [numLimits]int // cfg.Limits, by kind

	mu       sync.Mutex
	used     map[int32]uint64         // guarded by mu; bytes allocated per client device, over all sessions
	conns    map[net.Conn]struct{}    // guarded by mu
	queues   map[net.Conn]*replyQueue // guarded by mu; the answers of the sessions past their handshake
	closed   bool                     // guarded by mu
	sessions int                      // guarded by mu; sessions started, for log ids
	live     map[int]struct{}         // guarded by mu; the ids of the sessions not yet ended
	// running counts the sessions and Serve's goroutines that start
	// them; Add only under mu while closed is false, so that Close's Wait
	// sees every one.
	running sync.WaitGroup
}

// New checks cfg and returns a server.
func New(cfg Config) (*Server, error) {
	if len(cfg.Devices) == 0 {
		return nil, errors.New("cudaserver: Devices: at least one device, the lease's")
	}
	seen := map[int]bool{}
	for i, d := range cfg.Devices {
		if d.Index < 0 || seen[d.Index] {
			return nil, fmt.Errorf("cudaserver: Devices[%d].Index %d: want distinct ordinals >= 0", i, d.Index)
		}
		seen[d.Index] = true
	}
	if cfg.NewBackend == nil {
		return nil, errors.New("cudaserver: NewBackend: required")
	}
	lim := DefaultSessionLimits()
	if cfg.Limits != nil {
		lim = *cfg.Limits
	}
	if err := lim.Validate(); err != nil {
		return nil, err
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if cfg.CloseWait < 0 {
		return nil, fmt.Errorf("cudaserver: CloseWait %v: must not be negative (0 is %v)", cfg.CloseWait, DefaultCloseWait)
	}
	if cfg.CloseWait == 0 {
		cfg.CloseWait = DefaultCloseWait
	}
	return &Server{cfg: cfg, log: log, limits: lim.byKind(), used: map[int32]uint64{}, conns: map[net.Conn]struct{}{}, queues: map[net.Conn]*replyQueue{}, live: map[int]struct{}{}}, nil
}

// Serve accepts connections on l and serves each in its own session until
// l fails or the server is closed. A session's end is logged by
// ServeConn: a warning with the error, or at debug level for a client
// that hung up.
func (s *Server) Serve(l net.Listener) error {
	for {
		c, err := l.Accept()
		s.mu.Lock()
		closed := s.closed
		if err == nil && !closed {
			s.running.Add(1)
		}
		s.mu.Unlock()
		switch {
		case closed:
			if err == nil {
				_ = c.Close()
			}
			return nil
		case err != nil:
			return err
		}
		go func() {
			defer s.running.Done()
			_ = s.ServeConn(c) // logged there, with the session's id
		}()
	}
}

// Close ends every session: their clients' next calls fail with
// CUDA_ERROR_DEVICE_UNAVAILABLE. It returns once they all ended and freed
// their backends, or after Config.CloseWait, logging the sessions still
// running: those are stuck in a backend call, which closing their
// connections cannot interrupt, and end when it returns (or with the
// process). Sessions that start after Close are refused. Close must not
// be called from a session (a Backend or OnSessions).
func (s *Server) Close() {
	s.mu.Lock()
	s.closed = true
	conns := s.conns
	s.conns = map[net.Conn]struct{}{}
	s.opened()
	s.mu.Unlock()
	for c := range conns {
		_ = c.Close()
	}
	ended := make(chan struct{})
	go func() {
		s.running.Wait()
		close(ended)
	}()
	wait := time.NewTimer(s.cfg.CloseWait)
	defer wait.Stop()
	select {
	case <-ended:
	case <-wait.C:
		s.mu.Lock()
		stuck := slices.Sorted(maps.Keys(s.live))
		s.mu.Unlock()
		s.log.Warn("cuda server closed with sessions still running, stuck in a backend call: each ends when its call returns",
			"sessions", stuck, "waited", s.cfg.CloseWait)
	}
}

// opened tells OnSessions how many sessions are open. s.mu is held.
func (s *Server) opened() {
	if s.cfg.OnSessions != nil {
		s.cfg.OnSessions(len(s.conns))
	}
}

// ServeConn runs one session on c until c ends or a frame is malformed,
// which it logs as a warning and returns as the error. A client that hangs
// up ends the session without an error. It closes c.
func (s *Server) ServeConn(c net.Conn) error {
	c = newThreadConn(c)
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		_ = c.Close()
		s.log.Debug("cuda session refused: the server is closed")
		return errors.New("cudaserver: closed")
	}
	s.running.Add(1)
	defer s.running.Done()
	s.conns[c] = struct{}{}
	s.sessions++
	id := s.sessions
	s.live[id] = struct{}{}
	s.opened()
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		delete(s.live, id)
		if _, ok := s.conns[c]; ok {
			delete(s.conns, c)
			s.opened()
		}
		s.mu.Unlock()
		_ = c.Close()
	}()
	log := s.log.With("session", id)

	// The driver's current context is per OS thread; the session waits
	// for its requests on that thread too (threadConn).
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()

	err := s.serve(c, log)
	switch {
	case err == nil || hungUp(err):
		log.Debug("cuda session ended")
		return nil
	default:
		log.Warn("cuda session ended", "err", err)
		return err
	}
}

// hungUp reports whether err is how a session ends when its client exits
// or closes its connection, or the server closes it: no error.
func hungUp(err error) bool {
	return errors.Is(err, io.EOF) || errors.Is(err, net.ErrClosed) ||
		errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE)
}

// What a session's answers not yet written may hold: a client that stops
// reading (mid-copy, or on purpose) stalls its own session here, holding
// at most this much, never the whole of what it asked for. The shim keeps
// to smaller windows (cuda/shim/csrc/transport.c: SHIM_WINDOW,
// SHIM_REPLY_WINDOW), so a client that reads its answers never waits on
// them.
var (
	maxQueuedReplies      = 4096
	maxQueuedReplyBytes   = 32 << 20
	replyWriteBufferBytes = 256 << 10
	replyDrainTimeout     = 5 * time.Second
)

func (s *Server) serve(c net.Conn, log *slog.Logger) error {
	r := wire.NewFrameReader(bufio.NewReaderSize(c, 256<<10))
	w := bufio.NewWriterSize(c, replyWriteBufferBytes)
	h, p, err := r.Next()
	if err != nil {
		return err
	}
	if h.Op != wire.OpHello {
		return fmt.Errorf("%w: op %d before the handshake", errMalformed, h.Op)
	}
	d := wire.NewDecoder(p)
	magic, version, hash := d.U32(), d.U32(), d.U32()
	if err := d.Err(); err != nil || magic != wire.Magic {
		return fmt.Errorf("%w: not a gpupool CUDA handshake", errMalformed)
	}
	var e wire.Encoder
	e.U32(Protocol)
	e.U32(APIHash)
	res, msg := Success, ""
	if version != Protocol || hash != APIHash {
		res = ErrorSystemDriverMismatch
		msg = fmt.Sprintf("the shim speaks protocol %d (API %08x), this server %d (API %08x)", version, hash, Protocol, APIHash)
	}
	e.String(msg)
	if err := writeReply(w, replyFrame{h: replyHeader(h, res), payload: e.B}); err != nil {
		return err
	}
	if err := w.Flush(); err != nil {
		return err
	}
	if res != Success {
		return fmt.Errorf("cudaserver: %s", msg)
	}

	b, err := s.cfg.NewBackend()
	if err != nil {
		return fmt.Errorf("cudaserver: opening the backend: %w", err)
	}
	ss := newSession(s, b, log)
	defer ss.close()
	out := newReplyQueue(c, w)
	defer out.close(c)
	if tc, ok := c.(*threadConn); ok {
		tc.idle = out.idle
	}
	s.mu.Lock()
	s.queues[c] = out
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		delete(s.queues, c)
		s.mu.Unlock()
	}()
	log.Debug("cuda session started")
	for {
		h, p, err := r.Next()
		if err != nil {
			return err
		}
		e := wire.Encoder{B: make([]byte, 0, 64)}
		res, err := ss.call(h, p, &e)
		if err != nil {
			return err
		}
		if res != Success {
			e.B = e.B[:0]
		}
		if err := out.put(replyFrame{h: replyHeader(h, res), payload: e.B}, h.Flags&wire.FlagWait != 0); err != nil {
			return err
		}
	}
}

func replyHeader(req wire.Header, res Result) wire.Header {
	return wire.Header{Op: req.Op, Flags: wire.FlagReply, Seq: req.Seq, Word: uint64(res)}
}

type replyFrame struct {
	h       wire.Header
	payload []byte
}

func writeReply(w *bufio.Writer, f replyFrame) error {
	var hdr [4 + wire.HeaderSize]byte
	if _, err := w.Write(wire.AppendHeader(hdr[:0], f.h, len(f.payload))); err != nil {
		return err
	}
	_, err := w.Write(f.payload)
	return err
}

// replyQueue writes a session's answers on their own goroutine, so the
// session runs calls while earlier answers are on their way, and a batch of
// small answers leaves in one write. It holds at most maxQueuedReplies
// answers and maxQueuedReplyBytes of their payloads (one larger answer
// alone): put waits for room, which is the back-pressure a client that
// does not read feels.
type replyQueue struct {
	ch   chan replyFrame
	done chan struct{}

	wmu sync.Mutex    // guards w: the writer goroutine's, or put's when nothing is queued
	w   *bufio.Writer // guarded by wmu

	mu      sync.Mutex
	room    *sync.Cond
	pending int   // guarded by mu; answers queued or being written
	bytes   int   // guarded by mu; their payload bytes
	high    int   // guarded by mu; the most bytes ever queued
	failed  error // guarded by mu; the write error that ended the writer
}

func newReplyQueue(c net.Conn, w *bufio.Writer) *replyQueue {
	q := &replyQueue{ch: make(chan replyFrame, maxQueuedReplies), done: make(chan struct{}), w: w}
	q.room = sync.NewCond(&q.mu)
	go q.write(c)
	return q
}

func (q *replyQueue) write(c net.Conn) {
	defer close(q.done)
	var err error
	for f := range q.ch {
		if err == nil {
			q.wmu.Lock()
			err = writeReply(q.w, f)
			if err == nil && len(q.ch) == 0 {
				err = q.w.Flush()
			}
			q.wmu.Unlock()
			if err != nil {
				// The session's next read fails too: it ends.
				_ = c.Close()
			}
		}
		q.written(f, err)
	}
}

// written accounts for f, written (or not, with err).
func (q *replyQueue) written(f replyFrame, err error) {
	q.mu.Lock()
	q.pending--
	q.bytes -= len(f.payload)
	if err != nil && q.failed == nil {
		q.failed = err
	}
	q.room.Broadcast()
	q.mu.Unlock()
}

// put queues f, waiting while the queue holds its most bytes. The answer
// to a request marked wire.FlagWait (inline), with nothing queued before
// it, is written at once: its client reads answers now, and a hand-off to
// the writer would cost a wake-up on every round trip.
func (q *replyQueue) put(f replyFrame, inline bool) error {
	q.mu.Lock()
	for q.failed == nil && q.bytes > 0 && q.bytes+len(f.payload) > maxQueuedReplyBytes {
		q.room.Wait()
	}
	if q.failed != nil {
		err := q.failed
		q.mu.Unlock()
		return err
	}
	now := inline && q.pending == 0
	q.pending++
	q.bytes += len(f.payload)
	q.high = max(q.high, q.bytes)
	q.mu.Unlock()
	if !now {
		q.ch <- f
		return nil
	}
	q.wmu.Lock()
	err := writeReply(q.w, f)
	if err == nil {
		err = q.w.Flush()
	}
	q.wmu.Unlock()
	q.written(f, err)
	return err
}

// close writes what is queued (unless writing failed) and stops the
// writer; a client that does not take its last answers within
// replyDrainTimeout has c closed under it.
func (q *replyQueue) close(c net.Conn) {
	close(q.ch)
	t := time.NewTimer(replyDrainTimeout)
	defer t.Stop()
	select {
	case <-q.done:
	case <-t.C:
		_ = c.Close()
		<-q.done
	}
}

// idle reports whether every answer put has been written.
func (q *replyQueue) idle() bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.pending == 0
}

// queued reports the payload bytes queued now and the most ever queued.
func (q *replyQueue) queued() (now, high int) {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.bytes, q.high
}

// reserve takes n bytes of the lease's memory on device dev.
func (s *Server) reserve(dev int32, n uint64, total uint64) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if n > total || s.used[dev] > total-n {
		return false
	}
	s.used[dev] += n
	return true
}

// release returns n bytes of device dev.
func (s *Server) release(dev int32, n uint64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.used[dev] -= n
}

// usedOn is the lease's memory allocated on dev.
func (s *Server) usedOn(dev int32) uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.used[dev]
}

// ListenAndServe serves the unix socket at path, which it creates with
// mode 0600 (the proxy or the agent connects as the same user), until ctx
// ends; then it closes the server, ending every session, and removes the
// socket. It returns nil when ctx ended it.
func (s *Server) ListenAndServe(ctx context.Context, path string) error {
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return fmt.Errorf("cudaserver: %w", err)
	}
	defer os.Remove(path)
	if err := os.Chmod(path, 0o600); err != nil {
		l.Close()
		return fmt.Errorf("cudaserver: %w", err)
	}
	stop := context.AfterFunc(ctx, func() { s.Close(); l.Close() })
	defer stop()
	err = s.Serve(l)
	if ctx.Err() != nil {
		return nil
	}
	l.Close()
	return err
}
