package broker

import (
	"context"
	"fmt"
	"slices"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/gpupool/gpupool/broker/fsm"
	"github.com/gpupool/gpupool/broker/planner"
	"github.com/gpupool/gpupool/broker/state"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
	"github.com/gpupool/gpupool/protocol"
)

// leaseService implements LeaseService.
type leaseService struct {
	gpupoolv1.UnimplementedLeaseServiceServer
	*node
	capacity   *capacity
	leadership *leadership
	membership forwarder
	limits     *limiters
	metrics    *metrics
	watch      stateWatch
}

func (e leaseService) Acquire(ctx context.Context, req *gpupoolv1.AcquireRequest) (*gpupoolv1.AcquireResponse, error) {
	if req.GetRequest() == nil {
		return nil, protocol.Validate(nil)
	}
	req = proto.CloneOf(req) // the one copy of the request on this broker
	r := req.Request
	if err := callerFrom(ctx).scopeRequest(r); err != nil {
		return nil, err
	}
	if err := protocol.Validate(r); err != nil {
		return nil, err
	}
	if err := protocol.ValidateWait(req.WaitMs); err != nil {
		return nil, err
	}
	if conn, fctx, err := e.membership.leaderConn(ctx); err != nil {
		return nil, err
	} else if conn != nil {
		return gpupoolv1.NewLeaseServiceClient(conn).Acquire(fctx, req)
	}
	if req.WaitMs > 0 {
		release, err := e.limits.holdPending(r.Tenant)
		if err != nil {
			return nil, err
		}
		defer release()
	}
	start := time.Now()
	resp, err := e.capacity.acquire(ctx, r, time.Duration(req.WaitMs)*time.Millisecond)
	err = toStatus(err)
	e.metrics.observeAcquire(start, err)
	return resp, err
}

// withLeaderView returns l with what only the leader knows filled in: its
// expiry from the leader's timer and the agents' last usage reports. It
// returns l itself when this server does not lead.
func (ld *leadership) withLeaderView(l *gpupoolv1.Lease) *gpupoolv1.Lease {
	ls := ld.currentLeader()
	if ls == nil || l == nil {
		return l
	}
	d, hasExpiry := ls.ttl.Deadline(l.Id)
	usage := ls.leaseUsage(l)
	if !hasExpiry && len(usage) == 0 {
		return l
	}
	l = proto.Clone(l).(*gpupoolv1.Lease)
	if hasExpiry {
		l.ExpiresAtMs = d.UnixMilli()
	}
	l.Usage = usage
	return l
}

// view is l as reads show it: the leader's view, and for a pending lease
// why it is not granted yet.
func (ld *leadership) view(why *planner.Explainer, l *gpupoolv1.Lease) *gpupoolv1.Lease {
	if l.State != gpupoolv1.LeaseState_LEASE_STATE_PENDING {
		return ld.withLeaderView(l)
	}
	l = proto.CloneOf(l)
	l.PendingReason = why.Why(l)
	return l
}

func (e leaseService) Release(ctx context.Context, req *gpupoolv1.ReleaseRequest) (*gpupoolv1.ReleaseResponse, error) {
	if req.LeaseId == "" {
		return nil, refuse(ErrInvalid, "lease_id: is required")
	}
	if conn, fctx, err := e.membership.leaderConn(ctx); err != nil {
		return nil, err
	} else if conn != nil {
		return gpupoolv1.NewLeaseServiceClient(conn).Release(fctx, req)
	}
	c := callerFrom(ctx)
	if err := c.mayTouch(e.fsm.State().Lease(req.LeaseId), "release"); err != nil {
		return nil, err
	}
	reason := "released by the holder"
	if req.Reason != "" {
		reason += ": " + req.Reason
	}
	res, err := e.apply(&gpupoolv1.EndLeaseCommand{
		LeaseId: req.LeaseId, EndState: gpupoolv1.LeaseState_LEASE_STATE_RELEASED, Reason: reason, NowMs: e.nowMs(), Actor: c.actor(),
	})
	if err != nil {
		return nil, err
	}
	return &gpupoolv1.ReleaseResponse{Lease: res.Lease}, nil
}

func (e leaseService) Get(ctx context.Context, req *gpupoolv1.GetLeaseRequest) (*gpupoolv1.GetLeaseResponse, error) {
	if req.LeaseId == "" {
		return nil, refuse(ErrInvalid, "lease_id: is required")
	}
	if conn, fctx, err := e.membership.readConn(ctx, req.Stale); err != nil {
		return nil, err
	} else if conn != nil {
		return gpupoolv1.NewLeaseServiceClient(conn).Get(fctx, req)
	}
	l := e.fsm.State().Lease(req.LeaseId)
	if l == nil {
		return nil, refusef(ErrNotFound, "lease %q: not found", req.LeaseId)
	}
	if err := callerFrom(ctx).mayTouch(l, "get"); err != nil {
		return nil, err
	}
	st := e.fsm.State()
	resp := &gpupoolv1.GetLeaseResponse{Lease: e.leadership.view(e.capacity.explainer(st), l), HostIsolation: map[string]string{}}
	for _, id := range state.LeaseHosts(l) {
		if h := st.Host(id); h != nil {
			resp.HostIsolation[id] = h.GetLeaseIsolation()
		}
	}
	return resp, nil
}

// ended reports whether a lease state is final.
func ended(s gpupoolv1.LeaseState) bool {
	switch s {
	case gpupoolv1.LeaseState_LEASE_STATE_RELEASED, gpupoolv1.LeaseState_LEASE_STATE_EXPIRED, gpupoolv1.LeaseState_LEASE_STATE_REVOKED:
		return true
	}
	return false
}

// onlyHolding reports whether req asks only for leases that hold capacity,
// which the state indexes by host.
func onlyHolding(req *gpupoolv1.ListLeasesRequest) bool {
	if len(req.States) == 0 {
		return false // pending leases, and ended ones with IncludeEnded
	}
	for _, s := range req.States {
		if !state.Holding(s) {
			return false
		}
	}
	return true
}

func leaseMatches(l *gpupoolv1.Lease, req *gpupoolv1.ListLeasesRequest) bool {
	if req.Tenant != "" && l.Tenant != req.Tenant {
		return false
	}
	if req.Host != "" && !slices.Contains(state.LeaseHosts(l), req.Host) {
		return false
	}
	if len(req.States) > 0 {
		return slices.Contains(req.States, l.State)
	}
	return req.IncludeEnded || !ended(l.State)
}

func (e leaseService) List(ctx context.Context, req *gpupoolv1.ListLeasesRequest) (*gpupoolv1.ListLeasesResponse, error) {
	for _, st := range req.States {
		if _, ok := gpupoolv1.LeaseState_name[int32(st)]; !ok || st == gpupoolv1.LeaseState_LEASE_STATE_UNSPECIFIED {
			return nil, refusef(ErrInvalid, "states %d: must be one of pending, granted, releasing, released, expired, revoked", st)
		}
	}
	c := callerFrom(ctx)
	if req.Tenant != "" {
		if err := c.mayActFor(req.Tenant, "tenant"); err != nil {
			return nil, err
		}
	}
	if conn, fctx, err := e.membership.readConn(ctx, req.Stale); err != nil {
		return nil, err
	} else if conn != nil {
		return gpupoolv1.NewLeaseServiceClient(conn).List(fctx, req)
	}
	st := e.fsm.State()
	resp := &gpupoolv1.ListLeasesResponse{Index: st.Index()}
	candidates := st.Leases()
	if req.Host != "" && onlyHolding(req) {
		candidates = st.HostLeases(req.Host)
	}
	why := e.capacity.explainer(st)
	for _, l := range candidates {
		if leaseMatches(l, req) && c.sees(l) {
			resp.Leases = append(resp.Leases, e.leadership.view(why, l))
		}
	}
	return resp, nil
}

// Watch is served from this server's own state: every server applies the
// same log, so any of them can stream its changes.
func (e leaseService) Watch(req *gpupoolv1.WatchLeasesRequest, stream grpc.ServerStreamingServer[gpupoolv1.LeaseEvent]) error {
	c := callerFrom(stream.Context())
	if req.Tenant != "" {
		if err := c.mayActFor(req.Tenant, "tenant"); err != nil {
			return err
		}
	}
	// Another tenant's lease id watches like a missing one: nothing shows.
	match := func(l *gpupoolv1.Lease) bool {
		return (req.Tenant == "" || l.Tenant == req.Tenant) && (req.LeaseId == "" || l.Id == req.LeaseId) && c.sees(l)
	}
	// The events this stream would not send do not wake it.
	events, cancel := e.fsm.SubscribeFunc(func(ev fsm.Event) bool { return ev.Lease != nil && match(ev.Lease) })
	defer cancel()
	sendAll := func() (uint64, error) {
		st := e.fsm.State()
		for _, l := range st.Leases() {
			if ended(l.State) || !match(l) {
				continue
			}
			ev := &gpupoolv1.LeaseEvent{Type: gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_SNAPSHOT, Lease: l, Index: l.ModifyIndex,
				Actor: fsm.EventActor(fsm.Event{Type: gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_SNAPSHOT, Lease: l})}
			if err := stream.Send(ev); err != nil {
				return 0, err
			}
		}
		return st.Index(), nil
	}
	since, err := sendAll()
	if err != nil {
		return err
	}
	for {
		select {
		case <-stream.Context().Done():
			// The caller's deadline or cancellation, not a clean end: a
			// nil here could reach a client as EOF before its own
			// deadline fired.
			return stream.Context().Err()
		case <-e.ctx.Done():
			return refuse(ErrUnavailable, "server shutting down")
		case ev, ok := <-events:
			if !ok {
				return refuse(ErrExhausted, "watch fell too far behind; watch again")
			}
			if ev.Reset {
				if since, err = sendAll(); err != nil {
					return err
				}
				continue
			}
			if ev.Lease == nil || ev.Index <= since || !match(ev.Lease) {
				continue
			}
			if err := stream.SendMsg(watchEvent(stream, ev)); err != nil {
				return err
			}
		}
	}
}

// KeepAlive renews leases on the leader; followers proxy the stream.
//
// Notices follow the state, not the stream: when a stream first renews a
// lease, it gets at once the DRAIN_NOTICE of a host draining towards a
// deadline, the lease's PREEMPT_NOTICE, and, for an elastic lease, a
// GROWN for each extra it holds (then their notices once they are renewed
// here), so a holder that (re)connects after the fact (a new leader, a new
// process) still learns of them.
func (e leaseService) KeepAlive(stream grpc.BidiStreamingServer[gpupoolv1.KeepAliveRequest, gpupoolv1.KeepAliveResponse]) error {
	c := callerFrom(stream.Context())
	watched := map[string]bool{}
	noticed := map[noticeKey]bool{} // notices sent on this stream
	send := func(ev fsm.Event) error {
		switch ev.Type {
		case gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_DRAIN_NOTICE, gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_PREEMPT_NOTICE,
			gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_GROWN:
			// The same notice may come from the catch-up and from the
			// Apply that raced with it: send it once.
			k := noticeKey{ev.Lease.Id, ev.Type, ev.DeadlineMs}
			if noticed[k] {
				return nil
			}
			noticed[k] = true
		}
		return stream.Send(&gpupoolv1.KeepAliveResponse{
			LeaseId: ev.Lease.Id, State: ev.Lease.State,
			Event: &gpupoolv1.LeaseEvent{Type: ev.Type, Lease: e.leadership.withLeaderView(ev.Lease), Index: ev.Index, Message: ev.Text(), DeadlineMs: ev.DeadlineMs, Actor: fsm.EventActor(ev)},
		})
	}
	return serveOnLeader(leaderStream{e.membership, e.leadership, e.fsm}, stream,
		func(conn *grpc.ClientConn, ctx context.Context) (grpc.BidiStreamingClient[gpupoolv1.KeepAliveRequest, gpupoolv1.KeepAliveResponse], error) {
			return gpupoolv1.NewLeaseServiceClient(conn).KeepAlive(ctx)
		},
		func(ls *leaderState, r *gpupoolv1.KeepAliveRequest) error {
			if err := c.mayTouch(e.fsm.State().Lease(r.LeaseId), "renew"); err != nil {
				return stream.Send(&gpupoolv1.KeepAliveResponse{LeaseId: r.LeaseId, Error: status.Convert(err).Message()})
			}
			first := !watched[r.LeaseId]
			watched[r.LeaseId] = true
			resp, err := e.leadership.renew(stream.Context(), ls, r.LeaseId)
			if err != nil {
				return err
			}
			if err := stream.Send(resp); err != nil || !first || resp.Error != "" {
				return err
			}
			for _, ev := range leaseNotices(e.fsm.State(), r.LeaseId) {
				if err := send(ev); err != nil {
					return err
				}
			}
			return nil
		},
		func(ev fsm.Event) error {
			l := ev.Lease
			if l == nil {
				return nil
			}
			if ev.Type == gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_GRANTED {
				if l.Parent == "" || !watched[l.Parent] {
					return nil
				}
				ev.Type = gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_GROWN
				ev.Message = fmt.Sprintf("elastic lease %s grew: extra slice %s", l.Parent, l.Id)
				return send(ev)
			}
			if !watched[l.Id] && (l.Parent == "" || !watched[l.Parent]) {
				return nil
			}
			return send(ev)
		})
}

// noticeKey names a notice by its lease, type and deadline.
type noticeKey struct {
	lease      string
	typ        gpupoolv1.LeaseEventType
	deadlineMs int64
}

// leaseNotices are the notices due to the holder of a granted lease: a
// DRAIN_NOTICE for each of its hosts whose drain, not yet forced, has a
// deadline; its PREEMPT_NOTICE; a GROWN for each extra of an elastic lease.
func leaseNotices(st *state.Reader, leaseID string) []fsm.Event {
	l := st.Lease(leaseID)
	if l == nil || l.State != gpupoolv1.LeaseState_LEASE_STATE_GRANTED {
		return nil
	}
	var evs []fsm.Event
	for _, id := range state.LeaseHosts(l) {
		h := st.Host(id)
		if d := h.GetDrain(); d == nil || d.Force || d.DeadlineMs == 0 {
			continue
		}
		ev := fsm.DrainNotice(h, l)
		ev.Index = st.Index()
		evs = append(evs, ev)
	}
	if l.PreemptAtMs != 0 {
		evs = append(evs, fsm.Event{Lease: l, Type: gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_PREEMPT_NOTICE, Index: st.Index(),
			DeadlineMs: l.PreemptAtMs, Message: fmt.Sprintf("preempted for %s", l.PreemptedFor)})
	}
	if l.GetRequest().GetElasticMax() > 0 {
		for _, x := range st.Extras(l.Id) {
			if x.State == gpupoolv1.LeaseState_LEASE_STATE_GRANTED {
				evs = append(evs, fsm.Event{Lease: x, Type: gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_GROWN, Index: st.Index(),
					Message: fmt.Sprintf("elastic lease %s holds extra slice %s", l.Id, x.Id)})
			}
		}
	}
	return evs
}

// renew resets a granted lease's TTL on the leader, once the leader has
// confirmed that it still leads (leadVerifier): a leader cut off from its
// quorum answers no renewal, so a lease that a newer leader ended is never
// renewed by an older one. The new deadline counts from the renewal's
// arrival, before the confirmation started, so it never outlives the
// expiry a newer leader could set (which re-arms at full TTL from its
// election, after that confirmation). It fails with ErrUnavailable when
// leadership cannot be confirmed, which ends the stream: the holder
// reconnects to the leader and renews there.
func (ld *leadership) renew(ctx context.Context, ls *leaderState, id string) (*gpupoolv1.KeepAliveResponse, error) {
	arrived := ld.cfg.Clock.Now()
	if err := ls.verifier.Confirm(ctx); err != nil {
		ld.metrics.renewVerifyFailures.Inc()
		return nil, refusef(ErrUnavailable, "this broker could not confirm that it still leads (%v); renew on the leader", err)
	}
	ls.expireMu.Lock()
	defer ls.expireMu.Unlock()
	select {
	case <-ls.stopCh:
		return nil, refuse(ErrUnavailable, ErrLeadershipLost.Error())
	default:
	}
	l := ld.fsm.State().Lease(id)
	if l == nil {
		return &gpupoolv1.KeepAliveResponse{LeaseId: id, Error: fmt.Sprintf("lease %q: not found", id)}, nil
	}
	if l.State != gpupoolv1.LeaseState_LEASE_STATE_GRANTED {
		return &gpupoolv1.KeepAliveResponse{LeaseId: id, State: l.State, Error: fmt.Sprintf("lease %s is %s and cannot be renewed: %s", id, stateName(l.State), l.Reason)}, nil
	}
	if l.Parent != "" {
		// An extra lives no longer than its elastic lease, even while the
		// leader has yet to end it.
		if p := ld.fsm.State().Lease(l.Parent); p == nil || p.State != gpupoolv1.LeaseState_LEASE_STATE_GRANTED {
			return &gpupoolv1.KeepAliveResponse{LeaseId: id, State: l.State, Error: fmt.Sprintf("lease %s is an extra of elastic lease %s, which ended", id, l.Parent)}, nil
		}
	}
	ttl := time.Duration(l.TtlMs) * time.Millisecond
	deadline := ls.ttl.Reset(id, ttl-ld.cfg.Clock.Now().Sub(arrived))
	resp := &gpupoolv1.KeepAliveResponse{LeaseId: id, State: l.State, TtlMs: l.TtlMs}
	if toks, err := ld.signing.hostTokens(ld.fsm.State(), l, deadline); err == nil {
		resp.Tokens = toks
	}
	return resp, nil
}

func stateName(s gpupoolv1.LeaseState) string { return fsm.LeaseStateName(s) }
