package broker

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/gpupool/gpupool/broker/lease"
	"github.com/gpupool/gpupool/broker/planner"
	"github.com/gpupool/gpupool/broker/state"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
	"github.com/gpupool/gpupool/protocol"
)

// The queue runs on the leader. Pending leases, preemption deadlines and
// elastic extras are state; what is in leader memory is only who waits on
// a pending lease (a new leader gives absent waiters PendingGrace to come
// back) and the timers, re-armed from the state like lease TTLs.
//
// A pass (schedule) asks broker/planner what to do (its package doc has
// the rules: order, backfill, reservations, victims, growth) and writes
// the plan to the log through the queueWriter. Passes run one at a time,
// follow the same lock rule as Acquire (doc.go), and are triggered by
// every change that can free or take capacity.

// minPassInterval spaces the queue's passes under a stream of changes, so
// a queue that cannot move does not hold placeMu back to back.
const minPassInterval = 20 * time.Millisecond

// kickQueue asks for a pass of the queue.
func (ls *leaderState) kickQueue() {
	select {
	case ls.kick <- struct{}{}:
	default:
	}
}

// runQueue runs passes of the queue as they are asked for, until ls ends.
func (cp *capacity) runQueue(ls *leaderState) {
	for {
		select {
		case <-ls.stopCh:
			return
		case <-ls.kick:
		}
		cp.schedule(ls)
		select {
		case <-ls.stopCh:
			return
		case <-time.After(minPassInterval):
		}
	}
}

// schedule runs one pass of the queue under the lock rule (see doc.go):
// proposePass plans on a snapshot under placeMu and proposes the plan;
// schedule then waits for the commits without placeMu, as Acquire does.
// FSM Apply re-checks every grant and preemption.
func (cp *capacity) schedule(ls *leaderState) {
	if sent := cp.proposePass(); sent != nil {
		cp.queue.landPlan(ls.ttl, sent)
	}
}

// proposePass plans a pass of the queue under placeMu (planner.Make,
// pure) and proposes the plan, registering its grants, extras and
// reservations as in flight. It returns nil when nothing waits.
func (cp *capacity) proposePass() *sentPlan {
	cp.placeMu.Lock()
	defer cp.placeMu.Unlock()
	if st := cp.fsm.State(); len(st.PendingLeases()) == 0 && len(st.ElasticLeases()) == 0 {
		return nil
	}
	cp.grants.drain() // the plan reads the state alone
	st := cp.fsm.State()
	plan := planner.Make(planner.Input{
		State: st, Hosts: st.HostsWithDevices(), Placer: cp.placer,
		Now: cp.cfg.Clock.Now(), PreemptGrace: cp.cfg.PreemptGrace, NewID: newLeaseID,
	})
	return cp.queue.proposePlan(st, plan, cp.nowMs())
}

// sentPlan is a plan whose commands are proposed and not yet landed.
type sentPlan struct {
	grants, grows []sentGrant
	preemptions   []sentPreemption
	withdrawals   []Proposal
}

type sentGrant struct {
	lease *gpupoolv1.Lease
	p     Proposal
}

type sentPreemption struct {
	cmd     *gpupoolv1.PreemptLeasesCommand
	reserve string // the in-flight id of the room kept for cmd.ForLease
	p       Proposal
}

// queueWriter writes the queue's decisions to the log through the
// Proposer, following the lock rule (see doc.go): its propose methods run
// under placeMu and record what they take as in flight; its land methods
// run outside it and wait for the commits.
type queueWriter struct {
	props  Proposer
	grants *inflight
	log    *slog.Logger
	grace  time.Duration // how long a preempted lease keeps running, for the log
}

// proposePlan proposes plan's commands in order: grants, preemptions,
// withdrawals, extras. st is the snapshot plan was made on, nowMs the
// leader's time. What it grants or reserves is in flight before it
// returns, so a decision made after it places around it.
func (s *queueWriter) proposePlan(st *state.Reader, plan *planner.Plan, now int64) *sentPlan {
	sent := &sentPlan{}
	for _, g := range plan.Grants {
		s.grants.add(g)
		sent.grants = append(sent.grants, sentGrant{g, s.props.Propose(&gpupoolv1.GrantLeaseCommand{Lease: g, NowMs: now})})
	}
	for _, c := range plan.Preemptions {
		// Until it commits, the room it makes is held in flight; once it
		// has, the state's preemption reserves it (planner.Reserved).
		r := st.Lease(c.ForLease)
		room := &gpupoolv1.Lease{Id: "reserved-for-" + c.ForLease, Slices: plan.Reserved[c.ForLease],
			HostCpuMillicores: r.GetHostCpuMillicores(), HostMemoryMib: r.GetHostMemoryMib()}
		s.grants.add(room)
		sent.preemptions = append(sent.preemptions, sentPreemption{c, room.Id, s.props.Propose(c)})
	}
	for _, c := range plan.Withdrawals {
		sent.withdrawals = append(sent.withdrawals, s.props.Propose(c))
	}
	for _, x := range plan.Grows {
		s.grants.add(x)
		sent.grows = append(sent.grows, sentGrant{x, s.props.Propose(&gpupoolv1.GrantLeaseCommand{Lease: x, NowMs: x.CreatedAtMs})})
	}
	return sent
}

// landPlan waits for a sent plan's commands and arms the TTLs of what it
// granted on ttl.
func (s *queueWriter) landPlan(ttl *lease.Timers, sent *sentPlan) {
	for _, g := range sent.grants {
		res, err := g.p.Wait()
		s.grants.done(g.lease.Id)
		if err != nil {
			s.log.Debug("granting a pending lease failed", "lease", g.lease.Id, "err", err)
			continue
		}
		if res.Lease.State != gpupoolv1.LeaseState_LEASE_STATE_GRANTED || res.Lease.Id != g.lease.Id {
			continue // it left the queue meanwhile; nothing was allocated
		}
		ttl.Reset(res.Lease.Id, protocol.TTL(res.Lease.Request))
		s.log.Info("pending lease granted", "lease", g.lease.Id, "tenant", g.lease.Tenant, "waited", time.Duration(res.Lease.StateChangedAtMs-res.Lease.CreatedAtMs)*time.Millisecond)
	}
	for _, p := range sent.preemptions {
		_, err := p.p.Wait()
		s.grants.done(p.reserve)
		if err != nil {
			s.log.Warn("preempting leases failed", "for", p.cmd.ForLease, "leases", p.cmd.LeaseIds, "err", err)
			continue
		}
		s.log.Info("leases preempted", "for", p.cmd.ForLease, "leases", p.cmd.LeaseIds, "grace", s.grace)
	}
	for _, p := range sent.withdrawals {
		if _, err := p.Wait(); err != nil {
			s.log.Debug("withdraw a preemption failed", "err", err)
		}
	}
	for _, g := range sent.grows {
		res, err := g.p.Wait()
		s.grants.done(g.lease.Id)
		if err != nil {
			s.log.Debug("growing an elastic lease failed", "lease", g.lease.Parent, "err", err)
			continue
		}
		ttl.Reset(res.Lease.Id, time.Duration(res.Lease.TtlMs)*time.Millisecond)
		s.log.Info("elastic lease grew", "lease", g.lease.Parent, "extra", res.Lease.Id, "host", g.lease.Slices[0].Host)
	}
}

// newLeaseID names a new lease.
func newLeaseID() string { return "l-" + randomHex(8) }

// addWaiter records a call waiting on pending lease id.
func (ls *leaderState) addWaiter(id string) {
	ls.mu.Lock()
	ls.waiters[id]++
	ls.mu.Unlock()
	ls.pendingGrace.Stop(id)
}

// removeWaiter forgets one call waiting on id and returns how many remain.
func (ls *leaderState) removeWaiter(id string) int {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	ls.waiters[id]--
	n := ls.waiters[id]
	if n <= 0 {
		delete(ls.waiters, id)
	}
	return n
}

func (ls *leaderState) waiting(id string) bool {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	return ls.waiters[id] > 0
}

// enqueue adds r to the queue as a pending lease and returns it. Call it
// without placeMu.
func (cp *capacity) enqueue(r *gpupoolv1.LeaseRequest, by *gpupoolv1.Actor) (*gpupoolv1.Lease, error) {
	return cp.queue.sendEnqueue(cp.queue.reserveEnqueue(r, by, cp.nowMs()))
}

// reserveEnqueue makes r a pending lease and records it in flight, under
// placeMu (see doc.go), so that a retry of the same request waits for it
// rather than enqueueing it twice. Send it, outside placeMu, with
// sendEnqueue.
func (s *queueWriter) reserveEnqueue(r *gpupoolv1.LeaseRequest, by *gpupoolv1.Actor, nowMs int64) *gpupoolv1.Lease {
	l := lease.New(newLeaseID(), r, nil, nowMs, by)
	s.grants.add(l)
	return l
}

// sendEnqueue proposes pending lease l, which reserveEnqueue recorded in
// flight, waits for it to land, and returns it as the state has it.
func (s *queueWriter) sendEnqueue(l *gpupoolv1.Lease) (*gpupoolv1.Lease, error) {
	res, err := s.props.Propose(&gpupoolv1.EnqueueLeaseCommand{Lease: l}).Wait()
	s.grants.done(l.Id)
	if err != nil {
		return nil, err
	}
	return res.Lease, nil
}

// awaitGrant waits, on the leader, for pending lease id to be granted, for
// at most wait. A caller that goes away takes the lease out of the queue
// (unless another call still waits on it); so does the end of the wait.
func (cp *capacity) awaitGrant(ctx context.Context, id string, wait time.Duration) (*gpupoolv1.AcquireResponse, error) {
	yieldWriteSeat(ctx) // the tenant's pending cap bounds the wait
	ls := cp.leadership.currentLeader()
	if ls == nil {
		return nil, refuse(ErrUnavailable, "leader is still starting; retry with the same request id to rejoin the queue")
	}
	changed, unwatch := ls.watchLease(id)
	defer unwatch()
	timeout := make(chan struct{})
	t := cp.cfg.Clock.AfterFunc(wait, func() { close(timeout) })
	defer t.Stop()
	ls.addWaiter(id) // after the timer: a waiter seen waiting has its wait running
	ls.kickQueue()
	// leave takes the lease out of the queue unless another call still
	// waits on it. The end applies only while the lease is pending, so it
	// cannot undo a grant that raced with it; it returns the lease after.
	leave := func(end gpupoolv1.LeaseState, reason string) *gpupoolv1.Lease {
		if ls.removeWaiter(id) > 0 {
			return cp.fsm.State().Lease(id)
		}
		_, err := cp.apply(&gpupoolv1.EndLeaseCommand{LeaseId: id, EndState: end, Reason: reason, NowMs: cp.nowMs(), IfPending: true})
		if err != nil {
			cp.log.Debug("taking a pending lease out of the queue failed", "lease", id, "err", err)
		}
		return cp.fsm.State().Lease(id)
	}
	for {
		l := cp.fsm.State().Lease(id)
		switch {
		case l == nil:
			ls.removeWaiter(id)
			return nil, refusef(ErrNotFound, "lease %s: not found", id)
		case l.State == gpupoolv1.LeaseState_LEASE_STATE_GRANTED:
			ls.removeWaiter(id)
			return cp.acquired(l, false)
		case l.State != gpupoolv1.LeaseState_LEASE_STATE_PENDING:
			ls.removeWaiter(id)
			return nil, refusef(ErrExhausted, "lease %s left the queue without a grant: %s", id, l.Reason)
		}
		select {
		case <-ctx.Done():
			// A grant that raced with the departure is left to its TTL:
			// nobody is there to hold it.
			leave(gpupoolv1.LeaseState_LEASE_STATE_RELEASED, "left the queue: the waiting client went away")
			return nil, ctx.Err()
		case <-timeout:
			why := cp.whyPending(cp.fsm.State(), l)
			if now := leave(gpupoolv1.LeaseState_LEASE_STATE_EXPIRED, fmt.Sprintf("not granted within the wait of %s: %s", wait, why)); now.GetState() == gpupoolv1.LeaseState_LEASE_STATE_GRANTED {
				return cp.acquired(now, false) // granted as the wait ended
			}
			return nil, refusef(ErrExhausted, "not granted within the wait of %s: %s", wait, why)
		case <-ls.stopCh:
			ls.removeWaiter(id)
			return nil, refusef(ErrUnavailable, "%v while waiting; retry with the same request id to rejoin the queue", ErrLeadershipLost)
		case <-changed:
		}
	}
}

// watchLease returns a channel that receives (coalesced) whenever lease
// id changes, and a function to stop watching. The leader's react loop
// signals it, so a waiter costs one small channel, not a subscription.
func (ls *leaderState) watchLease(id string) (<-chan struct{}, func()) {
	ch := make(chan struct{}, 1)
	ls.mu.Lock()
	ls.leaseWatch[id] = append(ls.leaseWatch[id], ch)
	ls.mu.Unlock()
	return ch, func() {
		ls.mu.Lock()
		defer ls.mu.Unlock()
		ls.leaseWatch[id] = slices.DeleteFunc(ls.leaseWatch[id], func(c chan struct{}) bool { return c == ch })
		if len(ls.leaseWatch[id]) == 0 {
			delete(ls.leaseWatch, id)
		}
	}
}

// leaseChanged signals the watchers of lease id.
func (ls *leaderState) leaseChanged(id string) {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	for _, ch := range ls.leaseWatch[id] {
		select {
		case ch <- struct{}{}:
		default:
		}
	}
}

// pendingGraceOver ends a pending lease nobody waits for: its client did
// not come back after a leader change.
func (ld *leadership) pendingGraceOver(ls *leaderState, id string) {
	l := ld.fsm.State().Lease(id)
	if l == nil || l.State != gpupoolv1.LeaseState_LEASE_STATE_PENDING || ls.waiting(id) {
		return
	}
	_, err := ld.apply(&gpupoolv1.EndLeaseCommand{
		LeaseId: id, EndState: gpupoolv1.LeaseState_LEASE_STATE_EXPIRED, NowMs: ld.nowMs(), IfPending: true,
		Reason: fmt.Sprintf("left the queue: no client waited for it for %s", ld.cfg.PendingGrace),
	})
	ld.logTimerErr("end an abandoned pending lease", id, err)
}

// preemptDeadlinePassed revokes a preempted lease at its deadline, or
// withdraws the preemption when the lease it made room for no longer
// waits. A command that does not commit is retried while ls leads.
func (ld *leadership) preemptDeadlinePassed(ls *leaderState, id string) {
	st := ld.fsm.State()
	l := st.Lease(id)
	if l == nil || l.State != gpupoolv1.LeaseState_LEASE_STATE_GRANTED || l.PreemptAtMs == 0 {
		return
	}
	var cmd proto.Message = &gpupoolv1.EndLeaseCommand{
		LeaseId: id, EndState: gpupoolv1.LeaseState_LEASE_STATE_REVOKED, NowMs: ld.nowMs(), Preempted: true,
		Reason: fmt.Sprintf("preempted for %s after a grace of %s", l.PreemptedFor, ld.cfg.PreemptGrace),
	}
	if r := st.Lease(l.PreemptedFor); r == nil || r.State != gpupoolv1.LeaseState_LEASE_STATE_PENDING {
		cmd = planner.Withdrawal(l.PreemptedFor, []string{id})
	}
	res, err := ld.apply(cmd)
	if err == nil || res != nil {
		return
	}
	select {
	case <-ls.stopCh:
		return
	default:
	}
	ld.log.Warn("revoking a preempted lease failed; retrying", "lease", id, "err", err)
	ls.preempt.Reset(id, time.Second)
}

// reactQueue keeps the queue's timers and follow-ups in step with a
// changed lease.
func (ld *leadership) reactQueue(ls *leaderState, st *state.Reader, l *gpupoolv1.Lease) {
	ls.leaseChanged(l.Id)
	switch {
	case l.State == gpupoolv1.LeaseState_LEASE_STATE_PENDING:
		if _, armed := ls.pendingGrace.Deadline(l.Id); !armed && !ls.waiting(l.Id) {
			ls.pendingGrace.Reset(l.Id, ld.cfg.PendingGrace)
		}
		return
	case l.State == gpupoolv1.LeaseState_LEASE_STATE_GRANTED && l.PreemptAtMs != 0:
		at := time.UnixMilli(l.PreemptAtMs)
		if cur, ok := ls.preempt.Deadline(l.Id); !ok || !cur.Equal(at) {
			ls.preempt.Reset(l.Id, max(0, at.Sub(ld.cfg.Clock.Now())))
		}
	default:
		ls.preempt.Stop(l.Id)
	}
	ls.pendingGrace.Stop(l.Id)
	if l.CreateIndex != 0 && l.State != gpupoolv1.LeaseState_LEASE_STATE_PENDING {
		// A lease that stopped waiting spares the leases preempted for it.
		var spare []string
		for _, v := range st.PreemptedFor(l.Id) {
			if v.State == gpupoolv1.LeaseState_LEASE_STATE_GRANTED {
				spare = append(spare, v.Id)
			}
		}
		if len(spare) > 0 {
			ld.goFunc(func() { ld.applyLogged("withdraw a preemption", planner.Withdrawal(l.Id, spare)) })
		}
	}
	if l.GetRequest().GetElasticMax() > 0 && l.State != gpupoolv1.LeaseState_LEASE_STATE_GRANTED {
		// The extras of an elastic lease end with it.
		for _, x := range st.Extras(l.Id) {
			if x.State == gpupoolv1.LeaseState_LEASE_STATE_GRANTED {
				ld.goFunc(func() {
					ld.applyLogged("end an elastic lease's extra", &gpupoolv1.EndLeaseCommand{
						LeaseId: x.Id, EndState: gpupoolv1.LeaseState_LEASE_STATE_REVOKED, NowMs: ld.nowMs(),
						Reason: fmt.Sprintf("elastic lease %s ended", l.Id),
					})
				})
			}
		}
	}
}

func (ld *leadership) applyLogged(what string, cmd proto.Message) {
	if _, err := ld.apply(cmd); err != nil {
		ld.log.Debug(what+" failed", "err", err)
	}
}

// whyPending explains why pending lease l is not granted: see
// planner.Explainer.
func (cp *capacity) whyPending(st *state.Reader, l *gpupoolv1.Lease) string {
	return cp.explainer(st).Why(l)
}

// explainer explains the pending leases of st, as of now on this server.
func (cp *capacity) explainer(st *state.Reader) *planner.Explainer {
	return planner.NewExplainer(st, cp.placer, cp.cfg.Clock.Now())
}
