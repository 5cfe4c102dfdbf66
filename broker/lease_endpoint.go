package broker

import (
	"context"
	"errors"
	"fmt"
	"path"
	"slices"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/gpupool/gpupool/broker/fsm"
	"github.com/gpupool/gpupool/broker/lease"
	"github.com/gpupool/gpupool/broker/placement"
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

// acquire places and grants a lease on the leader. With a wait, a request
// that does not fit now joins the queue and the call waits for its grant.
// r is the call's own: Acquire cloned the request once on its way in, and
// acquire fills in its defaults in place.
//
// It decides, then acts: decideAcquire takes the decision under placeMu
// and returns it as an acquirePlan; act proposes what the plan took (it
// is in flight from the decision on) and waits, without placeMu.
func (cp *capacity) acquire(ctx context.Context, r *gpupoolv1.LeaseRequest, wait time.Duration) (*gpupoolv1.AcquireResponse, error) {
	if r.Tenant == "" {
		r.Tenant = protocol.DefaultTenant
	}
	if r.Class == gpupoolv1.LeaseClass_LEASE_CLASS_UNSPECIFIED {
		r.Class = gpupoolv1.LeaseClass_LEASE_CLASS_GUARANTEED
	}
	if currentKey(cp.fsm.State()) == nil {
		// Granting a lease whose tokens cannot be signed would leave the
		// caller with nothing to use it with. Outside placeMu: it waits
		// for a commit (see doc.go).
		if err := cp.signing.ensureSigningKey(); err != nil {
			return nil, refusef(ErrUnavailable, "no token signing key yet: %v; retry", err)
		}
	}
	by := callerFrom(ctx).actor()
	for {
		plan := cp.decideAcquire(r, wait, by)
		if !plan.again {
			return cp.act(ctx, r, wait, plan)
		}
		// A retry while the first attempt's grant still commits: wait for
		// it to land, then decide again, answering from the state as for
		// any retry.
		if plan.landed != nil {
			select {
			case <-plan.landed:
			case <-ctx.Done():
				return nil, ctx.Err()
			}
		}
	}
}

// acquirePlan is what decideAcquire decided for one request. Exactly one
// of its cases holds, checked in this order:
//
//   - again: the request's first attempt is in flight; wait for landed
//     (nil: it landed already) and decide again;
//   - err: refuse the request with err;
//   - existing: answer with this lease, granted to the same request before;
//   - await: wait in the queue for the grant of this pending lease;
//   - enqueue: propose this pending lease, then wait for its grant;
//   - grant: propose this grant, then answer with it.
//
// The leases of enqueue and grant are in flight (capacity.grants) from
// the decision on: act must propose them and mark them done.
type acquirePlan struct {
	again    bool
	landed   <-chan struct{}
	err      error
	existing *gpupoolv1.Lease
	await    string
	enqueue  *gpupoolv1.Lease
	grant    *gpupoolv1.Lease
}

// decideAcquire decides what to do with r, under placeMu and on a
// snapshot (the state plus the grants in flight), without waiting for
// any commit but the drain of grants in flight that a quota check needs.
// What it grants or enqueues is recorded in flight before it lets go of
// placeMu, so the next decision places around it.
func (cp *capacity) decideAcquire(r *gpupoolv1.LeaseRequest, wait time.Duration, by *gpupoolv1.Actor) acquirePlan {
	cp.placeMu.Lock()
	defer cp.placeMu.Unlock()
	if cp.fsm.State().Quota(r.Tenant) != nil {
		// The quota check below reads the state alone: let the tenant's
		// grants in flight land first.
		cp.grants.drain()
	}
	inflight := cp.grants.snapshot() // before the state: see overlay
	st := cp.fsm.State()
	if ex := st.LeaseByRequest(r.Tenant, r.RequestId); ex != nil {
		if !proto.Equal(ex.Request, r) {
			return acquirePlan{err: refusef(ErrExists, "request_id %q: already used by lease %s for a different request; use a new request_id", r.RequestId, ex.Id)}
		}
		switch {
		case ex.State == gpupoolv1.LeaseState_LEASE_STATE_PENDING && wait > 0:
			return acquirePlan{await: ex.Id}
		case ex.State == gpupoolv1.LeaseState_LEASE_STATE_PENDING:
			return acquirePlan{err: refusef(ErrExhausted, "request_id %q: waiting in the queue as lease %s (%s); acquire with a wait to rejoin it",
				r.RequestId, ex.Id, cp.whyPending(st, ex))}
		case ex.FencingToken == 0:
			return acquirePlan{err: refusef(ErrExhausted, "request_id %q: its pending lease %s left the queue without a grant (%s); use a new request_id",
				r.RequestId, ex.Id, ex.Reason)}
		}
		return acquirePlan{existing: ex}
	}
	if r.RequestId != "" && slices.ContainsFunc(inflight, func(l *gpupoolv1.Lease) bool {
		return l.Tenant == r.Tenant && l.RequestId == r.RequestId
	}) {
		return acquirePlan{again: true, landed: cp.grants.ofRequest(r.Tenant, r.RequestId)}
	}
	pool, over, indexed := cp.acquirePool(st, inflight)
	if c := r.GetConstraints(); !indexed || c.GetModel() != "" {
		if err := checkAgainstPool(r, pool()); err != nil {
			return acquirePlan{err: err}
		}
	} else if id := c.GetHost(); id != "" {
		// The one host it names, not the whole pool: a pinned request (a
		// Kubernetes claim's, on its node) reads no more than that.
		if st.HostWithDevices(id) == nil {
			return acquirePlan{err: noSuchHost(id)}
		}
	}
	queue := func(err error) acquirePlan {
		if wait <= 0 {
			return acquirePlan{err: err}
		}
		return acquirePlan{enqueue: cp.queue.reserveEnqueue(r, by, cp.nowMs())}
	}
	cp.placer.observeLazy(pool, r)
	var slices []*gpupoolv1.Slice
	var err error
	if indexed {
		slices, err = cp.placer.placeIndexed(cp.fsm.PoolIndex(), over, r)
	} else {
		slices, err = cp.placer.Place(pool(), r)
	}
	if pe := (*placement.Error)(nil); errors.As(err, &pe) && !pe.Never {
		if wait <= 0 {
			return acquirePlan{err: planner.PreemptionHint(st, pool(), r, pe, cp.placer, cp.cfg.PreemptGrace)}
		}
		return queue(err)
	}
	if err != nil {
		return acquirePlan{err: err}
	}
	planner.SetIsolation(slices, st.Host)
	l := lease.New(newLeaseID(), r, slices, cp.nowMs(), by)
	// The fast path: Apply checks the quota again in the grant's entry.
	if err := fsm.CheckQuota(st, l); err != nil {
		return queue(err)
	}
	// The grant commits without placeMu: the next acquire places on the
	// state plus the grants in flight, and their fsyncs are batched.
	cp.grants.add(l)
	return acquirePlan{grant: l}
}

// act carries out plan, without placeMu: it proposes what the plan took
// and waits for it, and answers the call.
func (cp *capacity) act(ctx context.Context, r *gpupoolv1.LeaseRequest, wait time.Duration, plan acquirePlan) (*gpupoolv1.AcquireResponse, error) {
	switch {
	case plan.err != nil:
		return nil, plan.err
	case plan.existing != nil:
		return cp.acquired(plan.existing, true)
	case plan.await != "":
		return cp.awaitGrant(ctx, plan.await, wait)
	case plan.enqueue != nil:
		pl, err := cp.queue.sendEnqueue(plan.enqueue)
		if err != nil {
			return nil, err
		}
		return cp.awaitGrant(ctx, pl.Id, wait)
	}
	l := plan.grant
	res, err := cp.applyAsync(&gpupoolv1.GrantLeaseCommand{Lease: l}).Wait()
	cp.grants.done(l.Id)
	if err != nil {
		return nil, err
	}
	if ls := cp.leadership.currentLeader(); ls != nil && !res.Existing {
		ls.ttl.Reset(res.Lease.Id, protocol.TTL(r))
	}
	return cp.acquired(res.Lease, res.Existing)
}

// acquired answers an Acquire with l and its tokens, valid until the
// lease's expiry on this leader's timer.
func (cp *capacity) acquired(l *gpupoolv1.Lease, existing bool) (*gpupoolv1.AcquireResponse, error) {
	resp := &gpupoolv1.AcquireResponse{Lease: cp.leadership.withLeaderView(l), Existing: existing}
	if l.State != gpupoolv1.LeaseState_LEASE_STATE_GRANTED {
		return resp, nil
	}
	// Before this leader armed its timers (startup), the lease has a whole
	// TTL from now: a new leader re-arms every lease at its full TTL.
	deadline := cp.cfg.Clock.Now().Add(time.Duration(l.TtlMs) * time.Millisecond)
	if ls := cp.leadership.currentLeader(); ls != nil {
		if d, ok := ls.ttl.Deadline(l.Id); ok {
			deadline = d
		}
	}
	toks, err := cp.signing.hostTokens(cp.fsm.State(), l, deadline)
	if err != nil {
		return nil, refuse(ErrUnavailable, err.Error())
	}
	resp.Tokens = toks
	return resp, nil
}

// checkAgainstPool rejects constraints that name things the pool does not
// have at all: a model glob no device matches, an unknown host.
// noSuchHost refuses a request pinned to a host that has no GPU registered.
func noSuchHost(id string) error {
	return &protocol.FieldError{Field: "constraints.host", Value: fmt.Sprintf("%q", id), Allowed: "no such host; see 'gpupool host ls'"}
}

func checkAgainstPool(r *gpupoolv1.LeaseRequest, hosts []*gpupoolv1.Host) error {
	c := r.GetConstraints()
	if c == nil {
		return nil
	}
	if c.Host != "" && !slices.ContainsFunc(hosts, func(h *gpupoolv1.Host) bool { return h.Id == c.Host }) {
		return noSuchHost(c.Host)
	}
	if c.Model == "" {
		return nil
	}
	models := map[string]bool{}
	for _, h := range hosts {
		for _, d := range h.Devices {
			if ok, _ := path.Match(c.Model, d.Model); ok {
				return nil
			}
			models[d.Model] = true
		}
	}
	known := sortedKeys(models)
	if len(known) == 0 {
		known = []string{"none: no host has registered GPUs"}
	}
	return &protocol.FieldError{Field: "constraints.model", Value: fmt.Sprintf("%q", c.Model), Allowed: "matches no GPU in the pool; models: " + strings.Join(known, ", ")}
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
