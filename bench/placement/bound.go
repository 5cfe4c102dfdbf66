package placement

import (
	"math"
	"slices"
)

// sliverBound is a lower bound on the unallocated GPU share (% of capacity) that any placement
// of a's tasks, online or offline, leaves at 100 % arrived, averaged over the arrivals the
// metric averages there (those whose arrived request rounds to 100 %).
//
// It counts only GPU shares, ignoring CPU, memory, models and hosts, which can only raise the
// true figure. A GPU holds at most one fractional task of a share m > θ ≥ 500; the rest of it,
// 1000 − m, can hold only tasks of less than 1000 − θ. So with W the sum of 1000 − m over the
// one-GPU tasks of share m > θ placed, and S the GPU request of all tasks of share below
// 1000 − θ, at least W − S of the capacity stays free. A placement may refuse such tasks
// instead, but the unallocated share then counts their request (it is C − A + F: capacity less
// arrived plus the request refused), and refusing a task of share m saves at most 1000 − m of
// W at a cost of m. The bound is, for the best θ, the least over the tasks refused (the
// smallest shares first, as a fraction may be) of the larger of the two.
func sliverBound(a *arrival) float64 {
	var sum float64
	var n int
	var arrived int64
	gpus := a.capacity / 1000
	for i := range a.tasks {
		arrived += a.tasks[i].gpuMilli()
		if math.RoundToEven(float64(arrived)/float64(gpus)/10) != 100 {
			if n > 0 {
				break
			}
			continue
		}
		sum += 100 * boundAt(a.tasks[:i+1], a.capacity, arrived) / float64(a.capacity)
		n++
	}
	if n == 0 {
		return 0
	}
	return sum / float64(n)
}

// boundAt is sliverBound's bound, in GPU milli, after tasks have arrived (asking arrived of
// capacity).
func boundAt(tasks []task, capacity, arrived int64) float64 {
	var big []int // shares of the one-GPU fractional tasks, ascending
	for i := range tasks {
		if t := &tasks[i]; t.gpus == 1 && t.milli > 500 && t.milli < 1000 {
			big = append(big, t.milli)
		}
	}
	slices.Sort(big)
	var best float64
	for theta := 500; theta < 1000; theta += 5 {
		var w, s float64
		from := len(big)
		for i, m := range big {
			if m > theta {
				from = min(from, i)
				w += float64(1000 - m)
			}
		}
		for i := range tasks {
			if t := &tasks[i]; t.gpus > 0 && t.milli < 1000-theta {
				s += float64(t.gpuMilli())
			}
		}
		// Refuse the big tasks smallest share first, a fraction at a time, until the free
		// capacity they would strand no longer exceeds what refusing costs.
		strand, refused := w-s, float64(capacity-arrived)
		b := math.Max(strand, refused)
		for _, m := range big[from:] {
			if strand <= refused {
				break
			}
			dx, dy := float64(1000-m), float64(m)
			if strand-dx >= refused+dy {
				strand, refused = strand-dx, refused+dy
				b = math.Max(strand, refused)
				continue
			}
			phi := (strand - refused) / (dx + dy) // where the two meet
			b = strand - phi*dx
			break
		}
		best = math.Max(best, b)
	}
	return max(best, 0)
}
