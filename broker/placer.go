package broker

import (
	"sync"
	"sync/atomic"

	"github.com/gpupool/gpupool/broker/placement"
	"github.com/gpupool/gpupool/broker/state"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// Policies are the placement policies a broker accepts, its default first.
// FGD is the default: on the Alibaba GPU-sharing trace it leaves the
// least GPU capacity unusable (see bench/README.md).
var Policies = []string{placement.FGD, placement.Binpack, placement.Spread}

// placer places requests with the broker's policy. For FGD it learns the
// mix of requests online, on the leader: from the live leases when it
// starts leading, then from every request it is asked to place. Nothing
// here is replicated; a new leader learns the mix again from the state.
type placer struct {
	policy string
	// window is how many hosts a placement looks at first (0: all). On a
	// larger pool each placement looks at the next window of hosts, round
	// robin, and at all of them only when the request fits none there, as
	// the Kubernetes scheduler scores a share of the nodes: placement
	// cost stays flat however large the pool grows.
	window int
	next   atomic.Int64 // where the next window starts

	mu      sync.Mutex
	learner placement.MixLearner // guarded by mu
	refMem  int64                // the largest GPU memory seen, MiB; guarded by mu
}

func newPlacer(policy string, window int) *placer { return &placer{policy: policy, window: window} }

// options are the placement options as learned so far.
func (p *placer) options() placement.Options {
	o := placement.Options{Policy: p.policy}
	if p.policy == placement.FGD {
		p.mu.Lock()
		o.Mix = p.learner.Mix()
		p.mu.Unlock()
	}
	return o
}

// Place places r on hosts: on the next window of them if it fits there,
// else on all of them. It implements planner.Placer.
func (p *placer) Place(hosts []*gpupoolv1.Host, r *gpupoolv1.LeaseRequest) ([]*gpupoolv1.Slice, error) {
	opts := p.options()
	if n := len(hosts); p.window > 0 && n > p.window {
		from := int(p.next.Add(int64(p.window))-int64(p.window)) % n
		part := make([]*gpupoolv1.Host, 0, p.window)
		part = append(part, hosts[from:min(n, from+p.window)]...)
		part = append(part, hosts[:p.window-len(part)]...)
		if ss, err := placement.PlaceWith(part, r, opts); err == nil {
			return ss, nil
		}
	}
	return placement.PlaceWith(hosts, r, opts)
}

// observe counts r in the mix FGD expects. hosts tell how large a GPU is,
// so that a slice's memory weighs in its share of a GPU.
func (p *placer) observe(hosts []*gpupoolv1.Host, r *gpupoolv1.LeaseRequest) {
	if p.policy != placement.FGD {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.refMem == 0 {
		p.refMem = largestGPU(hosts)
	}
	p.learner.Observe(placement.ShapeOn(r, p.refMem))
}

// relearn forgets the mix and learns it again from the leases in st that
// hold or wait for capacity: a new leader starts from the pool's workload.
func (p *placer) relearn(st *state.Reader) {
	if p.policy != placement.FGD {
		return
	}
	hosts := st.HostsWithDevices()
	p.mu.Lock()
	p.learner = placement.MixLearner{}
	p.refMem = largestGPU(hosts)
	p.mu.Unlock()
	for _, l := range st.Leases() {
		switch l.State {
		case gpupoolv1.LeaseState_LEASE_STATE_GRANTED, gpupoolv1.LeaseState_LEASE_STATE_PENDING:
			p.observe(hosts, l.Request)
		}
	}
}

func largestGPU(hosts []*gpupoolv1.Host) int64 {
	var m int64
	for _, h := range hosts {
		for _, d := range h.Devices {
			m = max(m, d.MemoryMib)
		}
	}
	return m
}
