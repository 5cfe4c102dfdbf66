package placement

import (
	"slices"
	"testing"
)

func TestBoundIsTheLeastAnyPlacementLeaves(t *testing.T) {
	// Pools of 10 GPUs (10,000 milli) where the best placement is plain to see.
	frac := func(n, milli int) []task { return slices.Repeat([]task{{gpus: 1, milli: milli}}, n) }
	for _, tc := range []struct {
		name  string
		tasks []task
		want  float64
	}{
		{"ten tasks of 900: each GPU keeps 100 that nothing can use", frac(10, 900), 1000},
		{"tasks of 100 fill what the tasks of 900 leave", append(frac(10, 900), frac(10, 100)...), 0},
		{"twenty tasks of 510: ten fit, one per GPU, and ten are refused", frac(20, 510), 4900},
		{"whole GPUs leave nothing stranded", slices.Repeat([]task{{gpus: 2, milli: 1000}}, 5), 0},
		{"tasks of 500 pair up", frac(20, 500), 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var arrived int64
			for i := range tc.tasks {
				arrived += tc.tasks[i].gpuMilli()
			}
			if got := boundAt(tc.tasks, 10000, arrived); got != tc.want {
				t.Errorf("got %v milli, want %v", got, tc.want)
			}
		})
	}
}
