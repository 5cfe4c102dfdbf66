package planner

import (
	"slices"

	"google.golang.org/protobuf/proto"

	"github.com/gpupool/gpupool/broker/placement"
	"github.com/gpupool/gpupool/broker/state"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// Placer places a request on a view of the pool's free capacity: the
// placement engine with the broker's policy.
type Placer interface {
	// Place returns the slices r takes on hosts, or a *placement.Error
	// when it does not fit. It never modifies hosts.
	Place(hosts []*gpupoolv1.Host, r *gpupoolv1.LeaseRequest) ([]*gpupoolv1.Slice, error)
}

// Pool is a copy-on-write view of the pool's free capacity: the hosts it
// starts from are never modified; a host is copied the first time this
// Pool counts something on it (a grant it plans, room it reserves, a
// victim it considers gone). A plan thus costs one slice of pointers
// plus the hosts it touches, not a deep copy of the pool per pass.
type Pool struct {
	hosts []*gpupoolv1.Host
	at    map[string]int  // host id → index in hosts; shared by clones, never changed
	owned map[string]bool // hosts this Pool copied and may change in place
}

// NewPool is a view of hosts (the state's, or the placement engine's).
func NewPool(hosts []*gpupoolv1.Host) *Pool {
	at := make(map[string]int, len(hosts))
	for i, h := range hosts {
		at[h.Id] = i
	}
	return &Pool{hosts: slices.Clone(hosts), at: at, owned: map[string]bool{}}
}

// Hosts is the pool as placement reads it. The caller must not modify it.
func (p *Pool) Hosts() []*gpupoolv1.Host { return p.hosts }

// Host returns the host with id as this view sees it, or nil.
func (p *Pool) Host(id string) *gpupoolv1.Host {
	if i, ok := p.at[id]; ok {
		return p.hosts[i]
	}
	return nil
}

// Clone returns an independent view of p. Hosts copied so far are shared
// until either side writes them again.
func (p *Pool) Clone() *Pool {
	p.owned = map[string]bool{} // shared from now on: copy again before writing
	return &Pool{hosts: slices.Clone(p.hosts), at: p.at, owned: map[string]bool{}}
}

// writable returns host id, copied first unless this Pool owns it.
func (p *Pool) writable(id string) *gpupoolv1.Host {
	i, ok := p.at[id]
	if !ok {
		return nil
	}
	if !p.owned[id] {
		p.hosts[i] = proto.CloneOf(p.hosts[i])
		p.owned[id] = true
	}
	return p.hosts[i]
}

// Allocate counts l's slices and host resources as taken. It does not
// check that they fit: a reservation may over-commit a device of the view
// on purpose, so nothing else is placed there.
func (p *Pool) Allocate(l *gpupoolv1.Lease) { p.change(l, placement.Allocate, 1) }

// Free counts l's slices and host resources as free.
func (p *Pool) Free(l *gpupoolv1.Lease) { p.change(l, placement.Free, -1) }

func (p *Pool) change(l *gpupoolv1.Lease, slice func(*gpupoolv1.Device, *gpupoolv1.Slice), sign int64) {
	for _, s := range l.Slices {
		h := p.writable(s.Host)
		if h == nil {
			continue
		}
		for _, d := range h.Devices {
			if d.Uuid == s.Device {
				slice(d, s)
				break
			}
		}
	}
	if l.HostCpuMillicores == 0 && l.HostMemoryMib == 0 {
		return
	}
	for _, id := range state.LeaseHosts(l) {
		if h := p.writable(id); h != nil {
			h.AllocatedCpuMillicores = max(0, h.AllocatedCpuMillicores+sign*l.HostCpuMillicores)
			h.AllocatedMemoryMib = max(0, h.AllocatedMemoryMib+sign*l.HostMemoryMib)
		}
	}
}

// Place runs placement on the view and sets each slice's isolation.
func (p *Pool) Place(r *gpupoolv1.LeaseRequest, pl Placer) ([]*gpupoolv1.Slice, error) {
	ss, err := pl.Place(p.hosts, r)
	if err == nil {
		SetIsolation(ss, p.Host)
	}
	return ss, err
}

// SetIsolation decides how the agent will isolate each slice: exclusive
// slices own their GPU; fractional ones use MPS where the host's agent can
// run it, else the watchdog alone.
func SetIsolation(ss []*gpupoolv1.Slice, host func(id string) *gpupoolv1.Host) {
	for _, sl := range ss {
		switch {
		case sl.Exclusive:
			sl.Isolation = gpupoolv1.Isolation_ISOLATION_EXCLUSIVE
		case host(sl.Host).GetMps():
			sl.Isolation = gpupoolv1.Isolation_ISOLATION_MPS
		default:
			sl.Isolation = gpupoolv1.Isolation_ISOLATION_WATCHDOG
		}
	}
}

// reservation is the room a pending lease whose victims are leaving
// holds on a view: its slices and host resources.
func reservation(r *gpupoolv1.Lease, ss []*gpupoolv1.Slice) *gpupoolv1.Lease {
	return &gpupoolv1.Lease{Slices: ss, HostCpuMillicores: r.HostCpuMillicores, HostMemoryMib: r.HostMemoryMib}
}

// Reserved is hosts less what pending leases with victims reserve: each
// is placed as if its victims had gone and its slices count as taken
// while the victims still hold theirs. Without such leases it is hosts
// itself. It is the pool Acquire places on, and the one why-pending
// explains from.
func Reserved(st *state.Reader, hosts []*gpupoolv1.Host, pl Placer) []*gpupoolv1.Host {
	var reserving []*gpupoolv1.Lease
	for _, r := range st.PendingLeases() {
		if len(st.PreemptedFor(r.Id)) > 0 {
			reserving = append(reserving, r)
		}
	}
	if len(reserving) == 0 {
		return hosts
	}
	p := NewPool(hosts)
	for _, r := range reserving {
		work := p.Clone()
		for _, v := range st.PreemptedFor(r.Id) {
			work.Free(v)
		}
		if ss, err := work.Place(r.Request, pl); err == nil {
			p.Allocate(reservation(r, ss))
		}
	}
	return p.Hosts()
}

// Victims picks the preemptible leases among cands to revoke so that r
// fits p (see chooseVictims); nil when none would make room. p is not
// changed. The broker uses it to tell a caller without a wait that
// preempting would make room.
func Victims(p *Pool, r *gpupoolv1.LeaseRequest, pl Placer, cands []*gpupoolv1.Lease) ([]*gpupoolv1.Lease, []*gpupoolv1.Slice) {
	return chooseVictims(p, cands, func(trial *Pool, _ []*gpupoolv1.Lease) []*gpupoolv1.Slice {
		ss, err := trial.Place(r, pl)
		if err != nil {
			return nil
		}
		return ss
	})
}

// chooseVictims picks victims among cands: lowest priority first, then
// youngest, until fit finds a placement on the pool without them; then,
// from the last chosen back, it keeps out every victim the fit does not
// need, so no victim can be spared. It returns nil when even all
// candidates together do not make room: then nothing is preempted. It
// also returns the placement fit found without the victims. fit gets the
// pool less the victims, and the victims (for a quota check).
func chooseVictims(p *Pool, cands []*gpupoolv1.Lease, fit func(trial *Pool, chosen []*gpupoolv1.Lease) []*gpupoolv1.Slice) ([]*gpupoolv1.Lease, []*gpupoolv1.Slice) {
	if len(cands) == 0 {
		return nil, nil // no copy of the pool for nothing to try
	}
	cands = slices.Clone(cands)
	slices.SortFunc(cands, VictimOrder)
	trial := p.Clone()
	var chosen []*gpupoolv1.Lease
	var ss []*gpupoolv1.Slice
	for _, c := range cands {
		trial.Free(c)
		chosen = append(chosen, c)
		if ss = fit(trial, chosen); ss != nil {
			break
		}
	}
	if ss == nil {
		return nil, nil
	}
	for i := len(chosen) - 2; i >= 0; i-- { // the last one was needed to fit
		trial.Allocate(chosen[i])
		without := slices.Delete(slices.Clone(chosen), i, i+1)
		if fewer := fit(trial, without); fewer != nil {
			ss, chosen = fewer, without
			continue
		}
		trial.Free(chosen[i])
	}
	return chosen, ss
}

// VictimOrder sorts preemption candidates: lowest priority first, then
// youngest, then by id for a stable order.
func VictimOrder(a, b *gpupoolv1.Lease) int {
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

// Candidates are the leases r may preempt: granted preemptible leases of
// priority at most r's, and every elastic extra (extras only use room
// nobody waits for), not already preempted. A guaranteed lease is never
// preempted.
func Candidates(st *state.Reader, r *gpupoolv1.Lease) []*gpupoolv1.Lease {
	return slices.DeleteFunc(st.Preemptible(), func(l *gpupoolv1.Lease) bool { return l.Parent == "" && l.Priority > r.Priority })
}
