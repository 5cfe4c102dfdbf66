package agent

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/gpupool/gpupool/agent/device"
	"github.com/gpupool/gpupool/agent/workload"
	"github.com/gpupool/gpupool/internal/clock"
	"github.com/gpupool/gpupool/internal/quantity"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// Defaults of the watchdog and of the agent's safety when cut off.
const (
	DefaultPoll        = 500 * time.Millisecond
	DefaultGrace       = 2 * time.Second
	DefaultKillAfter   = 5 * time.Second
	DefaultExpiryGrace = 10 * time.Second
)

// Enforcement tunes the watchdog. Zero fields take the defaults.
type Enforcement struct {
	// Poll is how often the watchdog reads per-process GPU memory.
	Poll time.Duration
	// Grace is how long a lease may use more memory than its slice
	// before its processes are stopped.
	Grace time.Duration
	// KillAfter is how long a process has to exit after SIGTERM before
	// it gets SIGKILL.
	KillAfter time.Duration
	// ExpiryGrace is how long past a lease's expiry its processes may go
	// on while the brokers cannot be reached to renew or revoke it.
	ExpiryGrace time.Duration
}

func (e *Enforcement) setDefaults() {
	if e.Poll <= 0 {
		e.Poll = DefaultPoll
	}
	if e.Grace <= 0 {
		e.Grace = DefaultGrace
	}
	if e.KillAfter <= 0 {
		e.KillAfter = DefaultKillAfter
	}
	if e.ExpiryGrace <= 0 {
		e.ExpiryGrace = DefaultExpiryGrace
	}
}

// gpuUse is what one lease's processes use of one device.
type gpuUse struct {
	memMiB int64
	procs  int
}

// stopOrder asks for a lease's processes to be stopped.
type stopOrder struct {
	leaseID string
	procs   []workload.Proc
	why     string
	// event is the violation to report, nil for an expiry.
	event *gpupoolv1.AgentEvent
	// stray: the lease is not enforced here.
	stray bool
}

// watchdog polls until ctx ends.
func (a *Agent) watchdog(ctx context.Context) {
	tick := clock.NewTicker(a.clock, a.cfg.Enforcement.Poll)
	defer tick.Stop()
	for {
		a.watchOnce(ctx, a.clock.Now())
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

// watchOnce reads the GPUs and the lease processes once, updates every
// lease's usage, and stops the processes of leases that used more memory
// than their slice for longer than the grace, that run on a GPU they do
// not hold, or whose lease expired while the brokers were unreachable.
func (a *Agent) watchOnce(ctx context.Context, now time.Time) {
	samples, err := a.cfg.Backend.Sample()
	if err != nil {
		a.sampleErr.log(a.log, "reading GPU usage failed", err)
	} else {
		a.sampleErr.clear(a.log, "reading GPU usage works again")
	}
	procs, err := a.procs.Scan()
	if err != nil {
		a.scanErr.log(a.log, "listing lease processes failed", err)
	} else {
		a.scanErr.clear(a.log, "listing lease processes works again")
	}
	use := map[string]map[string]gpuUse{} // lease → device → use
	for _, s := range samples {
		if s.Lost {
			a.markUnhealthy(s.UUID, "GPU is lost")
		}
		for _, p := range s.Processes {
			id := a.procs.LeaseOf(p.PID)
			if id == "" || p.UsedMiB < 0 {
				// Not a lease's, or NVML cannot say how much it uses.
				continue
			}
			if use[id] == nil {
				use[id] = map[string]gpuUse{}
			}
			u := use[id][s.UUID]
			u.memMiB += p.UsedMiB
			u.procs++
			use[id][s.UUID] = u
		}
	}
	a.setReadings(samples)
	for _, o := range a.leases.check(now, samples, use, procs, a.cfg.Enforcement) {
		a.stop(ctx, o)
	}
}

// check applies the watchdog's rules to every enforced lease and returns
// the stops to carry out. Leases being stopped are skipped.
func (t *leaseTable) check(now time.Time, samples []device.Sample, use map[string]map[string]gpuUse, procs map[string][]workload.Proc, cfg Enforcement) []stopOrder {
	util := map[string]int32{}
	for _, s := range samples {
		util[s.UUID] = s.UtilizationPercent
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	var out []stopOrder
	// A lease this host does not enforce (never assigned, torn down, or
	// dropped at resume) has no right to this host's GPUs: its processes
	// are stopped once they show up on one. Only GPU processes count, as
	// several agents may share one machine (gpupool dev), and only once a
	// broker's list arrived: before that, a lease may just not be known
	// yet.
	for _, id := range slices.Sorted(maps.Keys(use)) {
		e := t.entries[id]
		if !t.synced || len(procs[id]) == 0 || t.strays[id] || (e != nil && e.phase != tornDown) {
			continue
		}
		t.strays[id] = true
		out = append(out, stopOrder{leaseID: id, procs: procs[id], stray: true,
			why: "the processes carry the id of a lease this host does not enforce"})
	}
	for _, id := range slices.Sorted(maps.Keys(t.entries)) {
		e := t.entries[id]
		if e.phase != enforcing {
			continue
		}
		held := map[string]*gpupoolv1.Slice{}
		u := &gpupoolv1.LeaseUsage{LeaseId: id, SampledAtMs: now.UnixMilli()}
		for _, s := range e.a.Slices {
			held[s.Device] = s
			got := use[id][s.Device]
			u.Slices = append(u.Slices, &gpupoolv1.SliceUsage{
				Device: s.Device, MemoryUsedMib: got.memMiB, UtilizationPercent: util[s.Device], Processes: int32(got.procs),
			})
		}
		e.usage = u
		if e.stopping {
			continue
		}
		if o, ok := t.expiryLocked(e, now, procs[id], cfg); ok {
			out = append(out, o)
			continue
		}
		if o, ok := t.overuseLocked(e, now, held, use[id], procs[id], cfg); ok {
			out = append(out, o)
		}
	}
	return out
}

// expiryLocked stops a lease's processes once its deadline plus the expiry
// grace passed: the brokers could neither renew nor revoke it. Only an
// agent cut off from the brokers gets there; a connected one hears of the
// expiry as a teardown first.
func (t *leaseTable) expiryLocked(e *leaseEntry, now time.Time, procs []workload.Proc, cfg Enforcement) (stopOrder, bool) {
	if e.deadline.IsZero() || !now.After(e.deadline.Add(cfg.ExpiryGrace)) {
		return stopOrder{}, false
	}
	first := !e.expired
	e.expired = true
	if len(procs) == 0 && !first {
		return stopOrder{}, false
	}
	e.stopping = true
	return stopOrder{leaseID: e.a.LeaseId, procs: procs, why: fmt.Sprintf(
		"lease expired at %s and the brokers could not be reached to renew it; grace of %s passed",
		e.deadline.Format(time.RFC3339), cfg.ExpiryGrace)}, true
}

// overuseLocked stops a lease's processes once they have used more memory
// than a slice allows, or any memory on a GPU the lease does not hold,
// for longer than the grace.
func (t *leaseTable) overuseLocked(e *leaseEntry, now time.Time, held map[string]*gpupoolv1.Slice, use map[string]gpuUse, procs []workload.Proc, cfg Enforcement) (stopOrder, bool) {
	if e.over == nil {
		e.over = map[string]time.Time{}
	}
	var why, dev string
	for _, uuid := range slices.Sorted(maps.Keys(use)) {
		got := use[uuid]
		s := held[uuid]
		var msg string
		switch {
		case s == nil:
			msg = fmt.Sprintf("%s of memory on GPU %s, which the lease does not hold", quantity.FormatMiB(got.memMiB), uuid)
		case !s.Exclusive && got.memMiB > s.MemoryMib:
			msg = fmt.Sprintf("%s of memory on %s, over its slice of %s", quantity.FormatMiB(got.memMiB), describeSlice(s), quantity.FormatMiB(s.MemoryMib))
		default:
			delete(e.over, uuid)
			continue
		}
		since, ok := e.over[uuid]
		if !ok {
			e.over[uuid] = now
			continue
		}
		if why == "" && now.Sub(since) >= cfg.Grace {
			why, dev = fmt.Sprintf("used %s for %s", msg, now.Sub(since).Round(time.Millisecond)), uuid
		}
	}
	for uuid := range e.over {
		if _, ok := use[uuid]; !ok {
			delete(e.over, uuid)
		}
	}
	if why == "" {
		return stopOrder{}, false
	}
	e.stopping = true
	e.violations++
	clear(e.over)
	why = fmt.Sprintf("%s: stopping %d process(es) with SIGTERM, SIGKILL after %s", why, len(procs), cfg.KillAfter)
	ev := t.addEventLocked(gpupoolv1.AgentEventType_AGENT_EVENT_TYPE_VIOLATION, e.a.LeaseId, dev, why, now)
	return stopOrder{leaseID: e.a.LeaseId, procs: procs, why: why, event: ev}, true
}

// stopDone records that a stop of id's processes finished.
func (t *leaseTable) stopDone(id string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	delete(t.strays, id)
	if e := t.entries[id]; e != nil {
		e.stopping = false
	}
}

// stop carries out a stop order in the background.
func (a *Agent) stop(ctx context.Context, o stopOrder) {
	switch {
	case o.event != nil:
		a.log.Warn("watchdog: memory violation", "lease", o.leaseID, "device", o.event.Device, "why", o.why)
		a.saveMemory() // the event must survive a restart until acknowledged
		a.kick()
	case o.stray:
		a.log.Warn("stopping processes of a lease this host does not enforce", "lease", o.leaseID, "processes", len(o.procs))
	default:
		a.log.Warn("stopping an expired lease's processes", "lease", o.leaseID, "processes", len(o.procs), "why", o.why)
	}
	a.wg.Add(1)
	go func() {
		defer a.wg.Done()
		defer a.leases.stopDone(o.leaseID)
		if len(o.procs) == 0 {
			return
		}
		res, err := workload.Stop(ctx, o.procs, a.cfg.Enforcement.KillAfter)
		a.logStop(o.leaseID, res, err)
	}()
}

func (a *Agent) logStop(leaseID string, res workload.StopResult, err error) {
	attrs := []any{"lease", leaseID, "terminated", res.Terminated, "killed", res.Killed, "took", res.Took.Round(time.Millisecond)}
	if err != nil || len(res.Remaining) > 0 {
		a.log.Error("could not stop every process of a lease", append(attrs, "remaining", len(res.Remaining), "err", err)...)
		return
	}
	a.log.Info("stopped a lease's processes", attrs...)
}
