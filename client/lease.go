package client

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// ErrLeaseEnded is what Lease.Err wraps once the lease can no longer be
// renewed: released, expired, revoked or lost.
var ErrLeaseEnded = errors.New("lease ended")

// Lease is a granted lease that renews itself, a third of its TTL at a
// time, until it is released or closed, or it ends at the broker. Its
// data-plane calls (Dial, Exec, Put, Get, Forward, Usage) present the
// token of the latest renewal. It is safe for concurrent use.
//
// An elastic lease (LeaseRequest.elastic_max) also holds extras: slices
// the brokers add while capacity is free, each its own preemptible lease
// whose parent is this one. The Lease renews its extras on the same
// stream and at the same pace as itself, and drops an extra when it ends
// or cannot be renewed; the lease itself carries on. Slices lists what
// is held, TokenFor and DialSlice reach an extra's hosts, and Events says
// when the lease grows and shrinks.
type Lease struct {
	sessions
	c      *Client
	events chan *gpupoolv1.LeaseEvent
	done   chan struct{}
	cancel context.CancelFunc

	mu      sync.Mutex
	parent  held    // guarded by mu; the lease itself
	extras  []*held // guarded by mu; its live extras, oldest first
	err     error   // guarded by mu; why renewal stopped
	onRenew func()  // guarded by mu; see OnRenew
}

// ID is the lease's id.
func (l *Lease) ID() string { return l.Info().GetId() }

// Info returns the lease as the brokers last described it.
func (l *Lease) Info() *gpupoolv1.Lease {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.parent.lease
}

// Token returns the current token and agent address for one host of the
// lease (not of its extras: see TokenFor).
func (l *Lease) Token(host string) (*gpupoolv1.HostToken, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	t, ok := l.parent.tokens[host]
	return t, ok
}

// Tokens returns the current token of every host of the lease (not of its
// extras: see TokenFor).
func (l *Lease) Tokens() []*gpupoolv1.HostToken {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []*gpupoolv1.HostToken
	for _, s := range l.parent.lease.GetSlices() {
		if t := l.parent.tokens[s.Host]; t != nil && !containsHost(out, s.Host) {
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

// OnRenew makes fn run after every renewal of the lease or of one of its
// extras, once Token, Tokens and TokenFor return the tokens it brought,
// replacing any fn set before; nil stops the calls. fn runs on the
// goroutine that renews the lease, so it must return promptly; it may
// call the Lease's methods. No call starts after Close or Release
// returns.
func (l *Lease) OnRenew(fn func()) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.onRenew = fn
}

func (l *Lease) renewed() {
	l.mu.Lock()
	fn := l.onRenew
	l.mu.Unlock()
	if fn != nil {
		fn()
	}
}

func containsHost(ts []*gpupoolv1.HostToken, host string) bool {
	for _, t := range ts {
		if t.Host == host {
			return true
		}
	}
	return false
}

// Events carries what happens to the lease and its extras, as the brokers
// say it: violations, unhealthy devices, drain notices (DRAIN_NOTICE,
// with the deadline after which the lease is revoked in DeadlineMs),
// preemption notices (PREEMPT_NOTICE, likewise), revocation, its end.
//
// For an elastic lease, an event whose Lease.Parent is ID() is about an
// extra: GROWN when one is added, PREEMPT_NOTICE when it is to be taken
// back (a shrink), RELEASING and ENDED when it is gone. GROWN comes once
// per extra, after its first renewal, so that Slices and TokenFor already
// know it. An extra that cannot be renewed is dropped with an ENDED event
// of the client's making (Index 0) whose message says why. An extra's
// end does not end the lease.
//
// Events is closed when renewal stops. Events that arrive while nobody
// reads and 64 are waiting are dropped.
func (l *Lease) Events() <-chan *gpupoolv1.LeaseEvent { return l.events }

// emit passes ev on to Events, unless 64 are waiting.
func (l *Lease) emit(ev *gpupoolv1.LeaseEvent) {
	select {
	case l.events <- ev:
	default:
	}
}

// Done is closed when the lease is no longer renewed; Err says why.
func (l *Lease) Done() <-chan struct{} { return l.done }

// Err is nil while the lease is renewed, then why renewal stopped.
func (l *Lease) Err() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.err
}

// Close stops renewing without releasing: the lease and its extras expire
// after their TTL unless someone else renews them.
func (l *Lease) Close() {
	l.closeSessions()
	l.cancel()
	<-l.done
}

// Release stops renewing and releases the lease, which ends its extras
// too. Releasing a lease that already ended is not an error.
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

// keepAlive renews the lease and its extras through k until ctx ends or
// the lease can no longer be renewed, then says why.
func (l *Lease) keepAlive(ctx context.Context, k *renewer) {
	defer close(l.events)
	defer close(l.done)
	err := k.run(ctx)
	why, failed := k.sched.failed[l.ID()]
	switch {
	case failed:
		l.stop(fmt.Errorf("%w: %s", ErrLeaseEnded, strings.TrimPrefix(why, "lease ended: ")))
	case ctx.Err() != nil:
		l.stop(context.Canceled)
	case err != nil:
		l.stop(fmt.Errorf("%w: %v", ErrLeaseEnded, err))
	default:
		l.stop(ErrLeaseEnded)
	}
}

// stop records why renewal stopped. The extras are no longer renewed
// either: they end with the lease, or expire after its TTL.
func (l *Lease) stop(err error) {
	l.mu.Lock()
	l.err = err
	l.extras = nil
	l.mu.Unlock()
}

// answer applies what the KeepAlive stream says about the lease or its
// extras; the renewer, which calls it, keeps the schedule.
func (l *Lease) answer(r *gpupoolv1.KeepAliveResponse) error {
	switch {
	case r.GetEvent() != nil:
		l.handleEvent(r.GetEvent())
	case l.isExtraAnswer(r):
		l.handleExtraAnswer(r)
	case RenewalFailure(r) == "":
		l.mu.Lock()
		l.parent.setTokens(r.GetTokens())
		l.mu.Unlock()
		l.renewed()
	}
	return nil
}
