package placement

import (
	"bytes"
	"cmp"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// Index keeps a pool's free capacity indexed, change by change, so that a placement looks at
// one host per distinct state that can hold the request rather than at every host.
//
// Hosts whose placement-relevant state is the same (status and eligibility, host CPU and
// memory, and the multiset of their devices' model, size, health and allocation) form one
// group, with a summary of what the group can hold (free CPU and memory, idle GPUs, the
// largest free share, the models). Every policy rates a host from that state alone, so all
// hosts of a group rate alike and the group's first host in tie-break order stands for it:
// Place rates one host per group that can hold the request and returns the placement the
// exhaustive PlaceWith would return on all the hosts (Random excepted: it draws a host
// uniformly among those that fit, in its own order).
//
// FGD's scores are remembered between placements, per group, request shape and mix: a group's
// score holds until the group changes (its hosts move to other groups as they change) or the
// mix does, so a placement rates only the groups that are new since the last request of the
// same shape, and reads the others' scores.
//
// An Index is safe for concurrent use. It keeps the *Host values it is given and never
// modifies them; the caller gives a host again with Update whenever it changes, either a new
// value (as the broker's state store makes one per change) or the same one modified in place.
type Index struct {
	mu     sync.Mutex
	rank   map[string]int      // tie-break rank; nil: by host id
	hosts  map[string]*ixHost  // guarded by mu
	groups map[string]*ixGroup // by key; guarded by mu
	list   []*ixGroup          // groups in a deterministic order; guarded by mu
	cpus   map[int64]int       // host CPU capacities and how many hosts have each; guarded by mu
	gpus   map[int64]int       // host GPU counts × 1000 and how many hosts have each; guarded by mu

	// The scores FGD gave the groups, kept between placements (see placeCachedLocked): gen
	// numbers the cache, which holds for one mix (mix) and the requests of reqs. All guarded by
	// mu.
	gen  uint64
	mix  *Mix
	reqs map[reqKey]int32

	scratchHosts  []*gpupoolv1.Host // guarded by mu
	scratchGroups []*ixGroup        // guarded by mu
}

type ixHost struct {
	h *gpupoolv1.Host
	g *ixGroup
	// cpu and gpu are what the host added to Index.cpus and Index.gpus.
	cpu, gpu int64
}

// ixGroup is hosts with the same key. members are sorted in tie-break order.
type ixGroup struct {
	key     string
	pos     int // in Index.list
	members []*ixHost
	sum     summary

	// scores[r] codes the score of request r of Index.reqs on the group's hosts when gen is the
	// index's; at most maxCachedReqs of them.
	gen    uint64
	scores []int32
}

// Codes of ixGroup.scores: unknown, no placement fits, or scoreBase plus the score (FGD's
// scores are 0 to 100).
const (
	scoreUnknown = 0
	scoreNoFit   = 1
	scoreBase    = 2
)

// summary is what a group's hosts can hold, for a quick test before rating one of them.
type summary struct {
	usable           bool // ready and eligible
	freeCPU, freeMem int64
	idle             int   // healthy GPUs with nothing allocated
	maxMem           int64 // largest free memory of a healthy GPU not held exclusively
	maxCompute       int32 // largest free compute of one
	models           []string
}

// NewIndex returns an index of hosts. rank orders hosts whose placements rate alike, as
// Options.Rank does (nil: by host id); Place uses it in place of Options.Rank.
func NewIndex(hosts []*gpupoolv1.Host, rank map[string]int) *Index {
	x := &Index{rank: rank}
	x.Reset(hosts)
	return x
}

// Update puts h (by its id) in the index, replacing what the index held for that id.
func (x *Index) Update(h *gpupoolv1.Host) {
	x.mu.Lock()
	defer x.mu.Unlock()
	x.updateLocked(h)
}

// Reset replaces everything the index holds by hosts, as NewIndex would build it.
func (x *Index) Reset(hosts []*gpupoolv1.Host) {
	x.mu.Lock()
	defer x.mu.Unlock()
	x.hosts, x.groups, x.list = make(map[string]*ixHost, len(hosts)), map[string]*ixGroup{}, nil
	x.cpus, x.gpus = map[int64]int{}, map[int64]int{}
	for _, h := range hosts {
		x.updateLocked(h)
	}
}

// Remove takes the host with id out of the index; an unknown id is ignored.
func (x *Index) Remove(id string) {
	x.mu.Lock()
	defer x.mu.Unlock()
	if ih := x.hosts[id]; ih != nil {
		x.leaveLocked(ih)
		delete(x.hosts, id)
	}
}

// Len is the number of hosts indexed.
func (x *Index) Len() int {
	x.mu.Lock()
	defer x.mu.Unlock()
	return len(x.hosts)
}

// Groups is the number of distinct host states indexed: what a placement looks at, at most.
func (x *Index) Groups() int {
	x.mu.Lock()
	defer x.mu.Unlock()
	return len(x.groups)
}

// Dump describes the index: one line per host, in host id order, with its group's key. Two
// indexes of the same pool dump the same text, however each was built.
func (x *Index) Dump() string {
	x.mu.Lock()
	defer x.mu.Unlock()
	ids := make([]string, 0, len(x.hosts))
	for id := range x.hosts {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	var b strings.Builder
	for _, id := range ids {
		ih := x.hosts[id]
		fmt.Fprintf(&b, "%s %s\n", id, ih.g.key)
	}
	return b.String()
}

func (x *Index) updateLocked(h *gpupoolv1.Host) {
	if h == nil {
		return
	}
	ih := x.hosts[h.GetId()]
	if ih == nil {
		ih = &ixHost{}
		x.hosts[h.GetId()] = ih
	} else {
		x.leaveLocked(ih)
	}
	ih.h = h
	ih.cpu, ih.gpu = h.GetCpuMillicores(), 1000*int64(len(h.GetDevices()))
	x.cpus[ih.cpu]++
	x.gpus[ih.gpu]++
	key, sum := hostKey(h)
	g := x.groups[key]
	if g == nil {
		g = &ixGroup{key: key, pos: len(x.list), sum: sum}
		x.groups[key] = g
		x.list = append(x.list, g)
	}
	i, _ := slices.BinarySearchFunc(g.members, ih, x.order)
	g.members = slices.Insert(g.members, i, ih)
	ih.g = g
}

// leaveLocked takes ih out of its group (dropping the group when it empties) and out of the
// capacity counts.
func (x *Index) leaveLocked(ih *ixHost) {
	g := ih.g
	if i, ok := slices.BinarySearchFunc(g.members, ih, x.order); ok {
		g.members = slices.Delete(g.members, i, i+1)
	}
	if len(g.members) == 0 {
		last := x.list[len(x.list)-1]
		x.list[g.pos], last.pos = last, g.pos
		x.list = x.list[:len(x.list)-1]
		delete(x.groups, g.key)
	}
	for _, c := range []struct {
		m map[int64]int
		v int64
	}{{x.cpus, ih.cpu}, {x.gpus, ih.gpu}} {
		if c.m[c.v]--; c.m[c.v] == 0 {
			delete(c.m, c.v)
		}
	}
	ih.g = nil
}

// order is the tie-break order of hosts: rank, then id.
func (x *Index) order(a, b *ixHost) int {
	return cmp.Or(cmp.Compare(x.rankOf(a.h.GetId()), x.rankOf(b.h.GetId())), strings.Compare(a.h.GetId(), b.h.GetId()))
}

func (x *Index) rankOf(id string) int {
	if x.rank == nil {
		return 0
	}
	if n, ok := x.rank[id]; ok {
		return n
	}
	return int(^uint(0) >> 1)
}

// hostKey is what placement reads of h, with the devices in a canonical order, and its
// summary.
func hostKey(h *gpupoolv1.Host) (string, summary) {
	s := summary{usable: viewNow.hostUsable(h), freeCPU: viewNow.hostFreeCPU(h), freeMem: viewNow.hostFreeMem(h)}
	var scratch [8][64]byte
	devs := make([][]byte, 0, len(h.GetDevices()))
	for i, d := range h.GetDevices() {
		if d == nil {
			continue
		}
		healthy := viewNow.deviceUsable(d)
		var b []byte
		if i < len(scratch) {
			b = scratch[i][:0]
		}
		b = append(b, d.GetModel()...)
		b = strconv.AppendInt(append(b, ','), d.GetMemoryMib(), 10)
		b = strconv.AppendBool(append(b, ','), healthy)
		b = strconv.AppendInt(append(b, ','), d.GetAllocatedMemoryMib(), 10)
		b = strconv.AppendInt(append(b, ','), int64(d.GetAllocatedComputePercent()), 10)
		b = strconv.AppendBool(append(b, ','), d.GetAllocatedExclusive())
		b = strconv.AppendInt(append(b, ','), int64(d.GetLeaseCount()), 10)
		devs = append(devs, b)
		if !slices.Contains(s.models, d.GetModel()) {
			s.models = append(s.models, d.GetModel())
		}
		if !healthy {
			continue
		}
		if viewNow.idle(d) {
			s.idle++
		}
		if !d.GetAllocatedExclusive() {
			s.maxMem = max(s.maxMem, viewNow.freeMem(d))
			s.maxCompute = max(s.maxCompute, viewNow.freeCompute(d))
		}
	}
	slices.SortFunc(devs, bytes.Compare)
	key := make([]byte, 0, 64+70*len(devs))
	key = strconv.AppendBool(key, s.usable)
	key = strconv.AppendInt(append(key, ' '), h.GetAllocatedCpuMillicores(), 10)
	key = strconv.AppendInt(append(key, '/'), h.GetCpuMillicores(), 10)
	key = strconv.AppendInt(append(key, ' '), h.GetAllocatedMemoryMib(), 10)
	key = strconv.AppendInt(append(key, '/'), h.GetMemoryMib(), 10)
	key = append(key, " ["...)
	for i, d := range devs {
		if i > 0 {
			key = append(key, ' ')
		}
		key = append(key, d...)
	}
	key = append(key, ']')
	return string(key), s
}

// mayHold reports whether the hosts of a group may hold one host's share of rq: false only
// when they cannot.
func (s *summary) mayHold(rq *request, perHost int) bool {
	if !s.usable || (rq.hostCPU > 0 && s.freeCPU < rq.hostCPU) || (rq.hostMem > 0 && s.freeMem < rq.hostMem) {
		return false
	}
	if rq.models != nil && !slices.ContainsFunc(s.models, func(m string) bool { return modelMatches(rq.models, m) }) {
		return false
	}
	if rq.exclusive {
		return s.idle >= perHost
	}
	return s.maxMem >= rq.mem && s.maxCompute >= rq.compute
}

// pinned reports whether rq names its host: the exhaustive placement filters every other host
// out, so Place may rate that host alone.
func (rq *request) pinned() bool { return rq.cons.GetHost() != "" }

// pinnedLocked is the host of id, from over if it is there, else as indexed; none if neither
// has it.
func (x *Index) pinnedLocked(over []*gpupoolv1.Host, id string) []*gpupoolv1.Host {
	for _, h := range over {
		if h.GetId() == id {
			return []*gpupoolv1.Host{h}
		}
	}
	if ih, ok := x.hosts[id]; ok {
		return []*gpupoolv1.Host{ih.h}
	}
	return nil
}

// indexable reports whether Place can answer rq from groups: the request's slices share one
// host (or there is one), and nothing but the group's state decides where they go.
func (rq *request) indexable() bool {
	c := rq.cons
	return (rq.oneHost || rq.count == 1) && c.GetHost() == "" && len(c.GetLabels()) == 0 && rq.devices == nil &&
		rq.topo != gpupoolv1.Topology_TOPOLOGY_SAME_NVLINK && rq.topo != gpupoolv1.Topology_TOPOLOGY_SAME_PCIE_ROOT &&
		!(rq.opts.Policy == GPUClustering && rq.opts.Affinity != nil)
}

// Place is PlaceWith on the indexed hosts, with ties broken by the index's rank. It rates
// one host per group that may hold the request. A request that fits none is refused with the
// same error PlaceWith gives.
func (x *Index) Place(req *gpupoolv1.LeaseRequest, opts Options) ([]*gpupoolv1.Slice, error) {
	return x.PlaceOver(nil, req, opts)
}

// PlaceOver is Place on the indexed hosts with over in place of the indexed hosts of the same
// id (and in addition to them, for ids the index lacks): the pool with changes not yet
// indexed, such as grants in flight. It rates the hosts of over one by one, so over should be
// small.
func (x *Index) PlaceOver(over []*gpupoolv1.Host, req *gpupoolv1.LeaseRequest, opts Options) ([]*gpupoolv1.Slice, error) {
	if err := checkOptions(opts); err != nil {
		return nil, err
	}
	opts.Rank = x.rank
	if req == nil {
		return nil, &Error{Never: true, Reason: "empty lease request"}
	}
	rq, reason := newRequest(req, &opts)
	if reason != "" {
		return nil, &Error{Never: true, Reason: reason}
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	opts.maxCPU, opts.maxGPU = maxKey(x.cpus), maxKey(x.gpus)
	var overID map[string]bool
	if len(over) > 0 {
		overID = make(map[string]bool, len(over))
		for _, h := range over {
			overID[h.GetId()] = true
			if len(h.GetDevices()) > 0 {
				opts.maxCPU, opts.maxGPU = max(opts.maxCPU, h.GetCpuMillicores()), max(opts.maxGPU, 1000*int64(len(h.GetDevices())))
			}
		}
	}
	if rq.pinned() && !(opts.Policy == Random && len(over) > 0) {
		// Only the named host may hold it: rate that host alone.
		if ss, err := place(x.pinnedLocked(over, rq.cons.GetHost()), req, &opts); err == nil {
			return ss, nil
		}
		return place(x.allLocked(over), req, &opts) // the same refusal as the exhaustive placement
	}
	if !rq.indexable() || (opts.Policy == Random && len(over) > 0) {
		return place(x.allLocked(over), req, &opts)
	}
	perHost := 1
	if rq.oneHost {
		perHost = rq.count
	}
	byID := x.rank != nil && !scoredPolicy(opts.Policy) // binpack and spread break ties by id
	if opts.Policy == FGD {
		return x.placeCachedLocked(over, overID, req, rq, &opts, perHost)
	}
	reps := make([]*gpupoolv1.Host, 0, 64+len(over))
	var weights []int
	for _, g := range x.list {
		if !g.sum.mayHold(rq, perHost) {
			continue
		}
		if h := g.first(byID, overID); h != nil {
			reps = append(reps, h)
			weights = append(weights, len(g.members))
		}
	}
	if opts.Policy == Random {
		return x.placeRandomLocked(reps, weights, req, &opts)
	}
	reps = append(reps, over...)
	ss, err := place(reps, req, &opts)
	if err != nil {
		return place(x.allLocked(over), req, &opts) // the same refusal as the exhaustive placement
	}
	return ss, nil
}

// placeRandomLocked draws a host uniformly among those that fit: a group by its size among
// the groups whose first host fits, then a member.
func (x *Index) placeRandomLocked(reps []*gpupoolv1.Host, weights []int, req *gpupoolv1.LeaseRequest, opts *Options) ([]*gpupoolv1.Slice, error) {
	probe := *opts
	probe.Policy = Binpack
	var fit []int
	total := 0
	for i, h := range reps {
		if _, err := place([]*gpupoolv1.Host{h}, req, &probe); err == nil {
			fit = append(fit, i)
			total += weights[i]
		}
	}
	if total == 0 {
		return place(x.allLocked(nil), req, opts)
	}
	n := opts.Rand.Intn(total)
	for _, i := range fit {
		if n < weights[i] {
			g := x.hosts[reps[i].GetId()].g
			return place([]*gpupoolv1.Host{g.members[n].h}, req, opts)
		}
		n -= weights[i]
	}
	panic("placement: random draw out of range")
}

// first is the group's first host in tie-break order (or by id) that is not in skip, or nil.
func (g *ixGroup) first(byID bool, skip map[string]bool) *gpupoolv1.Host {
	var h *gpupoolv1.Host
	for _, m := range g.members {
		if skip[m.h.GetId()] {
			continue
		}
		if !byID {
			return m.h
		}
		if h == nil || m.h.GetId() < h.GetId() {
			h = m.h
		}
	}
	return h
}

// allLocked is every indexed host, with over in place of those of the same id, in id order.
func (x *Index) allLocked(over []*gpupoolv1.Host) []*gpupoolv1.Host {
	out := make([]*gpupoolv1.Host, 0, len(x.hosts)+len(over))
	skip := map[string]bool{}
	for _, h := range over {
		skip[h.GetId()] = true
		out = append(out, h)
	}
	for id, ih := range x.hosts {
		if !skip[id] {
			out = append(out, ih.h)
		}
	}
	slices.SortFunc(out, func(a, b *gpupoolv1.Host) int { return strings.Compare(a.GetId(), b.GetId()) })
	return out
}

func maxKey(m map[int64]int) int64 {
	var most int64
	for k := range m {
		most = max(most, k)
	}
	return most
}

// reqKey is what a policy that rates hosts one by one reads of an indexable request.
type reqKey struct {
	count               int
	exclusive           bool
	mem, hostCPU, hostM int64
	compute             int32
	topo                gpupoolv1.Topology
	model               string
	minMem              int64
}

// maxCachedReqs bounds the requests whose scores the index remembers at once: past it, the
// cache starts afresh.
const maxCachedReqs = 256

// placeCachedLocked is PlaceOver for FGD: it rates each group that may hold the request once
// per mix and request, remembering the score, as a group's hosts rate alike and most groups do
// not change between placements. The hosts of over are rated every time. The request goes on
// the host with the best rating (score, then tie-break order), as the exhaustive search
// chooses it, and is placed there as the exhaustive search places it on that host.
func (x *Index) placeCachedLocked(over []*gpupoolv1.Host, overID map[string]bool, req *gpupoolv1.LeaseRequest,
	rq *request, opts *Options, perHost int) ([]*gpupoolv1.Slice, error) {
	if x.mix != opts.Mix || len(x.reqs) >= maxCachedReqs {
		x.gen++
		x.mix, x.reqs = opts.Mix, map[reqKey]int32{}
	}
	k := reqKey{count: rq.count, exclusive: rq.exclusive, mem: rq.mem, hostCPU: rq.hostCPU, hostM: rq.hostMem,
		compute: rq.compute, topo: rq.topo, model: rq.cons.GetModel(), minMem: rq.cons.GetMinMemoryMib()}
	id, ok := x.reqs[k]
	if !ok {
		id = int32(len(x.reqs))
		x.reqs[k] = id
	}
	var (
		top   rating
		win   *gpupoolv1.Host
		found bool
	)
	consider := func(h *gpupoolv1.Host, score int) {
		if score == noFit {
			return
		}
		r := rating{score: score, rank: x.rankOf(h.GetId()), host: h.GetId()}
		if x.rank == nil {
			r.rank = 0
		}
		if !found || r.beats(top) {
			top, win, found = r, h, true
		}
	}
	// Rate the groups whose score is not cached, and the hosts of over, in one pool.
	unknown, unknownGroups := x.scratchHosts[:0], x.scratchGroups[:0]
	defer func() {
		clear(unknown)
		clear(unknownGroups)
		x.scratchHosts, x.scratchGroups = unknown[:0], unknownGroups[:0]
	}()
	for _, g := range x.list {
		if !g.sum.mayHold(rq, perHost) {
			continue
		}
		h := g.first(false, overID)
		if h == nil {
			continue
		}
		if g.gen != x.gen {
			g.gen, g.scores = x.gen, g.scores[:0]
		}
		for int(id) >= len(g.scores) {
			g.scores = append(g.scores, scoreUnknown)
		}
		switch c := g.scores[id]; c {
		case scoreUnknown:
			unknown, unknownGroups = append(unknown, h), append(unknownGroups, g)
		case scoreNoFit:
		default:
			consider(h, int(c-scoreBase))
		}
	}
	if len(unknown) > 0 || len(over) > 0 {
		unknown = append(unknown, over...)
		scores := rateEach(unknown, rq)
		for i, g := range unknownGroups {
			g.scores[id] = scoreNoFit
			if scores[i] != noFit {
				g.scores[id] = scoreBase + int32(scores[i])
			}
		}
		for i, h := range unknown {
			consider(h, scores[i])
		}
	}
	if found {
		p := newPool([]*gpupoolv1.Host{win}, rq, viewNow)
		defer p.free()
		if len(p.hosts) == 1 {
			if picks := p.pickOne(&p.hosts[0]); picks != nil {
				return p.slices(picks), nil
			}
		}
	}
	return place(x.allLocked(over), req, opts) // the same refusal as the exhaustive placement
}

// rateEach is the score of the best placement of rq on each of hosts alone, noFit where none
// fits, for the policies that rate the hosts of a single-host request one by one.
func rateEach(hosts []*gpupoolv1.Host, rq *request) []int {
	out := make([]int, len(hosts))
	p := newPool(hosts, rq, viewNow)
	defer p.free()
	j := 0 // newPool keeps the order of hosts, leaving out those no slice fits
	for i, h := range hosts {
		out[i] = noFit
		if j < len(p.hosts) && p.hosts[j].h == h {
			out[i] = p.rateOne(&p.hosts[j])
			j++
		}
	}
	return out
}

// rateOne is the score of the best placement of the request on hs alone, as search rates it,
// or noFit.
func (p *pool) rateOne(hs *hostState) int {
	s := noFit
	if p.pickOne(hs) != nil {
		s = p.lastScore
	}
	p.reset(hs)
	return s
}

// pickOne places the request on hs alone as search does, for the policies that rate the hosts
// of a single-host request one by one, and rates it in p.lastScore. It returns the picks, or
// nil when the request does not fit; the takes stay in place until reset.
func (p *pool) pickOne(hs *hostState) []int {
	if !hs.roomy {
		return nil
	}
	if p.rq.opts.Policy == FGD && p.rq.count == 1 && !p.rq.exclusive {
		return p.fgdPick(hs) // rates it as hostScore would
	}
	picks := p.greedy(hs.lo, hs.hi, "", p.rq.count)
	if picks != nil {
		p.lastScore = p.hostScore(hs)
	}
	return picks
}
