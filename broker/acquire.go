package broker

import (
	"context"
	"errors"
	"fmt"
	"path"
	"slices"
	"strings"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/gpupool/gpupool/broker/fsm"
	"github.com/gpupool/gpupool/broker/lease"
	"github.com/gpupool/gpupool/broker/placement"
	"github.com/gpupool/gpupool/broker/planner"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
	"github.com/gpupool/gpupool/protocol"
)

// Acquire on the leader: capacity decides under placeMu, then acts
// without it (see the lock rule in doc.go).

// acquire places and grants a lease on the leader. With a wait, a request
// that does not fit now joins the queue and the call waits for its grant.
// r is the call's own: Acquire cloned the request once on its way in, and
// acquire fills in its defaults in place (protocol.FillDefaults, which
// Acquire's ACL check applied already).
//
// It decides, then acts: decideAcquire takes the decision under placeMu
// and returns it as an acquirePlan; act proposes what the plan took (it
// is in flight from the decision on) and waits, without placeMu.
func (cp *capacity) acquire(ctx context.Context, r *gpupoolv1.LeaseRequest, wait time.Duration) (*gpupoolv1.AcquireResponse, error) {
	if err := protocol.FillDefaults(r, callerFrom(ctx).token); err != nil {
		return nil, err
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

// noSuchHost refuses a request pinned to a host that has no GPU registered.
func noSuchHost(id string) error {
	return &protocol.FieldError{Field: "constraints.host", Value: fmt.Sprintf("%q", id), Allowed: "no such host; see 'gpupool host ls'"}
}

// checkAgainstPool rejects constraints that name things the pool does not
// have at all: a model glob no device matches, an unknown host.
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
