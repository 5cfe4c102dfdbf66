package placement

import (
	"cmp"
	"math"
	"slices"
	"strings"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// rating is how a scored policy rates a trial placement on one host (and PCIe root).
type rating struct {
	score      int // 0 to 100, higher is better
	rank       int // Options.Rank of the host
	host, root string
}

// beats reports whether r is better than s: a higher score, then a lower rank, then host id,
// then PCIe root.
func (r rating) beats(s rating) bool {
	return cmp.Or(cmp.Compare(s.score, r.score), cmp.Compare(r.rank, s.rank),
		strings.Compare(r.host, s.host), strings.Compare(r.root, s.root)) < 0
}

// rateBetter rates the trial on hs and reports whether it beats the best so far (always, when
// first), remembering it if so. Random instead keeps each host that fits with probability
// 1/(hosts seen), which leaves each one equally likely.
func (p *pool) rateBetter(hs *hostState, root string, first bool) bool {
	if p.rq.opts.Policy == Random {
		if first {
			p.top.score = 0
		}
		p.top.score++
		return p.rq.opts.Rand.Intn(p.top.score) == 0
	}
	p.lastScore = p.hostScore(hs)
	r := p.rating(hs, root, p.lastScore)
	if first || r.beats(p.top) {
		p.top = r
		return true
	}
	return false
}

// rating is hs's rating with the given score.
func (p *pool) rating(hs *hostState, root string, score int) rating {
	r := rating{score: score, rank: math.MaxInt, host: hs.h.GetId(), root: root}
	if p.rq.opts.Rank == nil {
		r.rank = 0
	} else if n, ok := p.rq.opts.Rank[r.host]; ok {
		r.rank = n
	}
	return r
}

// node reads hs's host for FGD and the scored policies: its free host CPU and memory and the
// free share of each usable GPU, before the trial (after false) or after it.
func (p *pool) node(hs *hostState, after bool, st *nodeState) {
	h := hs.h
	st.cpu, st.mem = p.v.hostFreeCPU(h), p.v.hostFreeMem(h)
	if after {
		st.cpu, st.mem = st.cpu-p.rq.hostCPU, st.mem-p.rq.hostMem
	}
	st.free, st.models = st.free[:0], st.models[:0]
	if !after {
		p.pos = slices.Grow(p.pos[:0], hs.hi-hs.lo)[:hs.hi-hs.lo]
	}
	j := hs.lo
	for _, d := range h.GetDevices() {
		if d == nil || !p.v.deviceUsable(d) {
			continue
		}
		mem, compute := p.v.freeMem(d), p.v.freeCompute(d)
		if j < hs.hi && p.cands[j].d == d {
			if after {
				mem, compute = p.cands[j].freeMem, p.cands[j].freeCompute
			} else {
				p.pos[j-hs.lo] = len(st.free)
			}
			j++
		}
		st.free = append(st.free, freeMilli(d, mem, compute))
		st.models = append(st.models, d.GetModel())
	}
}

// freeMilli is the share of d free in thousandths, given its free memory and compute: the
// smaller of the two shares.
func freeMilli(d *gpupoolv1.Device, mem int64, compute int32) int32 {
	f := int32(compute) * 10
	if m := d.GetMemoryMib(); m > 0 {
		f = min(f, int32(mem*1000/m))
	}
	return max(0, f)
}

// fgdScore is FGD's score of a placement that takes a host's expected fragmentation from
// before to after (thousandths of a GPU): 100·sigmoid((before−after)/1000), truncated, as the
// paper's artifact computes it.
func fgdScore(before, after float64) int {
	x := (before - after) / 1000
	return int(1 / (1 + math.Exp(-x)) * 100)
}

// hostScore rates the trial placement on hs for the scored policies, from 0 to 100 (BestFit:
// its raw score, which search normalises over the hosts that fit). The formulas are those of
// the FGD paper's artifact; the artifact's constants (128 cores, 8 GPUs) are the largest host
// CPU and GPU count of the pool given.
func (p *pool) hostScore(hs *hostState) int {
	before, after := &p.before, &p.after
	p.node(hs, false, before)
	p.node(hs, true, after)
	gpuLeft := sum(before.free)
	gpuReq := gpuLeft - sum(after.free)
	switch p.rq.opts.Policy {
	case FGD:
		return fgdScore(p.rq.opts.Mix.frag(before), p.rq.opts.Mix.frag(after))
	case BestFit:
		return bestFitRaw(before.cpu, gpuLeft, p.rq.hostCPU, gpuReq, p.maxCPU, p.maxGPU)
	case DotProduct:
		return dotProduct(before.cpu, gpuLeft, p.rq.hostCPU, gpuReq, p.maxCPU, p.maxGPU)
	case GPUPacking:
		return p.packing(hs, before)
	case GPUClustering:
		return clustering(p.affinity(hs.h), p.rq.class, gpuLeft, p.maxGPU)
	}
	return 0
}

// bestFitRaw is best-fit's score before normalisation: 100 less half the free CPU and half
// the free GPU share left after the placement, each relative to the pool's largest host.
func bestFitRaw(cpuLeft, gpuLeft, cpu, gpu, maxCPU, maxGPU int64) int {
	free := [2]float64{float64(cpuLeft), float64(gpuLeft)}
	req := [2]float64{float64(cpu), float64(gpu)}
	mx := [2]float64{float64(maxCPU), float64(maxGPU)}
	var sc float64
	for i := range free {
		if free[i] < req[i] {
			return 0
		}
		if mx[i] > 0 {
			sc += (free[i] - req[i]) / mx[i] * 0.5
		}
	}
	return int((1 - sc) * 100)
}

// dotProduct is dot-product's score: 100 less half the dot product of the host's free CPU and
// GPU share with the request's, each relative to the pool's largest host.
func dotProduct(cpuLeft, gpuLeft, cpu, gpu, maxCPU, maxGPU int64) int {
	if cpuLeft < cpu {
		return 0
	}
	var d float64
	if maxCPU > 0 {
		d += float64(cpuLeft) / float64(maxCPU) * float64(cpu) / float64(maxCPU)
	}
	if maxGPU > 0 {
		d += float64(gpuLeft) / float64(maxGPU) * float64(gpu) / float64(maxGPU)
	}
	return int(100 * (1 - d/2))
}

// normalise maps raw scores of the hosts that fit onto 0..100 by min-max, truncated, as the
// artifact normalises best-fit; all equal scores become 0.
func normalise(raw, lo, hi int) int {
	if hi == lo {
		return 0
	}
	return (raw - lo) * 100 / (hi - lo)
}

// packing is gpu-packing's score: a request that takes only GPUs already in use scores 50 to
// 100 (the fuller the GPUs, the higher), one that opens idle GPUs on a host in use 33 to 49,
// and one on an idle host at most 33; a request without GPUs scores 0.
func (p *pool) packing(hs *hostState, before *nodeState) int {
	idle := 0
	for _, f := range before.free {
		if f == 1000 {
			idle++
		}
	}
	if idle == len(before.free) {
		return max(100/3-idle, idle)
	}
	opened, r := 0, 0
	for i := hs.lo; i < hs.hi; i++ {
		c := &p.cands[i]
		if c.taken == 0 {
			continue
		}
		f := int(freeMilli(c.d, c.baseMem, c.baseCompute))
		if f == 1000 {
			opened++
		}
		r += f * 100 / 1000
	}
	if opened > 0 {
		return max(50-opened, 33)
	}
	return max(100-r/10, 50)
}

// clustering is gpu-clustering's score: base 0 to 25 for how full the host's GPUs are
// relative to the pool's largest host, plus 75 when the host holds only leases of the
// request's class, 50 when it holds that class among others, 25 when it holds none.
func clustering(aff map[string]int, class string, gpuLeft, maxGPU int64) int {
	if class == "" {
		return 0
	}
	var base int64
	if maxGPU > 0 {
		base = 25 * (maxGPU - gpuLeft) / maxGPU
	}
	switch {
	case aff[class] > 0 && len(aff) == 1:
		return int(base) + 75
	case aff[class] > 0:
		return int(base) + 50
	case len(aff) == 0:
		return int(base) + 25
	}
	return int(base)
}

// affinity is the lease classes h holds: from Options.Affinity when given, else read from its
// devices (see Options.Affinity).
func (p *pool) affinity(h *gpupoolv1.Host) map[string]int {
	if a := p.rq.opts.Affinity; a != nil {
		return a[h.GetId()]
	}
	clear(p.aff)
	if p.aff == nil {
		p.aff = map[string]int{}
	}
	for _, d := range h.GetDevices() {
		if d == nil || !p.v.deviceUsable(d) || p.v.idle(d) {
			continue
		}
		switch {
		case !d.GetAllocatedExclusive():
			p.aff[classShare]++
		case p.rq.exclusive:
			p.aff[p.rq.class]++
		default:
			p.aff["whole-gpu"]++
		}
	}
	return p.aff
}

// fgdPick takes one slice of a fractional request on the candidate of hs whose placement FGD
// scores highest (the first such in device order) and returns it, or nil when none has room.
// The take stays in place until reset.
func (p *pool) fgdPick(hs *hostState) []int {
	p.node(hs, false, &p.before)
	before := p.rq.opts.Mix.frag(&p.before)
	// A slice on one candidate changes the host's free CPU and memory and that GPU's free
	// share only: the state after it is the one before with those changed (as node would read
	// it after the take).
	st := &p.after
	st.cpu, st.mem = p.before.cpu-p.rq.hostCPU, p.before.mem-p.rq.hostMem
	st.free, st.models = append(st.free[:0], p.before.free...), append(st.models[:0], p.before.models...)
	best, bestScore := -1, 0
	for i := hs.lo; i < hs.hi; i++ {
		if p.slots(&p.cands[i]) == 0 || p.twinBefore(hs, i) {
			continue
		}
		p.take(i)
		c, g := &p.cands[i], p.pos[i-hs.lo]
		st.free[g] = freeMilli(c.d, c.freeMem, c.freeCompute)
		if sc := fgdScore(before, p.rq.opts.Mix.frag(st)); best < 0 || sc > bestScore {
			best, bestScore = i, sc
		}
		st.free[g] = p.before.free[g]
		p.reset(hs)
	}
	if best < 0 {
		return nil
	}
	p.lastScore = bestScore
	p.take(best)
	p.picks = append(p.picks[:0], best)
	return p.picks
}

// twinBefore reports whether a candidate of hs before i has the same model, size and free
// memory and compute as i: a slice on either leaves the host in the same state up to the
// order of its GPUs, so FGD scores both alike and keeps the first.
func (p *pool) twinBefore(hs *hostState, i int) bool {
	c := &p.cands[i]
	for j := hs.lo; j < i; j++ {
		d := &p.cands[j]
		if d.freeMem == c.freeMem && d.freeCompute == c.freeCompute && d.d.GetMemoryMib() == c.d.GetMemoryMib() &&
			d.d.GetModel() == c.d.GetModel() {
			return true
		}
	}
	return false
}

func sum(xs []int32) int64 {
	var n int64
	for _, x := range xs {
		n += int64(x)
	}
	return n
}
