package broker

import (
	"slices"

	"google.golang.org/protobuf/proto"

	"github.com/gpupool/gpupool/broker/placement"
	"github.com/gpupool/gpupool/broker/state"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// workPool is a private copy of the pool that the queue changes as it
// decides: grants it made, capacity it reserves for a pending lease whose
// victims are still leaving, leases it considers freed. Placement reads it
// like the state; nothing here is replicated.
type workPool struct {
	hosts []*gpupoolv1.Host
	byID  map[string]*gpupoolv1.Host
	devs  map[string]*gpupoolv1.Device
}

func newWorkPool(st *state.Reader) *workPool {
	return copyPool(st.HostsWithDevices())
}

// copyPool deep-copies hosts and their devices.
func copyPool(hosts []*gpupoolv1.Host) *workPool {
	p := &workPool{hosts: make([]*gpupoolv1.Host, len(hosts)), byID: map[string]*gpupoolv1.Host{}, devs: map[string]*gpupoolv1.Device{}}
	for i, h := range hosts {
		c := proto.CloneOf(h)
		p.hosts[i] = c
		p.byID[c.Id] = c
		for _, d := range c.Devices {
			p.devs[d.Uuid] = d
		}
	}
	return p
}

func (p *workPool) clone() *workPool { return copyPool(p.hosts) }

// allocate counts l's slices and host resources as taken. It does not
// check that they fit: a reservation may over-commit a device of the copy
// on purpose, so nothing else is placed there.
func (p *workPool) allocate(l *gpupoolv1.Lease) {
	for _, s := range l.Slices {
		if d := p.devs[s.Device]; d != nil {
			placement.Allocate(d, s)
		}
	}
	p.hostResources(l, 1)
}

// free counts l's slices and host resources as free.
func (p *workPool) free(l *gpupoolv1.Lease) {
	for _, s := range l.Slices {
		if d := p.devs[s.Device]; d != nil {
			placement.Free(d, s)
		}
	}
	p.hostResources(l, -1)
}

func (p *workPool) hostResources(l *gpupoolv1.Lease, sign int64) {
	if l.HostCpuMillicores == 0 && l.HostMemoryMib == 0 {
		return
	}
	for _, id := range state.LeaseHosts(l) {
		if h := p.byID[id]; h != nil {
			h.AllocatedCpuMillicores = max(0, h.AllocatedCpuMillicores+sign*l.HostCpuMillicores)
			h.AllocatedMemoryMib = max(0, h.AllocatedMemoryMib+sign*l.HostMemoryMib)
		}
	}
}

// place runs placement on the copy.
func (p *workPool) place(r *gpupoolv1.LeaseRequest, pl *placer) ([]*gpupoolv1.Slice, error) {
	ss, err := pl.place(p.hosts, r)
	if err == nil {
		setIsolation(ss, func(id string) *gpupoolv1.Host { return p.byID[id] })
	}
	return ss, err
}

// reservedPool is the pool as Acquire may place on: the state with the
// grants in flight, less what pending leases whose victims are still
// leaving will take once they have gone.
func (s *Server) reservedPool(st *state.Reader, inflight []*gpupoolv1.Lease) []*gpupoolv1.Host {
	return reservedHosts(st, overlay(st, st.HostsWithDevices(), inflight), s.placer)
}

// reservedHosts is hosts (the state, or more) less what pending leases
// with victims reserve. Without such leases it is hosts itself.
func reservedHosts(st *state.Reader, hosts []*gpupoolv1.Host, pl *placer) []*gpupoolv1.Host {
	reserving := reservingLeases(st)
	if len(reserving) == 0 {
		return hosts
	}
	p := copyPool(hosts)
	for _, r := range reserving {
		p.reserve(st, r, pl)
	}
	return p.hosts
}

// reservingLeases are the pending leases whose victims are still leaving.
func reservingLeases(st *state.Reader) []*gpupoolv1.Lease {
	var reserving []*gpupoolv1.Lease
	for _, r := range st.PendingLeases() {
		if len(st.PreemptedFor(r.Id)) > 0 {
			reserving = append(reserving, r)
		}
	}
	return reserving
}

// acquirePool is reservedPool, and, when no pending lease reserves capacity, the hosts the
// grants in flight touch, as copies with those grants: then the FSM's pool index (never
// behind st) with those copies over it is the pool Acquire places on.
//
// Without reservations it reads only the hosts the grants in flight touch, and hosts is a
// function that builds the whole pool (with them) when a caller needs it: a grant then costs
// no pass over the pool.
func (s *Server) acquirePool(st *state.Reader, inflight []*gpupoolv1.Lease) (hosts func() []*gpupoolv1.Host, over []*gpupoolv1.Host, indexed bool) {
	whole := func() []*gpupoolv1.Host { return overlay(st, st.HostsWithDevices(), inflight) }
	if len(reservingLeases(st)) > 0 {
		pool := reservedHosts(st, whole(), s.placer)
		return func() []*gpupoolv1.Host { return pool }, nil, false
	}
	var touched []*gpupoolv1.Host
	seen := map[string]bool{}
	for _, l := range inflight {
		if st.Lease(l.Id) != nil {
			continue
		}
		for _, id := range state.LeaseHosts(l) {
			if h := st.HostWithDevices(id); h != nil && !seen[id] {
				seen[id] = true
				touched = append(touched, h)
			}
		}
	}
	_, over = overlayCopies(st, touched, inflight)
	var pool []*gpupoolv1.Host
	return func() []*gpupoolv1.Host {
		if pool == nil {
			pool = whole()
		}
		return pool
	}, over, true
}

// reserve places pending lease r on the copy as if its victims had gone,
// and counts its slices as taken while the victims still hold theirs. It
// reports whether r fits that way.
func (p *workPool) reserve(st *state.Reader, r *gpupoolv1.Lease, pl *placer) bool {
	work := p.clone()
	for _, v := range st.PreemptedFor(r.Id) {
		work.free(v)
	}
	ss, err := work.place(r.Request, pl)
	if err != nil {
		return false
	}
	p.allocate(&gpupoolv1.Lease{Slices: ss, HostCpuMillicores: r.HostCpuMillicores, HostMemoryMib: r.HostMemoryMib})
	return true
}

// chooseVictims picks the preemptible leases to revoke so that r fits the
// pool: see chooseVictimsFor.
func chooseVictims(p *workPool, r *gpupoolv1.LeaseRequest, pl *placer, cands []*gpupoolv1.Lease) ([]*gpupoolv1.Lease, []*gpupoolv1.Slice) {
	return chooseVictimsFor(p, cands, func(trial *workPool, _ []*gpupoolv1.Lease) []*gpupoolv1.Slice {
		ss, err := trial.place(r, pl)
		if err != nil {
			return nil
		}
		return ss
	})
}

// chooseVictimsFor picks victims among cands: lowest priority first, then
// youngest, until fit finds a placement on the pool without them; then,
// from the last chosen back, it keeps out every victim the fit does not
// need, so no victim can be spared. It returns nil when even all
// candidates together do not make room: then nothing is preempted. It
// also returns the placement fit found without the victims. fit gets the
// pool less the victims, and the victims (for a quota check).
func chooseVictimsFor(p *workPool, cands []*gpupoolv1.Lease, fit func(trial *workPool, chosen []*gpupoolv1.Lease) []*gpupoolv1.Slice) ([]*gpupoolv1.Lease, []*gpupoolv1.Slice) {
	if len(cands) == 0 {
		return nil, nil // no copy of the pool for nothing to try
	}
	cands = slices.Clone(cands)
	slices.SortFunc(cands, victimOrder)
	trial := p.clone()
	var chosen []*gpupoolv1.Lease
	var ss []*gpupoolv1.Slice
	for _, c := range cands {
		trial.free(c)
		chosen = append(chosen, c)
		if ss = fit(trial, chosen); ss != nil {
			break
		}
	}
	if ss == nil {
		return nil, nil
	}
	for i := len(chosen) - 2; i >= 0; i-- { // the last one was needed to fit
		trial.allocate(chosen[i])
		without := slices.Delete(slices.Clone(chosen), i, i+1)
		if fewer := fit(trial, without); fewer != nil {
			ss, chosen = fewer, without
			continue
		}
		trial.free(chosen[i])
	}
	return chosen, ss
}

// victimOrder sorts preemption candidates: lowest priority first, then
// youngest, then by id for a stable order.
func victimOrder(a, b *gpupoolv1.Lease) int {
	if a.Priority != b.Priority {
		return int(a.Priority) - int(b.Priority)
	}
	if a.CreatedAtMs != b.CreatedAtMs {
		if a.CreatedAtMs > b.CreatedAtMs {
			return -1
		}
		return 1
	}
	if a.CreateIndex != b.CreateIndex {
		if a.CreateIndex > b.CreateIndex {
			return -1
		}
		return 1
	}
	switch {
	case a.Id < b.Id:
		return -1
	case a.Id > b.Id:
		return 1
	}
	return 0
}
