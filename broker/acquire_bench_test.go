package broker

import (
	"fmt"
	"testing"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// BenchmarkAcquireLargePool grants fractional slices one after another on
// a leader holding many hosts: the cost of placement and grant per lease
// as the pool grows.
func BenchmarkAcquireLargePool(b *testing.B) {
	for _, hosts := range []int{1000, 10000} {
		b.Run(fmt.Sprintf("hosts=%d", hosts), func(b *testing.B) {
			ts := startServer(b)
			for i := range hosts {
				ts.registerHost(b, fmt.Sprintf("h%05d", i), 8, 81920)
			}
			b.ResetTimer()
			for i := range b.N {
				r := slice(10240, 10)
				r.RequestId = fmt.Sprintf("r%d", i)
				if _, err := ts.c.Lease.Acquire(ctx(b), &gpupoolv1.AcquireRequest{Request: r}); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
