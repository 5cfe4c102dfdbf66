package main

import (
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/gpupool/gpupool/client"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// errLeaseLost is what job.handle returns when the elastic lease itself
// ended: the job no longer holds even its guaranteed slices.
var errLeaseLost = errors.New("the lease ended")

// jobConfig is what a job needs to know besides the lease.
type jobConfig struct {
	// parent is the elastic lease's id.
	parent string
	// perGPU is how many units a whole GPU is given per tick; a slice is
	// given its compute share of that, at least 1.
	perGPU int
	// total is how many units the job has; 0 means endless.
	total int64
	// run runs one unit. It is called on the workers' goroutines.
	run func(unit) tally
	// out receives a line for every change to the slices the job holds.
	out io.Writer
}

// job spreads work units over the slices an elastic lease holds, one
// worker goroutine per slice, and follows the lease as it grows and
// shrinks.
//
// Its methods are called from one goroutine, the run loop; the workers
// report their results under mu. A unit is handed to one worker at a
// time and counted done once: a worker that stops hands its unstarted
// units back, and they are handed out again before new ones. A leaving
// worker is given no new unit.
type job struct {
	jobConfig

	workers  map[string]*worker // by sliceKeys
	next     uint64             // id of the next new unit
	returned []unit             // units handed back, handed out first
	wg       sync.WaitGroup     // the worker goroutines

	mu      sync.Mutex
	done    int64         // guarded by mu; units completed
	result  tally         // guarded by mu; of the completed units
	allDone chan struct{} // closed, under mu, once done reaches total
}

// worker runs the units handed to one slice.
type worker struct {
	key    string // see sliceKeys
	slice  client.HeldSlice
	budget int // units per tick

	// queue holds units handed out and not started; its capacity is
	// budget, and since pending never exceeds budget a send never blocks.
	queue chan unit
	stop  chan struct{} // closed when the worker is to take no more units

	leaving  bool
	listed   bool  // Lease.Slices listed the slice at least once
	assigned int64 // units handed to the worker in all

	pending int   // guarded by job.mu; units handed out and not completed
	done    int64 // guarded by job.mu; units completed
}

func newJob(cfg jobConfig) *job {
	return &job{jobConfig: cfg, workers: map[string]*worker{}, allDone: make(chan struct{})}
}

// sliceKeys names the slices held, in the order given, each by its lease,
// device and how many slices of the same lease on the same device come
// before it: a lease may hold two slices of one GPU.
func sliceKeys(held []client.HeldSlice) []string {
	seen := map[string]int{}
	keys := make([]string, len(held))
	for i, h := range held {
		base := h.LeaseID + "/" + h.GetHost() + "/" + h.GetDevice()
		keys[i] = fmt.Sprintf("%s#%d", base, seen[base])
		seen[base]++
	}
	return keys
}

// where says where slices are, for people: "host-2 gpu 3".
func where(ss ...*gpupoolv1.Slice) string {
	parts := make([]string, len(ss))
	for i, s := range ss {
		parts[i] = fmt.Sprintf("%s gpu %d", s.GetHost(), s.GetDeviceIndex())
	}
	return strings.Join(parts, ", ")
}

// sync makes the workers match held, the slices the lease holds now: a
// worker for every slice, leaving when the slice is. A worker is removed
// only once held has listed its slice and then no longer does, so that a
// slice announced by an event before Lease.Slices shows it keeps its
// worker.
func (j *job) sync(held []client.HeldSlice, now time.Time) {
	listed := make(map[string]bool, len(held))
	keys := sliceKeys(held)
	for i, h := range held {
		k := keys[i]
		listed[k] = true
		w := j.workers[k]
		if w == nil {
			w = j.start(k, h)
		}
		w.listed = true
		if h.Leaving && !w.leaving {
			n := j.drain(w)
			fmt.Fprintf(j.out, "- shrink notice: %s on %s %s; drained, %d units handed back\n",
				h.LeaseID, where(h.Slice), leaves(h.LeaveAtMs, now), n)
		}
	}
	for _, k := range j.keys() {
		if w := j.workers[k]; w.listed && !listed[k] {
			j.remove(w, "no longer listed by the lease")
		}
	}
}

// handle applies one event of the lease. It returns an error wrapping
// errLeaseLost when the lease itself ended; events for other leases are
// ignored.
func (j *job) handle(ev *gpupoolv1.LeaseEvent, now time.Time) error {
	l := ev.GetLease()
	if l.GetId() != j.parent && l.GetParent() != j.parent {
		return nil
	}
	switch ev.GetType() {
	case gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_GROWN:
		var held []client.HeldSlice
		for _, s := range l.GetSlices() {
			held = append(held, client.HeldSlice{LeaseID: l.GetId(), Extra: true, Slice: s})
		}
		for i, k := range sliceKeys(held) {
			if j.workers[k] == nil {
				j.start(k, held[i])
			}
		}
	case gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_PREEMPT_NOTICE, gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_DRAIN_NOTICE:
		n := 0
		for _, w := range j.ofLease(l.GetId()) {
			if !w.leaving {
				n += j.drain(w)
			}
		}
		what := "shrink notice"
		if ev.GetType() == gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_DRAIN_NOTICE {
			what = "drain notice"
		}
		fmt.Fprintf(j.out, "- %s: %s %s: %s; drained, %d units handed back\n",
			what, l.GetId(), leaves(ev.GetDeadlineMs(), now), orDash(ev.GetMessage()), n)
	case gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_ENDED:
		if l.GetId() == j.parent {
			return fmt.Errorf("%w: %s", errLeaseLost, orDash(ev.GetMessage()))
		}
		for _, w := range j.ofLease(l.GetId()) {
			j.remove(w, "ended: "+orDash(ev.GetMessage()))
		}
	case gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_RELEASING:
		if l.GetId() == j.parent {
			fmt.Fprintf(j.out, "  releasing: %s: %s\n", l.GetId(), orDash(ev.GetMessage()))
			break
		}
		// An extra that is releasing is no longer the job's to use.
		for _, w := range j.ofLease(l.GetId()) {
			j.remove(w, "releasing: "+orDash(ev.GetMessage()))
		}
	default:
		fmt.Fprintf(j.out, "  %s: %s: %s\n", eventName(ev.GetType()), l.GetId(), orDash(ev.GetMessage()))
	}
	return nil
}

// tick hands every worker that is not leaving enough units to have its
// budget outstanding, new units only while the job has some left, and
// reports how the job stands.
func (j *job) tick() sample {
	for _, k := range j.keys() {
		w := j.workers[k]
		if w.leaving {
			continue
		}
		j.mu.Lock()
		room := w.budget - w.pending
		j.mu.Unlock()
		var batch []unit
		for range room {
			u, ok := j.take()
			if !ok {
				break
			}
			batch = append(batch, u)
		}
		j.mu.Lock()
		w.pending += len(batch)
		j.mu.Unlock()
		for _, u := range batch {
			w.queue <- u
		}
		w.assigned += int64(len(batch))
	}
	s := sample{slices: len(j.workers)}
	for _, w := range j.workers {
		if w.leaving {
			s.leaving++
		}
	}
	j.mu.Lock()
	s.done = j.done
	j.mu.Unlock()
	return s
}

// finished is closed once every unit of a job with a total is done; it is
// never closed for an endless job.
func (j *job) finished() <-chan struct{} { return j.allDone }

// results returns the units done and their tally so far.
func (j *job) results() (int64, tally) {
	j.mu.Lock()
	defer j.mu.Unlock()
	return j.done, j.result
}

// close stops every worker and waits for them: units in progress finish
// and count, unstarted ones are handed back.
func (j *job) close() {
	for _, w := range j.workers {
		if !w.leaving {
			j.drain(w)
		}
	}
	j.wg.Wait()
}

// take returns the next unit to hand out, a handed-back one first; false
// when the job has none left to hand out.
func (j *job) take() (unit, bool) {
	if n := len(j.returned); n > 0 {
		u := j.returned[n-1]
		j.returned = j.returned[:n-1]
		return u, true
	}
	if j.total > 0 && j.next >= uint64(j.total) {
		return unit{}, false
	}
	u := unit{id: j.next}
	j.next++
	return u, true
}

// start starts a worker for slice h, whose key is k, and says so.
func (j *job) start(k string, h client.HeldSlice) *worker {
	share := h.GetComputePercent()
	if h.GetExclusive() || share <= 0 || share > 100 {
		share = 100
	}
	budget := max(1, j.perGPU*int(share)/100)
	w := &worker{key: k, slice: h, budget: budget, queue: make(chan unit, budget), stop: make(chan struct{})}
	j.workers[k] = w
	j.wg.Add(1)
	go j.work(w)
	what := "slice: %s on %s (guaranteed, %d units/tick)"
	if h.Extra {
		what = "grew: %s on %s (extra, %d units/tick)"
	}
	fmt.Fprintf(j.out, "+ "+what+"\n", h.LeaseID, where(h.Slice), budget)
	return w
}

// work runs w's units until w is stopped.
func (j *job) work(w *worker) {
	defer j.wg.Done()
	for {
		select {
		case <-w.stop:
			return
		default:
		}
		select {
		case <-w.stop:
			return
		case u := <-w.queue:
			t := j.run(u)
			j.complete(w, t)
		}
	}
}

// complete records a unit w finished: this is the checkpoint, after
// which the unit's result survives the slice.
func (j *job) complete(w *worker, t tally) {
	j.mu.Lock()
	defer j.mu.Unlock()
	w.pending--
	w.done++
	j.done++
	j.result = j.result.add(t)
	if j.total > 0 && j.done == j.total {
		close(j.allDone)
	}
}

// drain stops giving w units and hands its unstarted ones back; the unit
// it is running, if any, finishes and counts. It returns how many units
// were handed back.
func (j *job) drain(w *worker) int {
	w.leaving = true
	close(w.stop)
	n := 0
	for {
		select {
		case u := <-w.queue:
			j.returned = append(j.returned, u)
			n++
		default:
			j.mu.Lock()
			w.pending -= n
			j.mu.Unlock()
			return n
		}
	}
}

// remove forgets w, whose slice is gone, and says why.
func (j *job) remove(w *worker, why string) {
	n := 0
	if !w.leaving {
		n = j.drain(w)
	}
	delete(j.workers, w.key)
	j.mu.Lock()
	done := w.done
	j.mu.Unlock()
	fmt.Fprintf(j.out, "- shrank: %s on %s gone after %d units (%d handed back): %s\n",
		w.slice.LeaseID, where(w.slice.Slice), done, n, why)
}

// ofLease returns the workers of lease id's slices.
func (j *job) ofLease(id string) []*worker {
	var out []*worker
	for _, k := range j.keys() {
		if w := j.workers[k]; w.slice.LeaseID == id {
			out = append(out, w)
		}
	}
	return out
}

// keys returns the workers' keys in order, so that work is handed out in
// the same order every tick.
func (j *job) keys() []string {
	ks := make([]string, 0, len(j.workers))
	for k := range j.workers {
		ks = append(ks, k)
	}
	slices.Sort(ks)
	return ks
}

// leaves says when a slice revoked at the Unix time ms leaves, for
// people: "leaves in 30s"; 0 means no deadline.
func leaves(ms int64, now time.Time) string {
	if ms == 0 {
		return "should leave when it can (no deadline)"
	}
	return "leaves in " + max(0, time.UnixMilli(ms).Sub(now)).Round(time.Second).String()
}

// eventName is an event type without its prefix, in lower case.
func eventName(t gpupoolv1.LeaseEventType) string {
	return strings.ToLower(strings.TrimPrefix(t.String(), "LEASE_EVENT_TYPE_"))
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
