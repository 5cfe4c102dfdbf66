package fsm

import (
	"math/big"
	"math/rand/v2"
	"testing"
)

// TestSharesSumExactlyAsRationals checks the allocation-free sum of GPU
// shares against math/big on random slices, added and taken away.
func TestSharesSumExactlyAsRationals(t *testing.T) {
	sizes := []int64{81920, 40960, 24576, 16384}
	for seed := range uint64(200) {
		r := rand.New(rand.NewPCG(seed, 7))
		var g shares
		want := new(big.Rat)
		for range r.IntN(40) + 1 {
			sign := int64(1)
			if r.IntN(5) == 0 {
				sign = -1
			}
			var one shares
			var share *big.Rat
			switch r.IntN(3) {
			case 0:
				one.whole, share = 1, big.NewRat(1, 1)
			case 1:
				p := int64(r.IntN(100))
				one.percent, share = p, big.NewRat(p, 100)
			default:
				d := sizes[r.IntN(len(sizes))]
				m := r.Int64N(d)
				one.addFrac(m, d)
				share = big.NewRat(m, d)
			}
			g.add(one, sign)
			if sign < 0 {
				want.Sub(want, share)
			} else {
				want.Add(want, share)
			}
		}
		q, m := new(big.Int).QuoRem(want.Num(), want.Denom(), new(big.Int))
		if m.Sign() > 0 {
			q.Add(q, big.NewInt(1))
		}
		if got := g.ceil(); got != q.Int64() {
			t.Fatalf("seed %d: got %d GPUs, want %d (%s)", seed, got, q.Int64(), want.RatString())
		}
	}
}
