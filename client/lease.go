package client

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/google/uuid"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// minRenewEvery bounds how often a Lease renews itself.
const minRenewEvery = 500 * time.Millisecond

// ErrLeaseEnded is what Lease.Err wraps once the lease can no longer be
// renewed: released, expired, revoked or lost.
var ErrLeaseEnded = errors.New("lease ended")

// Lease is a granted lease that renews itself, a third of its TTL at a
// time, until it is released or closed, or it ends at the broker. Its
// data-plane calls (Dial, Exec, Put, Get, Forward, Usage) present the
// token of the latest renewal. It is safe for concurrent use.
type Lease struct {
	sessions
	c      *Client
	events chan *gpupoolv1.LeaseEvent
	done   chan struct{}
	cancel context.CancelFunc

	mu      sync.Mutex
	lease   *gpupoolv1.Lease                // guarded by mu
	tokens  map[string]*gpupoolv1.HostToken // guarded by mu; by host
	err     error                           // guarded by mu; why renewal stopped
	onRenew func()                          // guarded by mu; see OnRenew
}

// Acquire asks the brokers for a lease and keeps it alive in the
// background until Release or Close; ctx bounds the request only. A
// request without a request_id gets one, so a retried Acquire never
// grants twice.
func (c *Client) Acquire(ctx context.Context, req *gpupoolv1.LeaseRequest) (*Lease, error) {
	req = proto.CloneOf(req)
	if req.RequestId == "" {
		req.RequestId = uuid.NewString()
	}
	resp, err := c.Lease.Acquire(ctx, &gpupoolv1.AcquireRequest{Request: req})
	if err != nil {
		return nil, err
	}
	return c.follow(resp.Lease, resp.Tokens), nil
}

// ID is the lease's id.
func (l *Lease) ID() string { return l.Info().GetId() }

// Info returns the lease as the brokers last described it.
func (l *Lease) Info() *gpupoolv1.Lease {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.lease
}

// Token returns the current token and agent address for one host of the
// lease.
func (l *Lease) Token(host string) (*gpupoolv1.HostToken, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	t, ok := l.tokens[host]
	return t, ok
}

// Tokens returns the current token of every host of the lease.
func (l *Lease) Tokens() []*gpupoolv1.HostToken {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []*gpupoolv1.HostToken
	for _, s := range l.lease.GetSlices() {
		if t := l.tokens[s.Host]; t != nil && !containsHost(out, s.Host) {
			out = append(out, t)
		}
	}
	return out
}

func (l *Lease) leaseID() string { return l.ID() }

func (l *Lease) hostToken(host string) (*gpupoolv1.HostToken, error) {
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
	return t, nil
}

// OnRenew makes fn run after every renewal, once Token and Tokens return
// the tokens it brought, replacing any fn set before; nil stops the
// calls. fn runs on the goroutine that renews the lease, so it must
// return promptly; it may call the Lease's methods. No call starts after
// Close or Release returns.
func (l *Lease) OnRenew(fn func()) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.onRenew = fn
}

func containsHost(ts []*gpupoolv1.HostToken, host string) bool {
	for _, t := range ts {
		if t.Host == host {
			return true
		}
	}
	return false
}

func (l *Lease) setTokens(ts []*gpupoolv1.HostToken) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, t := range ts {
		l.tokens[t.Host] = t
	}
}

// Events carries what happens to the lease: violations, unhealthy
// devices, drain notices (DRAIN_NOTICE, with the deadline after which the
// lease is revoked in DeadlineMs), revocation, its end. It is closed when renewal stops. Events
// that arrive while nobody reads and 64 are waiting are dropped.
func (l *Lease) Events() <-chan *gpupoolv1.LeaseEvent { return l.events }

// Done is closed when the lease is no longer renewed; Err says why.
func (l *Lease) Done() <-chan struct{} { return l.done }

// Err is nil while the lease is renewed, then why renewal stopped.
func (l *Lease) Err() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.err
}

// Close stops renewing without releasing: the lease expires after its
// TTL unless someone else renews it.
func (l *Lease) Close() {
	l.closeSessions()
	l.cancel()
	<-l.done
}

// Release stops renewing and releases the lease. Releasing a lease that
// already ended is not an error.
func (l *Lease) Release(ctx context.Context, reason string) error {
	l.closeSessions()
	l.cancel()
	<-l.done
	_, err := l.c.Lease.Release(ctx, &gpupoolv1.ReleaseRequest{LeaseId: l.ID(), Reason: reason})
	if status.Code(err) == codes.NotFound {
		return nil
	}
	return err
}

// keepAlive renews until ctx ends or the lease ends, reconnecting after a
// broken stream for as long as the lease may still be alive.
func (l *Lease) keepAlive(ctx context.Context) {
	defer close(l.events)
	defer close(l.done)
	ttl := time.Duration(l.Info().GetTtlMs()) * time.Millisecond
	deadline := time.Now().Add(ttl)
	pause := 100 * time.Millisecond
	for {
		err := l.session(ctx, ttl, &deadline)
		switch {
		case ctx.Err() != nil:
			l.stop(context.Canceled)
			return
		case errors.Is(err, ErrLeaseEnded):
			l.stop(err)
			return
		case time.Now().After(deadline):
			l.stop(fmt.Errorf("%w: could not renew it before it expired: %v", ErrLeaseEnded, err))
			return
		}
		select {
		case <-ctx.Done():
			l.stop(context.Canceled)
			return
		case <-time.After(pause):
		}
		pause = min(2*pause, 2*time.Second)
	}
}

func (l *Lease) stop(err error) {
	l.mu.Lock()
	l.err = err
	l.mu.Unlock()
}

// session runs one KeepAlive stream: it renews every ttl/3 and passes
// events on. It returns ErrLeaseEnded when the broker says the lease can
// no longer be renewed.
func (l *Lease) session(ctx context.Context, ttl time.Duration, deadline *time.Time) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := l.c.Lease.KeepAlive(ctx)
	if err != nil {
		return err
	}
	answers := make(chan *gpupoolv1.KeepAliveResponse)
	recvErr := make(chan error, 1)
	go func() {
		for {
			r, err := stream.Recv()
			if err != nil {
				recvErr <- err
				return
			}
			select {
			case answers <- r:
			case <-ctx.Done():
				return
			}
		}
	}()
	every := max(ttl/3, minRenewEvery)
	tick := time.NewTimer(0)
	defer tick.Stop()
	id := l.ID()
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case err := <-recvErr:
			return err
		case <-tick.C:
			if time.Now().After(*deadline) {
				// No answer for a whole TTL: the stream may be half-open.
				return errors.New("no renewal answered before the lease's TTL ran out")
			}
			if err := stream.Send(&gpupoolv1.KeepAliveRequest{LeaseId: id}); err != nil {
				return err
			}
			tick.Reset(min(every, max(time.Until(*deadline), time.Millisecond)))
		case r := <-answers:
			if ev := r.GetEvent(); ev != nil {
				if ev.Lease != nil {
					l.mu.Lock()
					l.lease = ev.Lease
					l.mu.Unlock()
				}
				select {
				case l.events <- ev:
				default:
				}
				if ev.Type == gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_ENDED {
					return fmt.Errorf("%w: %s", ErrLeaseEnded, ev.Message)
				}
				continue
			}
			if r.Error != "" || r.State != gpupoolv1.LeaseState_LEASE_STATE_GRANTED {
				return fmt.Errorf("%w: %s", ErrLeaseEnded, r.Error)
			}
			*deadline = time.Now().Add(time.Duration(r.TtlMs) * time.Millisecond)
			l.setTokens(r.Tokens)
			l.mu.Lock()
			renewed := l.onRenew
			l.mu.Unlock()
			if renewed != nil {
				renewed()
			}
		}
	}
}
