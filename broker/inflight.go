package broker

import (
	"sync"

	"github.com/hashicorp/raft"
	"google.golang.org/protobuf/proto"

	"github.com/gpupool/gpupool/broker/fsm"
	"github.com/gpupool/gpupool/broker/state"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// inflight holds the grants the leader has placed and sent to Raft but
// that the state does not show yet. Acquire places the next request on the
// state plus these, and lets go of placeMu while its grant commits, so
// that concurrent acquires share Raft's batched fsyncs instead of waiting
// for each other's. Apply still re-checks every slice: in-flight grants
// only make placement see the capacity they take.
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
// no new one starts; those in flight finish without placeMu.
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
	out, _ := overlayCopies(st, hosts, snap)
	return out
}

// overlayCopies is overlay, and the copies it made: the hosts the grants in flight touch,
// with those grants.
func overlayCopies(st *state.Reader, hosts []*gpupoolv1.Host, snap []*gpupoolv1.Lease) ([]*gpupoolv1.Host, []*gpupoolv1.Host) {
	var pending []*gpupoolv1.Lease
	for _, l := range snap {
		if st.Lease(l.Id) == nil {
			pending = append(pending, l)
		}
	}
	if len(pending) == 0 {
		return hosts, nil
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
	work := copyPool(copies)
	for _, l := range pending {
		work.allocate(l)
	}
	out := make([]*gpupoolv1.Host, len(hosts))
	copy(out, hosts)
	for _, h := range work.hosts {
		out[at[h.Id]] = h
	}
	return out, work.hosts
}

// proposal is a command sent to Raft and not yet known to commit.
type proposal struct {
	f   raft.ApplyFuture
	err error // set when it could not be sent
}

// applyAsync sends cmd to Raft and returns at once; wait for the outcome
// with proposal.wait. Commands sent one after the other commit in that order.
func (s *Server) applyAsync(cmd proto.Message) *proposal {
	if fault := s.applyFault.Load(); fault != nil {
		if err := (*fault)(cmd); err != nil {
			return &proposal{err: raftError(err)}
		}
	}
	b, err := fsm.Encode(cmd)
	if err != nil {
		return &proposal{err: err}
	}
	return &proposal{f: s.raft.Apply(b, applyTimeout)}
}

// wait returns the command's result once it is applied.
func (p *proposal) wait() (*fsm.Result, error) {
	if p.err != nil {
		return nil, p.err
	}
	if err := p.f.Error(); err != nil {
		return nil, raftError(err)
	}
	res := p.f.Response().(*fsm.Result)
	return res, res.Err
}
