package broker

import (
	"sync"
	"time"

	"github.com/gpupool/gpupool/broker/state"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// capacity decides, on the leader, what is placed and granted: Acquire's
// placements and the queue's passes. It owns placeMu and everything
// guarded by it, and follows the lock rule (doc.go): every decision is
// taken under placeMu, on a snapshot, by a function that returns it as
// a value (decideAcquire's acquirePlan, proposePass's sentPlan) with
// what it takes already in flight; the commits are waited for outside
// placeMu.
//
// It sees the rest of the broker through two seams: leaderMemory (the
// leader's timers, to arm a grant's TTL and answer its expiry) and
// tokenSigner (the tokens a grant is answered with).
type capacity struct {
	*node
	leadership leaderMemory
	signing    tokenSigner

	// placeMu serialises placement and grant on the leader, so that two
	// acquires never pick the same free capacity. Held only inside the
	// decide functions (decideAcquire, schedule's plan), never while a
	// command commits.
	placeMu sync.Mutex
	// placer places with the policy, and learns FGD's mix on the leader.
	placer *placer
	// grants are the grants (and pending leases, extras, reservations)
	// proposed under placeMu that are not applied yet.
	grants *inflight
	// overlay is the last acquire's overlay of grants, reused by the
	// next while the state has not moved; guarded by placeMu.
	overlay *overlayCache
	// queue writes the queue's plans and pending leases to the log.
	queue *queueWriter
}

// newCapacity builds the capacity component; nd's proposer must be set.
func newCapacity(nd *node, lm leaderMemory, ts tokenSigner) *capacity {
	cp := &capacity{node: nd, leadership: lm, signing: ts, placer: newPlacer(nd.cfg.Policy), grants: newInflight()}
	cp.queue = &queueWriter{props: nd.proposer, grants: cp.grants, log: nd.log, grace: nd.cfg.PreemptGrace}
	return cp
}

// relearn makes the placer learn the mix of requests again from the live
// leases of st; a new leader calls it before its first decision.
func (cp *capacity) relearn(st *state.Reader) { cp.placer.relearn(st) }

// leaderMemory is the leader's memory, as the components that do not
// keep it see it. It is implemented by leadership.
type leaderMemory interface {
	// currentLeader returns the leader's state while this server acts as
	// leader (its barrier passed, its timers armed), or nil. The state
	// it returns belongs to one term: its stopCh is closed when that
	// term's leadership ends, and it is never reused for another.
	currentLeader() *leaderState
	// withLeaderView returns l with what only the leader knows filled in
	// (its expiry on the leader's timer, the agents' last usage reports),
	// as a copy; it returns l itself when this server does not lead or
	// knows nothing more. l is never modified.
	withLeaderView(l *gpupoolv1.Lease) *gpupoolv1.Lease
}

// tokenSigner signs the tokens that agents check before they run a
// lease. It is implemented by signing.
type tokenSigner interface {
	// ensureSigningKey returns nil once the state holds a key that signs:
	// it proposes the cluster's first key when there is none, and waits
	// for it to commit. Never call it under placeMu.
	ensureSigningKey() error
	// hostTokens signs one token per host of granted lease l, valid until
	// expires, with the key that signs now. It fails, signing nothing,
	// when the state holds no key yet.
	hostTokens(st *state.Reader, l *gpupoolv1.Lease, expires time.Time) ([]*gpupoolv1.HostToken, error)
}
