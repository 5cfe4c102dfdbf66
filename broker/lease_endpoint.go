package broker

import (
	"context"
	"errors"
	"fmt"
	"io"
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
	s *Server
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
	if conn, fctx, err := e.s.leaderConn(ctx); err != nil {
		return nil, err
	} else if conn != nil {
		return gpupoolv1.NewLeaseServiceClient(conn).Acquire(fctx, req)
	}
	if req.WaitMs > 0 {
		release, err := e.s.holdPending(r.Tenant)
		if err != nil {
			return nil, err
		}
		defer release()
	}
	start := time.Now()
	resp, err := e.s.acquire(ctx, r, time.Duration(req.WaitMs)*time.Millisecond)
	err = toStatus(err)
	e.s.metrics.observeAcquire(start, err)
	return resp, err
}

// acquire places and grants a lease on the leader. With a wait, a request
// that does not fit now joins the queue and the call waits for its grant.
// r is the call's own: Acquire cloned the request once on its way in, and
// acquire fills in its defaults in place (protocol.FillDefaults, which
// Acquire's ACL check applied already).
func (s *Server) acquire(ctx context.Context, r *gpupoolv1.LeaseRequest, wait time.Duration) (*gpupoolv1.AcquireResponse, error) {
	if err := protocol.FillDefaults(r, callerFrom(ctx).token); err != nil {
		return nil, err
	}
	if currentKey(s.fsm.State()) == nil {
		// Granting a lease whose tokens cannot be signed would leave the
		// caller with nothing to use it with. Outside placeMu: it waits
		// for a commit (see doc.go).
		if err := s.ensureSigningKey(); err != nil {
			return nil, refusef(ErrUnavailable, "no token signing key yet: %v; retry", err)
		}
	}
	s.placeMu.Lock()
	locked := true
	defer func() {
		if locked {
			s.placeMu.Unlock()
		}
	}()
	if s.fsm.State().Quota(r.Tenant) != nil {
		// The quota check below reads the state alone: let the tenant's
		// grants in flight land first.
		s.grants.drain()
	}
	inflight := s.grants.snapshot() // before the state: see overlay
	st := s.fsm.State()
	if ex := st.LeaseByRequest(r.Tenant, r.RequestId); ex != nil {
		if !proto.Equal(ex.Request, r) {
			return nil, refusef(ErrExists, "request_id %q: already used by lease %s for a different request; use a new request_id", r.RequestId, ex.Id)
		}
		switch {
		case ex.State == gpupoolv1.LeaseState_LEASE_STATE_PENDING && wait > 0:
			s.placeMu.Unlock()
			locked = false
			return s.awaitGrant(ctx, ex.Id, wait)
		case ex.State == gpupoolv1.LeaseState_LEASE_STATE_PENDING:
			return nil, refusef(ErrExhausted, "request_id %q: waiting in the queue as lease %s (%s); acquire with a wait to rejoin it",
				r.RequestId, ex.Id, s.whyPending(st, ex))
		case ex.FencingToken == 0:
			return nil, refusef(ErrExhausted, "request_id %q: its pending lease %s left the queue without a grant (%s); use a new request_id",
				r.RequestId, ex.Id, ex.Reason)
		}
		return s.acquired(ex, true)
	}
	if r.RequestId != "" && slices.ContainsFunc(inflight, func(l *gpupoolv1.Lease) bool {
		return l.Tenant == r.Tenant && l.RequestId == r.RequestId
	}) {
		// A retry while the first attempt's grant still commits: wait for
		// it to land, then answer from the state as for any retry.
		landed := s.grants.ofRequest(r.Tenant, r.RequestId) // nil: landed already
		s.placeMu.Unlock()
		locked = false
		if landed != nil {
			select {
			case <-landed:
			case <-ctx.Done():
				return nil, ctx.Err()
			}
		}
		return s.acquire(ctx, r, wait)
	}
	pool, over, indexed := s.acquirePool(st, inflight)
	if c := r.GetConstraints(); !indexed || c.GetModel() != "" {
		if err := checkAgainstPool(r, pool()); err != nil {
			return nil, err
		}
	} else if id := c.GetHost(); id != "" {
		// The one host it names, not the whole pool: a pinned request (a
		// Kubernetes claim's, on its node) reads no more than that.
		if st.HostWithDevices(id) == nil {
			return nil, noSuchHost(id)
		}
	}
	queue := func(err error) (*gpupoolv1.AcquireResponse, error) {
		if wait <= 0 {
			return nil, err
		}
		l, p := s.queue.proposeEnqueue(r, callerFrom(ctx).actor(), s.nowMs())
		s.placeMu.Unlock()
		locked = false
		pl, qerr := s.queue.landEnqueue(l, p)
		if qerr != nil {
			return nil, qerr
		}
		return s.awaitGrant(ctx, pl.Id, wait)
	}
	s.placer.observeLazy(pool, r)
	var slices []*gpupoolv1.Slice
	var err error
	if indexed {
		slices, err = s.placer.placeIndexed(s.fsm.PoolIndex(), over, r)
	} else {
		slices, err = s.placer.Place(pool(), r)
	}
	if pe := (*placement.Error)(nil); errors.As(err, &pe) && !pe.Never {
		if wait <= 0 {
			return nil, planner.PreemptionHint(st, pool(), r, pe, s.placer, s.cfg.PreemptGrace)
		}
		return queue(err)
	}
	if err != nil {
		return nil, err
	}
	planner.SetIsolation(slices, st.Host)
	l := lease.New(newLeaseID(), r, slices, s.nowMs(), callerFrom(ctx).actor())
	// The fast path: Apply checks the quota again in the grant's entry.
	if err := fsm.CheckQuota(st, l); err != nil {
		return queue(err)
	}
	// The grant commits without placeMu: the next acquire places on the
	// state plus the grants in flight, and their fsyncs are batched.
	g := s.applyAsync(&gpupoolv1.GrantLeaseCommand{Lease: l})
	s.grants.add(l)
	s.placeMu.Unlock()
	locked = false
	res, err := g.Wait()
	s.grants.done(l.Id)
	if err != nil {
		return nil, err
	}
	if ls := s.currentLeader(); ls != nil && !res.Existing {
		ls.ttl.Reset(res.Lease.Id, protocol.TTL(r))
	}
	return s.acquired(res.Lease, res.Existing)
}

// acquired answers an Acquire with l and its tokens, valid until the
// lease's expiry on this leader's timer.
func (s *Server) acquired(l *gpupoolv1.Lease, existing bool) (*gpupoolv1.AcquireResponse, error) {
	resp := &gpupoolv1.AcquireResponse{Lease: s.withLeaderView(l), Existing: existing}
	if l.State != gpupoolv1.LeaseState_LEASE_STATE_GRANTED {
		return resp, nil
	}
	// Before this leader armed its timers (startup), the lease has a whole
	// TTL from now: a new leader re-arms every lease at its full TTL.
	deadline := s.cfg.Clock.Now().Add(time.Duration(l.TtlMs) * time.Millisecond)
	if ls := s.currentLeader(); ls != nil {
		if d, ok := ls.ttl.Deadline(l.Id); ok {
			deadline = d
		}
	}
	toks, err := s.hostTokens(s.fsm.State(), l, deadline)
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
func (s *Server) withLeaderView(l *gpupoolv1.Lease) *gpupoolv1.Lease {
	ls := s.currentLeader()
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
func (s *Server) view(why *planner.Explainer, l *gpupoolv1.Lease) *gpupoolv1.Lease {
	if l.State != gpupoolv1.LeaseState_LEASE_STATE_PENDING {
		return s.withLeaderView(l)
	}
	l = proto.CloneOf(l)
	l.PendingReason = why.Why(l)
	return l
}

func (e leaseService) Release(ctx context.Context, req *gpupoolv1.ReleaseRequest) (*gpupoolv1.ReleaseResponse, error) {
	if req.LeaseId == "" {
		return nil, refuse(ErrInvalid, "lease_id: is required")
	}
	if conn, fctx, err := e.s.leaderConn(ctx); err != nil {
		return nil, err
	} else if conn != nil {
		return gpupoolv1.NewLeaseServiceClient(conn).Release(fctx, req)
	}
	c := callerFrom(ctx)
	if err := c.mayTouch(e.s.fsm.State().Lease(req.LeaseId), "release"); err != nil {
		return nil, err
	}
	reason := "released by the holder"
	if req.Reason != "" {
		reason += ": " + req.Reason
	}
	res, err := e.s.apply(&gpupoolv1.EndLeaseCommand{
		LeaseId: req.LeaseId, EndState: gpupoolv1.LeaseState_LEASE_STATE_RELEASED, Reason: reason, NowMs: e.s.nowMs(), Actor: c.actor(),
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
	if conn, fctx, err := e.s.readConn(ctx, req.Stale); err != nil {
		return nil, err
	} else if conn != nil {
		return gpupoolv1.NewLeaseServiceClient(conn).Get(fctx, req)
	}
	l := e.s.fsm.State().Lease(req.LeaseId)
	if l == nil {
		return nil, refusef(ErrNotFound, "lease %q: not found", req.LeaseId)
	}
	if err := callerFrom(ctx).mayTouch(l, "get"); err != nil {
		return nil, err
	}
	st := e.s.fsm.State()
	resp := &gpupoolv1.GetLeaseResponse{Lease: e.s.view(e.s.explainer(st), l), HostIsolation: map[string]string{}}
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
	if conn, fctx, err := e.s.readConn(ctx, req.Stale); err != nil {
		return nil, err
	} else if conn != nil {
		return gpupoolv1.NewLeaseServiceClient(conn).List(fctx, req)
	}
	st := e.s.fsm.State()
	resp := &gpupoolv1.ListLeasesResponse{Index: st.Index()}
	candidates := st.Leases()
	if req.Host != "" && onlyHolding(req) {
		candidates = st.HostLeases(req.Host)
	}
	why := e.s.explainer(st)
	for _, l := range candidates {
		if leaseMatches(l, req) && c.sees(l) {
			resp.Leases = append(resp.Leases, e.s.view(why, l))
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
	events, cancel := e.s.fsm.SubscribeFunc(func(ev fsm.Event) bool { return ev.Lease != nil && match(ev.Lease) })
	defer cancel()
	sendAll := func() (uint64, error) {
		st := e.s.fsm.State()
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
		case <-e.s.shutdownCh:
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

// watchEvent is what a Watch sends for ev: the LeaseEvent, encoded once
// for all the streams that send it (a token's few hundred watches of its
// own tenant would otherwise each encode every event). The broker has one
// codec (proto) and no compressor, so one encoding serves every stream;
// if it cannot be encoded, each stream sends the message itself.
func watchEvent(stream grpc.ServerStream, ev fsm.Event) any {
	return ev.Shared(func() any {
		m := &gpupoolv1.LeaseEvent{Type: ev.Type, Lease: ev.Lease, Index: ev.Index, Message: ev.Text(), DeadlineMs: ev.DeadlineMs, Actor: fsm.EventActor(ev)}
		var p grpc.PreparedMsg
		if err := p.Encode(stream, m); err != nil {
			return m
		}
		return &p
	})
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
			Event: &gpupoolv1.LeaseEvent{Type: ev.Type, Lease: e.s.withLeaderView(ev.Lease), Index: ev.Index, Message: ev.Text(), DeadlineMs: ev.DeadlineMs, Actor: fsm.EventActor(ev)},
		})
	}
	return serveOnLeader(e.s, stream,
		func(conn *grpc.ClientConn, ctx context.Context) (grpc.BidiStreamingClient[gpupoolv1.KeepAliveRequest, gpupoolv1.KeepAliveResponse], error) {
			return gpupoolv1.NewLeaseServiceClient(conn).KeepAlive(ctx)
		},
		func(ls *leaderState, r *gpupoolv1.KeepAliveRequest) error {
			if err := c.mayTouch(e.s.fsm.State().Lease(r.LeaseId), "renew"); err != nil {
				return stream.Send(&gpupoolv1.KeepAliveResponse{LeaseId: r.LeaseId, Error: status.Convert(err).Message()})
			}
			first := !watched[r.LeaseId]
			watched[r.LeaseId] = true
			resp, err := e.s.renew(stream.Context(), ls, r.LeaseId)
			if err != nil {
				return err
			}
			if err := stream.Send(resp); err != nil || !first || resp.Error != "" {
				return err
			}
			for _, ev := range leaseNotices(e.s.fsm.State(), r.LeaseId) {
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

// serveOnLeader runs a bidi stream whose work needs the leader's memory.
// On a follower it proxies the stream to the leader through open. On the
// leader it calls onRecv for every request and onEvent for every applied
// change, one at a time, until the caller leaves or leadership ends
// (Unavailable, so clients reconnect to the new leader).
func serveOnLeader[Req, Resp any](s *Server, stream grpc.BidiStreamingServer[Req, Resp],
	open func(*grpc.ClientConn, context.Context) (grpc.BidiStreamingClient[Req, Resp], error),
	onRecv func(*leaderState, *Req) error, onEvent func(fsm.Event) error,
) error {
	return serveOnLeaderWith(s, stream, open, onRecv, onEvent, eventBatching{})
}

// eventBatching lets a stream on the leader skip events and answer a run
// of them at once.
type eventBatching struct {
	// keep filters the events as they are published (see
	// fsm.SubscribeFunc); nil keeps all of them.
	keep func(fsm.Event) bool
	// flush, if set, runs after onEvent has seen every event that was
	// waiting: a stream whose answer is the current state, not the event,
	// sends it once for the run.
	flush func() error
}

// serveOnLeaderWith is serveOnLeader with events filtered and batched.
func serveOnLeaderWith[Req, Resp any](s *Server, stream grpc.BidiStreamingServer[Req, Resp],
	open func(*grpc.ClientConn, context.Context) (grpc.BidiStreamingClient[Req, Resp], error),
	onRecv func(*leaderState, *Req) error, onEvent func(fsm.Event) error, b eventBatching,
) error {
	ctx := stream.Context()
	if conn, fctx, err := s.leaderConn(ctx); err != nil {
		return err
	} else if conn != nil {
		out, err := open(conn, fctx)
		if err != nil {
			return err
		}
		return proxyBidi(stream, out)
	}
	ls := s.currentLeader()
	if ls == nil {
		return refuse(ErrUnavailable, "leader is still starting; retry")
	}
	events, cancel := s.fsm.SubscribeFunc(b.keep)
	defer cancel()
	reqs := recvAll(stream)
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-ls.stopCh:
			return refuse(ErrUnavailable, ErrLeadershipLost.Error())
		case r, ok := <-reqs:
			if !ok {
				return nil
			}
			if r.err != nil {
				return r.err
			}
			if err := onRecv(ls, r.msg); err != nil {
				return err
			}
		case ev, ok := <-events:
			if !ok {
				return refuse(ErrUnavailable, "stream fell behind the leader's changes; reconnect")
			}
			if err := onEvent(ev); err != nil {
				return err
			}
			if b.flush == nil {
				continue
			}
			for waiting := true; waiting; {
				select {
				case ev, ok := <-events:
					if !ok {
						return refuse(ErrUnavailable, "stream fell behind the leader's changes; reconnect")
					}
					if err := onEvent(ev); err != nil {
						return err
					}
				default:
					waiting = false
				}
			}
			if err := b.flush(); err != nil {
				return err
			}
		}
	}
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
func (s *Server) renew(ctx context.Context, ls *leaderState, id string) (*gpupoolv1.KeepAliveResponse, error) {
	arrived := s.cfg.Clock.Now()
	if err := ls.verifier.Confirm(ctx); err != nil {
		s.metrics.renewVerifyFailures.Inc()
		return nil, refusef(ErrUnavailable, "this broker could not confirm that it still leads (%v); renew on the leader", err)
	}
	ls.expireMu.Lock()
	defer ls.expireMu.Unlock()
	select {
	case <-ls.stopCh:
		return nil, refuse(ErrUnavailable, ErrLeadershipLost.Error())
	default:
	}
	l := s.fsm.State().Lease(id)
	if l == nil {
		return &gpupoolv1.KeepAliveResponse{LeaseId: id, Error: fmt.Sprintf("lease %q: not found", id)}, nil
	}
	if l.State != gpupoolv1.LeaseState_LEASE_STATE_GRANTED {
		return &gpupoolv1.KeepAliveResponse{LeaseId: id, State: l.State, Error: fmt.Sprintf("lease %s is %s and cannot be renewed: %s", id, stateName(l.State), l.Reason)}, nil
	}
	if l.Parent != "" {
		// An extra lives no longer than its elastic lease, even while the
		// leader has yet to end it.
		if p := s.fsm.State().Lease(l.Parent); p == nil || p.State != gpupoolv1.LeaseState_LEASE_STATE_GRANTED {
			return &gpupoolv1.KeepAliveResponse{LeaseId: id, State: l.State, Error: fmt.Sprintf("lease %s is an extra of elastic lease %s, which ended", id, l.Parent)}, nil
		}
	}
	ttl := time.Duration(l.TtlMs) * time.Millisecond
	deadline := ls.ttl.Reset(id, ttl-s.cfg.Clock.Now().Sub(arrived))
	resp := &gpupoolv1.KeepAliveResponse{LeaseId: id, State: l.State, TtlMs: l.TtlMs}
	if toks, err := s.hostTokens(s.fsm.State(), l, deadline); err == nil {
		resp.Tokens = toks
	}
	return resp, nil
}

func stateName(s gpupoolv1.LeaseState) string { return fsm.LeaseStateName(s) }

type recvResult[T any] struct {
	msg *T
	err error
}

// recvAll reads a stream in the background; the channel closes at EOF.
func recvAll[Req, Resp any](stream grpc.BidiStreamingServer[Req, Resp]) <-chan recvResult[Req] {
	ch := make(chan recvResult[Req])
	go func() {
		defer close(ch)
		for {
			m, err := stream.Recv()
			if errors.Is(err, io.EOF) {
				return
			}
			select {
			case ch <- recvResult[Req]{msg: m, err: err}:
			case <-stream.Context().Done():
				return
			}
			if err != nil {
				return
			}
		}
	}()
	return ch
}
