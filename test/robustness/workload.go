package robustness

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/gpupool/gpupool/client"
	"github.com/gpupool/gpupool/internal/clock"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// LeaseTTL is the TTL of the workload's leases. Workers renew every lease
// they hold at least every RenewEvery.
const (
	LeaseTTL   = 20 * time.Second
	RenewEvery = 3 * time.Second
	opTimeout  = 8 * time.Second
	maxHeld    = 4 // leases per worker
)

// OpCounts counts a workload's operations of one kind by result.
type OpCounts struct {
	OK, Failed, Unknown int64
}

// Workload is clients that acquire, release, renew and read fractional
// leases, recording every call in a History.
type Workload struct {
	Client  *client.Client
	History *History
	Seed    uint64
	Workers int
	MaxOps  int64

	ops    atomic.Int64
	mu     sync.Mutex
	counts map[OpKind]*OpCounts // guarded by mu
	recent []string             // the last leases granted, to any worker; guarded by mu
}

// recentLeases is how many granted leases other workers may look at.
const recentLeases = 256

func (w *Workload) granted(id string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.recent = append(w.recent, id)
	if len(w.recent) > recentLeases {
		w.recent = w.recent[len(w.recent)-recentLeases:]
	}
}

func (w *Workload) someRecent(rng *rand.Rand) string {
	w.mu.Lock()
	defer w.mu.Unlock()
	if len(w.recent) == 0 {
		return ""
	}
	return w.recent[rng.IntN(len(w.recent))]
}

// Run runs the workers until ctx ends or MaxOps operations were made.
func (w *Workload) Run(ctx context.Context) {
	w.counts = map[OpKind]*OpCounts{}
	var wg sync.WaitGroup
	for i := range w.Workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			wk := &worker{w: w, id: i, rng: rand.New(rand.NewPCG(w.Seed, uint64(i)))}
			wk.run(ctx)
		}()
	}
	wg.Wait()
}

// Counts returns the operations made so far, by kind.
func (w *Workload) Counts() map[OpKind]OpCounts {
	w.mu.Lock()
	defer w.mu.Unlock()
	out := map[OpKind]OpCounts{}
	for k, c := range w.counts {
		out[k] = *c
	}
	return out
}

func (w *Workload) record(r Record) {
	w.History.Add(r)
	w.mu.Lock()
	defer w.mu.Unlock()
	c := w.counts[r.Kind]
	if c == nil {
		c = &OpCounts{}
		w.counts[r.Kind] = c
	}
	switch {
	case r.Unknown:
		c.Unknown++
	case r.Outcome == "ok" || r.Outcome == "granted" || r.Outcome == "released" && r.Kind == OpRelease:
		c.OK++
	default:
		c.Failed++
	}
}

type heldLease struct {
	id, device string
	renewed    time.Time
}

type worker struct {
	w    *Workload
	id   int
	rng  *rand.Rand
	n    int
	held []heldLease
}

func (wk *worker) run(ctx context.Context) {
	for ctx.Err() == nil && wk.w.ops.Add(1) <= wk.w.MaxOps {
		if i := wk.due(); i >= 0 {
			wk.keepAlive(ctx, i)
			continue
		}
		switch r := wk.rng.IntN(10); {
		case len(wk.held) == 0 || r < 4 && len(wk.held) < maxHeld:
			wk.acquire(ctx)
		case r < 6:
			wk.release(ctx, wk.rng.IntN(len(wk.held)))
		case r < 8:
			wk.get(ctx, wk.rng.IntN(len(wk.held)))
		case r < 9:
			wk.keepAlive(ctx, wk.rng.IntN(len(wk.held)))
		default:
			wk.probe(ctx)
		}
	}
}

// due is a held lease whose renewal is due, or -1.
func (wk *worker) due() int {
	for i, h := range wk.held {
		if time.Since(h.renewed) > RenewEvery {
			return i
		}
	}
	return -1
}

func (wk *worker) drop(i int) { wk.held = append(wk.held[:i], wk.held[i+1:]...) }

// unknown reports whether err leaves the outcome open: the call may or
// may not have taken effect.
func unknown(err error) bool {
	switch status.Code(err) {
	case codes.Unavailable, codes.DeadlineExceeded, codes.Canceled, codes.Aborted, codes.Internal, codes.Unknown:
		return true
	}
	return errors.Is(err, context.DeadlineExceeded)
}

func (wk *worker) acquire(ctx context.Context) {
	wk.n++
	req := &gpupoolv1.LeaseRequest{
		Count: 1, MemoryMib: int64(1+wk.rng.IntN(24)) * 1024, ComputePercent: int32(1 + wk.rng.IntN(40)),
		TtlMs: LeaseTTL.Milliseconds(), RequestId: fmt.Sprintf("rb-%d-%d-%d", wk.w.Seed, wk.id, wk.n), Holder: "robustness",
	}
	r := Record{Client: wk.id, Kind: OpAcquire, RequestID: req.RequestId, Call: time.Now().UnixNano()}
	cctx, cancel := context.WithTimeout(ctx, opTimeout)
	resp, err := wk.w.Client.Lease.Acquire(cctx, &gpupoolv1.AcquireRequest{Request: req})
	cancel()
	r.Ret = time.Now().UnixNano()
	switch {
	case err == nil && resp.Lease.GetState() == gpupoolv1.LeaseState_LEASE_STATE_GRANTED && len(resp.Lease.Slices) == 1:
		s := resp.Lease.Slices[0]
		r.Lease, r.Device, r.Memory, r.Compute, r.Fence, r.Outcome = resp.Lease.Id, s.Device, s.MemoryMib, s.ComputePercent, resp.Lease.FencingToken, "ok"
		wk.held = append(wk.held, heldLease{id: r.Lease, device: r.Device, renewed: time.Now()})
		wk.w.granted(r.Lease)
	case err == nil:
		r.Outcome, r.Err = "refused", fmt.Sprintf("not granted: %v", resp.Lease.GetState())
	case unknown(err):
		r.Unknown, r.Err = true, err.Error()
	default:
		r.Outcome, r.Err = "refused", err.Error()
	}
	wk.w.record(r)
	if r.Outcome == "refused" {
		clock.Sleep(ctx, clock.Real, 100*time.Millisecond) // back off as a real client would
	}
}

func (wk *worker) release(ctx context.Context, i int) {
	h := wk.held[i]
	wk.drop(i)
	r := Record{Client: wk.id, Kind: OpRelease, Lease: h.id, Call: time.Now().UnixNano()}
	cctx, cancel := context.WithTimeout(ctx, opTimeout)
	resp, err := wk.w.Client.Lease.Release(cctx, &gpupoolv1.ReleaseRequest{LeaseId: h.id, Reason: "robustness workload"})
	cancel()
	r.Ret = time.Now().UnixNano()
	switch {
	case err == nil:
		r.Outcome = outcomeOf(resp.Lease)
	case status.Code(err) == codes.NotFound:
		r.Outcome, r.Err = "missing", err.Error()
	default:
		r.Unknown, r.Err = true, err.Error()
	}
	wk.w.record(r)
}

func (wk *worker) get(ctx context.Context, i int) {
	h := wk.held[i]
	r := Record{Client: wk.id, Kind: OpGet, Lease: h.id, Call: time.Now().UnixNano()}
	cctx, cancel := context.WithTimeout(ctx, opTimeout)
	resp, err := wk.w.Client.Lease.Get(cctx, &gpupoolv1.GetLeaseRequest{LeaseId: h.id})
	cancel()
	r.Ret = time.Now().UnixNano()
	switch {
	case err == nil:
		r.Outcome, r.Fence = outcomeOf(resp.Lease), resp.Lease.FencingToken
		if r.Outcome != "granted" {
			wk.drop(i)
		}
	case status.Code(err) == codes.NotFound:
		r.Outcome, r.Err = "missing", err.Error()
		wk.drop(i)
	default:
		r.Unknown, r.Err = true, err.Error()
	}
	wk.w.record(r)
}

func (wk *worker) keepAlive(ctx context.Context, i int) {
	h := &wk.held[i]
	r := Record{Client: wk.id, Kind: OpKeepAlive, Lease: h.id, Call: time.Now().UnixNano()}
	resp, err := keepAliveOnce(ctx, wk.w.Client, h.id)
	r.Ret = time.Now().UnixNano()
	h.renewed = time.Now() // also after a failure: try the others first
	switch {
	case err != nil:
		r.Unknown, r.Err = true, err.Error()
	case resp.Error == "" && resp.TtlMs > 0:
		r.Outcome = "ok"
	case resp.State == gpupoolv1.LeaseState_LEASE_STATE_UNSPECIFIED:
		r.Outcome, r.Err = "missing", resp.Error // "lease ... not found"
		wk.drop(i)
	default:
		r.Outcome, r.Err = "ended", resp.Error
		wk.drop(i)
	}
	wk.w.record(r)
}

// probe reads or renews a lease some worker was granted lately, likely
// not this one's and perhaps released: a release that one client saw
// acknowledged must hold for every other client too.
func (wk *worker) probe(ctx context.Context) {
	id := wk.w.someRecent(wk.rng)
	if id == "" {
		return
	}
	kind := OpGet
	if wk.rng.IntN(2) == 0 {
		kind = OpKeepAlive
	}
	r := Record{Client: wk.id, Kind: kind, Lease: id, Call: time.Now().UnixNano()}
	if kind == OpGet {
		cctx, cancel := context.WithTimeout(ctx, opTimeout)
		resp, err := wk.w.Client.Lease.Get(cctx, &gpupoolv1.GetLeaseRequest{LeaseId: id})
		cancel()
		r.Ret = time.Now().UnixNano()
		switch {
		case err == nil:
			r.Outcome, r.Fence = outcomeOf(resp.Lease), resp.Lease.FencingToken
		case status.Code(err) == codes.NotFound:
			r.Outcome, r.Err = "missing", err.Error()
		default:
			r.Unknown, r.Err = true, err.Error()
		}
	} else {
		resp, err := keepAliveOnce(ctx, wk.w.Client, id)
		r.Ret = time.Now().UnixNano()
		switch {
		case err != nil:
			r.Unknown, r.Err = true, err.Error()
		case resp.Error == "" && resp.TtlMs > 0:
			r.Outcome = "ok"
		case resp.State == gpupoolv1.LeaseState_LEASE_STATE_UNSPECIFIED:
			r.Outcome, r.Err = "missing", resp.Error
		default:
			r.Outcome, r.Err = "ended", resp.Error
		}
	}
	wk.w.record(r)
}

// keepAliveOnce renews one lease on a stream of its own and returns the
// renewal's answer (events on the stream are skipped).
func keepAliveOnce(ctx context.Context, c *client.Client, id string) (*gpupoolv1.KeepAliveResponse, error) {
	ctx, cancel := context.WithTimeout(ctx, opTimeout)
	defer cancel()
	ka, err := c.Lease.KeepAlive(ctx)
	if err != nil {
		return nil, err
	}
	if err := ka.Send(&gpupoolv1.KeepAliveRequest{LeaseId: id}); err != nil {
		return nil, err
	}
	for {
		resp, err := ka.Recv()
		if err != nil {
			return nil, err
		}
		if resp.Event == nil && resp.LeaseId == id {
			ka.CloseSend()
			return resp, nil
		}
	}
}
