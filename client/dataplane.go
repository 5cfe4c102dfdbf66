package client

import (
	"context"
	"fmt"
	"io"
	"io/fs"
	"net"
	"strings"
	"sync"
	"time"

	"github.com/gpupool/gpupool/dataplane"
	"github.com/gpupool/gpupool/internal/clock"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// Attach keeps an existing lease alive from this process, as Acquire
// does for a new one: it renews the lease once to fetch its tokens, then
// in the background until Release or Close. It fails when the lease cannot
// be renewed (ended, or unknown).
func (c *Client) Attach(ctx context.Context, leaseID string) (*Lease, error) {
	got, err := c.Lease.Get(ctx, &gpupoolv1.GetLeaseRequest{LeaseId: leaseID})
	if err != nil {
		return nil, err
	}
	var tokens []*gpupoolv1.HostToken
	first := newRenewSchedule([]string{leaseID}, 0, true)
	k := &renewer{sched: first, open: c.keepAliveStream, clk: clock.Real, onAnswer: func(r *gpupoolv1.KeepAliveResponse) error {
		if r.GetEvent() == nil && r.GetLeaseId() == leaseID && RenewalFailure(r) == "" {
			tokens = r.GetTokens()
		}
		return nil
	}}
	if err := k.run(ctx); err != nil {
		if why, failed := first.failed[leaseID]; failed {
			return nil, fmt.Errorf("%w: %s", ErrLeaseEnded, strings.TrimPrefix(why, "lease ended: "))
		}
		return nil, err
	}
	return c.follow(got.Lease, tokens), nil
}

// keepAliveStream opens a LeaseService.KeepAlive stream.
func (c *Client) keepAliveStream(ctx context.Context) (KeepAliveStream, error) {
	return c.Lease.KeepAlive(ctx)
}

// follow starts renewing l in the background.
func (c *Client) follow(l *gpupoolv1.Lease, tokens []*gpupoolv1.HostToken) *Lease {
	return c.followWith(l, tokens, clock.Real, c.keepAliveStream)
}

// followWith starts renewing l in the background with the renewer, over
// the streams open opens and paced by clk: a third of its TTL at a time,
// giving up when no renewal succeeds for a whole TTL.
func (c *Client) followWith(l *gpupoolv1.Lease, tokens []*gpupoolv1.HostToken, clk clock.Clock, open func(context.Context) (KeepAliveStream, error)) *Lease {
	rctx, cancel := context.WithCancel(context.Background())
	lease := &Lease{c: c, events: make(chan *gpupoolv1.LeaseEvent, 64), done: make(chan struct{}), cancel: cancel}
	lease.parent.update(l)
	lease.parent.setTokens(tokens)
	lease.sessions.src = lease
	sched := newRenewSchedule([]string{l.GetId()}, 0, false)
	sched.expireAfter(l.GetId(), time.Duration(l.GetTtlMs())*time.Millisecond, clk.Now())
	k := &renewer{sched: sched, open: open, onAnswer: lease.answer, clk: clk}
	go lease.keepAlive(rctx, k)
	return lease
}

// tokenSource is where data-plane sessions get a lease's current tokens:
// a Lease renewing itself, or a token file someone else keeps fresh.
type tokenSource interface {
	// leaseID is the id of the lease the tokens are for.
	leaseID() string
	// hostToken returns the current token of host, one of the lease's
	// hosts; "" means the host of its first slice.
	hostToken(host string) (*gpupoolv1.HostToken, error)
}

// sessions is the data-plane side of a lease, shared by Lease and
// FileLease: Dial, and calls on the lease's first host over a session
// dialed on first use. Every call presents the token src holds at that
// moment.
type sessions struct {
	src tokenSource

	mu     sync.Mutex
	first  *Host // guarded by mu; session with the first host, once dialed
	closed bool  // guarded by mu; no more sessions once set
}

// Host is the data-plane session with one pool host of a lease: commands,
// files and ports there, each authorized with the lease's current token.
type Host struct {
	src  tokenSource
	host string
	conn *dataplane.Conn
}

// Dial opens the data-plane session with host, one of the lease's hosts;
// "" means the host of its first slice. The agent's certificate is pinned
// to the fingerprint the brokers hand out with the token.
func (s *sessions) Dial(ctx context.Context, host string) (*Host, error) {
	return dialHost(ctx, s.src, host)
}

// dialHost opens the data-plane session with host, authorized by the
// tokens of src.
func dialHost(ctx context.Context, src tokenSource, host string) (*Host, error) {
	t, err := src.hostToken(host)
	if err != nil {
		return nil, err
	}
	if t.Address == "" {
		return nil, fmt.Errorf("host %s has no data-plane address (is its agent running with --data-bind?)", t.Host)
	}
	conn, err := dataplane.Dial(ctx, t.Address, t.CertSha256)
	if err != nil {
		return nil, fmt.Errorf("reach the agent of %s at %s: %w", t.Host, t.Address, err)
	}
	return &Host{src: src, host: t.Host, conn: conn}, nil
}

// token is the lease's token for h's host at this moment.
func (h *Host) token() (string, error) {
	t, err := h.src.hostToken(h.host)
	if err != nil {
		return "", err
	}
	return t.Token, nil
}

// Exec runs argv in the lease's directory with its environment, streaming
// stdio, until it exits.
func (h *Host) Exec(ctx context.Context, argv []string, stdio dataplane.ExecIO) (dataplane.ExitStatus, error) {
	tok, err := h.token()
	if err != nil {
		return dataplane.ExitStatus{}, err
	}
	return h.conn.Exec(ctx, tok, &gpupoolv1.ExecStart{Argv: argv}, stdio)
}

// Put copies r (size bytes, or -1 if unknown) to remotePath in the lease's
// directory and returns its SHA-256.
func (h *Host) Put(ctx context.Context, r io.Reader, size int64, remotePath string, mode fs.FileMode) (string, error) {
	tok, err := h.token()
	if err != nil {
		return "", err
	}
	return h.conn.Put(ctx, tok, r, size, remotePath, mode)
}

// Get copies remotePath of the lease's directory to w and returns its
// SHA-256, checked against the agent's.
func (h *Host) Get(ctx context.Context, remotePath string, w io.Writer) (string, error) {
	tok, err := h.token()
	if err != nil {
		return "", err
	}
	return h.conn.Get(ctx, tok, remotePath, w)
}

// Forward carries local's bytes to and from remotePort on the pool host's
// loopback until either side closes.
func (h *Host) Forward(ctx context.Context, remotePort int, local net.Conn) error {
	tok, err := h.token()
	if err != nil {
		return err
	}
	return h.conn.Forward(ctx, tok, remotePort, local)
}

// Cuda carries local, a connection of the CUDA shim, to the lease's CUDA
// server on this host until either side closes (see dataplane.Conn.Cuda).
func (h *Host) Cuda(ctx context.Context, local net.Conn) error {
	tok, err := h.token()
	if err != nil {
		return err
	}
	return h.conn.Cuda(ctx, tok, local)
}

// Usage calls fn with the lease's live usage on this host every interval
// until ctx ends.
func (h *Host) Usage(ctx context.Context, interval time.Duration, fn func(*gpupoolv1.LeaseUsage)) error {
	tok, err := h.token()
	if err != nil {
		return err
	}
	return h.conn.Usage(ctx, tok, interval, fn)
}

// Close ends the session.
func (h *Host) Close() error { return h.conn.Close() }

// firstHost returns the data-plane session with the lease's first host,
// dialing it on first use. closeSessions closes it.
func (s *sessions) firstHost(ctx context.Context) (*Host, error) {
	s.mu.Lock()
	h, closed := s.first, s.closed
	s.mu.Unlock()
	if closed {
		return nil, fmt.Errorf("lease %s: closed", s.src.leaseID())
	}
	if h != nil {
		return h, nil
	}
	h, err := s.Dial(ctx, "")
	if err != nil {
		return nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case s.closed: // closed while dialing
		h.Close()
		return nil, fmt.Errorf("lease %s: closed", s.src.leaseID())
	case s.first != nil: // another call won the race
		h.Close()
		return s.first, nil
	}
	s.first = h
	return h, nil
}

// closeSessions closes the session with the first host and refuses new
// calls on the lease itself; sessions returned by Dial stay open.
func (s *sessions) closeSessions() {
	s.mu.Lock()
	h := s.first
	s.first, s.closed = nil, true
	s.mu.Unlock()
	if h != nil {
		h.Close()
	}
}

// Exec runs argv on the lease's first host; see Host.Exec.
func (s *sessions) Exec(ctx context.Context, argv []string, stdio dataplane.ExecIO) (dataplane.ExitStatus, error) {
	h, err := s.firstHost(ctx)
	if err != nil {
		return dataplane.ExitStatus{}, err
	}
	return h.Exec(ctx, argv, stdio)
}

// Put copies r to remotePath on the lease's first host; see Host.Put.
func (s *sessions) Put(ctx context.Context, r io.Reader, size int64, remotePath string, mode fs.FileMode) (string, error) {
	h, err := s.firstHost(ctx)
	if err != nil {
		return "", err
	}
	return h.Put(ctx, r, size, remotePath, mode)
}

// Get copies remotePath from the lease's first host; see Host.Get.
func (s *sessions) Get(ctx context.Context, remotePath string, w io.Writer) (string, error) {
	h, err := s.firstHost(ctx)
	if err != nil {
		return "", err
	}
	return h.Get(ctx, remotePath, w)
}

// Forward carries local to remotePort on the lease's first host; see
// Host.Forward.
func (s *sessions) Forward(ctx context.Context, remotePort int, local net.Conn) error {
	h, err := s.firstHost(ctx)
	if err != nil {
		return err
	}
	return h.Forward(ctx, remotePort, local)
}

// Usage reports the lease's live usage on its first host; see Host.Usage.
func (s *sessions) Usage(ctx context.Context, interval time.Duration, fn func(*gpupoolv1.LeaseUsage)) error {
	h, err := s.firstHost(ctx)
	if err != nil {
		return err
	}
	return h.Usage(ctx, interval, fn)
}
