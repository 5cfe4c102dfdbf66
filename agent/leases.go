package agent

import (
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/gpupool/gpupool/internal/clock"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// phase is where a lease is on this host.
type phase int

const (
	// enforcing: the lease may run processes on its slices.
	enforcing phase = iota
	// tearingDown: its processes are being stopped.
	tearingDown
	// tornDown: its processes are gone; the broker is told until it stops
	// listing the lease for teardown.
	tornDown
)

func (p phase) String() string {
	switch p {
	case enforcing:
		return "enforcing"
	case tearingDown:
		return "tearing down"
	case tornDown:
		return "torn down"
	}
	return "phase(" + strconv.Itoa(int(p)) + ")"
}

// leaseEntry is this host's record of one lease.
type leaseEntry struct {
	a     *gpupoolv1.Assignment
	phase phase
	// deadline is when the lease expires as far as this agent knows;
	// saved is the deadline last written to the lease's file.
	deadline, saved time.Time
	// expired is set once the watchdog stopped the lease's processes
	// because deadline plus the expiry grace passed; cleared when a
	// heartbeat response moves the deadline past now again.
	expired bool
	// over records, per device uuid, since when the lease has used more
	// memory than its slice there.
	over map[string]time.Time
	// usage is the watchdog's last reading of the lease.
	usage *gpupoolv1.LeaseUsage
	// stopping is set while a stop of the lease's processes runs.
	stopping bool
	// violations counts the watchdog's interventions since the agent
	// started.
	violations int
}

// leaseTable is the agent's view of its leases: what the brokers last
// asked it to enforce and tear down, what it refused, and the watchdog
// events not yet acknowledged. Every method is safe for concurrent use.
type leaseTable struct {
	mu      sync.Mutex
	entries map[string]*leaseEntry // guarded by mu
	// rejected holds leases refused, with why, while the broker still
	// lists them. Guarded by mu.
	rejected map[string]string
	// events are watchdog events not yet acknowledged; lastSeq is the
	// newest seq handed out. Guarded by mu.
	events  []*gpupoolv1.AgentEvent
	lastSeq uint64
	// synced is set once a broker's assignment list arrived; strays are
	// leases not enforced here whose processes are being stopped. Guarded
	// by mu.
	synced bool
	strays map[string]bool
	// added is closed and replaced whenever a lease starts being
	// enforced. Guarded by mu.
	added chan struct{}
	// clock times waitEnforced; read-only.
	clock clock.Clock
}

func newLeaseTable(c clock.Clock) *leaseTable {
	return &leaseTable{entries: map[string]*leaseEntry{}, rejected: map[string]string{}, strays: map[string]bool{},
		added: make(chan struct{}), clock: c}
}

// plan is what one heartbeat response asks of the agent, decided under
// the table's lock and carried out by the agent outside it.
type plan struct {
	// prepare are new leases to enforce; the agent adds them with add or
	// refuses them with reject.
	prepare []*gpupoolv1.Assignment
	// teardown are leases whose processes must be stopped: the broker
	// lists them for teardown, or no longer lists them at all (forget).
	teardown []teardownOrder
	// save are entries whose deadline moved enough to be written again.
	save []leaseRecord
}

type teardownOrder struct {
	a      *gpupoolv1.Assignment
	reason string
	// confirm: the broker waits for this teardown's confirmation.
	confirm bool
}

// saveEvery is the fraction of a lease's TTL its deadline must move
// before its file is written again: a restarted agent then underestimates
// a deadline by at most this much, which only stops work early.
const saveEvery = 4

// reconcile compares a heartbeat response, received at now, with the
// table. Deadlines move to now plus what the leader says is left.
func (t *leaseTable) reconcile(resp *gpupoolv1.HeartbeatResponse, now time.Time) plan {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.synced = true
	var p plan
	listed := map[string]bool{}
	for _, a := range resp.GetTeardown() {
		id := a.GetLeaseId()
		listed[id] = true
		delete(t.rejected, id)
		e := t.entries[id]
		if e == nil {
			// Not known here (the agent restarted, or refused it): stop
			// whatever runs under its id, then confirm.
			e = &leaseEntry{a: a, phase: tearingDown}
			t.entries[id] = e
			p.teardown = append(p.teardown, teardownOrder{a: a, reason: "the broker asks for teardown", confirm: true})
			continue
		}
		if e.phase == enforcing {
			e.phase = tearingDown
			p.teardown = append(p.teardown, teardownOrder{a: e.a, reason: teardownReason(a), confirm: true})
		}
	}
	for _, a := range resp.GetEnforce() {
		id := a.GetLeaseId()
		if listed[id] {
			continue
		}
		listed[id] = true
		if _, ok := t.rejected[id]; ok {
			continue
		}
		e := t.entries[id]
		if e == nil {
			p.prepare = append(p.prepare, a)
			continue
		}
		if e.phase != enforcing {
			continue
		}
		e.a = a
		if d := deadlineOf(a, now); d.After(e.deadline) {
			e.deadline = d
			if e.expired && d.After(now) {
				e.expired = false
			}
		}
		if ttl := time.Duration(a.GetTtlMs()) * time.Millisecond; e.deadline.Sub(e.saved) > ttl/saveEvery {
			e.saved = e.deadline
			p.save = append(p.save, leaseRecord{Assignment: e.a, Deadline: e.deadline})
		}
	}
	for id, e := range t.entries {
		if listed[id] {
			continue
		}
		switch e.phase {
		case enforcing:
			// The broker forgot the lease: it ended and was freed while
			// this agent was away. Stop it; nobody waits for a
			// confirmation.
			e.phase = tearingDown
			p.teardown = append(p.teardown, teardownOrder{a: e.a, reason: "the brokers no longer list it"})
		case tornDown:
			delete(t.entries, id)
		}
	}
	for id := range t.rejected {
		if !listed[id] {
			delete(t.rejected, id)
		}
	}
	slices.SortFunc(p.prepare, func(a, b *gpupoolv1.Assignment) int { return strings.Compare(a.LeaseId, b.LeaseId) })
	slices.SortFunc(p.teardown, func(a, b teardownOrder) int { return strings.Compare(a.a.LeaseId, b.a.LeaseId) })
	return p
}

// teardownReason says why the broker lists a lease for teardown.
func teardownReason(a *gpupoolv1.Assignment) string {
	return "the broker asks for teardown (lease " + a.GetLeaseId() + " is " + strings.ToLower(strings.TrimPrefix(a.GetState().String(), "LEASE_STATE_")) + ")"
}

// deadlineOf is when a lease listed at now expires: what the leader says
// is left, else a whole TTL.
func deadlineOf(a *gpupoolv1.Assignment, now time.Time) time.Time {
	if ms := a.GetExpiresInMs(); ms > 0 {
		return now.Add(time.Duration(ms) * time.Millisecond)
	}
	return now.Add(time.Duration(a.GetTtlMs()) * time.Millisecond)
}

// add starts enforcing a lease with the given deadline.
func (t *leaseTable) add(a *gpupoolv1.Assignment, deadline time.Time) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.entries[a.LeaseId] = &leaseEntry{a: a, deadline: deadline, saved: deadline}
	close(t.added)
	t.added = make(chan struct{})
}

// waitEnforced returns id's assignment once it is enforced, waiting up to
// d for it: a holder may present its token before the broker's push of
// the new lease has reached this agent.
func (t *leaseTable) waitEnforced(id string, d time.Duration) (*gpupoolv1.Assignment, bool) {
	timer := clock.NewTimer(t.clock, d)
	defer timer.Stop()
	for {
		t.mu.Lock()
		e, added := t.entries[id], t.added
		if e != nil && e.phase == enforcing {
			a := proto.CloneOf(e.a)
			t.mu.Unlock()
			return a, true
		}
		t.mu.Unlock()
		if e != nil { // being torn down: it will not come back
			return nil, false
		}
		select {
		case <-added:
		case <-timer.C:
			return nil, false
		}
	}
}

// startTeardown records a lease that is being torn down without the
// broker asking (it could not be resumed).
func (t *leaseTable) startTeardown(a *gpupoolv1.Assignment) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.entries[a.LeaseId] = &leaseEntry{a: a, phase: tearingDown}
}

// has reports whether the table holds lease id, in any phase.
func (t *leaseTable) has(id string) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	_, ok := t.entries[id]
	return ok
}

// reject records that the agent refuses a lease, for the broker to
// revoke it.
func (t *leaseTable) reject(id, reason string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.rejected[id] = reason
}

// finishTeardown marks a lease torn down. When nobody waits for a
// confirmation, the entry is dropped at once.
func (t *leaseTable) finishTeardown(id string, confirm bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	e := t.entries[id]
	if e == nil {
		return
	}
	if confirm {
		e.phase = tornDown
	} else {
		delete(t.entries, id)
	}
}

// addEventLocked queues a watchdog event for the broker and returns it.
func (t *leaseTable) addEventLocked(typ gpupoolv1.AgentEventType, leaseID, device, msg string, now time.Time) *gpupoolv1.AgentEvent {
	// Sequence numbers grow across restarts because they start from the
	// clock.
	t.lastSeq = max(t.lastSeq+1, uint64(now.UnixNano()))
	ev := &gpupoolv1.AgentEvent{Seq: t.lastSeq, Type: typ, LeaseId: leaseID, Device: device, Message: msg, AtMs: now.UnixMilli()}
	t.events = append(t.events, ev)
	return ev
}

// ack drops the events up to seq; it reports whether it dropped any.
func (t *leaseTable) ack(seq uint64) bool {
	if seq == 0 {
		return false
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	n := len(t.events)
	t.events = slices.DeleteFunc(t.events, func(e *gpupoolv1.AgentEvent) bool { return e.Seq <= seq })
	return len(t.events) != n
}

// report fills a heartbeat with the confirmations, refusals, usage and
// events the broker should hear about.
func (t *leaseTable) report(req *gpupoolv1.HeartbeatRequest) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, id := range slices.Sorted(maps.Keys(t.entries)) {
		e := t.entries[id]
		switch {
		case e.phase == tornDown:
			req.TornDown = append(req.TornDown, id)
		case e.phase == enforcing && e.usage != nil:
			req.Usage = append(req.Usage, e.usage)
		}
	}
	for _, id := range slices.Sorted(maps.Keys(t.rejected)) {
		req.Rejected = append(req.Rejected, &gpupoolv1.Rejection{LeaseId: id, Reason: t.rejected[id]})
	}
	req.Events = slices.Clone(t.events)
}

// enforced returns copies of the enforced leases, sorted by id.
func (t *leaseTable) enforced() []*gpupoolv1.Assignment {
	t.mu.Lock()
	defer t.mu.Unlock()
	var out []*gpupoolv1.Assignment
	for _, id := range slices.Sorted(maps.Keys(t.entries)) {
		if e := t.entries[id]; e.phase == enforcing {
			out = append(out, proto.CloneOf(e.a))
		}
	}
	return out
}

// get returns a copy of a lease's assignment while it is enforced.
func (t *leaseTable) get(id string) (*gpupoolv1.Assignment, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	e := t.entries[id]
	if e == nil || e.phase != enforcing {
		return nil, false
	}
	return proto.CloneOf(e.a), true
}

// mpsInUse reports whether a lease other than except that is not torn
// down holds an MPS slice on device uuid.
func (t *leaseTable) mpsInUse(uuid, except string) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	for id, e := range t.entries {
		if id == except || e.phase == tornDown {
			continue
		}
		for _, s := range e.a.GetSlices() {
			if s.Device == uuid && s.Isolation == gpupoolv1.Isolation_ISOLATION_MPS {
				return true
			}
		}
	}
	return false
}

// describeSlice is "GPU 2 (GPU-1234…)" for logs and events.
func describeSlice(s *gpupoolv1.Slice) string {
	return fmt.Sprintf("GPU %d (%s)", s.GetDeviceIndex(), s.GetDevice())
}
