package broker

import (
	"sync"

	"github.com/gpupool/gpupool/broker/planner"
	"github.com/gpupool/gpupool/broker/state"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// inflight holds what the leader decided under placeMu and the state
// does not show yet: Acquire's grants and pending leases, the queue's
// grants and extras, and the room a preemption in flight reserves. Every
// decision places on the state plus these, so placeMu can be let go
// while the commands commit (see the lock rule in doc.go) and concurrent
// acquires share Raft's batched fsyncs instead of waiting for each
// other's. Apply still re-checks every slice: what is in flight only
// makes placement see the capacity it takes.
type inflight struct {
	mu     sync.Mutex
	leases map[string]*flight // by lease id; guarded by mu
	idle   chan struct{}      // closed while leases is empty; guarded by mu
}

// flight is one grant in flight.
type flight struct {
	lease  *gpupoolv1.Lease
	landed chan struct{} // closed once its outcome is known
}

func newInflight() *inflight {
	idle := make(chan struct{})
	close(idle)
	return &inflight{leases: map[string]*flight{}, idle: idle}
}

func (f *inflight) add(l *gpupoolv1.Lease) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.leases) == 0 {
		f.idle = make(chan struct{})
	}
	f.leases[l.Id] = &flight{lease: l, landed: make(chan struct{})}
}

func (f *inflight) done(id string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	fl, ok := f.leases[id]
	if !ok {
		return
	}
	close(fl.landed)
	delete(f.leases, id)
	if len(f.leases) == 0 {
		close(f.idle)
	}
}

// ofRequest returns a channel closed when the grant in flight for the
// tenant's request id lands, or nil when none is in flight. A retry of an
// Acquire waits for it instead of placing the request a second time.
func (f *inflight) ofRequest(tenant, requestID string) <-chan struct{} {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, fl := range f.leases {
		if fl.lease.Tenant == tenant && fl.lease.RequestId == requestID {
			return fl.landed
		}
	}
	return nil
}

// drain waits until no grant is in flight. Call it under placeMu, so that
// no new one starts; those in flight are proposed and finish without
// placeMu.
func (f *inflight) drain() {
	f.mu.Lock()
	idle := f.idle
	f.mu.Unlock()
	<-idle
}

// snapshot returns the grants in flight. Take it before reading the state
// that overlay gets: a grant that leaves the set after the snapshot is
// still in it, and one that left before is in the state.
func (f *inflight) snapshot() []*gpupoolv1.Lease {
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.leases) == 0 {
		return nil
	}
	out := make([]*gpupoolv1.Lease, 0, len(f.leases))
	for _, fl := range f.leases {
		out = append(out, fl.lease)
	}
	return out
}

// overlay returns hosts with the grants of snap that st does not show yet
// counted as taken. Only the hosts they touch are copied.
func overlay(st *state.Reader, hosts []*gpupoolv1.Host, snap []*gpupoolv1.Lease) []*gpupoolv1.Host {
	pending := inFlight(st, snap)
	if len(pending) == 0 {
		return hosts
	}
	touched := map[string]bool{}
	for _, l := range pending {
		for _, id := range state.LeaseHosts(l) {
			touched[id] = true
		}
	}
	var copies []*gpupoolv1.Host
	at := map[string]int{}
	for i, h := range hosts {
		if touched[h.Id] {
			at[h.Id] = i
			copies = append(copies, h)
		}
	}
	work := planner.NewPool(copies)
	for _, l := range pending {
		work.Allocate(l)
	}
	out := make([]*gpupoolv1.Host, len(hosts))
	copy(out, hosts)
	for _, h := range work.Hosts() {
		out[at[h.Id]] = h
	}
	return out
}

// inFlight are the grants of snap that st does not show yet.
func inFlight(st *state.Reader, snap []*gpupoolv1.Lease) []*gpupoolv1.Lease {
	var pending []*gpupoolv1.Lease
	for _, l := range snap {
		// A grant of a lease the queue holds is in flight while the
		// state still shows it pending.
		if cur := st.Lease(l.Id); cur == nil || cur.State == gpupoolv1.LeaseState_LEASE_STATE_PENDING {
			pending = append(pending, l)
		}
	}
	return pending
}

// reservedPool is the pool as Acquire may place on: the state with the
// grants in flight, less what pending leases whose victims are still
// leaving will take once they have gone.
func (cp *capacity) reservedPool(st *state.Reader, inflight []*gpupoolv1.Lease) []*gpupoolv1.Host {
	return planner.Reserved(st, overlay(st, st.HostsWithDevices(), inflight), cp.placer)
}

// reserving reports whether a pending lease reserves capacity while its
// victims are still leaving.
func reserving(st *state.Reader) bool {
	for _, r := range st.PendingLeases() {
		if len(st.PreemptedFor(r.Id)) > 0 {
			return true
		}
	}
	return false
}

// acquirePool is reservedPool as a function that builds it when a caller
// needs it, and, when no pending lease reserves capacity, the hosts the
// grants in flight touch, as copies with those grants: then the FSM's
// pool index (never behind st) with those copies over it is the pool
// Acquire places on, and a grant reads no more of the pool than that.
func (cp *capacity) acquirePool(st *state.Reader, inflight []*gpupoolv1.Lease) (hosts func() []*gpupoolv1.Host, over []*gpupoolv1.Host, indexed bool) {
	var pool []*gpupoolv1.Host
	hosts = func() []*gpupoolv1.Host {
		if pool == nil {
			pool = cp.reservedPool(st, inflight)
		}
		return pool
	}
	if reserving(st) {
		cp.overlay = nil
		return hosts, nil, false
	}
	return hosts, cp.inflightOverlay(st, inflight), true
}

// overlayCache is the overlay of the grants in flight that an acquire
// built, kept for the next one under placeMu: while the state stays at
// the same applied index and none of its grants left the set, the next
// acquire adds the grants proposed since, one by one, instead of copying
// and counting every grant in flight again (which made placeMu's hold
// grow with the number of grants in flight, and a batch of them cost the
// square of it).
type overlayCache struct {
	index uint64          // the state's applied index it was built on
	ids   map[string]bool // every grant of the in-flight set it has seen
	work  *planner.Pool   // the hosts the grants in flight touch, with them
}

// inflightOverlay returns the hosts the grants of inflight that st does
// not show yet touch, as copies with those grants. Call it under placeMu.
func (cp *capacity) inflightOverlay(st *state.Reader, inflight []*gpupoolv1.Lease) []*gpupoolv1.Host {
	if len(inflight) == 0 {
		cp.overlay = nil
		return nil
	}
	idx := st.Index()
	if c := cp.overlay; c != nil && c.index == idx && c.extend(st, inflight) {
		return c.work.Hosts()
	}
	c := buildOverlay(st, idx, inflight)
	cp.overlay = c
	if c.work == nil {
		return nil
	}
	return c.work.Hosts()
}

// buildOverlay counts every grant of inflight that st does not show yet.
func buildOverlay(st *state.Reader, idx uint64, inflight []*gpupoolv1.Lease) *overlayCache {
	c := &overlayCache{index: idx, ids: make(map[string]bool, len(inflight))}
	for _, l := range inflight {
		c.ids[l.Id] = true
	}
	pending := inFlight(st, inflight)
	if len(pending) == 0 {
		return c
	}
	var touched []*gpupoolv1.Host
	seen := map[string]bool{}
	for _, l := range pending {
		for _, id := range state.LeaseHosts(l) {
			if seen[id] {
				continue
			}
			seen[id] = true
			if h := st.HostWithDevices(id); h != nil {
				touched = append(touched, h)
			}
		}
	}
	c.work = planner.NewPool(touched)
	for _, l := range pending {
		c.work.Allocate(l)
	}
	return c
}

// extend adds the grants of inflight that c has not seen, and reports
// false, changing nothing, when c cannot serve inflight: a grant it
// counted left the set, or a new one touches a host it holds no copy of.
// The caller checked that the state is still at c.index, so a grant c
// has not seen is one the state does not show yet, unless it is a
// queued lease's grant: those are checked as inFlight does.
func (c *overlayCache) extend(st *state.Reader, inflight []*gpupoolv1.Lease) bool {
	if c.work == nil {
		return false
	}
	kept := 0
	var added []*gpupoolv1.Lease
	for _, l := range inflight {
		if c.ids[l.Id] {
			kept++
			continue
		}
		added = append(added, l)
	}
	if kept != len(c.ids) {
		return false
	}
	added = inFlight(st, added)
	for _, l := range added {
		for _, id := range state.LeaseHosts(l) {
			if c.work.Host(id) == nil {
				return false
			}
		}
	}
	for _, l := range inflight {
		c.ids[l.Id] = true
	}
	for _, l := range added {
		c.work.Allocate(l)
	}
	return true
}
