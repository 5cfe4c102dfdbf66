package broker

import (
	"context"
	"sync"
	"time"

	"github.com/hashicorp/raft"
)

// noLeaderWait bounds how long a call that needs the leader waits, on a
// server that knows none, for one to be elected before it answers
// Unavailable: about the slowest election (a follower's timeout of up to
// twice RaftHeartbeatTimeout, then a vote that may need a second round).
const noLeaderWait = 2*RaftHeartbeatTimeout + 2*RaftElectionTimeout

// leaderWatch wakes the calls waiting for a leader as soon as Raft
// reports one, so that clients learn the new leader at the election, not
// at their next retry.
type leaderWatch struct {
	mu      sync.Mutex
	changed chan struct{} // guarded by mu; closed at the next leader observation
}

func newLeaderWatch() *leaderWatch {
	return &leaderWatch{changed: make(chan struct{})}
}

// next returns a channel closed at the next leader observation.
func (w *leaderWatch) next() <-chan struct{} {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.changed
}

// observed wakes every waiter.
func (w *leaderWatch) observed() {
	w.mu.Lock()
	close(w.changed)
	w.changed = make(chan struct{})
	w.mu.Unlock()
}

// watchLeader feeds w from r's leader observations until stop closes.
func watchLeader(r *raft.Raft, w *leaderWatch, stop <-chan struct{}) {
	ch := make(chan raft.Observation, 4)
	obs := raft.NewObserver(ch, false, func(o *raft.Observation) bool {
		_, ok := o.Data.(raft.LeaderObservation)
		return ok
	})
	r.RegisterObserver(obs)
	defer r.DeregisterObserver(obs)
	for {
		select {
		case <-ch:
			w.observed()
		case <-stop:
			return
		}
	}
}

// awaitLeader returns the id of the leader, waiting up to noLeaderWait
// (or until ctx ends) for an election while this server knows none. It
// returns "" when none was elected in that time. The leader may be this
// server.
func (m *membership) awaitLeader(ctx context.Context) raft.ServerID {
	timer := time.NewTimer(noLeaderWait)
	defer timer.Stop()
	for {
		changed := m.leaders.next() // before the read: no observation is missed
		if _, id := m.raft.LeaderWithID(); id != "" {
			return id
		}
		select {
		case <-changed:
		case <-timer.C:
			return ""
		case <-ctx.Done():
			return ""
		case <-m.ctx.Done():
			return ""
		}
	}
}
