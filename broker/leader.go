package broker

import (
	"fmt"
	"github.com/hashicorp/raft"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gpupool/gpupool/broker/fsm"
	"github.com/gpupool/gpupool/broker/lease"
	"github.com/gpupool/gpupool/broker/state"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// leaderState is what only the leader keeps, in memory: lease TTLs, host
// heartbeats and lock-delays, and teardown confirmations. Nothing here is
// replicated; a new leader rebuilds it from the state, re-arming every
// timer at its full duration (a lease never expires early; late is allowed).
type leaderState struct {
	stopCh    chan struct{}
	ttl       *lease.Timers // lease id → expiry
	heartbeat *lease.Timers // host id → down
	lockDelay *lease.Timers // lease id → free without confirmation
	drain     *lease.Timers // host id → drain deadline (absolute, from Host.drain)
	// preempt: lease id → revocation of a preempted lease (from
	// Lease.preempt_at_ms); pendingGrace: pending lease id → its end when
	// no call waits on it.
	preempt      *lease.Timers
	pendingGrace *lease.Timers
	kick         chan struct{} // asks for a pass of the queue
	// collectKick asks for a pass of the collection of ended leases;
	// endedSinceCollect counts the leases that ended since the last one.
	collectKick       chan struct{}
	endedSinceCollect atomic.Int64
	// verifier confirms that this server still leads before a renewal
	// is answered; one per term.
	verifier *leadVerifier

	// expireMu orders renewals against expiry: a renewal that is answered
	// happens entirely before or after an expiry is decided.
	expireMu sync.Mutex

	mu        sync.Mutex
	lastSeen  map[string]time.Time       // guarded by mu; host → last heartbeat
	confirmed map[string]map[string]bool // guarded by mu; lease → hosts that confirmed teardown
	reports   map[string]*hostReport     // guarded by mu; host → its agent's last live readings
	// drainRetry is set while the drain timer of a host is re-armed to
	// retry the deadline's revocation after its apply failed.
	drainRetry map[string]drainRetry      // guarded by mu; host → retry
	waiters    map[string]int             // guarded by mu; pending lease → Acquire calls waiting on it
	leaseWatch map[string][]chan struct{} // guarded by mu; lease → channels signalled when it changes
	// healthClears are the GPUs whose unhealthy mark an operator cleared
	// and whose agent has not reported them healthy yet.
	healthClears map[string]map[string]bool // guarded by mu; host → device uuids
}

// leadership keeps what only the leader keeps, in memory (leaderState),
// and runs the leader's duties while this server leads: the timers of
// leases, hosts, drains and preemptions, the queue's passes (through
// capacity), the collection of ended leases and the servers' versions.
// It implements leaderMemory for the other components.
//
// It reaches the rest of the broker through three seams: queueRunner
// (capacity's queue), peerAddresses (membership) and tokenSigner
// (signing).
type leadership struct {
	*node
	capacity   queueRunner
	membership peerAddresses
	signing    tokenSigner
	// raft is set by New before the server serves, never changed.
	raft *raft.Raft
	// notifyCh receives Raft's leadership changes.
	notifyCh chan bool
	// metrics counts what the leader's duties do; set by New.
	metrics *metrics

	leaderMu sync.Mutex
	leader   *leaderState // guarded by leaderMu; nil unless leader
}

func newLeadership(nd *node) *leadership {
	return &leadership{node: nd, notifyCh: make(chan bool, 16)}
}

// queueRunner is the queue, as the leader's duties drive it. It is
// implemented by capacity.
type queueRunner interface {
	// runQueue runs passes of the queue, one at a time, each time one is
	// asked for (ls.kickQueue), until ls's term ends (ls.stopCh).
	runQueue(ls *leaderState)
	// relearn makes placement learn the mix of requests again from the
	// live leases of st. A new leader calls it before its first pass.
	relearn(st *state.Reader)
}

// monitorLeadership starts and stops the leader's duties as raft reports
// leadership changes.
func (ld *leadership) monitorLeadership() {
	var stop func()
	for {
		select {
		case isLeader := <-ld.notifyCh:
			switch {
			case isLeader && stop == nil:
				stop = ld.startLeading()
			case !isLeader && stop != nil:
				stop()
				stop = nil
			}
		case <-ld.ctx.Done():
			if stop != nil {
				stop()
			}
			return
		}
	}
}

// startLeading begins the leader's duties and returns the function that
// ends them.
func (ld *leadership) startLeading() func() {
	ls := &leaderState{
		stopCh:    make(chan struct{}),
		lastSeen:  map[string]time.Time{},
		confirmed: map[string]map[string]bool{},
		reports:   map[string]*hostReport{},

		drainRetry:   map[string]drainRetry{},
		waiters:      map[string]int{},
		leaseWatch:   map[string][]chan struct{}{},
		healthClears: map[string]map[string]bool{},
		kick:         make(chan struct{}, 1),
		collectKick:  make(chan struct{}, 1),
	}
	ls.verifier = newLeadVerifier(func() error { return ld.raft.VerifyLeader().Error() }, ld.goFunc)
	ls.ttl = lease.NewTimers(ld.cfg.Clock, ld.expireLease)
	ls.heartbeat = lease.NewTimers(ld.cfg.Clock, ld.hostMissedHeartbeats)
	ls.lockDelay = lease.NewTimers(ld.cfg.Clock, ld.lockDelayPassed)
	ls.drain = lease.NewTimers(ld.cfg.Clock, func(id string) { ld.drainDeadlinePassed(ls, id) })
	ls.preempt = lease.NewTimers(ld.cfg.Clock, func(id string) { ld.preemptDeadlinePassed(ls, id) })
	ls.pendingGrace = lease.NewTimers(ld.cfg.Clock, func(id string) { ld.pendingGraceOver(ls, id) })
	events, cancel := ld.fsm.Subscribe()
	done := make(chan struct{})
	ld.goFunc(func() {
		defer close(done)
		ld.lead(ls, events)
	})
	return func() {
		close(ls.stopCh)
		cancel()
		<-done
		ld.leaderMu.Lock()
		ld.leader = nil
		ld.leaderMu.Unlock()
		ls.ttl.StopAll()
		ls.heartbeat.StopAll()
		ls.lockDelay.StopAll()
		ls.drain.StopAll()
		ls.preempt.StopAll()
		ls.pendingGrace.StopAll()
		ld.log.Info("lost leadership", "id", ld.cfg.NodeID)
	}
}

func (ld *leadership) lead(ls *leaderState, events <-chan fsm.Event) {
	// Everything committed by earlier leaders is applied after the barrier.
	if !ld.retryWhileLeading(ls, "leader barrier", func() error { return ld.raft.Barrier(0).Error() }) {
		return
	}
	ld.upsertServers()
	if !ld.retryWhileLeading(ls, "creating the token signing key", ld.signing.ensureSigningKey) {
		return
	}
	ld.armAll(ls, 2*ld.cfg.HeartbeatTTL)
	ld.capacity.relearn(ld.fsm.State())
	ld.leaderMu.Lock()
	ld.leader = ls
	ld.leaderMu.Unlock()
	ld.log.Info("became leader", "id", ld.cfg.NodeID, "index", ld.fsm.State().Index())
	queueDone := make(chan struct{})
	ld.goFunc(func() {
		defer close(queueDone)
		ld.capacity.runQueue(ls)
	})
	defer func() { <-queueDone }()
	versionsDone := make(chan struct{})
	ld.goFunc(func() {
		defer close(versionsDone)
		ld.watchServerVersions(ls)
	})
	defer func() { <-versionsDone }()
	collectDone := make(chan struct{})
	ld.goFunc(func() {
		defer close(collectDone)
		ld.collectEnded(ls)
	})
	defer func() { <-collectDone }()
	ls.kickQueue()
	for {
		select {
		case <-ls.stopCh:
			return
		case ev, ok := <-events:
			if !ok {
				// Fell behind: re-read everything and carry on.
				var cancel func()
				events, cancel = ld.fsm.Subscribe()
				defer cancel()
				ld.armAll(ls, ld.cfg.HeartbeatTTL)
				ls.kickQueue()
				continue
			}
			ld.react(ls, ev)
		}
	}
}

// retryWhileLeading calls fn, with backoff, until it succeeds (true) or
// leadership ends (false).
func (ld *leadership) retryWhileLeading(ls *leaderState, what string, fn func() error) bool {
	for backoff := 50 * time.Millisecond; ; backoff = min(2*backoff, 2*time.Second) {
		err := fn()
		if err == nil {
			return true
		}
		ld.log.Warn(what+" failed; retrying", "err", err, "retry_in", backoff)
		select {
		case <-ls.stopCh:
			return false
		case <-time.After(backoff):
		}
	}
}

// currentLeader returns the leader state, or nil when this server is not
// (yet) acting as leader.
func (ld *leadership) currentLeader() *leaderState {
	ld.leaderMu.Lock()
	defer ld.leaderMu.Unlock()
	return ld.leader
}

// upsertServers records every configured server's gRPC address in the
// state, so followers can forward to whichever becomes leader.
func (ld *leadership) upsertServers() {
	f := ld.raft.GetConfiguration()
	if f.Error() != nil {
		return
	}
	st := ld.fsm.State()
	for _, srv := range f.Configuration().Servers {
		id := string(srv.ID)
		rpc := ld.membership.rpcAddrOf(id)
		if rpc == "" {
			continue
		}
		cur := st.Server(id)
		if cur != nil && cur.RpcAddress == rpc && cur.RaftAddress == string(srv.Address) {
			continue
		}
		if _, err := ld.apply(keepVersion(ld.fsm.State(), &gpupoolv1.UpsertServerCommand{Id: id, RpcAddress: rpc, RaftAddress: string(srv.Address)})); err != nil {
			ld.log.Warn("record server address", "id", id, "err", err)
		}
	}
}

// armAll sets every timer from the state, at full duration. A host
// without a heartbeat deadline gets hostTTL.
//
// A new leader passes twice the heartbeat TTL: no agent has heartbeated
// to it yet, and an agent whose stream sits on a broker that went silent
// (the old leader, cut off from the others) needs one TTL to give that
// stream up, then time to find this leader. At one TTL a host would be
// marked down, and its leases revoked, for the election alone. The grace
// only ever marks a host down later, which keeps lock-delay's bound.
func (ld *leadership) armAll(ls *leaderState, hostTTL time.Duration) {
	st := ld.fsm.State()
	for _, h := range st.Hosts() {
		ld.armHost(ls, st, h, hostTTL)
	}
	for _, l := range st.Leases() {
		ld.reactLease(ls, st, l)
	}
}

func (ld *leadership) react(ls *leaderState, ev fsm.Event) {
	st := ld.fsm.State()
	switch {
	case ev.Reset:
		ls.ttl.StopAll()
		ls.lockDelay.StopAll()
		ls.drain.StopAll()
		ls.preempt.StopAll()
		ls.pendingGrace.StopAll()
		ld.armAll(ls, ld.cfg.HeartbeatTTL)
		ls.kickQueue()
		// A restored snapshot may predate signing keys.
		ld.goFunc(func() {
			if err := ld.signing.ensureSigningKey(); err != nil {
				ld.log.Warn("creating the token signing key after a restore failed", "err", err)
			}
		})
	case ev.Host != nil:
		ld.reactHost(ls, st, ev.Host)
		ls.kickQueue()
	case ev.Lease != nil:
		ld.reactLease(ls, st, ev.Lease)
		if state.Ended(ev.Lease.State) && ev.Type == gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_ENDED {
			ld.noteEnded(ls)
		}
		if ev.Type != gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_RELEASING {
			ls.kickQueue()
		}
	}
}

func (ld *leadership) reactHost(ls *leaderState, st *state.Reader, h *gpupoolv1.Host) {
	ld.armHost(ls, st, h, ld.cfg.HeartbeatTTL)
}

func (ld *leadership) armHost(ls *leaderState, st *state.Reader, h *gpupoolv1.Host, ttl time.Duration) {
	ld.reactDrain(ls, h)
	if h.Status == gpupoolv1.HostStatus_HOST_STATUS_DOWN {
		ls.heartbeat.Stop(h.Id)
		for _, l := range st.HostLeases(h.Id) {
			ld.reactLease(ls, st, l)
		}
		return
	}
	if _, ok := ls.heartbeat.Deadline(h.Id); !ok {
		ls.heartbeat.Reset(h.Id, ttl)
	}
	// The host is back: its agent confirms teardown of what it still runs,
	// so no lease of it may be freed on the lock-delay any more.
	for _, l := range st.HostLeases(h.Id) {
		if l.State == gpupoolv1.LeaseState_LEASE_STATE_RELEASING && !fsm.AnyHostDown(st, l) {
			ls.lockDelay.Stop(l.Id)
		}
	}
}

func (ld *leadership) reactLease(ls *leaderState, st *state.Reader, l *gpupoolv1.Lease) {
	ld.reactQueue(ls, st, l)
	switch l.State {
	case gpupoolv1.LeaseState_LEASE_STATE_GRANTED:
		if _, ok := ls.ttl.Deadline(l.Id); !ok {
			ls.ttl.Reset(l.Id, time.Duration(l.TtlMs)*time.Millisecond)
		}
	case gpupoolv1.LeaseState_LEASE_STATE_RELEASING:
		ls.ttl.Stop(l.Id)
		if _, ok := ls.lockDelay.Deadline(l.Id); !ok && fsm.AnyHostDown(st, l) {
			ls.lockDelay.Reset(l.Id, ld.cfg.LockDelay)
		}
	default:
		ls.ttl.Stop(l.Id)
		ls.lockDelay.Stop(l.Id)
		ls.mu.Lock()
		delete(ls.confirmed, l.Id)
		ls.mu.Unlock()
	}
}

func (ld *leadership) expireLease(id string) {
	ls := ld.currentLeader()
	if ls == nil {
		return
	}
	ls.expireMu.Lock()
	defer ls.expireMu.Unlock()
	if _, renewed := ls.ttl.Deadline(id); renewed {
		return
	}
	l := ld.fsm.State().Lease(id)
	if l == nil || l.State != gpupoolv1.LeaseState_LEASE_STATE_GRANTED {
		return
	}
	_, err := ld.apply(&gpupoolv1.EndLeaseCommand{
		LeaseId: id, EndState: gpupoolv1.LeaseState_LEASE_STATE_EXPIRED, NowMs: ld.nowMs(),
		Reason: fmt.Sprintf("not renewed within its TTL of %s", time.Duration(l.TtlMs)*time.Millisecond),
	})
	ld.logTimerErr("expire lease", id, err)
}

func (ld *leadership) hostMissedHeartbeats(id string) {
	_, err := ld.apply(&gpupoolv1.SetHostStatusCommand{
		HostId: id, Status: gpupoolv1.HostStatus_HOST_STATUS_DOWN, NowMs: ld.nowMs(),
		Reason: fmt.Sprintf("no heartbeat for %s", ld.cfg.HeartbeatTTL),
	})
	ld.logTimerErr("mark host down", id, err)
	if ls := ld.currentLeader(); ls != nil {
		ls.forgetReport(id)
	}
	if err == nil {
		ld.log.Warn("host down: heartbeats stopped", "host", id, "ttl", ld.cfg.HeartbeatTTL)
	}
}

func (ld *leadership) lockDelayPassed(id string) {
	_, err := ld.apply(&gpupoolv1.FreeLeaseCommand{
		LeaseId: id, NowMs: ld.nowMs(), RequireHostDown: true,
		Reason: fmt.Sprintf("capacity freed after the lock-delay of %s: %s", ld.cfg.LockDelay, unconfirmedFreeReason),
	})
	ld.logTimerErr("free lease after lock-delay", id, err)
}

func (ld *leadership) logTimerErr(what, id string, err error) {
	if err != nil {
		// Usually leadership moved; the new leader re-arms its own timers.
		ld.log.Debug(what+" failed", "id", id, "err", err)
	}
}

// freeAfterTeardown frees l once its agents confirmed teardown.
func freeAfterTeardown(l *gpupoolv1.Lease, nowMs int64) *gpupoolv1.FreeLeaseCommand {
	return &gpupoolv1.FreeLeaseCommand{LeaseId: l.Id, NowMs: nowMs, Reason: "agent confirmed teardown"}
}

// tornDownEverywhere records that hostID tore l down, and reports whether
// every host of l has now.
func (ls *leaderState) tornDownEverywhere(hostID string, l *gpupoolv1.Lease) bool {
	hosts := state.LeaseHosts(l)
	if !slices.Contains(hosts, hostID) {
		return false
	}
	ls.mu.Lock()
	defer ls.mu.Unlock()
	set := ls.confirmed[l.Id]
	if set == nil {
		set = map[string]bool{}
		ls.confirmed[l.Id] = set
	}
	set[hostID] = true
	all := true
	for _, h := range hosts {
		all = all && set[h]
	}
	return all
}
