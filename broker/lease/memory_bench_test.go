package lease

import (
	"fmt"
	"runtime"
	"testing"
	"time"

	"github.com/gpupool/gpupool/internal/clock"
)

// BenchmarkTimersMemory reports the live heap a deadline costs, as a
// leader keeps one per lease (100k keys, the wall clock, deadlines a day
// out), and how long setting them all takes.
func BenchmarkTimersMemory(b *testing.B) {
	const n = 100_000
	keys := make([]string, n)
	for i := range keys {
		keys[i] = fmt.Sprintf("l-%016x", i)
	}
	for b.Loop() {
		before := heapNow()
		ts := NewTimers(clock.Real, func(string) {})
		start := time.Now()
		for i, k := range keys {
			ts.Reset(k, 24*time.Hour+time.Duration(i)*time.Millisecond)
		}
		set := time.Since(start)
		after := heapNow()
		b.ReportMetric(float64(after-before)/n, "B/key")
		b.ReportMetric(set.Seconds()*1e9/n, "ns/Reset")
		ts.StopAll()
		runtime.KeepAlive(ts)
	}
}

func heapNow() uint64 {
	var ms runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc
}
