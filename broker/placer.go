package broker

import (
	"sync"

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
// starts leading, then from every request it is asked to place. It
// places with FGD's look-ahead (placement.Mix.LookAhead). Nothing here is
// replicated; a new leader learns the mix again from the state.
//
// Every placement is the best of the whole pool: Acquire places through
// the FSM's pool index, which rates one host per distinct host state
// that can hold the request; Place, on any hosts (the queue's private
// copies of the pool), rates every host.
type placer struct {
	policy string

	mu      sync.Mutex
	learner placement.MixLearner // guarded by mu
	refMem  int64                // the largest GPU memory seen, MiB; guarded by mu
}

func newPlacer(policy string) *placer {
	return &placer{policy: policy, learner: newLearner()}
}

// newLearner is the learner of the default policy: the mix learned
// online, rated with look-ahead.
func newLearner() placement.MixLearner { return placement.MixLearner{LookAhead: true} }

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

// Place places r on hosts, rating every one of them. It implements
// planner.Placer.
func (p *placer) Place(hosts []*gpupoolv1.Host, r *gpupoolv1.LeaseRequest) ([]*gpupoolv1.Slice, error) {
	return placement.PlaceWith(hosts, r, p.options())
}

// placeIndexed places r on the pool of idx with over in place of the
// hosts of the same id: the same placement as Place on that pool, at the
// cost of one host per distinct host state that can hold r.
func (p *placer) placeIndexed(idx *placement.Index, over []*gpupoolv1.Host, r *gpupoolv1.LeaseRequest) ([]*gpupoolv1.Slice, error) {
	return idx.PlaceOver(over, r, p.options())
}

// observeLazy is observe with the pool built only when the placer has
// not yet seen how large a GPU is.
func (p *placer) observeLazy(hosts func() []*gpupoolv1.Host, r *gpupoolv1.LeaseRequest) {
	if p.policy != placement.FGD {
		return
	}
	p.mu.Lock()
	known := p.refMem != 0
	p.mu.Unlock()
	if known {
		p.observe(nil, r)
		return
	}
	p.observe(hosts(), r)
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
	p.learner = newLearner()
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
