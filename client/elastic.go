package client

import (
	"context"
	"fmt"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// HeldSlice is one slice a Lease holds: its own, or an extra's.
type HeldSlice struct {
	// LeaseID is the lease that holds the slice: the Lease's id, or the
	// extra's. Its tokens authorize data-plane calls on the slice (see
	// TokenFor and DialSlice).
	LeaseID string
	// Extra is set for an extra's slice: the brokers may take it back.
	Extra bool
	// Leaving is set once the lease holding the slice got a
	// PREEMPT_NOTICE: it is revoked at LeaveAtMs (Unix ms; 0 for no
	// deadline). Move work off the slice before then.
	Leaving   bool
	LeaveAtMs int64
	*gpupoolv1.Slice
}

// held is a lease whose slices a Lease holds: the lease itself or one of
// its extras.
type held struct {
	lease  *gpupoolv1.Lease
	tokens map[string]*gpupoolv1.HostToken // by host, from the latest renewal
	// leaving is set once the lease is preempted (a PREEMPT_NOTICE, or
	// preempt_at_ms on the lease): it is revoked at leaveAtMs.
	leaving   bool
	leaveAtMs int64
	// grown is an extra's GROWN event, held back until the extra's first
	// renewal brings its tokens; nil once passed on.
	grown *gpupoolv1.LeaseEvent
}

// update takes l as the brokers' latest word on the lease.
func (h *held) update(l *gpupoolv1.Lease) {
	if l == nil {
		return
	}
	h.lease = l
	switch {
	case l.GetPreemptAtMs() > 0:
		h.leaving, h.leaveAtMs = true, l.GetPreemptAtMs()
	case l.GetState() == gpupoolv1.LeaseState_LEASE_STATE_GRANTED:
		// Granted and not preempted: a preemption was withdrawn.
		h.leaving, h.leaveAtMs = false, 0
	}
}

// notice records a PREEMPT_NOTICE about the lease.
func (h *held) notice(ev *gpupoolv1.LeaseEvent) {
	h.leaving = true
	if ev.GetDeadlineMs() != 0 {
		h.leaveAtMs = ev.GetDeadlineMs()
	}
}

func (h *held) setTokens(ts []*gpupoolv1.HostToken) {
	if h.tokens == nil {
		h.tokens = map[string]*gpupoolv1.HostToken{}
	}
	for _, t := range ts {
		h.tokens[t.Host] = t
	}
}

// Slices lists the slices the lease holds: its own, then its extras',
// oldest extra first. An extra's slices are listed from the moment its
// GROWN event arrives until it ends or cannot be renewed, Leaving once it
// is to be taken back. Once Done is closed, only the lease's own slices
// are listed.
func (l *Lease) Slices() []HeldSlice {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []HeldSlice
	add := func(h *held, extra bool) {
		for _, s := range h.lease.GetSlices() {
			out = append(out, HeldSlice{LeaseID: h.lease.GetId(), Extra: extra, Leaving: h.leaving, LeaveAtMs: h.leaveAtMs, Slice: s})
		}
	}
	add(&l.parent, false)
	for _, x := range l.extras {
		add(x, true)
	}
	return out
}

// TokenFor returns the current token and agent address of host for
// leaseID: the lease's own id (as Token does) or one of its extras'. An
// extra has tokens from its first renewal, which the Lease sends as soon
// as the extra is announced, until it is dropped.
func (l *Lease) TokenFor(leaseID, host string) (*gpupoolv1.HostToken, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	h := l.heldLocked(leaseID)
	if h == nil {
		return nil, false
	}
	t, ok := h.tokens[host]
	return t, ok
}

// DialSlice opens the data-plane session with the host of s, one of the
// slices Slices lists. Its calls present the current token of the lease
// holding s, the Lease's own or an extra's, and fail once that lease is
// no longer held.
func (l *Lease) DialSlice(ctx context.Context, s HeldSlice) (*Host, error) {
	if s.Slice == nil {
		return nil, fmt.Errorf("lease %s: no slice given", s.LeaseID)
	}
	return dialHost(ctx, heldTokens{l: l, id: s.LeaseID}, s.Host)
}

// heldTokens is the token source of one lease a Lease holds, its own or
// an extra's.
type heldTokens struct {
	l  *Lease
	id string
}

func (h heldTokens) leaseID() string { return h.id }

func (h heldTokens) hostToken(host string) (*gpupoolv1.HostToken, error) {
	if host == "" {
		for _, s := range h.l.Slices() {
			if s.LeaseID == h.id {
				host = s.Host
				break
			}
		}
	}
	t, ok := h.l.TokenFor(h.id, host)
	if !ok {
		return nil, fmt.Errorf("lease %s has no token for host %s (an extra of %s that ended or is not renewed yet?)", h.id, host, h.l.ID())
	}
	return t, nil
}

// heldLocked finds the lease or extra with id; nil if it is neither.
func (l *Lease) heldLocked(id string) *held {
	if id == l.parent.lease.GetId() {
		return &l.parent
	}
	return l.extraLocked(id)
}

// extraLocked finds the live extra with id, or nil.
func (l *Lease) extraLocked(id string) *held {
	for _, x := range l.extras {
		if x.lease.GetId() == id {
			return x
		}
	}
	return nil
}

// dropExtraLocked stops renewing the extra id.
func (l *Lease) dropExtraLocked(id string) {
	for i, x := range l.extras {
		if x.lease.GetId() == id {
			l.extras = append(l.extras[:i:i], l.extras[i+1:]...)
			return
		}
	}
}

// handleEvent applies an event from the KeepAlive stream and passes it on
// to Events. A new extra's GROWN is held back until its first renewal,
// which the renewer sends at once.
func (l *Lease) handleEvent(ev *gpupoolv1.LeaseEvent) {
	id := ev.GetLease().GetId()
	l.mu.Lock()
	parentID := l.parent.lease.GetId()
	if id == "" || id == parentID {
		if id != "" {
			l.parent.update(ev.Lease)
		}
		if ev.Type == gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_PREEMPT_NOTICE {
			l.parent.notice(ev)
		}
		l.mu.Unlock()
		l.emit(ev)
		return
	}
	x := l.extraLocked(id)
	var out []*gpupoolv1.LeaseEvent // what to pass on, in order
	switch {
	case x == nil && ev.Type == gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_GROWN && ev.Lease.GetParent() == parentID:
		x = &held{grown: ev}
		x.update(ev.Lease)
		l.extras = append(l.extras, x) // its GROWN is passed on once renewed
	case x == nil:
		// About an extra already dropped: pass it on as it is.
		out = append(out, ev)
	case ev.Type == gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_GROWN:
		// Re-announced on a new stream: known already.
		x.update(ev.Lease)
	default:
		if x.grown != nil {
			// Announce the extra before saying more about it.
			out, x.grown = append(out, x.grown), nil
		}
		out = append(out, ev)
		switch ev.Type {
		case gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_RELEASING, gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_ENDED:
			l.dropExtraLocked(id)
		case gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_PREEMPT_NOTICE:
			x.update(ev.Lease)
			x.notice(ev)
		default:
			x.update(ev.Lease)
		}
	}
	l.mu.Unlock()
	for _, e := range out {
		l.emit(e)
	}
}

// isExtraAnswer reports whether a renewal answer is about another lease
// than the Lease itself: one of its extras, or one dropped already.
func (l *Lease) isExtraAnswer(r *gpupoolv1.KeepAliveResponse) bool {
	return r.GetLeaseId() != "" && r.GetLeaseId() != l.ID()
}

// handleExtraAnswer applies the answer to an extra's renewal: new tokens,
// or the extra is dropped.
func (l *Lease) handleExtraAnswer(r *gpupoolv1.KeepAliveResponse) {
	l.mu.Lock()
	x := l.extraLocked(r.GetLeaseId())
	if x == nil {
		l.mu.Unlock()
		return // dropped already
	}
	if why := RenewalFailure(r); why != "" {
		l.dropExtraLocked(r.GetLeaseId())
		announced := x.grown == nil
		l.mu.Unlock()
		if announced {
			l.emit(&gpupoolv1.LeaseEvent{Type: gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_ENDED, Lease: x.lease,
				Message: "extra " + r.GetLeaseId() + " could not be renewed: " + why})
		}
		return
	}
	x.setTokens(r.GetTokens())
	grown := x.grown
	x.grown = nil
	l.mu.Unlock()
	if grown != nil {
		l.emit(grown)
	}
	l.renewed()
}
