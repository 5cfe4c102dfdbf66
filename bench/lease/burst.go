package leasebench

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gpupool/gpupool/client"
)

// burstFigures are what the other clients saw while one client sent a
// burst of acquires at once, without quota: the broker must not let the
// burst starve them.
type burstFigures struct {
	Burst   int `json:"burst"`   // acquires the one client sent at once
	Clients int `json:"clients"` // other clients, each looping acquire + release
	// Quiet is the other clients' cycle latency without the burst, During
	// while it lasted (cycles that started between its first acquire and
	// its last answer).
	Quiet  latency `json:"quiet_cycle_ms"`
	During latency `json:"during_cycle_ms"`
	// BurstSeconds is from the burst's first acquire to its last answer;
	// BurstOK and BurstErrors count its acquires.
	BurstSeconds float64 `json:"burst_seconds"`
	BurstOK      int     `json:"burst_ok"`
	BurstErrors  int     `json:"burst_errors"`
	// OtherErrors are the other clients' failed calls during the burst.
	OtherErrors int `json:"other_errors"`
}

// quietWindow is how long the other clients run alone before the burst.
const quietWindow = 3 * time.Second

// measureBurst runs clients clients of others for quietWindow, then has
// burster (its own connection) send burst acquires at once, each released
// when granted, while the others go on until the burst is over.
func measureBurst(ctx context.Context, others, burster system, clients, burst int) burstFigures {
	f := burstFigures{Burst: burst, Clients: clients}
	var (
		mu        sync.Mutex
		quiet     []time.Duration
		during    []time.Duration
		otherErrs int
		burstFrom atomic.Int64 // unix ns; 0 until the burst starts
		burstTo   atomic.Int64 // unix ns; 0 while it runs
	)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for range clients {
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				if ctx.Err() != nil {
					return
				}
				t0 := time.Now()
				cctx, cancel := context.WithTimeout(ctx, callTimeout)
				release, err := others.acquire(cctx)
				cancel()
				if err == nil {
					cctx, cancel = context.WithTimeout(context.WithoutCancel(ctx), callTimeout)
					err = release(cctx)
					cancel()
				}
				d := time.Since(t0)
				from, to := burstFrom.Load(), burstTo.Load()
				mu.Lock()
				switch {
				case from == 0:
					if err == nil {
						quiet = append(quiet, d)
					}
				case to == 0 || t0.UnixNano() < to:
					if err != nil {
						otherErrs++
					} else {
						during = append(during, d)
					}
				}
				mu.Unlock()
				if err != nil {
					sleep(ctx, errorBackoff)
				}
			}
		})
	}
	sleep(ctx, quietWindow)
	start := time.Now()
	burstFrom.Store(start.UnixNano())
	var ok, bad atomic.Int64
	var bw sync.WaitGroup
	for range burst {
		bw.Go(func() {
			cctx, cancel := context.WithTimeout(ctx, callTimeout)
			release, err := burster.acquire(cctx)
			cancel()
			if err != nil {
				bad.Add(1)
				return
			}
			ok.Add(1)
			cctx, cancel = context.WithTimeout(context.WithoutCancel(ctx), callTimeout)
			_ = release(cctx)
			cancel()
		})
	}
	bw.Wait()
	burstTo.Store(time.Now().UnixNano())
	close(stop)
	wg.Wait()
	f.BurstSeconds = time.Since(start).Seconds()
	f.BurstOK, f.BurstErrors = int(ok.Load()), int(bad.Load())
	f.Quiet, f.During, f.OtherErrors = summarize(quiet), summarize(during), otherErrs
	return f
}

// burstClient is a gpupool system on a connection of its own, so that the
// brokers see its calls as another caller's.
func (s *gpupoolSystem) burstClient() (*gpupoolSystem, func(), error) {
	c, err := client.Dial(s.cl.addrs)
	if err != nil {
		return nil, nil, err
	}
	b := *s
	cl := *s.cl
	cl.c = c
	b.cl = &cl
	return &b, func() { c.Close() }, nil
}
