// Package planner decides what the broker's queue does next, as a pure
// function: from an immutable snapshot of the state (the pending queue,
// preemptions in progress, elastic leases, quotas) and the placement
// engine's view of free capacity, at a given time, it returns a Plan:
// the pending leases to grant and on which slices, the leases to preempt
// for which request, the preemptions to withdraw, the extras elastic
// leases grow by, and why every other pending lease waits.
//
// Invariants:
//   - Plan never modifies its input: the state snapshot and the hosts are
//     read-only, and every tentative change (a grant the plan makes, room
//     reserved for a request whose victims are leaving, victims counted as
//     gone) lives in a copy-on-write Pool that copies only the hosts it
//     touches.
//   - Plan has no clock, randomness or I/O of its own: the time and the
//     ids of new extras come from Input. The same Input gives the same Plan.
//   - Nothing in a Plan is committed: the broker proposes it to Raft, and
//     FSM Apply re-checks every grant and preemption, so a plan made on a
//     snapshot that has since changed is refused, never applied twice.
//
// The rules, in queue order (priority, then arrival):
//   - a request that fits (pool and tenant quota) is granted; a later,
//     smaller one that fits while the head does not is granted too
//     (backfill);
//   - a request whose victims are still leaving has its slices reserved in
//     the view, so nothing planned after it takes the room it waits for;
//   - a guaranteed request that does not fit looks for preemptible leases
//     to preempt and, if that makes room, preempts them and reserves;
//   - a request whose victims no longer make room spares them;
//   - when nobody waits for capacity, elastic leases grow into what is
//     left, one slice per lease per round, those with the fewest extras
//     (then the oldest) first.
package planner

import (
	"errors"
	"fmt"
	"slices"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/gpupool/gpupool/broker/fsm"
	"github.com/gpupool/gpupool/broker/lease"
	"github.com/gpupool/gpupool/broker/placement"
	"github.com/gpupool/gpupool/broker/state"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// Input is what one plan is made from. Nothing in it is modified.
type Input struct {
	// State is an immutable snapshot of the replicated state.
	State *state.Reader
	// Hosts is the placement engine's view of free capacity, consistent
	// with State (State.HostsWithDevices(), or that with grants in flight).
	Hosts []*gpupoolv1.Host
	// Placer places requests with the broker's policy.
	Placer Placer
	// Now is the leader's clock when the plan is made; preemption
	// deadlines and extras' creation times derive from it.
	Now time.Time
	// PreemptGrace is how long a preempted lease keeps running.
	PreemptGrace time.Duration
	// NewID names a new extra of an elastic lease.
	NewID func() string
}

// Outcome is what a plan does with one pending lease.
type Outcome int

const (
	// Granted: the plan grants it.
	Granted Outcome = iota
	// WaitingCapacity: it waits for room; nothing may grow into it.
	WaitingCapacity
	// WaitingQuota: it waits for its tenant's quota; it blocks nobody.
	WaitingQuota
	// WaitingNever: it cannot fit the pool as built now; it blocks nobody.
	WaitingNever
)

func (o Outcome) String() string {
	switch o {
	case Granted:
		return "granted"
	case WaitingCapacity:
		return "waiting for capacity"
	case WaitingQuota:
		return "waiting for quota"
	case WaitingNever:
		return "cannot fit the pool"
	}
	return fmt.Sprintf("outcome %d", int(o))
}

// Plan is what the queue should do now, in the order to propose it.
type Plan struct {
	// Grants are pending leases granted: each is the pending lease with
	// its slices, ready for a GrantLeaseCommand.
	Grants []*gpupoolv1.Lease
	// Preemptions preempt leases to make room for a pending lease.
	Preemptions []*gpupoolv1.PreemptLeasesCommand
	// Withdrawals spare the victims of a pending lease they no longer
	// make room for.
	Withdrawals []*gpupoolv1.PreemptLeasesCommand
	// Grows are new extras of elastic leases, ready for a GrantLeaseCommand.
	Grows []*gpupoolv1.Lease
	// Reserved holds, per pending lease whose victims are leaving (or
	// are preempted by this plan), the slices kept for it.
	Reserved map[string][]*gpupoolv1.Slice
	// Waiting says why each pending lease not granted waits: its outcome
	// and, when placement or the quota refused it, their reason.
	Waiting []Wait
}

// Wait is why one pending lease is not granted by a plan.
type Wait struct {
	LeaseID string
	Outcome Outcome
	Reason  string // placement's or the quota's refusal; empty when reserved
}

// Empty reports whether the plan proposes nothing.
func (p *Plan) Empty() bool {
	return len(p.Grants)+len(p.Preemptions)+len(p.Withdrawals)+len(p.Grows) == 0
}

// Make plans one pass of the queue. It is pure: see the package doc.
func Make(in Input) *Plan {
	m := &maker{in: in, st: in.State, pool: NewPool(in.Hosts), plan: &Plan{Reserved: map[string][]*gpupoolv1.Slice{}}, added: map[string][]*gpupoolv1.Lease{}}
	blocked := false
	for _, r := range m.st.PendingLeases() {
		if m.one(r) == WaitingCapacity {
			blocked = true
		}
	}
	if !blocked {
		m.grow()
	}
	return m.plan
}

type maker struct {
	in    Input
	st    *state.Reader
	pool  *Pool
	plan  *Plan
	added map[string][]*gpupoolv1.Lease // tenant → leases this plan grants
}

// quota checks the tenant quota of granting l with gone freed, counting
// what the plan grants before it.
func (m *maker) quota(l *gpupoolv1.Lease, gone []*gpupoolv1.Lease) error {
	return fsm.CheckQuotaAfter(m.st, l, gone, m.added[l.Tenant])
}

func (m *maker) take(l *gpupoolv1.Lease) {
	m.pool.Allocate(l)
	m.added[l.Tenant] = append(m.added[l.Tenant], l)
}

func (m *maker) wait(r *gpupoolv1.Lease, o Outcome, why error) Outcome {
	w := Wait{LeaseID: r.Id, Outcome: o}
	if why != nil {
		w.Reason = why.Error()
	}
	m.plan.Waiting = append(m.plan.Waiting, w)
	return o
}

func (m *maker) reserve(r *gpupoolv1.Lease, ss []*gpupoolv1.Slice) Outcome {
	m.pool.Allocate(reservation(r, ss))
	m.plan.Reserved[r.Id] = ss
	return m.wait(r, WaitingCapacity, nil)
}

// one grants, reserves for or preempts for pending lease r.
func (m *maker) one(r *gpupoolv1.Lease) Outcome {
	victims := m.st.PreemptedFor(r.Id)
	ss, err := m.pool.Place(r.Request, m.in.Placer)
	roomNow := err == nil
	if roomNow {
		g := GrantOf(r, ss)
		if err = m.quota(g, nil); err == nil {
			// It fits as the pool is, victims or not (their preemption is
			// withdrawn once r is granted).
			m.plan.Grants = append(m.plan.Grants, g)
			m.take(g)
			return Granted
		}
	}
	if pe := (*placement.Error)(nil); errors.As(err, &pe) && pe.Never {
		return m.wait(r, WaitingNever, err)
	}
	if len(victims) > 0 {
		work := m.pool.Clone()
		for _, v := range victims {
			work.Free(v)
		}
		if ss, err := work.Place(r.Request, m.in.Placer); err == nil && m.quota(GrantOf(r, ss), victims) == nil {
			return m.reserve(r, ss) // until the victims are gone
		}
	}
	blocked := WaitingCapacity
	if roomNow {
		blocked = WaitingQuota
	}
	if r.Class == gpupoolv1.LeaseClass_LEASE_CLASS_PREEMPTIBLE {
		return m.wait(r, blocked, err)
	}
	// Victims beyond those already leaving, counting those as gone: room
	// on the pool and in the tenant's quota.
	work := m.pool.Clone()
	for _, v := range victims {
		work.Free(v)
	}
	more, ss := chooseVictims(work, Candidates(m.st, r), func(trial *Pool, chosen []*gpupoolv1.Lease) []*gpupoolv1.Slice {
		ss, err := trial.Place(r.Request, m.in.Placer)
		if err != nil || m.quota(GrantOf(r, ss), append(slices.Clone(victims), chosen...)) != nil {
			return nil
		}
		return ss
	})
	if more == nil {
		if len(victims) > 0 {
			// Its victims no longer make room (the pool or the quota
			// changed): spare them.
			m.plan.Withdrawals = append(m.plan.Withdrawals, Withdrawal(r.Id, IDs(victims)))
		}
		return m.wait(r, blocked, err)
	}
	m.plan.Preemptions = append(m.plan.Preemptions, &gpupoolv1.PreemptLeasesCommand{
		LeaseIds: IDs(more), ForLease: r.Id, DeadlineMs: m.in.Now.Add(m.in.PreemptGrace).UnixMilli(),
		Reason: fmt.Sprintf("preempted for %s (tenant %s, guaranteed, priority %d): %s", r.Id, r.Tenant, r.Priority, RequestText(r.Request)),
		NowMs:  m.in.Now.UnixMilli(),
	})
	return m.reserve(r, ss)
}

// grow adds extras to elastic leases while the pool has room: one slice
// per lease per round, the leases with the fewest extras first (then the
// oldest), until none can grow.
func (m *maker) grow() {
	type growing struct {
		p      *gpupoolv1.Lease
		extras int32
		left   int32
	}
	var gs []*growing
	for _, p := range m.st.ElasticLeases() {
		held := int32(len(p.Slices))
		var extras int32
		for _, x := range m.st.Extras(p.Id) {
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
			if !m.growOne(g.p) {
				return true
			}
			g.extras++
			g.left--
			return g.left == 0
		})
	}
}

// growOne plans one extra slice for elastic lease p if the pool has room.
func (m *maker) growOne(p *gpupoolv1.Lease) bool {
	req := ExtraRequest(p.Request)
	ss, err := m.pool.Place(req, m.in.Placer)
	if err != nil {
		return false
	}
	x := lease.New(m.in.NewID(), req, ss, m.in.Now.UnixMilli(), nil)
	x.Parent = p.Id
	if m.quota(x, nil) != nil {
		return false
	}
	m.plan.Grows = append(m.plan.Grows, x)
	m.take(x)
	return true
}

// GrantOf is the grant of pending lease r on slices ss.
func GrantOf(r *gpupoolv1.Lease, ss []*gpupoolv1.Slice) *gpupoolv1.Lease {
	l := proto.CloneOf(r)
	l.Slices = ss
	l.State, l.Reason, l.PendingReason = gpupoolv1.LeaseState_LEASE_STATE_UNSPECIFIED, "", ""
	return l
}

// ExtraRequest is the request of one extra slice of elastic request r.
func ExtraRequest(r *gpupoolv1.LeaseRequest) *gpupoolv1.LeaseRequest {
	x := proto.CloneOf(r)
	x.Count, x.ElasticMax = 1, 0
	x.Class = gpupoolv1.LeaseClass_LEASE_CLASS_PREEMPTIBLE
	x.Topology = gpupoolv1.Topology_TOPOLOGY_UNSPECIFIED
	x.HostCpuMillicores, x.HostMemoryMib = 0, 0
	x.RequestId = ""
	return x
}

// Withdrawal is the command that spares leases preempted for forLease.
func Withdrawal(forLease string, ids []string) *gpupoolv1.PreemptLeasesCommand {
	return &gpupoolv1.PreemptLeasesCommand{LeaseIds: ids, ForLease: forLease,
		Reason: fmt.Sprintf("lease %s no longer waits for the room", forLease)}
}

// RequestText is a short description of what a request asks for.
func RequestText(r *gpupoolv1.LeaseRequest) string {
	if r.Exclusive {
		return fmt.Sprintf("%d whole GPU(s)", r.Count)
	}
	return fmt.Sprintf("%d slice(s) of %d MiB and %d%% compute", r.Count, r.MemoryMib, r.ComputePercent)
}

// IDs are the ids of ls.
func IDs(ls []*gpupoolv1.Lease) []string {
	out := make([]string, len(ls))
	for i, l := range ls {
		out[i] = l.Id
	}
	return out
}
