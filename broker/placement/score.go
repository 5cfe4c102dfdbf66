package placement

import (
	"cmp"
	"math"
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
	j := hs.lo
	for _, d := range h.GetDevices() {
		if d == nil || !p.v.deviceUsable(d) {
			continue
		}
		mem, compute := p.v.freeMem(d), p.v.freeCompute(d)
		if j < hs.hi && p.cands[j].d == d {
			if after {
				mem, compute = p.cands[j].freeMem, p.cands[j].freeCompute
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

// hostScore rates the trial placement on hs for the scored policies, from 0 to 100.
func (p *pool) hostScore(hs *hostState) int {
	before, after := &p.before, &p.after
	p.node(hs, false, before)
	p.node(hs, true, after)
	h := hs.h
	switch p.rq.opts.Policy {
	case FGD:
		delta := p.rq.opts.Mix.frag(after) - p.rq.opts.Mix.frag(before)
		return int(100 / (1 + math.Exp(delta/1000))) // 100·sigmoid(−Δ/1000)
	case BestFit:
		var left float64
		var dims int
		for _, r := range [][2]int64{{after.cpu, h.GetCpuMillicores()}, {after.mem, h.GetMemoryMib()},
			{sum(after.free), 1000 * int64(len(after.free))}} {
			if r[1] > 0 {
				left += float64(r[0]) / float64(r[1])
				dims++
			}
		}
		return int(100 * (1 - left/float64(max(dims, 1))))
	case DotProduct:
		var dot float64
		var dims int
		gpuCap := 1000 * int64(len(before.free))
		for _, r := range [][3]int64{{p.rq.hostCPU, before.cpu, h.GetCpuMillicores()}, {p.rq.hostMem, before.mem, h.GetMemoryMib()},
			{sum(before.free) - sum(after.free), sum(before.free), gpuCap}} {
			if r[2] > 0 {
				dot += float64(r[0]) / float64(r[2]) * float64(r[1]) / float64(r[2])
				dims++
			}
		}
		return int(100 * (1 - dot/float64(max(dims, 1))))
	case GPUPacking:
		for i := hs.lo; i < hs.hi; i++ {
			if c := &p.cands[i]; c.taken > 0 && !c.idle && !p.rq.exclusive {
				return 100 // shares a GPU already in use
			}
		}
		if p.anyInUse(h) {
			return 50
		}
		return 0
	case GPUClustering:
		for _, d := range h.GetDevices() {
			if d != nil && p.v.deviceUsable(d) && p.sameShare(d) {
				return 100
			}
		}
		if !p.anyInUse(h) {
			return 50
		}
		return 0
	}
	return 0
}

// anyInUse reports whether a usable GPU of h has anything allocated.
func (p *pool) anyInUse(h *gpupoolv1.Host) bool {
	for _, d := range h.GetDevices() {
		if d != nil && p.v.deviceUsable(d) && !p.v.idle(d) {
			return true
		}
	}
	return false
}

// sameShare reports whether every lease on d has the request's share of it: d is held
// exclusively for an exclusive request, or d's leases each take the request's compute.
func (p *pool) sameShare(d *gpupoolv1.Device) bool {
	if p.rq.exclusive {
		return p.v.heldExclusive(d)
	}
	n := d.GetLeaseCount()
	return n > 0 && !d.GetAllocatedExclusive() && d.GetAllocatedComputePercent() == n*p.rq.compute
}

// fgdPick takes one slice of a fractional request on the candidate of hs that grows hs's
// fragmentation least (the first such in device order) and returns it, or nil when none has
// room. The take stays in place until reset.
func (p *pool) fgdPick(hs *hostState) []int {
	st := &p.after
	best, bestFrag := -1, 0.0
	for i := hs.lo; i < hs.hi; i++ {
		if p.slots(&p.cands[i]) == 0 {
			continue
		}
		p.take(i)
		p.node(hs, true, st)
		if f := p.rq.opts.Mix.frag(st); best < 0 || f < bestFrag {
			best, bestFrag = i, f
		}
		p.reset(hs)
	}
	if best < 0 {
		return nil
	}
	p.take(best)
	p.picks = append(p.picks[:0], best)
	return p.picks
}

func sum(xs []int32) int64 {
	var n int64
	for _, x := range xs {
		n += int64(x)
	}
	return n
}
