package failover

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"time"

	"google.golang.org/grpc/status"

	"github.com/gpupool/gpupool/client"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

const (
	// sliceMiB and slicePercent are what every Acquire asks for.
	sliceMiB     = 1024
	slicePercent = 1
	// callTimeout bounds one Acquire or Release, retries of Unavailable
	// (an election) included.
	callTimeout = 5 * time.Second
	holder      = "bench-failover"
)

// ledger is every lease whose Acquire returned OK. Safe for concurrent use.
type ledger struct {
	mu     sync.Mutex
	leases map[string]*ledgerEntry // guarded by mu
	order  []string                // guarded by mu; ids in acknowledgement order
}

type ledgerEntry struct {
	// round and at say when the Acquire returned OK.
	round int
	at    time.Time
	// released is set before the client's Release is sent: from then on
	// the lease may end without being lost.
	released bool
	// releaseOK is set when that Release returned OK.
	releaseOK bool
}

func newLedger() *ledger { return &ledger{leases: map[string]*ledgerEntry{}} }

func (l *ledger) acked(id string, round int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if _, ok := l.leases[id]; !ok {
		l.order = append(l.order, id)
		l.leases[id] = &ledgerEntry{round: round, at: time.Now()}
	}
}

// describe says when the lease was acknowledged.
func (l *ledger) describe(id string) string {
	l.mu.Lock()
	defer l.mu.Unlock()
	e, ok := l.leases[id]
	if !ok {
		return "not in the ledger"
	}
	return fmt.Sprintf("acknowledged in round %d at %s", e.round, e.at.Format("15:04:05.000"))
}

func (l *ledger) releasing(id string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.leases[id].released = true
}

func (l *ledger) released(id string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.leases[id].releaseOK = true
}

// ledgerView is a copy of the ledger at one instant.
type ledgerView struct {
	held      []string // acknowledged, never released by the client
	releasing []string // released by the client, answer unknown
	released  []string // released by the client, OK
}

func (l *ledger) view() ledgerView {
	l.mu.Lock()
	defer l.mu.Unlock()
	var v ledgerView
	for _, id := range l.order {
		switch e := l.leases[id]; {
		case e.releaseOK:
			v.released = append(v.released, id)
		case e.released:
			v.releasing = append(v.releasing, id)
		default:
			v.held = append(v.held, id)
		}
	}
	return v
}

// roundLoad is the acquire load of one round and what it observed.
type roundLoad struct {
	start time.Time

	mu       sync.Mutex
	killAt   time.Time      // guarded by mu; zero before the kill
	firstOK  time.Time      // guarded by mu; the first OK of an Acquire sent after killAt
	okAt     []float64      // guarded by mu; seconds since start of each OK Acquire
	errs     map[string]int // guarded by mu; failed Acquires by gRPC code
	oks      int            // guarded by mu
	releases int            // guarded by mu; Releases that returned OK
	relErrs  int            // guarded by mu
}

// runLoad runs clients acquiring workers until ctx ends; it returns once
// they have all stopped. held carries each worker's leases across rounds.
func runLoad(ctx context.Context, c *client.Client, o options, round int, held [][]string, led *ledger, rl *roundLoad) {
	var wg sync.WaitGroup
	for w := range o.clients {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(o.seed, uint64(round)<<32|uint64(w)))
			for n := 0; ctx.Err() == nil; n++ {
				req := &gpupoolv1.AcquireRequest{Request: &gpupoolv1.LeaseRequest{
					Count: 1, MemoryMib: sliceMiB, ComputePercent: slicePercent, TtlMs: o.ttl.Milliseconds(),
					RequestId: fmt.Sprintf("failover-s%d-r%d-c%d-%d", o.seed, round, w, n), Holder: holder,
				}}
				sent := time.Now()
				cctx, cancel := context.WithTimeout(ctx, callTimeout)
				resp, err := c.Lease.Acquire(cctx, req)
				cancel()
				if err != nil {
					if ctx.Err() == nil {
						rl.failed(err)
					}
					continue
				}
				led.acked(resp.Lease.Id, round)
				rl.ok(sent, time.Now())
				held[w] = append(held[w], resp.Lease.Id)
				if len(held[w]) <= o.hold {
					continue
				}
				i := rng.IntN(len(held[w]))
				id := held[w][i]
				held[w] = append(held[w][:i], held[w][i+1:]...)
				led.releasing(id)
				cctx, cancel = context.WithTimeout(context.WithoutCancel(ctx), callTimeout)
				_, err = c.Lease.Release(cctx, &gpupoolv1.ReleaseRequest{LeaseId: id, Reason: "bench/failover"})
				cancel()
				rl.releaseDone(err)
				if err == nil {
					led.released(id)
				}
			}
		})
	}
	wg.Wait()
}

func newRoundLoad() *roundLoad {
	return &roundLoad{start: time.Now(), errs: map[string]int{}}
}

func (rl *roundLoad) kill(at time.Time) {
	rl.mu.Lock()
	defer rl.mu.Unlock()
	rl.killAt = at
}

func (rl *roundLoad) ok(sent, done time.Time) {
	rl.mu.Lock()
	defer rl.mu.Unlock()
	rl.oks++
	rl.okAt = append(rl.okAt, done.Sub(rl.start).Seconds())
	if !rl.killAt.IsZero() && rl.firstOK.IsZero() && sent.After(rl.killAt) {
		rl.firstOK = done
	}
}

func (rl *roundLoad) failed(err error) {
	rl.mu.Lock()
	defer rl.mu.Unlock()
	rl.errs[status.Code(err).String()]++
}

func (rl *roundLoad) releaseDone(err error) {
	rl.mu.Lock()
	defer rl.mu.Unlock()
	if err != nil {
		rl.relErrs++
	} else {
		rl.releases++
	}
}

// sinceKill returns the time from the kill to the first OK of an Acquire
// sent after it, and whether there has been one.
func (rl *roundLoad) sinceKill() (time.Duration, bool) {
	rl.mu.Lock()
	defer rl.mu.Unlock()
	if rl.firstOK.IsZero() {
		return 0, false
	}
	return rl.firstOK.Sub(rl.killAt), true
}
