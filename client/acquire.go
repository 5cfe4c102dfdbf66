package client

import (
	"context"
	"sync"
	"time"

	"github.com/google/uuid"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
	"github.com/gpupool/gpupool/protocol"
)

// Pacing of WithPendingProgress: a first look soon after the call starts,
// then one every pendingPollEvery.
const (
	pendingFirstPoll = 300 * time.Millisecond
	pendingPollEvery = 2 * time.Second
)

// waitGrace is how long past its wait a waiting Acquire call may run: the
// brokers answer ResourceExhausted, saying why, when the wait runs out,
// and the grace lets that answer arrive. The bound holds across the
// client's retries of the call after Unavailable, each of which would
// otherwise wait in full again.
const waitGrace = 10 * time.Second

// AcquireOption changes how Acquire and Grant ask for a lease.
type AcquireOption func(*acquireOptions)

type acquireOptions struct {
	wait     time.Duration
	progress func(*gpupoolv1.Lease)
}

// WithWait lets a request that does not fit now wait up to d in the
// brokers' pending queue instead of failing at once. The queue is served
// in order of priority, then arrival; a smaller request that fits is
// granted ahead of a larger one that does not (backfill), and waiting
// guaranteed work may preempt preemptible leases. The call returns the
// lease once it is granted, or fails with ResourceExhausted, saying why
// the lease is still pending, when d runs out. d <= 0 fails at once, as
// without the option.
//
// The request stays in the queue only while the call lives: when its
// context ends, the brokers drop it. Acquire is idempotent on (tenant,
// request_id), so calling it again with the same request rejoins the
// same pending lease while it is still queued.
func WithWait(d time.Duration) AcquireOption {
	return func(o *acquireOptions) { o.wait = d }
}

// WithPendingProgress makes fn run while the request waits in the queue
// (see WithWait): once soon after the call starts, then about every 2s,
// with the pending lease as the brokers describe it; its PendingReason
// says why it is not granted yet. fn is not called while the lease is
// not queued (before the brokers enqueue it, or once granted), nor
// without WithWait. Calls are one at a time, on a goroutine of their own,
// and none runs after Acquire returns, so fn must return promptly.
func WithPendingProgress(fn func(*gpupoolv1.Lease)) AcquireOption {
	return func(o *acquireOptions) { o.progress = fn }
}

// Acquire asks the brokers for a lease and keeps it alive in the
// background until Release or Close; ctx bounds the request only (with
// WithWait, the wait too).
//
// A request without a request_id is sent with a fresh one, on a copy, so
// that a retried attempt never grants twice: Acquire never writes req, so
// one request may serve as the template of many leases. A caller that
// must name the request afterwards, also when the call failed or was
// interrupted (to say which request left the queue, or to find a lease
// granted as the call ended), sets RequestId itself; calling Acquire again
// with that id asks for the same lease again (and gets it back while it
// lives).
func (c *Client) Acquire(ctx context.Context, req *gpupoolv1.LeaseRequest, opts ...AcquireOption) (*Lease, error) {
	resp, err := c.Grant(ctx, req, opts...)
	if err != nil {
		return nil, err
	}
	return c.follow(resp.Lease, resp.Tokens), nil
}

// Grant asks the brokers for a lease as Acquire does, giving a request
// without a request_id a fresh one on a copy as Acquire does, and returns
// their answer, but does not renew the lease: it lives for its TTL unless
// someone renews it ('gpupool lease keepalive', Attach).
func (c *Client) Grant(ctx context.Context, req *gpupoolv1.LeaseRequest, opts ...AcquireOption) (*gpupoolv1.AcquireResponse, error) {
	var o acquireOptions
	for _, opt := range opts {
		opt(&o)
	}
	if req != nil && req.RequestId == "" {
		req = proto.Clone(req).(*gpupoolv1.LeaseRequest)
		req.RequestId = uuid.NewString()
	}
	areq := &gpupoolv1.AcquireRequest{Request: req}
	if o.wait > 0 {
		areq.WaitMs = max(o.wait.Milliseconds(), 1)
	}
	if o.wait <= 0 {
		return c.Lease.Acquire(ctx, areq)
	}
	wctx, cancel := context.WithTimeout(ctx, o.wait+waitGrace)
	defer cancel()
	p := c.watchPending(wctx, req, o.progress)
	resp, err := c.Lease.Acquire(wctx, areq)
	why := p.stop()
	if err != nil && ctx.Err() == nil && wctx.Err() != nil {
		// The brokers' own answer never came (the call was retried, or
		// the answer was lost): say what they would have said.
		if why != "" {
			why = ": " + why
		}
		return nil, status.Errorf(codes.ResourceExhausted, "request %s not granted within %s%s", req.RequestId, o.wait, why)
	}
	return resp, err
}

// pendingWatch follows a waiting request's pending lease in the
// background.
type pendingWatch struct {
	cancel context.CancelFunc
	done   chan struct{}

	mu  sync.Mutex
	why string // guarded by mu; the last pending_reason seen
}

// watchPending calls fn with req's pending lease until stop; nil fn
// watches nothing.
func (c *Client) watchPending(ctx context.Context, req *gpupoolv1.LeaseRequest, fn func(*gpupoolv1.Lease)) *pendingWatch {
	ctx, cancel := context.WithCancel(ctx)
	p := &pendingWatch{cancel: cancel, done: make(chan struct{})}
	if fn == nil {
		close(p.done)
		return p
	}
	var list *gpupoolv1.ListLeasesRequest // nil until the tenant is known
	look := func(ctx context.Context) (*gpupoolv1.Lease, error) {
		if list == nil {
			tenant, err := c.queueTenant(ctx, req)
			if err != nil {
				return nil, err
			}
			list = &gpupoolv1.ListLeasesRequest{Tenant: tenant, States: []gpupoolv1.LeaseState{gpupoolv1.LeaseState_LEASE_STATE_PENDING}}
		}
		resp, err := c.Lease.List(ctx, list)
		if err != nil {
			return nil, err
		}
		return pendingLease(resp.GetLeases(), req.RequestId), nil
	}
	go func() {
		defer close(p.done)
		t := time.NewTimer(pendingFirstPoll)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
			lctx, lcancel := context.WithTimeout(ctx, pendingPollEvery)
			l, err := look(lctx)
			lcancel()
			if err == nil && l != nil && ctx.Err() == nil {
				p.mu.Lock()
				p.why = l.GetPendingReason()
				p.mu.Unlock()
				fn(l)
			}
			t.Reset(pendingPollEvery)
		}
	}()
	return p
}

// queueTenant is the tenant the brokers queue req under. The brokers fill
// in a request's tenant from the caller's token (protocol.FillDefaults),
// so the SDK asks WhoAmI for that token and applies the same function: a
// call the brokers already serve, made once per waiting Acquire, rather
// than a new field echoing the tenant, which the Acquire answer could
// only carry at the grant, too late to follow the wait.
func (c *Client) queueTenant(ctx context.Context, req *gpupoolv1.LeaseRequest) (string, error) {
	who, err := gpupoolv1.NewAclServiceClient(c.conn).WhoAmI(ctx, &gpupoolv1.WhoAmIRequest{})
	if err != nil {
		return "", err
	}
	r := proto.CloneOf(req)
	if err := protocol.FillDefaults(r, who.GetToken()); err != nil {
		return "", err
	}
	return r.Tenant, nil
}

// stop ends the watch, once no call of fn is running, and returns the
// last pending reason seen.
func (p *pendingWatch) stop() string {
	p.cancel()
	<-p.done
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.why
}

// pendingLease finds the pending lease of requestID among ls.
func pendingLease(ls []*gpupoolv1.Lease, requestID string) *gpupoolv1.Lease {
	for _, l := range ls {
		if l.GetRequestId() == requestID && l.GetState() == gpupoolv1.LeaseState_LEASE_STATE_PENDING {
			return l
		}
	}
	return nil
}
