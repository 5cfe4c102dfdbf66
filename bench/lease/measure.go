package leasebench

import (
	"context"
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// callTimeout bounds one acquire or release call.
const callTimeout = 30 * time.Second

// errorBackoff is how long a client waits after a failed acquire before
// the next, so that a full pool is not hammered in a tight loop.
const errorBackoff = 10 * time.Millisecond

// system is a lease service under test, as its clients see it.
type system interface {
	// acquire takes one slice of the benchmark's size for the benchmark's
	// TTL and returns the call that releases it.
	acquire(ctx context.Context) (release func(context.Context) error, err error)
	// idle returns once no slice is held any more (released capacity is
	// free again), or with an error when that does not happen in time.
	idle(ctx context.Context) error
	// retries is how many times, so far, a transaction lost a race and
	// was retried inside acquire or release; 0 where there are none.
	retries() int64
}

// figures are one system's results at one level of concurrency.
type figures struct {
	// Cycles are the acquire+release cycles that started and ended in
	// the timed window; CyclesPerSec is Cycles over the window.
	Cycles       int     `json:"cycles"`
	CyclesPerSec float64 `json:"cycles_per_sec"`
	// Latencies of the cycles that started in the timed window, in
	// milliseconds, including those that ended after it (so that slow
	// cycles are not left out); Samples is how many.
	Samples int     `json:"samples"`
	Acquire latency `json:"acquire_ms"`
	Release latency `json:"release_ms"`
	Cycle   latency `json:"cycle_ms"`
	// Failed calls that started in the timed window, and the first
	// error of each kind.
	AcquireErrors     int    `json:"acquire_errors"`
	ReleaseErrors     int    `json:"release_errors"`
	FirstAcquireError string `json:"first_acquire_error,omitempty"`
	FirstReleaseError string `json:"first_release_error,omitempty"`
	// Retries are the transactions retried in the timed window after a
	// failed compare (etcd only).
	Retries int64 `json:"retries"`
	// IdleSeconds is how long after the level it took until every slice
	// was free again.
	IdleSeconds float64 `json:"idle_seconds"`
	// IdleError says why the system was not idle again within a minute
	// after the level.
	IdleError string `json:"idle_error,omitempty"`
}

// errors is every failed call.
func (f *figures) errors() int { return f.AcquireErrors + f.ReleaseErrors }

// latency summarizes durations, in milliseconds.
type latency struct {
	P50  float64 `json:"p50"`
	P99  float64 `json:"p99"`
	Mean float64 `json:"mean"`
	Max  float64 `json:"max"`
}

// summarize sorts ds and summarizes them; the zero latency for none.
func summarize(ds []time.Duration) latency {
	if len(ds) == 0 {
		return latency{}
	}
	slices.Sort(ds)
	var sum time.Duration
	for _, d := range ds {
		sum += d
	}
	return latency{
		P50:  ms(percentile(ds, 50)),
		P99:  ms(percentile(ds, 99)),
		Mean: ms(sum / time.Duration(len(ds))),
		Max:  ms(ds[len(ds)-1]),
	}
}

// percentile is the nearest-rank p-th percentile of sorted, which is not
// empty.
func percentile(sorted []time.Duration, p float64) time.Duration {
	rank := int(math.Ceil(p / 100 * float64(len(sorted))))
	return sorted[min(max(rank, 1), len(sorted))-1]
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// clientLog is what one client saw of the cycles it started in the timed
// window.
type clientLog struct {
	completed                int // ended in the window too
	acquire, release, cycle  []time.Duration
	acquireErrs, releaseErrs int
	firstAcquireErr          string
	firstReleaseErr          string
}

// runLevel runs clients concurrent clients of sys, each looping acquire
// then release, untimed for warmup and then timed for duration. A cycle
// counts towards the throughput when it started and ended inside the
// timed window, and towards the latencies when it started inside it;
// cycles in flight at its end are finished, so that slices are released.
func runLevel(ctx context.Context, sys system, clients int, warmup, duration time.Duration) figures {
	from := time.Now().Add(warmup)
	to := from.Add(duration)
	var retriesFrom atomic.Int64
	timer := time.AfterFunc(warmup, func() { retriesFrom.Store(sys.retries()) })
	logs := make([]clientLog, clients)
	var wg sync.WaitGroup
	for i := range logs {
		wg.Go(func() { runClient(ctx, sys, to, from, &logs[i]) })
	}
	wg.Wait()
	timer.Stop()
	retriesTo := sys.retries()

	var all clientLog
	for _, l := range logs {
		all.acquire = append(all.acquire, l.acquire...)
		all.release = append(all.release, l.release...)
		all.cycle = append(all.cycle, l.cycle...)
		all.completed += l.completed
		all.acquireErrs += l.acquireErrs
		all.releaseErrs += l.releaseErrs
		if all.firstAcquireErr == "" {
			all.firstAcquireErr = l.firstAcquireErr
		}
		if all.firstReleaseErr == "" {
			all.firstReleaseErr = l.firstReleaseErr
		}
	}
	return figures{
		Cycles:            all.completed,
		CyclesPerSec:      float64(all.completed) / duration.Seconds(),
		Samples:           len(all.cycle),
		Acquire:           summarize(all.acquire),
		Release:           summarize(all.release),
		Cycle:             summarize(all.cycle),
		AcquireErrors:     all.acquireErrs,
		ReleaseErrors:     all.releaseErrs,
		FirstAcquireError: all.firstAcquireErr,
		FirstReleaseError: all.firstReleaseErr,
		Retries:           retriesTo - retriesFrom.Load(),
	}
}

// runClient loops acquire then release until to or ctx's end, logging
// to l what happened in [from, to].
func runClient(ctx context.Context, sys system, to, from time.Time, l *clientLog) {
	for ctx.Err() == nil {
		t0 := time.Now()
		if !t0.Before(to) {
			return
		}
		timed := !t0.Before(from)
		cctx, cancel := context.WithTimeout(ctx, callTimeout)
		release, err := sys.acquire(cctx)
		cancel()
		t1 := time.Now()
		if err != nil {
			if timed {
				l.acquireErrs++
				if l.firstAcquireErr == "" {
					l.firstAcquireErr = err.Error()
				}
			}
			sleep(ctx, errorBackoff)
			continue
		}
		// Released even after ctx ends, so that no slice is left held.
		cctx, cancel = context.WithTimeout(context.WithoutCancel(ctx), callTimeout)
		err = release(cctx)
		cancel()
		t2 := time.Now()
		if !timed {
			continue
		}
		if err != nil {
			l.releaseErrs++
			if l.firstReleaseErr == "" {
				l.firstReleaseErr = err.Error()
			}
			continue
		}
		if !t2.After(to) {
			l.completed++
		}
		l.acquire = append(l.acquire, t1.Sub(t0))
		l.release = append(l.release, t2.Sub(t1))
		l.cycle = append(l.cycle, t2.Sub(t0))
	}
}

// sleep waits for d or ctx's end.
func sleep(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}
