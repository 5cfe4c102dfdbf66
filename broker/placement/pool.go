package placement

import (
	"cmp"
	"math"
	"slices"
	"strings"
	"sync"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// pool is the part of the pool a request can use under one view: the hosts that pass the host
// constraints and have at least one candidate, and the candidates, the devices that match the
// device constraints and fit at least one slice. A host's candidates are contiguous.
//
// The free fields are working state for one trial placement; reset restores them.
type pool struct {
	rq    *request
	v     view
	hosts []hostState
	cands []cand

	// Scratch reused across trials, so a search allocates per call, not per host.
	picks, best, order []int

	// scored: the policy rates hosts with hostScore (only under viewNow: under viewEmpty a
	// search only asks whether the request fits). top is the best rating so far.
	scored bool
	top    rating
	// before and after are scratch for hostScore and fgdPick; pos[i] is where the candidate
	// hs.lo+i is in before.free after node read hs.
	before, after nodeState
	pos           []int
	// rated holds, per host shape, the score FGD gave the first host of that shape in this
	// search (-1: no slice fit): hosts that look alike rate alike, so the others need only
	// their tie-break. lastScore is the score rateBetter computed last.
	rated     map[hostShape]int
	lastScore int
	// maxCPU and maxGPU are the largest host CPU (millicores) and GPU count × 1000 among the
	// hosts given: the scale of best-fit, dot-product and gpu-clustering.
	maxCPU, maxGPU int64
	// fits is scratch for the two-pass policies: the hosts that fit and their raw scores.
	fits []hostFit
	aff  map[string]int // scratch for affinity
}

// hostFit is a host that fits the request, with its raw score.
type hostFit struct{ h, raw int }

// hostShape is what FGD's rating of a host depends on: the host as FGD sees it, and its
// candidates' free memory, compute and size in a fixed order.
type hostShape struct {
	node  nodeKey
	n     int
	cands [maxKeyGPUs]candShape
}

type candShape struct {
	freeMem, size int64
	freeCompute   int32
}

// shape returns hs's hostShape, or false when it has too many GPUs or mixed models.
func (p *pool) shape(hs *hostState) (hostShape, bool) {
	var k hostShape
	p.node(hs, false, &p.before)
	node, ok := p.before.key()
	if !ok || hs.hi-hs.lo > maxKeyGPUs {
		return k, false
	}
	k.node, k.n = node, hs.hi-hs.lo
	for i := hs.lo; i < hs.hi; i++ {
		c := &p.cands[i]
		k.cands[i-hs.lo] = candShape{freeMem: c.baseMem, size: c.d.GetMemoryMib(), freeCompute: c.baseCompute}
	}
	slices.SortFunc(k.cands[:k.n], func(a, b candShape) int {
		return cmp.Or(cmp.Compare(a.freeMem, b.freeMem), cmp.Compare(a.freeCompute, b.freeCompute), cmp.Compare(a.size, b.size))
	})
	return k, true
}

// fgdTry rates one fractional slice on hs with FGD, as try would, skipping the work when a
// host of the same shape was rated already and hs cannot win on the tie-break.
func (p *pool) fgdTry(hs *hostState, found bool, try func(*hostState, string, []int)) {
	k, ok := p.shape(hs)
	if ok {
		if score, seen := p.rated[k]; seen {
			if score == noFit || (found && !p.rating(hs, "", score).beats(p.top)) {
				return
			}
		}
	}
	p.lastScore = noFit
	try(hs, "", p.fgdPick(hs))
	if ok {
		if p.rated == nil {
			p.rated = map[hostShape]int{}
		}
		p.rated[k] = p.lastScore
	}
}

type hostState struct {
	h      *gpupoolv1.Host
	lo, hi int  // its candidates: cands[lo:hi]
	roomy  bool // has the host CPU and memory the request asks for
	// Free GPU memory over all its usable devices: how empty the host is.
	freeMem, baseFree int64
}

type cand struct {
	d    *gpupoolv1.Device
	host int32 // index into pool.hosts
	idle bool  // nothing was allocated on it before this request
	// Free capacity after the slices taken in the current trial.
	freeMem, baseMem         int64
	freeCompute, baseCompute int32
	taken                    int32 // slices taken in the current trial
}

func newPool(hosts []*gpupoolv1.Host, rq *request, v view) *pool {
	ndev := 0
	for _, h := range hosts {
		ndev += len(h.GetDevices())
	}
	// Sized for the whole pool: growing them costs more than the slack. The buffers of a pool
	// released with free are reused.
	p, _ := pools.Get().(*pool)
	if p == nil {
		p = &pool{}
	}
	if cap(p.hosts) < len(hosts) {
		p.hosts = make([]hostState, 0, len(hosts))
	}
	if cap(p.cands) < ndev {
		p.cands = make([]cand, 0, ndev)
	}
	p.rq, p.v, p.hosts, p.cands = rq, v, p.hosts[:0], p.cands[:0]
	p.scored, p.top = v == viewNow && scoredPolicy(rq.opts.Policy), rating{}
	p.maxCPU, p.maxGPU = 0, 0
	for _, h := range hosts {
		if h == nil {
			continue
		}
		p.maxCPU, p.maxGPU = max(p.maxCPU, h.GetCpuMillicores()), max(p.maxGPU, 1000*int64(len(h.GetDevices())))
		if !v.hostUsable(h) || !rq.hostMatches(h) {
			continue
		}
		hs := hostState{h: h, lo: len(p.cands), roomy: rq.hostRoomy(v, h)}
		for _, d := range h.GetDevices() {
			if d == nil || !v.deviceUsable(d) {
				continue
			}
			hs.freeMem += v.freeMem(d)
			if !rq.deviceMatches(d) || !rq.fitsOne(v, d) {
				continue
			}
			mem, compute := v.freeMem(d), v.freeCompute(d)
			p.cands = append(p.cands, cand{
				d: d, host: int32(len(p.hosts)), idle: v.idle(d),
				freeMem: mem, baseMem: mem, freeCompute: compute, baseCompute: compute,
			})
		}
		if len(p.cands) == hs.lo {
			continue
		}
		hs.hi, hs.baseFree = len(p.cands), hs.freeMem
		p.hosts = append(p.hosts, hs)
	}
	if rq.opts.maxCPU > 0 || rq.opts.maxGPU > 0 {
		p.maxCPU, p.maxGPU = rq.opts.maxCPU, rq.opts.maxGPU
	}
	return p
}

// pools holds released pools, for their buffers.
var pools sync.Pool

// free releases p for reuse. p must not be used after.
func (p *pool) free() {
	clear(p.hosts)
	clear(p.cands)
	clear(p.rated)
	p.rq = nil
	pools.Put(p)
}

// slots is how many more slices of the request fit on c in the current trial.
func (p *pool) slots(c *cand) int64 {
	if p.rq.distinct {
		if c.taken > 0 {
			return 0
		}
		return 1 // every candidate fits one slice
	}
	return min(c.freeMem/p.rq.mem, int64(c.freeCompute/p.rq.compute))
}

// take puts one more slice on candidate i in the current trial.
func (p *pool) take(i int) {
	c := &p.cands[i]
	m := p.rq.sliceMem(c.d)
	c.taken++
	c.freeMem -= m
	c.freeCompute -= p.rq.sliceCompute()
	p.hosts[c.host].freeMem -= m
}

// reset undoes every take on hs's candidates.
func (p *pool) reset(hs *hostState) {
	for i := hs.lo; i < hs.hi; i++ {
		c := &p.cands[i]
		c.freeMem, c.freeCompute, c.taken = c.baseMem, c.baseCompute, 0
	}
	hs.freeMem = hs.baseFree
}

// cmp orders candidates i and j by how good the next slice is on each, best first.
//
// binpack: a device already in use before an idle one; then the least free memory after the
// slice, the least free compute after it, the least free GPU memory on its host after it.
// spread: the most free memory after the slice, the most free compute, the most free host.
// Ties break by host id, then device index, then device uuid.
func (p *pool) cmp(i, j int) int {
	a, b := &p.cands[i], &p.cands[j]
	ma, mb := a.freeMem-p.rq.sliceMem(a.d), b.freeMem-p.rq.sliceMem(b.d)
	ha, hb := p.hosts[a.host].freeMem-p.rq.sliceMem(a.d), p.hosts[b.host].freeMem-p.rq.sliceMem(b.d)
	var c int
	if p.rq.binpack {
		fa, fb := a.idle && a.taken == 0, b.idle && b.taken == 0
		c = cmpBool(fa, fb)
		c = cmp.Or(c, cmp.Compare(ma, mb), cmp.Compare(a.freeCompute, b.freeCompute), cmp.Compare(ha, hb))
	} else {
		c = cmp.Or(cmp.Compare(mb, ma), cmp.Compare(b.freeCompute, a.freeCompute), cmp.Compare(hb, ha))
	}
	if c != 0 {
		return c
	}
	return cmp.Or(
		strings.Compare(p.hosts[a.host].h.GetId(), p.hosts[b.host].h.GetId()),
		cmp.Compare(a.d.GetIndex(), b.d.GetIndex()),
		strings.Compare(a.d.GetUuid(), b.d.GetUuid()),
	)
}

// cmpBool orders false before true.
func cmpBool(a, b bool) int {
	switch {
	case a == b:
		return 0
	case a:
		return 1
	}
	return -1
}

// capacity is how many slices of the request candidates lo..hi can take, counting only those
// under PCIe root when root is not empty. It stops counting at limit.
func (p *pool) capacity(lo, hi int, root string, limit int64) int64 {
	var n int64
	for i := lo; i < hi && n < limit; i++ {
		c := &p.cands[i]
		if root == "" || c.d.GetPcieRoot() == root {
			n += p.slots(c)
		}
	}
	return n
}

// hostCapacity is how many slices of the request one host can take under its topology,
// counting up to limit.
func (p *pool) hostCapacity(hs *hostState, limit int64) int64 {
	switch p.rq.topo {
	case gpupoolv1.Topology_TOPOLOGY_SAME_NVLINK:
		for n := min(int64(hs.hi-hs.lo), limit); n > 0; n-- {
			if p.clique(hs, int(n)) != nil {
				p.reset(hs)
				return n
			}
		}
		return 0
	case gpupoolv1.Topology_TOPOLOGY_SAME_PCIE_ROOT:
		var most int64
		for i := hs.lo; i < hs.hi; i++ {
			if root := p.cands[i].d.GetPcieRoot(); p.firstOfRoot(hs, i) {
				most = max(most, p.capacity(hs.lo, hs.hi, root, limit))
			}
		}
		return most
	}
	return p.capacity(hs.lo, hs.hi, "", limit)
}

// firstOfRoot reports whether candidate i is the first of hs under a non-empty PCIe root.
func (p *pool) firstOfRoot(hs *hostState, i int) bool {
	root := p.cands[i].d.GetPcieRoot()
	if root == "" {
		return false
	}
	for j := hs.lo; j < i; j++ {
		if p.cands[j].d.GetPcieRoot() == root {
			return false
		}
	}
	return true
}

// search returns the candidates the request's slices go on (one entry per slice), or nil when
// the request does not fit.
func (p *pool) search() []int {
	n := p.rq.count
	// A single slice is on one host anyway: the scored policies rate the hosts for it.
	if !p.rq.oneHost && !(p.scored && n == 1) {
		if p.capacity(0, len(p.cands), "", int64(n)) < int64(n) {
			return nil
		}
		return p.greedy(0, len(p.cands), "", n)
	}
	if p.scored && p.twoPass() {
		return p.searchTwoPass(n)
	}
	var best score
	found := false
	try := func(hs *hostState, root string, picks []int) {
		if picks != nil {
			var better bool
			if p.scored {
				better = p.rateBetter(hs, root, !found)
			} else if s := p.score(hs, root); !found || p.better(s, best) {
				best, better = s, true
			}
			if better {
				found = true
				p.best = append(p.best[:0], picks...)
			}
		}
		p.reset(hs)
	}
	for h := range p.hosts {
		hs := &p.hosts[h]
		if !hs.roomy {
			continue
		}
		switch p.rq.topo {
		case gpupoolv1.Topology_TOPOLOGY_SAME_NVLINK:
			try(hs, "", p.clique(hs, n))
		case gpupoolv1.Topology_TOPOLOGY_SAME_PCIE_ROOT:
			for i := hs.lo; i < hs.hi; i++ {
				if p.firstOfRoot(hs, i) {
					root := p.cands[i].d.GetPcieRoot()
					try(hs, root, p.greedy(hs.lo, hs.hi, root, n))
				}
			}
		default:
			if p.scored && p.rq.opts.Policy == FGD && n == 1 && !p.rq.exclusive {
				p.fgdTry(hs, found, try)
			} else {
				try(hs, "", p.greedy(hs.lo, hs.hi, "", n))
			}
		}
	}
	if !found {
		return nil
	}
	return p.best
}

// twoPass reports whether the policy needs every host that fits before it can choose: Random
// picks one of them, best-fit normalises its scores over them. Topologies within a host
// (same-nvlink, same-pcie-root) are rated in one pass, best-fit without normalising.
func (p *pool) twoPass() bool {
	switch p.rq.topo {
	case gpupoolv1.Topology_TOPOLOGY_SAME_NVLINK, gpupoolv1.Topology_TOPOLOGY_SAME_PCIE_ROOT:
		return false
	}
	return p.rq.opts.Policy == Random || p.rq.opts.Policy == BestFit
}

// searchTwoPass is search for the two-pass policies: it finds the hosts that fit (and rates
// them), then chooses one, then places the request on it.
func (p *pool) searchTwoPass(n int) []int {
	p.fits = p.fits[:0]
	lo, hi := math.MaxInt, math.MinInt
	for h := range p.hosts {
		hs := &p.hosts[h]
		if !hs.roomy || p.greedy(hs.lo, hs.hi, "", n) == nil {
			p.reset(hs)
			continue
		}
		f := hostFit{h: h}
		if p.rq.opts.Policy == BestFit {
			f.raw = p.hostScore(hs)
			lo, hi = min(lo, f.raw), max(hi, f.raw)
		}
		p.reset(hs)
		p.fits = append(p.fits, f)
	}
	if len(p.fits) == 0 {
		return nil
	}
	var win *hostState
	if p.rq.opts.Policy == Random {
		win = &p.hosts[p.fits[p.rq.opts.Rand.Intn(len(p.fits))].h]
	} else {
		var top rating
		for i, f := range p.fits {
			hs := &p.hosts[f.h]
			if r := p.rating(hs, "", normalise(f.raw, lo, hi)); i == 0 || r.beats(top) {
				top, win = r, hs
			}
		}
	}
	if p.rq.opts.Policy == Random && n == 1 && !p.rq.exclusive {
		return p.randomGPU(win)
	}
	p.best = append(p.best[:0], p.greedy(win.lo, win.hi, "", n)...)
	return p.best
}

// randomGPU takes one slice on a GPU of hs drawn uniformly among those with room, each kept
// with probability 1/(GPUs with room seen), in device order.
func (p *pool) randomGPU(hs *hostState) []int {
	pick, seen := -1, 0
	for i := hs.lo; i < hs.hi; i++ {
		if p.slots(&p.cands[i]) == 0 {
			continue
		}
		seen++
		if p.rq.opts.Rand.Intn(seen) == 0 {
			pick = i
		}
	}
	p.take(pick)
	p.best = append(p.best[:0], pick)
	return p.best
}

// greedy takes n slices one at a time among candidates lo..hi (under root, when not empty),
// each on the best candidate with room. It returns the picks, or nil when they do not fit; the
// takes stay in place until reset.
func (p *pool) greedy(lo, hi int, root string, n int) []int {
	if p.capacity(lo, hi, root, int64(n)) < int64(n) {
		return nil
	}
	p.picks = p.picks[:0]
	for range n {
		best := -1
		for i := lo; i < hi; i++ {
			c := &p.cands[i]
			if (root != "" && c.d.GetPcieRoot() != root) || p.slots(c) == 0 {
				continue
			}
			if best < 0 || p.cmp(i, best) < 0 {
				best = i
			}
		}
		p.take(best) // capacity guarantees one
		p.picks = append(p.picks, best)
	}
	return p.picks
}

// clique takes n distinct candidates of hs that are all NVLink peers of each other, the first
// such set in policy order. It returns the picks, or nil when there is none.
func (p *pool) clique(hs *hostState, n int) []int {
	p.order = p.order[:0]
	for i := hs.lo; i < hs.hi; i++ {
		p.order = append(p.order, i)
	}
	slices.SortFunc(p.order, p.cmp)
	p.picks = p.picks[:0]
	if !p.extendClique(0, n) {
		return nil
	}
	for _, i := range p.picks {
		p.take(i)
	}
	return p.picks
}

// extendClique grows p.picks to n candidates from p.order[from:], depth first.
func (p *pool) extendClique(from, n int) bool {
	if len(p.picks) == n {
		return true
	}
	for k := from; len(p.picks)+len(p.order)-k >= n; k++ {
		i := p.order[k]
		if !p.peersOfAll(i) {
			continue
		}
		p.picks = append(p.picks, i)
		if p.extendClique(k+1, n) {
			return true
		}
		p.picks = p.picks[:len(p.picks)-1]
	}
	return false
}

// peersOfAll reports whether candidate i has an NVLink to every pick, in both directions.
func (p *pool) peersOfAll(i int) bool {
	d := p.cands[i].d
	for _, j := range p.picks {
		e := p.cands[j].d
		if !slices.Contains(d.GetNvlinkPeers(), e.GetUuid()) || !slices.Contains(e.GetNvlinkPeers(), d.GetUuid()) {
			return false
		}
	}
	return true
}

// score rates a trial placement on one host (and PCIe root) when all slices share a host.
type score struct {
	opened     int   // idle devices the trial puts a slice on
	devMem     int64 // free memory left on the devices it uses
	devCompute int64 // free compute left on the devices it uses
	hostMem    int64 // free GPU memory left on the host
	host, root string
}

func (p *pool) score(hs *hostState, root string) score {
	s := score{hostMem: hs.freeMem, host: hs.h.GetId(), root: root}
	for i := hs.lo; i < hs.hi; i++ {
		if c := &p.cands[i]; c.taken > 0 {
			if c.idle {
				s.opened++
			}
			s.devMem += c.freeMem
			s.devCompute += int64(c.freeCompute)
		}
	}
	return s
}

// better reports whether s beats t. binpack: fewest idle GPUs opened, then the least free
// memory and compute left on the devices used, then the fullest host. spread: the most free
// memory and compute left on the devices used, then the emptiest host. Ties break by host id,
// then PCIe root.
func (p *pool) better(s, t score) bool {
	var c int
	if p.rq.binpack {
		c = cmp.Or(cmp.Compare(s.opened, t.opened), cmp.Compare(s.devMem, t.devMem),
			cmp.Compare(s.devCompute, t.devCompute), cmp.Compare(s.hostMem, t.hostMem))
	} else {
		c = cmp.Or(cmp.Compare(t.devMem, s.devMem), cmp.Compare(t.devCompute, s.devCompute),
			cmp.Compare(t.hostMem, s.hostMem))
	}
	return cmp.Or(c, strings.Compare(s.host, t.host), strings.Compare(s.root, t.root)) < 0
}

// noFit is the score remembered for a host shape on which no slice fits.
const noFit = math.MinInt

// noLimit counts capacity to the end.
const noLimit = math.MaxInt64
