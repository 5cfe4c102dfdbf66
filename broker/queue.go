package broker

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/gpupool/gpupool/broker/fsm"
	"github.com/gpupool/gpupool/broker/placement"
	"github.com/gpupool/gpupool/broker/state"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
	"github.com/gpupool/gpupool/protocol"
)

// The queue runs on the leader. Pending leases, preemption deadlines and
// elastic extras are state; what is in leader memory is only who waits on
// a pending lease (a new leader gives absent waiters PendingGrace to come
// back) and the timers, re-armed from the state like lease TTLs.
//
// A pass (schedule) walks the queue in order, priority then arrival, on a
// private copy of the pool:
//   - a request that fits is granted; a later, smaller one that fits while
//     the head does not is granted too (backfill);
//   - a request whose victims are still leaving has its slices reserved in
//     the copy, so nothing placed after it takes the room it waits for;
//   - a guaranteed request that does not fit looks for preemptible leases
//     to preempt (chooseVictims) and, if that makes room, notifies them and
//     reserves;
//   - when nobody waits for capacity, elastic leases grow into what is left.
//
// Passes run one at a time, under placeMu like Acquire's own placement, and
// are triggered by every change that can free or take capacity.

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
func (s *Server) runQueue(ls *leaderState) {
	for {
		select {
		case <-ls.stopCh:
			return
		case <-ls.kick:
		}
		s.schedule(ls)
		select {
		case <-ls.stopCh:
			return
		case <-time.After(minPassInterval):
		}
	}
}

// outcome is what a pass did with one pending lease.
type outcome int

const (
	granted         outcome = iota
	waitingCapacity         // waits for room: nothing may grow into it
	waitingQuota            // waits for its tenant's quota: does not block others
	waitingNever            // cannot fit the pool as it is built now: blocks nothing
)

func (s *Server) schedule(ls *leaderState) {
	s.placeMu.Lock()
	defer s.placeMu.Unlock()
	if st := s.fsm.State(); len(st.PendingLeases()) == 0 && len(st.ElasticLeases()) == 0 {
		return
	}
	s.grants.drain() // the pass works on a copy of the state alone
	st := s.fsm.State()
	queue := st.PendingLeases()
	pool := newWorkPool(st)
	blocked := false
	for _, r := range queue {
		if s.scheduleOne(ls, pool, r) == waitingCapacity {
			blocked = true
		}
	}
	if !blocked {
		s.grow(ls, pool)
	}
}

// scheduleOne grants, reserves for or preempts for pending lease r.
func (s *Server) scheduleOne(ls *leaderState, pool *workPool, r *gpupoolv1.Lease) outcome {
	st := s.fsm.State()
	victims := st.PreemptedFor(r.Id)
	ss, err := pool.place(r.Request, s.placer)
	roomNow := err == nil
	if roomNow && fsm.CheckQuota(st, grantOf(r, ss)) == nil {
		// It fits as the pool is, victims or not (their preemption is
		// withdrawn once r is granted).
		return s.grantPending(ls, pool, r, ss)
	}
	if pe := (*placement.Error)(nil); errors.As(err, &pe) && pe.Never {
		return waitingNever
	}
	if len(victims) > 0 {
		work := pool.clone()
		for _, v := range victims {
			work.free(v)
		}
		if ss, err := work.place(r.Request, s.placer); err == nil && fsm.CheckQuotaWithout(st, grantOf(r, ss), victims) == nil {
			// Reserved until the victims are gone.
			pool.allocate(&gpupoolv1.Lease{Slices: ss, HostCpuMillicores: r.HostCpuMillicores, HostMemoryMib: r.HostMemoryMib})
			return waitingCapacity
		}
	}
	blocked := waitingCapacity
	if roomNow {
		blocked = waitingQuota
	}
	if r.Class == gpupoolv1.LeaseClass_LEASE_CLASS_PREEMPTIBLE {
		return blocked
	}
	// Victims beyond those already leaving, counting those as gone: room
	// on the pool and in the tenant's quota.
	work := pool.clone()
	for _, v := range victims {
		work.free(v)
	}
	more, ss := chooseVictimsFor(work, preemptionCandidates(st, r), func(trial *workPool, chosen []*gpupoolv1.Lease) []*gpupoolv1.Slice {
		ss, err := trial.place(r.Request, s.placer)
		if err != nil || fsm.CheckQuotaWithout(st, grantOf(r, ss), append(slices.Clone(victims), chosen...)) != nil {
			return nil
		}
		return ss
	})
	if more == nil {
		if len(victims) > 0 {
			// Its victims no longer make room (the pool or the quota
			// changed): spare them.
			go s.applyLogged("withdraw a preemption", withdrawal(r.Id, ids(victims)))
		}
		return blocked
	}
	deadline := s.cfg.Clock.Now().Add(s.cfg.PreemptGrace)
	reason := fmt.Sprintf("preempted for %s (tenant %s, guaranteed, priority %d): %s", r.Id, r.Tenant, r.Priority, requestText(r.Request))
	if _, err := s.apply(&gpupoolv1.PreemptLeasesCommand{LeaseIds: ids(more), ForLease: r.Id, DeadlineMs: deadline.UnixMilli(), Reason: reason, NowMs: s.nowMs()}); err != nil {
		s.log.Warn("preempting leases failed", "for", r.Id, "leases", ids(more), "err", err)
		return waitingCapacity
	}
	s.log.Info("leases preempted", "for", r.Id, "leases", ids(more), "grace", s.cfg.PreemptGrace)
	pool.allocate(&gpupoolv1.Lease{Slices: ss, HostCpuMillicores: r.HostCpuMillicores, HostMemoryMib: r.HostMemoryMib})
	return waitingCapacity
}

// grantPending grants pending lease r on slices ss.
func (s *Server) grantPending(ls *leaderState, pool *workPool, r *gpupoolv1.Lease, ss []*gpupoolv1.Slice) outcome {
	res, err := s.apply(&gpupoolv1.GrantLeaseCommand{Lease: grantOf(r, ss), NowMs: s.nowMs()})
	if err != nil {
		s.log.Debug("granting a pending lease failed", "lease", r.Id, "err", err)
		return waitingCapacity
	}
	if res.Lease.State != gpupoolv1.LeaseState_LEASE_STATE_GRANTED || res.Lease.Id != r.Id {
		return granted // it left the queue meanwhile; nothing was allocated
	}
	pool.allocate(res.Lease)
	ls.ttl.Reset(res.Lease.Id, protocol.TTL(res.Lease.Request))
	s.log.Info("pending lease granted", "lease", r.Id, "tenant", r.Tenant, "waited", time.Duration(res.Lease.StateChangedAtMs-res.Lease.CreatedAtMs)*time.Millisecond)
	return granted
}

func ids(ls []*gpupoolv1.Lease) []string {
	out := make([]string, len(ls))
	for i, l := range ls {
		out[i] = l.Id
	}
	return out
}

// preemptionCandidates are the leases r may preempt: granted preemptible
// leases of priority at most r's, and every elastic extra (extras only
// use room nobody waits for), not already preempted. A guaranteed lease
// is never preempted.
func preemptionCandidates(st *state.Reader, r *gpupoolv1.Lease) []*gpupoolv1.Lease {
	return slices.DeleteFunc(st.Preemptible(), func(l *gpupoolv1.Lease) bool { return l.Parent == "" && l.Priority > r.Priority })
}

// grantOf is the grant of pending lease r on slices ss.
func grantOf(r *gpupoolv1.Lease, ss []*gpupoolv1.Slice) *gpupoolv1.Lease {
	l := proto.CloneOf(r)
	l.Slices = ss
	l.State, l.Reason, l.PendingReason = gpupoolv1.LeaseState_LEASE_STATE_UNSPECIFIED, "", ""
	return l
}

// grow adds extras to elastic leases while the pool has room: one slice
// per lease per round, the leases with the fewest extras first (then the
// oldest), until none can grow.
func (s *Server) grow(ls *leaderState, pool *workPool) {
	type growing struct {
		p      *gpupoolv1.Lease
		extras int32
		left   int32
	}
	st := s.fsm.State()
	var gs []*growing
	for _, p := range st.ElasticLeases() {
		held := int32(len(p.Slices))
		var extras int32
		for _, x := range st.Extras(p.Id) {
			if state.Holding(x.State) {
				held += int32(len(x.Slices))
				extras++
			}
		}
		if left := p.Request.ElasticMax - held; left > 0 {
			gs = append(gs, &growing{p: p, extras: extras, left: left})
		}
	}
	slices.SortFunc(gs, func(a, b *growing) int {
		if a.extras != b.extras {
			return int(a.extras - b.extras)
		}
		return int(a.p.CreateIndex) - int(b.p.CreateIndex)
	})
	for len(gs) > 0 {
		gs = slices.DeleteFunc(gs, func(g *growing) bool {
			if !s.growOne(ls, pool, g.p) {
				return true
			}
			g.extras++
			g.left--
			return g.left == 0
		})
	}
}

// growOne grants elastic lease p one extra slice if the pool has room.
func (s *Server) growOne(ls *leaderState, pool *workPool, p *gpupoolv1.Lease) bool {
	req := extraRequest(p.Request)
	ss, err := pool.place(req, s.placer)
	if err != nil {
		return false
	}
	x := &gpupoolv1.Lease{
		Id: "l-" + randomHex(8), Tenant: p.Tenant, Holder: p.Holder, Request: req, Slices: ss,
		Class: gpupoolv1.LeaseClass_LEASE_CLASS_PREEMPTIBLE, Priority: p.Priority, TtlMs: p.TtlMs,
		CreatedAtMs: s.nowMs(), Parent: p.Id,
	}
	if fsm.CheckQuota(s.fsm.State(), x) != nil {
		return false
	}
	res, err := s.apply(&gpupoolv1.GrantLeaseCommand{Lease: x, NowMs: x.CreatedAtMs})
	if err != nil {
		s.log.Debug("growing an elastic lease failed", "lease", p.Id, "err", err)
		return false
	}
	pool.allocate(res.Lease)
	ls.ttl.Reset(res.Lease.Id, time.Duration(res.Lease.TtlMs)*time.Millisecond)
	s.log.Info("elastic lease grew", "lease", p.Id, "extra", res.Lease.Id, "host", ss[0].Host)
	return true
}

// extraRequest is the request of one extra slice of elastic request r.
func extraRequest(r *gpupoolv1.LeaseRequest) *gpupoolv1.LeaseRequest {
	x := proto.CloneOf(r)
	x.Count, x.ElasticMax = 1, 0
	x.Class = gpupoolv1.LeaseClass_LEASE_CLASS_PREEMPTIBLE
	x.Topology = gpupoolv1.Topology_TOPOLOGY_UNSPECIFIED
	x.HostCpuMillicores, x.HostMemoryMib = 0, 0
	x.RequestId = ""
	return x
}

// requestText is a short description of what a request asks for.
func requestText(r *gpupoolv1.LeaseRequest) string {
	if r.Exclusive {
		return fmt.Sprintf("%d whole GPU(s)", r.Count)
	}
	return fmt.Sprintf("%d slice(s) of %d MiB and %d%% compute", r.Count, r.MemoryMib, r.ComputePercent)
}

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

// enqueue adds r to the queue as a pending lease and returns it.
func (s *Server) enqueue(r *gpupoolv1.LeaseRequest, by *gpupoolv1.Actor) (*gpupoolv1.Lease, error) {
	l := &gpupoolv1.Lease{
		GrantedBy: by,
		Id:        "l-" + randomHex(8), Tenant: r.Tenant, Holder: r.Holder, Request: r, Class: r.Class, Priority: r.Priority,
		TtlMs: r.TtlMs, CreatedAtMs: s.nowMs(), RequestId: r.RequestId,
		HostCpuMillicores: r.HostCpuMillicores, HostMemoryMib: r.HostMemoryMib,
	}
	res, err := s.apply(&gpupoolv1.EnqueueLeaseCommand{Lease: l})
	if err != nil {
		return nil, err
	}
	return res.Lease, nil
}

// awaitGrant waits, on the leader, for pending lease id to be granted, for
// at most wait. A caller that goes away takes the lease out of the queue
// (unless another call still waits on it); so does the end of the wait.
func (s *Server) awaitGrant(ctx context.Context, id string, wait time.Duration) (*gpupoolv1.AcquireResponse, error) {
	ls := s.currentLeader()
	if ls == nil {
		return nil, status.Error(codes.Unavailable, "leader is still starting; retry with the same request id to rejoin the queue")
	}
	changed, unwatch := ls.watchLease(id)
	defer unwatch()
	timeout := make(chan struct{})
	t := s.cfg.Clock.AfterFunc(wait, func() { close(timeout) })
	defer t.Stop()
	ls.addWaiter(id) // after the timer: a waiter seen waiting has its wait running
	ls.kickQueue()
	// leave takes the lease out of the queue unless another call still
	// waits on it. The end applies only while the lease is pending, so it
	// cannot undo a grant that raced with it; it returns the lease after.
	leave := func(end gpupoolv1.LeaseState, reason string) *gpupoolv1.Lease {
		if ls.removeWaiter(id) > 0 {
			return s.fsm.State().Lease(id)
		}
		_, err := s.apply(&gpupoolv1.EndLeaseCommand{LeaseId: id, EndState: end, Reason: reason, NowMs: s.nowMs(), IfPending: true})
		if err != nil {
			s.log.Debug("taking a pending lease out of the queue failed", "lease", id, "err", err)
		}
		return s.fsm.State().Lease(id)
	}
	for {
		l := s.fsm.State().Lease(id)
		switch {
		case l == nil:
			ls.removeWaiter(id)
			return nil, status.Errorf(codes.NotFound, "lease %s: not found", id)
		case l.State == gpupoolv1.LeaseState_LEASE_STATE_GRANTED:
			ls.removeWaiter(id)
			return s.acquired(l, false)
		case l.State != gpupoolv1.LeaseState_LEASE_STATE_PENDING:
			ls.removeWaiter(id)
			return nil, status.Errorf(codes.ResourceExhausted, "lease %s left the queue without a grant: %s", id, l.Reason)
		}
		select {
		case <-ctx.Done():
			// A grant that raced with the departure is left to its TTL:
			// nobody is there to hold it.
			leave(gpupoolv1.LeaseState_LEASE_STATE_RELEASED, "left the queue: the waiting client went away")
			return nil, status.FromContextError(ctx.Err()).Err()
		case <-timeout:
			why := s.whyPending(s.fsm.State(), l)
			if now := leave(gpupoolv1.LeaseState_LEASE_STATE_EXPIRED, fmt.Sprintf("not granted within the wait of %s: %s", wait, why)); now.GetState() == gpupoolv1.LeaseState_LEASE_STATE_GRANTED {
				return s.acquired(now, false) // granted as the wait ended
			}
			return nil, status.Errorf(codes.ResourceExhausted, "not granted within the wait of %s: %s", wait, why)
		case <-ls.stopCh:
			ls.removeWaiter(id)
			return nil, status.Errorf(codes.Unavailable, "%v while waiting; retry with the same request id to rejoin the queue", ErrLeadershipLost)
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
func (s *Server) pendingGraceOver(ls *leaderState, id string) {
	l := s.fsm.State().Lease(id)
	if l == nil || l.State != gpupoolv1.LeaseState_LEASE_STATE_PENDING || ls.waiting(id) {
		return
	}
	_, err := s.apply(&gpupoolv1.EndLeaseCommand{
		LeaseId: id, EndState: gpupoolv1.LeaseState_LEASE_STATE_EXPIRED, NowMs: s.nowMs(), IfPending: true,
		Reason: fmt.Sprintf("left the queue: no client waited for it for %s", s.cfg.PendingGrace),
	})
	s.logTimerErr("end an abandoned pending lease", id, err)
}

// preemptDeadlinePassed revokes a preempted lease at its deadline, or
// withdraws the preemption when the lease it made room for no longer
// waits. A command that does not commit is retried while ls leads.
func (s *Server) preemptDeadlinePassed(ls *leaderState, id string) {
	st := s.fsm.State()
	l := st.Lease(id)
	if l == nil || l.State != gpupoolv1.LeaseState_LEASE_STATE_GRANTED || l.PreemptAtMs == 0 {
		return
	}
	var cmd proto.Message = &gpupoolv1.EndLeaseCommand{
		LeaseId: id, EndState: gpupoolv1.LeaseState_LEASE_STATE_REVOKED, NowMs: s.nowMs(), Preempted: true,
		Reason: fmt.Sprintf("preempted for %s after a grace of %s", l.PreemptedFor, s.cfg.PreemptGrace),
	}
	if r := st.Lease(l.PreemptedFor); r == nil || r.State != gpupoolv1.LeaseState_LEASE_STATE_PENDING {
		cmd = withdrawal(l.PreemptedFor, []string{id})
	}
	res, err := s.apply(cmd)
	if err == nil || res != nil {
		return
	}
	select {
	case <-ls.stopCh:
		return
	default:
	}
	s.log.Warn("revoking a preempted lease failed; retrying", "lease", id, "err", err)
	ls.preempt.Reset(id, time.Second)
}

func withdrawal(forLease string, ids []string) *gpupoolv1.PreemptLeasesCommand {
	return &gpupoolv1.PreemptLeasesCommand{LeaseIds: ids, ForLease: forLease,
		Reason: fmt.Sprintf("lease %s no longer waits for the room", forLease)}
}

// reactQueue keeps the queue's timers and follow-ups in step with a
// changed lease.
func (s *Server) reactQueue(ls *leaderState, st *state.Reader, l *gpupoolv1.Lease) {
	ls.leaseChanged(l.Id)
	switch {
	case l.State == gpupoolv1.LeaseState_LEASE_STATE_PENDING:
		if _, armed := ls.pendingGrace.Deadline(l.Id); !armed && !ls.waiting(l.Id) {
			ls.pendingGrace.Reset(l.Id, s.cfg.PendingGrace)
		}
		return
	case l.State == gpupoolv1.LeaseState_LEASE_STATE_GRANTED && l.PreemptAtMs != 0:
		at := time.UnixMilli(l.PreemptAtMs)
		if cur, ok := ls.preempt.Deadline(l.Id); !ok || !cur.Equal(at) {
			ls.preempt.Reset(l.Id, max(0, at.Sub(s.cfg.Clock.Now())))
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
			go s.applyLogged("withdraw a preemption", withdrawal(l.Id, spare))
		}
	}
	if l.GetRequest().GetElasticMax() > 0 && l.State != gpupoolv1.LeaseState_LEASE_STATE_GRANTED {
		// The extras of an elastic lease end with it.
		for _, x := range st.Extras(l.Id) {
			if x.State == gpupoolv1.LeaseState_LEASE_STATE_GRANTED {
				go s.applyLogged("end an elastic lease's extra", &gpupoolv1.EndLeaseCommand{
					LeaseId: x.Id, EndState: gpupoolv1.LeaseState_LEASE_STATE_REVOKED, NowMs: s.nowMs(),
					Reason: fmt.Sprintf("elastic lease %s ended", l.Id),
				})
			}
		}
	}
}

func (s *Server) applyLogged(what string, cmd proto.Message) {
	if _, err := s.apply(cmd); err != nil {
		s.log.Debug(what+" failed", "err", err)
	}
}

// whyPending explains why pending lease l is not granted, from the real
// blockers: the leases it is preempting, what placement finds short in the
// pool (less what others reserved), hosts out of service, its tenant's
// quota, and the requests ahead of it.
func (s *Server) whyPending(st *state.Reader, l *gpupoolv1.Lease) string {
	return s.pendingExplainer(st).reason(l)
}

// pendingExplainer explains pending leases of one state: the pool less the
// reservations and the queue's order are computed once, however many
// leases a List explains.
type pendingExplainer struct {
	st     *state.Reader
	placer *placer
	now    time.Time
	hosts  []*gpupoolv1.Host
	ahead  map[string]int // pending lease → requests ahead of it
}

func (s *Server) pendingExplainer(st *state.Reader) *pendingExplainer {
	e := &pendingExplainer{st: st, placer: s.placer, now: s.cfg.Clock.Now(), ahead: map[string]int{}}
	for i, r := range st.PendingLeases() {
		e.ahead[r.Id] = i
	}
	return e
}

func (e *pendingExplainer) reason(l *gpupoolv1.Lease) string {
	st := e.st
	var parts []string
	if vs := st.PreemptedFor(l.Id); len(vs) > 0 {
		var last int64
		for _, v := range vs {
			last = max(last, v.PreemptAtMs)
		}
		parts = append(parts, fmt.Sprintf("preempting %s (%s), revoked in %s", plural(len(vs), "lease", "leases"),
			strings.Join(ids(vs), ", "), max(0, time.UnixMilli(last).Sub(e.now)).Round(time.Second)))
	} else {
		if e.hosts == nil {
			// Its own reservation is not in it: only leases with victims have one.
			e.hosts = reservedHosts(st, st.HostsWithDevices(), e.placer)
		}
		ss, err := e.placer.place(e.hosts, l.Request)
		switch {
		case err != nil:
			parts = append(parts, err.Error())
		case fsm.CheckQuota(st, grantOf(l, ss)) != nil:
			parts = append(parts, fsm.CheckQuota(st, grantOf(l, ss)).Error())
		default:
			parts = append(parts, "fits now: the queue grants it next")
		}
	}
	parts = append(parts, quotaPressure(st, l.Tenant)...)
	if n := e.ahead[l.Id]; n > 0 {
		parts = append(parts, fmt.Sprintf("%s ahead in the queue", plural(n, "request", "requests")))
	}
	return strings.Join(parts, "; ")
}

// quotaPressure names each dimension of a tenant's quota that is at least
// 80% used: "tenant sim at 90% of memory quota".
func quotaPressure(st *state.Reader, tenant string) []string {
	q := st.Quota(tenant)
	if q == nil {
		return nil
	}
	use := fsm.TenantUsage(st, tenant)
	var out []string
	for _, d := range []struct {
		name      string
		used, max int64
	}{
		{"gpus", int64(use.Gpus), int64(q.Gpus)},
		{"memory", use.MemoryMib, q.MemoryMib},
		{"compute", use.ComputePercent, q.ComputePercent},
	} {
		if d.max > 0 && d.used*100 >= 80*d.max {
			out = append(out, fmt.Sprintf("tenant %s at %d%% of %s quota", tenant, d.used*100/d.max, d.name))
		}
	}
	return out
}

func plural(n int, one, many string) string {
	if n == 1 {
		return "1 " + one
	}
	return fmt.Sprintf("%d %s", n, many)
}

// preemptionHint is the error for a guaranteed request without a wait
// that does not fit now: placement's reason, and, when preempting
// preemptible leases would make room, how to get it.
func (s *Server) preemptionHint(st *state.Reader, hosts []*gpupoolv1.Host, r *gpupoolv1.LeaseRequest, pe *placement.Error) error {
	if r.Class == gpupoolv1.LeaseClass_LEASE_CLASS_PREEMPTIBLE {
		return pe
	}
	cands := preemptionCandidates(st, &gpupoolv1.Lease{Priority: r.Priority})
	if len(cands) == 0 {
		return pe // the common case of a full pool: nothing to copy
	}
	victims, _ := chooseVictims(copyPool(hosts), r, s.placer, cands)
	if victims == nil {
		return pe
	}
	return &placement.Error{Reason: fmt.Sprintf("%s; preempting %s would make room: acquire with a wait of more than the %s grace (e.g. --wait 2m)",
		pe.Reason, plural(len(victims), "preemptible lease", "preemptible leases"), s.cfg.PreemptGrace)}
}
