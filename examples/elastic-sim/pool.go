package main

import (
	"context"
	"fmt"
	"sync"
	"time"

	"google.golang.org/grpc/status"

	"github.com/gpupool/gpupool/client"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// poolListTimeout bounds one listing of the pool's leases, so that a slow
// broker costs at most a missed reading, never a stalled job.
const poolListTimeout = 500 * time.Millisecond

// otherGuaranteedGPUs returns how many GPUs the guaranteed leases among
// leases hold, leaving out the lease own and its extras: an exclusive
// slice counts as one GPU, a shared slice as its compute share (a 25%
// slice is 0.25). A lease of unspecified class counts, as the brokers
// treat it as guaranteed; preemptible leases, other elastic leases'
// extras among them, do not. An empty own leaves nothing out.
func otherGuaranteedGPUs(leases []*gpupoolv1.Lease, own string) float64 {
	var percent int64 // summed in whole percent, so that shares add up exactly
	for _, l := range leases {
		if own != "" && (l.GetId() == own || l.GetParent() == own) {
			continue
		}
		switch l.GetClass() {
		case gpupoolv1.LeaseClass_LEASE_CLASS_GUARANTEED, gpupoolv1.LeaseClass_LEASE_CLASS_UNSPECIFIED:
		default:
			continue
		}
		for _, s := range l.GetSlices() {
			if s.GetExclusive() {
				percent += 100
			} else {
				percent += int64(s.GetComputePercent())
			}
		}
	}
	return float64(percent) / 100
}

// listGranted returns a function that lists the granted leases of the
// pool c talks to.
func listGranted(c *client.Client) func(context.Context) ([]*gpupoolv1.Lease, error) {
	req := &gpupoolv1.ListLeasesRequest{States: []gpupoolv1.LeaseState{gpupoolv1.LeaseState_LEASE_STATE_GRANTED}}
	return func(ctx context.Context) ([]*gpupoolv1.Lease, error) {
		resp, err := c.Lease.List(ctx, req)
		if err != nil {
			return nil, err
		}
		return resp.GetLeases(), nil
	}
}

// poolWatch follows how many GPUs the pool's other guaranteed leases hold
// (see otherGuaranteedGPUs), the load that makes an elastic lease shrink
// and grow. It lists the leases on a goroutine of its own, one listing at
// a time, so that the run loop never waits for a broker: the run loop
// asks for a reading with refresh, learns from updated that a listing
// has ended, and reads the latest reading with last.
//
// A failed listing keeps the last reading. Only the first failure is
// reported, by warning, so that a pool that stays unreachable does not
// fill the output.
type poolWatch struct {
	own     string // the job's elastic lease
	list    func(context.Context) ([]*gpupoolv1.Lease, error)
	timeout time.Duration // for each listing
	due     chan struct{} // capacity 1: holds a token while a listing is asked for
	ended   chan struct{} // capacity 1: holds a token once a listing has ended

	mu       sync.Mutex
	gpus     float64 // guarded by mu; from the last listing that succeeded
	known    bool    // guarded by mu; a listing has succeeded
	failure  string  // guarded by mu; the first failure, until warning reports it
	reported bool    // guarded by mu; the first failure has been seen
}

func newPoolWatch(own string, timeout time.Duration, list func(context.Context) ([]*gpupoolv1.Lease, error)) *poolWatch {
	return &poolWatch{own: own, list: list, timeout: timeout, due: make(chan struct{}, 1), ended: make(chan struct{}, 1)}
}

// start lists the leases whenever refresh asks, until the returned stop
// is called; stop returns once no listing is in flight.
func (w *poolWatch) start(ctx context.Context) (stop func()) {
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			select {
			case <-ctx.Done():
				return
			case <-w.due:
				w.poll(ctx)
			}
		}
	}()
	return func() {
		cancel()
		<-done
	}
}

// refresh asks for a new reading and returns at once. Asking again while
// a listing is already asked for, and not yet started, adds nothing.
func (w *poolWatch) refresh() {
	select {
	case w.due <- struct{}{}:
	default:
	}
}

// updated receives once a listing asked for by refresh has ended, with a
// reading or a failure; listings that end before it is read are told as
// one.
func (w *poolWatch) updated() <-chan struct{} { return w.ended }

// poll lists the leases once, within the watch's timeout, records the
// reading, or the failure when it is the first, and tells updated.
func (w *poolWatch) poll(ctx context.Context) {
	lctx, cancel := context.WithTimeout(ctx, w.timeout)
	defer cancel()
	leases, err := w.list(lctx)
	if ctx.Err() != nil {
		return // cut short by stop: no failure of the pool's
	}
	w.mu.Lock()
	if err == nil {
		w.gpus, w.known = otherGuaranteedGPUs(leases, w.own), true
	} else if !w.reported {
		w.reported = true
		w.failure = orDash(status.Convert(err).Message())
	}
	w.mu.Unlock()
	select {
	case w.ended <- struct{}{}:
	default:
	}
}

// last returns the latest reading; known is false until a listing has
// succeeded.
func (w *poolWatch) last() (gpus float64, known bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.gpus, w.known
}

// warning returns, once, a line about the first failed listing; "" when
// there is nothing new to report.
func (w *poolWatch) warning() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.failure == "" {
		return ""
	}
	msg := fmt.Sprintf("  warning: cannot list the pool's leases: %s; the other guaranteed GPUs keep their last value and further failures are not reported", w.failure)
	w.failure = ""
	return msg
}
