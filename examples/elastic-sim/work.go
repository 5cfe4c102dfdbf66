package main

import "math/rand/v2"

// samplesPerUnit is how many random points one work unit throws: about a
// millisecond of one CPU core.
const samplesPerUnit = 100_000

// unit is one work unit. Its id seeds its random points, so a unit handed
// back by a leaving slice and run again elsewhere gives the same result.
type unit struct{ id uint64 }

// tally is the result of some work: of samples random points in the unit
// square, hits fell inside the quarter circle of radius 1.
type tally struct{ samples, hits uint64 }

func (t tally) add(o tally) tally { return tally{t.samples + o.samples, t.hits + o.hits} }

// pi is the tally's estimate of pi, 0 for no samples.
func (t tally) pi() float64 {
	if t.samples == 0 {
		return 0
	}
	return 4 * float64(t.hits) / float64(t.samples)
}

// monteCarloPi runs unit u: it throws samplesPerUnit points seeded by
// u.id. The same unit always gives the same tally.
func monteCarloPi(u unit) tally {
	r := rand.New(rand.NewPCG(u.id, 0x9e3779b97f4a7c15))
	var hits uint64
	for range samplesPerUnit {
		x, y := r.Float64(), r.Float64()
		if x*x+y*y <= 1 {
			hits++
		}
	}
	return tally{samples: samplesPerUnit, hits: hits}
}
