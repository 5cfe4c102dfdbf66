package agent

import (
	"maps"
	"slices"
	"sync"

	"google.golang.org/protobuf/proto"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// assignments is the host's view of its leases, replaced wholesale by
// each heartbeat response (which always carries the full list).
//
// Invariant: a lease id is never both enforced and torn down.
type assignments struct {
	mu sync.Mutex
	// enforce holds the leases to keep enforced, by id. Guarded by mu.
	enforce map[string]*gpupoolv1.Assignment
	// tornDown holds the ids of leases this host has stopped and the
	// broker still lists for teardown: they are confirmed on every
	// heartbeat until the broker stops listing them. Guarded by mu.
	tornDown map[string]bool
}

// change is what one heartbeat response changed.
type change struct {
	added, removed []string // lease ids that started or stopped being enforced
	tornDown       []string // lease ids torn down that were not confirmed before
	enforcing      int      // how many leases are enforced now
}

func (c change) empty() bool {
	return len(c.added) == 0 && len(c.removed) == 0 && len(c.tornDown) == 0
}

// apply makes resp the current assignment list. Tearing a lease down
// means forgetting it: this agent runs no workloads yet.
func (s *assignments) apply(resp *gpupoolv1.HeartbeatResponse) change {
	s.mu.Lock()
	defer s.mu.Unlock()
	var c change
	teardown := make(map[string]bool, len(resp.GetTeardown()))
	for _, as := range resp.GetTeardown() {
		id := as.GetLeaseId()
		teardown[id] = true
		if !s.tornDown[id] {
			c.tornDown = append(c.tornDown, id)
		}
	}
	enforce := make(map[string]*gpupoolv1.Assignment, len(resp.GetEnforce()))
	for _, as := range resp.GetEnforce() {
		if id := as.GetLeaseId(); !teardown[id] {
			enforce[id] = as
			if s.enforce[id] == nil {
				c.added = append(c.added, id)
			}
		}
	}
	for id := range s.enforce {
		if enforce[id] == nil {
			c.removed = append(c.removed, id)
		}
	}
	s.enforce, s.tornDown = enforce, teardown
	c.enforcing = len(enforce)
	slices.Sort(c.added)
	slices.Sort(c.removed)
	slices.Sort(c.tornDown)
	return c
}

// confirmations lists the torn-down lease ids to report, sorted.
func (s *assignments) confirmations() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Sorted(maps.Keys(s.tornDown))
}

// enforced returns copies of the enforced leases, sorted by id.
func (s *assignments) enforced() []*gpupoolv1.Assignment {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]*gpupoolv1.Assignment, 0, len(s.enforce))
	for _, id := range slices.Sorted(maps.Keys(s.enforce)) {
		out = append(out, proto.CloneOf(s.enforce[id]))
	}
	return out
}
