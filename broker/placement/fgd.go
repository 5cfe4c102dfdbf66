package placement

import (
	"cmp"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// Shape is one kind of task in a Mix: what a task asks of one host.
type Shape struct {
	// CPU and Memory are the host millicores and MiB.
	CPU, Memory int64
	// GPUs is how many GPUs the task takes, 0 for a task without GPUs.
	GPUs int32
	// Milli is the share of each GPU in thousandths: 1000 for whole GPUs, 0 without GPUs.
	Milli int32
	// Models lists the GPU models the task accepts as Constraints.Model spells them
	// ("V100M16|V100M32", globs allowed); "" accepts any.
	Models string
}

// ShapeOf is the shape of a request: its host CPU and memory, its count, its share of each GPU
// (compute percent × 10 for a fractional slice, 1000 for an exclusive one) and its model
// constraint.
func ShapeOf(req *gpupoolv1.LeaseRequest) Shape {
	s := Shape{
		CPU: req.GetHostCpuMillicores(), Memory: req.GetHostMemoryMib(),
		GPUs: req.GetCount(), Milli: 1000, Models: req.GetConstraints().GetModel(),
	}
	if !req.GetExclusive() {
		s.Milli = req.GetComputePercent() * 10
	}
	return s
}

// ShapeOn is ShapeOf for a pool whose GPUs have gpuMemMiB of memory: a fractional slice's
// share of a GPU is the larger of its compute share and its memory share, as FGD rates a
// GPU's free share by the scarcer of the two. gpuMemMiB ≤ 0 counts compute alone.
func ShapeOn(req *gpupoolv1.LeaseRequest, gpuMemMiB int64) Shape {
	s := ShapeOf(req)
	if !req.GetExclusive() && gpuMemMiB > 0 {
		memMilli := (req.GetMemoryMib()*1000 + gpuMemMiB - 1) / gpuMemMiB
		s.Milli = int32(min(1000, max(int64(s.Milli), memMilli)))
	}
	return s
}

// Mix is the task mix FGD expects: shapes with their probabilities. A Mix is safe for
// concurrent use. It remembers the fragmentation of every host state it has rated, so a pool
// whose hosts mostly stay the same between placements costs one map look-up per host.
type Mix struct {
	shapes []Shape
	alts   [][]string // shapes[i].Models split at "|"; nil for any model
	probs  []float64  // sum to 1, or empty
	// class[i] numbers the share and model list of shapes[i]: shapes of one class can use
	// the same GPUs, so a host's gpuParts are counted per class. rep[c] is a shape of class c.
	class []int
	rep   []int

	// lookAhead: a shape's fragmentation also counts what many tasks of the shape could use,
	// not only the next one (see LookAhead).
	lookAhead bool

	mu      sync.Mutex
	memo    map[nodeKey]float64  // guarded by mu
	parts   map[gpuKey][]gpuPart // what each class can use of a host's GPUs; guarded by mu
	allowed map[string][]bool    // model → whether each shape accepts it; guarded by mu
	slab    []gpuPart            // room for the parts of hosts not yet seen; guarded by mu
}

// gpuPart is what the shapes of one class can use of a host's GPUs, whatever the host's free
// CPU and memory: the GPUs with their share free that they accept, the free capacity they
// cannot use on them, and how many of their slices they hold one after the other.
type gpuPart struct {
	fit             int32
	unusable, slots int64
}

// NewMix returns the mix of shapes with the given weights, normalised to probabilities.
// Weights must be positive and as many as shapes; a model pattern must be valid as in
// Constraints.Model. An empty mix rates every host as unfragmented.
func NewMix(shapes []Shape, weights []float64) (*Mix, error) {
	if len(shapes) != len(weights) {
		return nil, fmt.Errorf("mix: %d shapes but %d weights: give one weight per shape", len(shapes), len(weights))
	}
	m := &Mix{
		shapes: slices.Clone(shapes), alts: make([][]string, len(shapes)), probs: make([]float64, len(shapes)),
		allowed: make(map[string][]bool),
	}
	var sum float64
	for i, w := range weights {
		if !(w > 0) {
			return nil, fmt.Errorf("mix: shape %d weight %v: must be positive", i, w)
		}
		sum += w
	}
	for i, s := range shapes {
		m.probs[i] = weights[i] / sum
		if s.Models == "" {
			continue
		}
		rq, reason := newRequest(&gpupoolv1.LeaseRequest{Count: 1, Exclusive: true,
			Constraints: &gpupoolv1.Constraints{Model: s.Models}}, &Options{Policy: Binpack})
		if reason != "" {
			return nil, fmt.Errorf("mix: shape %d: %s", i, reason)
		}
		m.alts[i] = rq.models
	}
	m.class, m.rep = classes(m.shapes)
	return m, nil
}

// MixFromCounts keeps the most frequent shapes of counts until they cover the fraction
// coverage (0 < coverage ≤ 1) of all tasks, as the FGD paper keeps 95 %, and returns their
// mix. Equal counts keep shapes in a fixed order (the larger CPU, share, GPU count and model
// list first, as the FGD paper's artifact orders them), so the result is deterministic.
func MixFromCounts(counts map[Shape]int, coverage float64) *Mix {
	shapes := slices.SortedFunc(maps.Keys(counts), func(a, b Shape) int {
		return cmp.Or(cmp.Compare(counts[b], counts[a]), cmp.Compare(b.CPU, a.CPU), cmp.Compare(b.Milli, a.Milli),
			cmp.Compare(b.GPUs, a.GPUs), strings.Compare(b.Models, a.Models), cmp.Compare(b.Memory, a.Memory))
	})
	var total int
	for _, n := range counts {
		total += n
	}
	var kept []Shape
	var weights []float64
	var sum int
	for _, s := range shapes {
		if counts[s] <= 0 || (len(kept) > 0 && float64(sum) >= coverage*float64(total)) {
			break
		}
		kept = append(kept, s)
		weights = append(weights, float64(counts[s]))
		sum += counts[s]
	}
	m, err := NewMix(kept, weights)
	if err != nil { // a count came with a model pattern no request could have: drop the pattern
		for i := range kept {
			kept[i].Models = ""
		}
		m, _ = NewMix(kept, weights)
	}
	return m
}

// LookAhead returns a mix of the same shapes that also rates a host by what tasks of each
// shape could go on taking there, not only the next one. A shape's fragmentation is the mean
// of FGD's (the free GPU capacity the next task of the shape could not use) and the free GPU
// capacity that as many tasks of the shape as fit, one after the other (by free GPU share, host
// CPU and host memory), would leave unused. A host with eight idle GPUs and CPU left for one
// task of a shape strands seven GPUs for that shape, where FGD counts none; a GPU with 65 %
// free holds two tasks of 30 % and strands 5 %, where FGD counts none.
func (m *Mix) LookAhead() *Mix {
	c := &Mix{shapes: m.shapes, alts: m.alts, probs: m.probs, class: m.class, rep: m.rep, lookAhead: true,
		allowed: make(map[string][]bool)}
	return c
}

// inherit takes over the remembered fragmentation maps of prev, the mix m replaces, so that
// a learner's new mix does not grow them afresh: the memo emptied (its values depend on the
// probabilities) but its room kept, and what each shape can use of the GPUs (parts) and
// which models each shape accepts as they are when m has the same shapes as prev. prev
// remembers nothing after it, and starts afresh if it is used again.
func (m *Mix) inherit(prev *Mix) {
	if prev == nil || prev == m {
		return
	}
	prev.mu.Lock()
	memo, parts, allowed := prev.memo, prev.parts, prev.allowed
	prev.memo, prev.parts, prev.allowed = nil, nil, make(map[string][]bool)
	prev.mu.Unlock()
	if memo == nil {
		return
	}
	clear(memo)
	if !slices.Equal(m.shapes, prev.shapes) || m.lookAhead != prev.lookAhead {
		clear(parts)
		allowed = make(map[string][]bool)
	}
	m.mu.Lock()
	m.memo, m.parts, m.allowed = memo, parts, allowed
	m.mu.Unlock()
}

// Len is the number of shapes in the mix.
func (m *Mix) Len() int { return len(m.shapes) }

// MixLearner learns a Mix online from the shapes of the tasks it observes. It is not safe for
// concurrent use.
type MixLearner struct {
	// Coverage is the share of tasks the mix covers, as in MixFromCounts; 0.95 when zero.
	Coverage float64
	// LookAhead makes the mixes it builds look ahead (see Mix.LookAhead).
	LookAhead bool

	counts map[Shape]int
	total  int
	next   int // rebuild the mix when total reaches next
	mix    *Mix
}

// Observe counts one more task of shape s.
func (l *MixLearner) Observe(s Shape) {
	if l.counts == nil {
		l.counts = make(map[Shape]int)
	}
	l.counts[s]++
	l.total++
}

// Mix returns the mix of the tasks observed so far. It is rebuilt after 1, 2, 4, … 256
// observations and every 256 after that, so that the fragmentation it and the index remember
// pays off; in between, it is the last one built.
func (l *MixLearner) Mix() *Mix {
	if l.mix == nil || l.total >= l.next {
		prev := l.mix
		l.mix = MixFromCounts(l.counts, cmp.Or(l.Coverage, 0.95))
		if l.LookAhead {
			l.mix = l.mix.LookAhead()
		}
		l.mix.inherit(prev)
		switch {
		case l.next < 1:
			l.next = 1
		case l.next < 256:
			l.next *= 2
		default:
			l.next += 256
		}
		for l.next <= l.total {
			l.next = min(l.next*2, l.next+256)
		}
	}
	return l.mix
}

// maxKeyGPUs is the most GPUs a host may have for its fragmentation to be remembered.
const maxKeyGPUs = 16

// nodeState is a host as FGD sees it: free host CPU and memory, and the free share of each
// usable GPU in thousandths with its model.
type nodeState struct {
	cpu, mem int64
	free     []int32
	models   []string
}

// nodeKey identifies a nodeState up to the order of its GPUs.
type nodeKey struct {
	gpus     gpuKey
	cpu, mem int64
}

// gpuKey identifies the GPUs of a nodeState up to their order.
type gpuKey struct {
	model string
	n     int
	free  [maxKeyGPUs]int16 // descending
}

// key returns st's key, or false when st is not remembered (too many GPUs, mixed models).
func (st *nodeState) key() (nodeKey, bool) {
	k := nodeKey{cpu: st.cpu, mem: st.mem, gpus: gpuKey{n: len(st.free)}}
	g := &k.gpus
	if g.n > maxKeyGPUs {
		return k, false
	}
	for i, f := range st.free {
		if i > 0 && st.models[i] != st.models[0] {
			return k, false
		}
		// Insertion in descending order: there are few GPUs.
		j := i
		for ; j > 0 && g.free[j-1] < int16(f); j-- {
			g.free[j] = g.free[j-1]
		}
		g.free[j] = int16(f)
	}
	if g.n > 0 {
		g.model = st.models[0]
	}
	return k, true
}

// Frag is the expected fragmentation of a host in thousandths of a GPU: for each shape, the
// free GPU capacity of the host that a task of the shape cannot use, weighted by the shape's
// probability. A task cannot use any of it when it does not fit on the host at all (no
// accepted model, too little free CPU or memory, fewer GPUs with its share free than it
// asks); otherwise it cannot use the GPUs whose free share is less than its share, nor GPUs
// of a model it does not accept. A task without GPUs cannot use any.
//
// free and models describe the usable GPUs: free share in thousandths and model.
func (m *Mix) Frag(cpu, mem int64, free []int32, models []string) float64 {
	return m.frag(&nodeState{cpu: cpu, mem: mem, free: free, models: models})
}

func (m *Mix) frag(st *nodeState) float64 {
	k, ok := st.key()
	m.mu.Lock()
	defer m.mu.Unlock()
	if !ok {
		var f float64
		for i := range m.shapes {
			f += m.probs[i] * float64(m.shapeFragLocked(i, st))
		}
		return f
	}
	if f, hit := m.memo[k]; hit {
		return f
	}
	if m.memo == nil { // sized for a large pool's states: growing the maps costs more
		m.memo, m.parts = make(map[nodeKey]float64, 4096), make(map[gpuKey][]gpuPart, 1024)
	}
	parts := m.partsLocked(&k.gpus)
	var total int64
	for _, f := range k.gpus.free[:k.gpus.n] {
		total += int64(f)
	}
	var f float64
	for i := range m.shapes {
		f += m.probs[i] * float64(m.fragOf(i, st.cpu, st.mem, total, &parts[m.class[i]]))
	}
	m.memo[k] = f
	return f
}

// classes numbers the distinct share and model list of shapes: the class of each shape, and
// the first shape of each class.
func classes(shapes []Shape) (class, rep []int) {
	type cls struct {
		milli  int32
		models string
	}
	seen := make(map[cls]int, len(shapes))
	class = make([]int, len(shapes))
	for i, s := range shapes {
		c, ok := seen[cls{s.Milli, s.Models}]
		if !ok {
			c = len(rep)
			seen[cls{s.Milli, s.Models}] = c
			rep = append(rep, i)
		}
		class[i] = c
	}
	return class, rep
}

// partsLocked is what each class of shapes can use of the GPUs g, remembered.
func (m *Mix) partsLocked(g *gpuKey) []gpuPart {
	if ps, hit := m.parts[*g]; hit {
		return ps
	}
	n := len(m.rep)
	if len(m.slab) < n { // one allocation for many hosts' parts
		m.slab = make([]gpuPart, 256*n)
	}
	ps := m.slab[:n:n]
	m.slab = m.slab[n:]
	var allowed []bool // nil: every shape accepts g's model
	if g.n > 0 {
		allowed = m.allowedLocked(g.model)
	}
	for c, i := range m.rep {
		s, p := &m.shapes[i], &ps[c]
		accepts := allowed == nil || allowed[i]
		for _, f := range g.free[:g.n] {
			switch {
			case !accepts || int32(f) < s.Milli:
				p.unusable += int64(f)
			case s.Milli > 0:
				p.fit++
				p.slots += int64(int32(f) / s.Milli)
			default:
				p.fit++
			}
		}
	}
	m.parts[*g] = ps
	return ps
}

// fragOf is the free capacity that shape i cannot use on a host with cpu and mem free, total
// free GPU capacity and the GPUs described by p: shapeFragLocked from a gpuPart.
func (m *Mix) fragOf(i int, cpu, mem, total int64, p *gpuPart) int64 {
	s := &m.shapes[i]
	if s.GPUs == 0 || p.fit < s.GPUs || cpu < s.CPU || mem < s.Memory {
		return total
	}
	if !m.lookAhead {
		return p.unusable
	}
	tasks := p.slots / int64(s.GPUs)
	if s.CPU > 0 {
		tasks = min(tasks, cpu/s.CPU)
	}
	if s.Memory > 0 {
		tasks = min(tasks, mem/s.Memory)
	}
	return (p.unusable + total - tasks*int64(s.GPUs)*int64(s.Milli)) / 2
}

// shapeFragLocked is the free capacity of st that shape i cannot use.
func (m *Mix) shapeFragLocked(i int, st *nodeState) int64 {
	s := &m.shapes[i]
	var total, unusable int64
	var fit int32
	for g, f := range st.free {
		total += int64(f)
		switch {
		case !m.acceptsLocked(i, st.models[g]):
			unusable += int64(f)
		case f >= s.Milli:
			fit++
		default:
			unusable += int64(f)
		}
	}
	if s.GPUs == 0 || fit < s.GPUs || st.cpu < s.CPU || st.mem < s.Memory {
		return total
	}
	if !m.lookAhead {
		return unusable
	}
	return (unusable + m.lookAheadFrag(i, st, total)) / 2
}

// lookAheadFrag is the free capacity of st that as many tasks of shape i as fit leave unused.
func (m *Mix) lookAheadFrag(i int, st *nodeState, total int64) int64 {
	s := &m.shapes[i]
	// How many tasks of the shape fit, one after the other: by GPU slots, CPU and memory.
	var slots int64
	for g, f := range st.free {
		if m.acceptsLocked(i, st.models[g]) && f >= s.Milli {
			slots += int64(f / s.Milli)
		}
	}
	tasks := slots / int64(s.GPUs)
	if s.CPU > 0 {
		tasks = min(tasks, st.cpu/s.CPU)
	}
	if s.Memory > 0 {
		tasks = min(tasks, st.mem/s.Memory)
	}
	return total - tasks*int64(s.GPUs)*int64(s.Milli)
}

// acceptsLocked reports whether shape i accepts GPUs of model.
func (m *Mix) acceptsLocked(i int, model string) bool {
	return m.alts[i] == nil || m.allowedLocked(model)[i]
}

// allowedLocked reports for each shape whether it accepts GPUs of model.
func (m *Mix) allowedLocked(model string) []bool {
	ok, hit := m.allowed[model]
	if !hit {
		ok = make([]bool, len(m.shapes))
		for j, alts := range m.alts {
			ok[j] = alts == nil || modelMatches(alts, model)
		}
		m.allowed[model] = ok
	}
	return ok
}
