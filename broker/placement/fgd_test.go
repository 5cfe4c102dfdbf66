package placement

import (
	"math"
	"slices"
	"testing"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

func mustMix(t *testing.T, shapes []Shape, weights []float64) *Mix {
	t.Helper()
	m, err := NewMix(shapes, weights)
	if err != nil {
		t.Fatalf("NewMix: %v", err)
	}
	return m
}

func TestFragCountsTheCapacityAShapeCannotUse(t *testing.T) {
	half := Shape{CPU: 1000, GPUs: 1, Milli: 500}
	two := Shape{GPUs: 2, Milli: 1000}
	free := []int32{1000, 300, 600}
	v100 := []string{"V100", "V100", "V100"}
	for _, tc := range []struct {
		name   string
		mix    *Mix
		cpu    int64
		free   []int32
		models []string
		want   float64
	}{
		{"a half-GPU task cannot use a GPU with 300 free", mustMix(t, []Shape{half}, []float64{1}), 4000, free, v100, 300},
		{"a task that lacks CPU cannot use any GPU", mustMix(t, []Shape{half}, []float64{1}), 500, free, v100, 1900},
		{"a task for another model cannot use any GPU",
			mustMix(t, []Shape{{CPU: 1000, GPUs: 1, Milli: 500, Models: "T4"}}, []float64{1}), 4000, free, v100, 1900},
		{"a 2-GPU task on a host with one whole GPU free cannot use any", mustMix(t, []Shape{two}, []float64{1}), 4000, free, v100, 1900},
		{"shapes weigh by probability: 0.5×300 + 0.5×1900", mustMix(t, []Shape{half, two}, []float64{1, 1}), 4000, free, v100, 1100},
		{"weights are normalised: 0.75×300 + 0.25×1900", mustMix(t, []Shape{half, two}, []float64{3, 1}), 4000, free, v100, 700},
		{"a task without GPUs cannot use any", mustMix(t, []Shape{{CPU: 1000}}, []float64{1}), 4000, free, v100, 1900},
		{"a GPU of a model the task does not accept is unusable, the others count as usual",
			mustMix(t, []Shape{{GPUs: 1, Milli: 1000, Models: "A|B"}}, []float64{1}), 0,
			[]int32{1000, 1000, 200}, []string{"A", "C", "B"}, 1200},
		{"an empty mix sees no fragmentation", mustMix(t, nil, nil), 4000, free, v100, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for range 2 { // the second read comes from the memo
				if got := tc.mix.Frag(tc.cpu, 1<<20, tc.free, tc.models); got != tc.want {
					t.Errorf("got %v, want %v", got, tc.want)
				}
			}
		})
	}
}

func TestFGDPlacesWhereFragmentationGrowsLeast(t *testing.T) {
	// Tasks of 600 milli are expected. A GPU with 400 free is a fragment for them: filling it
	// with a 400-milli task removes the fragment (Δ = −400), while opening a whole GPU leaves
	// 600 free that they can still use (Δ = 0).
	mix := mustMix(t, []Shape{{GPUs: 1, Milli: 600}}, []float64{1})
	sixty := func(d *gpupoolv1.Device) { used(a100Mem*6/10, 60)(d) }
	req := frac(a100Mem*4/10, 40).hostRes(1000, 1024)
	runScoredCases(t, []scoredCase{
		{
			name:  "fills the fragment on another host",
			hosts: poolOf(idle("host-1", 2), host("host-2", gpu(0), gpu(1, sixty))),
			req:   req, opts: Options{Policy: FGD, Mix: mix},
			want: "host-2/1",
		},
		{
			name:  "fills the fragment rather than an idle GPU of the same host",
			hosts: poolOf(host("host-1", gpu(0), gpu(1, sixty), gpu(2))),
			req:   req, opts: Options{Policy: FGD, Mix: mix},
			want: "host-1/1",
		},
	})
}

func TestMixFromCountsKeepsTheMostFrequentShapes(t *testing.T) {
	a, b, c := Shape{GPUs: 1, Milli: 1000}, Shape{GPUs: 1, Milli: 500}, Shape{GPUs: 2, Milli: 1000}
	m := MixFromCounts(map[Shape]int{a: 6, b: 3, c: 1}, 0.9)
	if m.Len() != 2 {
		t.Fatalf("got %d shapes, want 2 (6+3 of 10 tasks cover 90 %%)", m.Len())
	}
	// a: 2/3, b: 1/3. Free [1000, 400]: a cannot use 400, b cannot use 400: 400 in all.
	if got := m.Frag(0, 0, []int32{1000, 400}, []string{"X", "X"}); math.Abs(got-400) > 1e-9 {
		t.Errorf("frag: got %v, want 400", got)
	}
}

func TestMixLearnerFollowsTheTasksItSees(t *testing.T) {
	var l MixLearner
	if got := l.Mix().Len(); got != 0 {
		t.Fatalf("before any task: got %d shapes, want 0", got)
	}
	l.Observe(ShapeOf(excl().n(2).req))
	if got := l.Mix().Len(); got != 1 {
		t.Errorf("after one task: got %d shapes, want 1", got)
	}
	if got := ShapeOf(frac(1024, 35).hostRes(2000, 3).req); got != (Shape{CPU: 2000, Memory: 3, GPUs: 1, Milli: 350}) {
		t.Errorf("ShapeOf: got %+v, want 35 %% as 350 milli", got)
	}
}

func TestShapeOnWeighsMemoryAgainstTheGPU(t *testing.T) {
	tests := []struct {
		name   string
		req    *gpupoolv1.LeaseRequest
		gpuMem int64
		want   int32
	}{
		{"compute is the larger share", frac(8192, 50).req, 81920, 500},
		{"memory is the larger share", frac(40960, 10).req, 81920, 500},
		{"memory rounds up", frac(1, 1).req, 81920, 10},
		{"no GPU size counts compute alone", frac(40960, 10).req, 0, 100},
		{"never more than a GPU", frac(163840, 10).req, 81920, 1000},
		{"an exclusive GPU is whole", excl().req, 81920, 1000},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := ShapeOn(tt.req, tt.gpuMem).Milli; got != tt.want {
				t.Fatalf("Milli = %d, want %d", got, tt.want)
			}
		})
	}
}

func TestLookAheadCountsWhatManyTasksOfAShapeWouldStrand(t *testing.T) {
	eight := func(f int32) []int32 { return []int32{f, f, f, f, f, f, f, f} }
	models := func(n int) []string { return slices.Repeat([]string{a100}, n) }
	for _, tc := range []struct {
		name     string
		shape    Shape
		cpu      int64
		free     []int32
		fgd, got float64
	}{
		{"a GPU with 65 % free holds two tasks of 30 %, stranding 5 %", Shape{GPUs: 1, Milli: 300}, 64000, []int32{650},
			0, 25},
		{"eight idle GPUs with CPU for one whole-GPU task strand seven", Shape{GPUs: 1, Milli: 1000, CPU: 8000}, 8000, eight(1000),
			0, 3500},
		{"a shape that does not fit strands everything, as in FGD", Shape{GPUs: 2, Milli: 1000}, 64000, []int32{1000, 500},
			1500, 1500},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m, err := NewMix([]Shape{tc.shape}, []float64{1})
			if err != nil {
				t.Fatal(err)
			}
			if got := m.Frag(tc.cpu, 1<<20, tc.free, models(len(tc.free))); got != tc.fgd {
				t.Errorf("FGD: got %v, want %v", got, tc.fgd)
			}
			if got := m.LookAhead().Frag(tc.cpu, 1<<20, tc.free, models(len(tc.free))); got != tc.got {
				t.Errorf("look-ahead: got %v, want %v", got, tc.got)
			}
		})
	}
}

func TestFragRememberedEqualsFragComputed(t *testing.T) {
	// Frag remembers what each shape can use of a host's GPUs, whatever its CPU and memory;
	// the sum it makes of them must be the one computed from scratch.
	r := newRand(5)
	shapes := []Shape{{GPUs: 1, Milli: 250, CPU: 2000}, {GPUs: 1, Milli: 600, Memory: 4096}, {GPUs: 2, Milli: 1000, CPU: 8000},
		{GPUs: 1, Milli: 1000, Models: "T4"}, {CPU: 1000}, {GPUs: 4, Milli: 500, CPU: 500, Memory: 1024},
		{GPUs: 1, Milli: 250, CPU: 6000}, {GPUs: 2, Milli: 1000, Models: "T4"}} // two classes of two shapes
	plain := mustMix(t, shapes, []float64{5, 4, 3, 2, 1, 1, 2, 1})
	for _, m := range []*Mix{plain, plain.LookAhead()} {
		for i := range 2000 {
			st := nodeState{cpu: int64(1000 * r.IntN(20)), mem: int64(1024 * r.IntN(20))}
			model := []string{"T4", "A100"}[r.IntN(2)]
			for range r.IntN(9) {
				st.free = append(st.free, []int32{0, 100, 250, 400, 600, 750, 1000}[r.IntN(7)])
				st.models = append(st.models, model)
			}
			var want float64
			m.mu.Lock()
			for s := range m.shapes {
				want += m.probs[s] * float64(m.shapeFragLocked(s, &st))
			}
			m.mu.Unlock()
			for range 2 {
				if got := m.frag(&st); math.Abs(got-want) > 1e-9 {
					t.Fatalf("look-ahead %t, state %d %+v: frag %v, want %v", m.lookAhead, i, st, got, want)
				}
			}
		}
	}
}

func TestALearnedMixRatesAsAFreshOne(t *testing.T) {
	// A learner's new mix takes over the memory of the one it replaces; what it rates must be
	// what a mix built afresh from the same counts rates, whether the shapes changed or not.
	r := newRand(9)
	shapes := []Shape{{GPUs: 1, Milli: 250, CPU: 2000}, {GPUs: 1, Milli: 600}, {GPUs: 2, Milli: 1000, CPU: 8000},
		{GPUs: 1, Milli: 1000, Models: "T4"}, {CPU: 1000}, {GPUs: 1, Milli: 250, CPU: 6000}}
	l := MixLearner{LookAhead: true}
	counts := map[Shape]int{}
	states := make([]nodeState, 200)
	for i := range states {
		st := &states[i]
		st.cpu, st.mem = int64(1000*r.IntN(20)), 1<<20
		model := []string{"T4", "A100"}[r.IntN(2)]
		for range r.IntN(9) {
			st.free = append(st.free, []int32{0, 100, 250, 400, 600, 750, 1000}[r.IntN(7)])
			st.models = append(st.models, model)
		}
	}
	var last, fresh *Mix
	for n := range 1200 {
		// The first shapes come alone, then all of them: the learned shapes change, then hold.
		s := shapes[r.IntN(min(len(shapes), 1+n/50))]
		l.Observe(s)
		counts[s]++
		m := l.Mix()
		if m != last { // rebuilt from the counts so far
			last, fresh = m, MixFromCounts(counts, 0.95).LookAhead()
		}
		for i := range states {
			if got, want := m.frag(&states[i]), fresh.frag(&states[i]); math.Abs(got-want) > 1e-9 {
				t.Fatalf("after %d tasks, state %d: learned mix rates %v, a fresh one %v", n+1, i, got, want)
			}
		}
	}
}
