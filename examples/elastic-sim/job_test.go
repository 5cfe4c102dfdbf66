package main

import (
	"errors"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/gpupool/gpupool/client"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

const parentID = "l-parent"

// perGPU makes a 25% slice's budget 2 units a tick.
const perGPU = 8

var now = time.UnixMilli(1_700_000_000_000)

// newGatedJob returns a job whose units block until the test ends, so
// that what a tick hands out depends only on the job's own bookkeeping.
// out receives the job's lines.
func newGatedJob(t *testing.T, total int64, out io.Writer) *job {
	t.Helper()
	gate := make(chan struct{})
	j := newJob(jobConfig{parent: parentID, perGPU: perGPU, total: total, out: out,
		run: func(unit) tally { <-gate; return tally{samples: 1, hits: 1} }})
	t.Cleanup(func() {
		close(gate)
		j.close()
	})
	return j
}

func slice(host string, index int32) *gpupoolv1.Slice {
	return &gpupoolv1.Slice{Host: host, Device: "GPU-" + host + "-" + string(rune('0'+index)), DeviceIndex: index,
		MemoryMib: 10240, ComputePercent: 25}
}

func guaranteed(s *gpupoolv1.Slice) client.HeldSlice {
	return client.HeldSlice{LeaseID: parentID, Slice: s}
}

func extraLease(id string, s *gpupoolv1.Slice) *gpupoolv1.Lease {
	return &gpupoolv1.Lease{Id: id, Parent: parentID, Slices: []*gpupoolv1.Slice{s}}
}

func event(typ gpupoolv1.LeaseEventType, l *gpupoolv1.Lease, msg string) *gpupoolv1.LeaseEvent {
	return &gpupoolv1.LeaseEvent{Type: typ, Lease: l, Message: msg, DeadlineMs: now.Add(30 * time.Second).UnixMilli()}
}

var (
	g0 = slice("host-1", 0)
	g1 = slice("host-1", 1)
	e1 = extraLease("l-e1", slice("host-2", 3))
	e2 = extraLease("l-e2", slice("host-2", 4))

	grown   = gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_GROWN
	notice  = gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_PREEMPT_NOTICE
	ended   = gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_ENDED
	release = gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_RELEASING
)

func keyOf(l *gpupoolv1.Lease) string {
	return sliceKeys([]client.HeldSlice{{LeaseID: l.Id, Slice: l.Slices[0]}})[0]
}

func TestJobFollowsTheLease(t *testing.T) {
	leavingE1 := client.HeldSlice{LeaseID: "l-e1", Extra: true, Leaving: true, LeaveAtMs: now.Add(time.Minute).UnixMilli(), Slice: e1.Slices[0]}
	tests := []struct {
		name        string
		held        []client.HeldSlice // synced first
		events      []*gpupoolv1.LeaseEvent
		wantWorkers int
		wantLeaving int
		idle        []string // keys that must be given no unit at the tick
		wantErr     error
		wantOut     []string // substrings of the job's lines
	}{
		{
			name:        "each guaranteed slice gets a worker",
			held:        []client.HeldSlice{guaranteed(g0), guaranteed(g1)},
			wantWorkers: 2,
			wantOut:     []string{"+ slice: l-parent on host-1 gpu 0", "+ slice: l-parent on host-1 gpu 1"},
		},
		{
			name:        "two guaranteed slices of one GPU get a worker each",
			held:        []client.HeldSlice{guaranteed(g0), guaranteed(g0)},
			wantWorkers: 2,
		},
		{
			name:        "a grown extra gets a worker at once",
			held:        []client.HeldSlice{guaranteed(g0)},
			events:      []*gpupoolv1.LeaseEvent{event(grown, e1, "")},
			wantWorkers: 2,
			wantOut:     []string{"+ grew: l-e1 on host-2 gpu 3"},
		},
		{
			name: "a shrink notice stops new work for that slice only",
			held: []client.HeldSlice{guaranteed(g0)},
			events: []*gpupoolv1.LeaseEvent{
				event(grown, e1, ""), event(grown, e2, ""),
				event(notice, e1, "preempted for l-xyz (guaranteed, priority 0)"),
			},
			wantWorkers: 3,
			wantLeaving: 1,
			idle:        []string{keyOf(e1)},
			wantOut:     []string{"- shrink notice: l-e1 leaves in 30s: preempted for l-xyz (guaranteed, priority 0)"},
		},
		{
			name:        "a slice the lease lists as leaving gets no new work without a notice",
			held:        []client.HeldSlice{guaranteed(g0), leavingE1},
			wantWorkers: 2,
			wantLeaving: 1,
			idle:        []string{keyOf(e1)},
			wantOut:     []string{"- shrink notice: l-e1 on host-2 gpu 3 leaves in 1m0s"},
		},
		{
			name: "an extra's end removes its worker",
			held: []client.HeldSlice{guaranteed(g0)},
			events: []*gpupoolv1.LeaseEvent{
				event(grown, e1, ""), event(notice, e1, "preempted"), event(ended, e1, "revoked"),
			},
			wantWorkers: 1,
			wantOut:     []string{"- shrank: l-e1 on host-2 gpu 3 gone", "ended: revoked"},
		},
		{
			name:        "an extra that is releasing is removed without a notice",
			held:        []client.HeldSlice{guaranteed(g0)},
			events:      []*gpupoolv1.LeaseEvent{event(grown, e1, ""), event(release, e1, "")},
			wantWorkers: 1,
		},
		{
			name:        "an extra's events for another job change nothing",
			held:        []client.HeldSlice{guaranteed(g0)},
			events:      []*gpupoolv1.LeaseEvent{event(grown, &gpupoolv1.Lease{Id: "l-other", Parent: "l-elsewhere", Slices: []*gpupoolv1.Slice{g1}}, "")},
			wantWorkers: 1,
		},
		{
			name:        "the lease's own end is a lost lease",
			held:        []client.HeldSlice{guaranteed(g0)},
			events:      []*gpupoolv1.LeaseEvent{event(ended, &gpupoolv1.Lease{Id: parentID}, "expired")},
			wantWorkers: 1,
			wantErr:     errLeaseLost,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var out strings.Builder
			j := newGatedJob(t, 0, &out)
			j.sync(tt.held, now)
			var err error
			for _, ev := range tt.events {
				if err = j.handle(ev, now); err != nil {
					break
				}
			}
			if !errors.Is(err, tt.wantErr) {
				t.Fatalf("got error %v, want %v", err, tt.wantErr)
			}
			s := j.tick()
			if s.slices != tt.wantWorkers || len(j.workers) != tt.wantWorkers {
				t.Errorf("got %d workers (sample says %d), want %d", len(j.workers), s.slices, tt.wantWorkers)
			}
			if s.leaving != tt.wantLeaving {
				t.Errorf("got %d leaving, want %d", s.leaving, tt.wantLeaving)
			}
			for k, w := range j.workers {
				idle := false
				for _, i := range tt.idle {
					idle = idle || i == k
				}
				switch {
				case idle && w.assigned != 0:
					t.Errorf("leaving %s was given %d units, want none", k, w.assigned)
				case !idle && w.assigned != int64(w.budget):
					t.Errorf("%s was given %d units, want its budget %d", k, w.assigned, w.budget)
				}
			}
			for _, want := range tt.wantOut {
				if !strings.Contains(out.String(), want) {
					t.Errorf("output lacks %q; got:\n%s", want, out.String())
				}
			}
		})
	}
}

func TestANoticeHandsQueuedUnitsBackAndStopsNewOnes(t *testing.T) {
	j := newGatedJob(t, 0, io.Discard)
	j.sync([]client.HeldSlice{guaranteed(g0)}, now)
	if err := j.handle(event(grown, e1, ""), now); err != nil {
		t.Fatal(err)
	}
	j.tick()
	w := j.workers[keyOf(e1)]
	if w.assigned != int64(w.budget) {
		t.Fatalf("before the notice %s was given %d units, want %d", keyOf(e1), w.assigned, w.budget)
	}
	if err := j.handle(event(notice, e1, "preempted"), now); err != nil {
		t.Fatal(err)
	}
	// The worker may have started one unit before the notice; every
	// other unit comes back.
	if back := len(j.returned); back < w.budget-1 || back > w.budget {
		t.Errorf("got %d units handed back, want %d or %d", back, w.budget-1, w.budget)
	}
	j.tick()
	j.tick()
	if w.assigned != int64(w.budget) {
		t.Errorf("after the notice %s was given %d units in all, want still %d", keyOf(e1), w.assigned, w.budget)
	}
}

func TestHandedBackUnitsAreHandedOutBeforeNewOnes(t *testing.T) {
	j := newGatedJob(t, 0, io.Discard)
	j.sync([]client.HeldSlice{guaranteed(g0)}, now)
	j.handle(event(grown, e1, ""), now)
	j.tick()
	j.handle(event(notice, e1, "preempted"), now)
	back, made := len(j.returned), j.next
	j.handle(event(grown, e2, ""), now)
	j.tick()
	budget := j.workers[keyOf(e2)].budget
	if back > budget {
		t.Fatalf("test needs at most %d units handed back, got %d", budget, back)
	}
	if len(j.returned) != 0 {
		t.Errorf("got %d handed-back units still waiting, want none", len(j.returned))
	}
	if want := made + uint64(budget-back); j.next != want {
		t.Errorf("got %d units made in all, want %d: the %d handed back first, then new ones", j.next, want, back)
	}
}

func TestAJobWithATotalHandsOutExactlyThatMany(t *testing.T) {
	j := newGatedJob(t, 5, io.Discard)
	j.sync([]client.HeldSlice{guaranteed(g0), guaranteed(g1)}, now)
	j.handle(event(grown, e1, ""), now)
	j.tick() // budgets are 2 each: 2 + 2 + 1
	j.tick()
	var total int64
	for _, w := range j.workers {
		total += w.assigned
	}
	if total != 5 {
		t.Errorf("got %d units handed out, want the job's 5", total)
	}
}

func TestAJobWithATotalFinishesWhenAllAreDone(t *testing.T) {
	// A budget larger than the total: one tick hands out every unit.
	j := newJob(jobConfig{parent: parentID, perGPU: 400, total: 7, out: io.Discard, run: monteCarloPi})
	j.sync([]client.HeldSlice{guaranteed(g0), guaranteed(g1)}, now)
	j.tick()
	<-j.finished()
	j.close()
	done, result := j.results()
	if done != 7 || result.samples != 7*samplesPerUnit {
		t.Errorf("got %d units and %d samples, want 7 and %d", done, result.samples, 7*samplesPerUnit)
	}
}

func TestCloseWaitsForTheUnitsInProgress(t *testing.T) {
	j := newJob(jobConfig{parent: parentID, perGPU: perGPU, out: io.Discard, run: monteCarloPi})
	j.sync([]client.HeldSlice{guaranteed(g0)}, now)
	j.tick()
	j.close()
	done, _ := j.results()
	if w := j.workers[sliceKeys([]client.HeldSlice{guaranteed(g0)})[0]]; done+int64(len(j.returned)) != w.assigned {
		t.Errorf("got %d done and %d handed back, want them to add up to the %d handed out", done, len(j.returned), w.assigned)
	}
}
