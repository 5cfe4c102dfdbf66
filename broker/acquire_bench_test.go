package broker

import (
	"fmt"
	"sync/atomic"
	"testing"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// BenchmarkAcquireLargePool grants fractional slices on a leader holding
// many hosts of 8 GPUs, with FGD: the cost of placement and grant per lease
// as the pool grows, placed through the pool index,
// one client at a time and 32 at once.
func BenchmarkAcquireLargePool(b *testing.B) {
	for _, hosts := range []int{1000, 10000} {
		ts := startServer(b)
		for i := range hosts {
			ts.registerHost(b, fmt.Sprintf("h%05d", i), 8, 81920)
		}
		var n atomic.Int64
		acquire := func(b *testing.B) {
			r := slice(2048, 5)
			r.RequestId = fmt.Sprintf("r%d", n.Add(1))
			if _, err := ts.c.Lease.Acquire(ctx(b), &gpupoolv1.AcquireRequest{Request: r}); err != nil {
				b.Fatal(err)
			}
		}
		{
			b.Run(fmt.Sprintf("hosts=%d/clients=1", hosts), func(b *testing.B) {
				for range b.N {
					acquire(b)
				}
			})
			b.Run(fmt.Sprintf("hosts=%d/clients=32", hosts), func(b *testing.B) {
				b.SetParallelism(16) // × GOMAXPROCS 2
				b.RunParallel(func(pb *testing.PB) {
					for pb.Next() {
						acquire(b)
					}
				})
			})
		}
	}
}
