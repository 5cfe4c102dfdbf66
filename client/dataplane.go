package client

import (
	"context"
	"fmt"
	"io"
	"io/fs"
	"net"
	"time"

	"github.com/gpupool/gpupool/dataplane"
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
	ka, err := c.Lease.KeepAlive(ctx)
	if err != nil {
		return nil, err
	}
	defer ka.CloseSend()
	if err := ka.Send(&gpupoolv1.KeepAliveRequest{LeaseId: leaseID}); err != nil {
		return nil, err
	}
	for {
		r, err := ka.Recv()
		if err != nil {
			return nil, err
		}
		if r.Event != nil {
			continue
		}
		if r.Error != "" || r.State != gpupoolv1.LeaseState_LEASE_STATE_GRANTED {
			return nil, fmt.Errorf("%w: %s", ErrLeaseEnded, r.Error)
		}
		return c.follow(got.Lease, r.Tokens), nil
	}
}

// follow starts renewing l in the background.
func (c *Client) follow(l *gpupoolv1.Lease, tokens []*gpupoolv1.HostToken) *Lease {
	rctx, cancel := context.WithCancel(context.Background())
	lease := &Lease{c: c, events: make(chan *gpupoolv1.LeaseEvent, 64), done: make(chan struct{}), cancel: cancel,
		lease: l, tokens: map[string]*gpupoolv1.HostToken{}}
	lease.setTokens(tokens)
	go lease.keepAlive(rctx)
	return lease
}

// Host is the data-plane session with one pool host of a lease: commands,
// files and ports there, each authorized with the lease's current token.
type Host struct {
	l    *Lease
	host string
	conn *dataplane.Conn
}

// Dial opens the data-plane session with host, one of the lease's hosts;
// "" means the host of its first slice. The agent's certificate is pinned
// to the fingerprint the brokers hand out with the token.
func (l *Lease) Dial(ctx context.Context, host string) (*Host, error) {
	if host == "" {
		ss := l.Info().GetSlices()
		if len(ss) == 0 {
			return nil, fmt.Errorf("lease %s has no slices", l.ID())
		}
		host = ss[0].Host
	}
	t, ok := l.Token(host)
	if !ok {
		return nil, fmt.Errorf("lease %s has no token for host %s", l.ID(), host)
	}
	if t.Address == "" {
		return nil, fmt.Errorf("host %s has no data-plane address (is its agent running with --data-bind?)", host)
	}
	conn, err := dataplane.Dial(ctx, t.Address, t.CertSha256)
	if err != nil {
		return nil, fmt.Errorf("reach the agent of %s at %s: %w", host, t.Address, err)
	}
	return &Host{l: l, host: host, conn: conn}, nil
}

func (h *Host) token() string {
	t, _ := h.l.Token(h.host)
	return t.GetToken()
}

// Exec runs argv in the lease's directory with its environment, streaming
// stdio, until it exits.
func (h *Host) Exec(ctx context.Context, argv []string, stdio dataplane.ExecIO) (dataplane.ExitStatus, error) {
	return h.conn.Exec(ctx, h.token(), &gpupoolv1.ExecStart{Argv: argv}, stdio)
}

// Put copies r (size bytes, or -1 if unknown) to remotePath in the lease's
// directory and returns its SHA-256.
func (h *Host) Put(ctx context.Context, r io.Reader, size int64, remotePath string, mode fs.FileMode) (string, error) {
	return h.conn.Put(ctx, h.token(), r, size, remotePath, mode)
}

// Get copies remotePath of the lease's directory to w and returns its
// SHA-256, checked against the agent's.
func (h *Host) Get(ctx context.Context, remotePath string, w io.Writer) (string, error) {
	return h.conn.Get(ctx, h.token(), remotePath, w)
}

// Forward carries local's bytes to and from remotePort on the pool host's
// loopback until either side closes.
func (h *Host) Forward(ctx context.Context, remotePort int, local net.Conn) error {
	return h.conn.Forward(ctx, h.token(), remotePort, local)
}

// Usage calls fn with the lease's live usage on this host every interval
// until ctx ends.
func (h *Host) Usage(ctx context.Context, interval time.Duration, fn func(*gpupoolv1.LeaseUsage)) error {
	return h.conn.Usage(ctx, h.token(), interval, fn)
}

// Close ends the session.
func (h *Host) Close() error { return h.conn.Close() }

// firstHost returns the data-plane session with the lease's first host,
// dialing it on first use. Close and Release close it.
func (l *Lease) firstHost(ctx context.Context) (*Host, error) {
	l.mu.Lock()
	h, closed := l.first, l.closed
	l.mu.Unlock()
	if closed {
		return nil, fmt.Errorf("lease %s: closed", l.ID())
	}
	if h != nil {
		return h, nil
	}
	h, err := l.Dial(ctx, "")
	if err != nil {
		return nil, err
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	switch {
	case l.closed: // closed while dialing
		h.Close()
		return nil, fmt.Errorf("lease %s: closed", l.ID())
	case l.first != nil: // another call won the race
		h.Close()
		return l.first, nil
	}
	l.first = h
	return h, nil
}

func (l *Lease) closeSession() {
	l.mu.Lock()
	h := l.first
	l.first, l.closed = nil, true
	l.mu.Unlock()
	if h != nil {
		h.Close()
	}
}

// Exec runs argv on the lease's first host; see Host.Exec.
func (l *Lease) Exec(ctx context.Context, argv []string, stdio dataplane.ExecIO) (dataplane.ExitStatus, error) {
	h, err := l.firstHost(ctx)
	if err != nil {
		return dataplane.ExitStatus{}, err
	}
	return h.Exec(ctx, argv, stdio)
}

// Put copies r to remotePath on the lease's first host; see Host.Put.
func (l *Lease) Put(ctx context.Context, r io.Reader, size int64, remotePath string, mode fs.FileMode) (string, error) {
	h, err := l.firstHost(ctx)
	if err != nil {
		return "", err
	}
	return h.Put(ctx, r, size, remotePath, mode)
}

// Get copies remotePath from the lease's first host; see Host.Get.
func (l *Lease) Get(ctx context.Context, remotePath string, w io.Writer) (string, error) {
	h, err := l.firstHost(ctx)
	if err != nil {
		return "", err
	}
	return h.Get(ctx, remotePath, w)
}

// Forward carries local to remotePort on the lease's first host; see
// Host.Forward.
func (l *Lease) Forward(ctx context.Context, remotePort int, local net.Conn) error {
	h, err := l.firstHost(ctx)
	if err != nil {
		return err
	}
	return h.Forward(ctx, remotePort, local)
}
