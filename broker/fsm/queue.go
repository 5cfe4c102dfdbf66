package fsm

import (
	"fmt"
	"strings"
	"time"

	"github.com/gpupool/gpupool/broker/state"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// The pending queue, elastic extras and preemption, as Apply sees them.
// Which lease waits, grows or is preempted is the leader's decision
// (broker/queue.go); Apply records it and checks that it still holds.

// applyEnqueueLease adds a pending lease: no slices, no capacity, its
// arrival order the entry's index.
func applyEnqueueLease(w *state.Writer, index uint64, c *gpupoolv1.EnqueueLeaseCommand) (*Result, []Event) {
	l := clone(c.GetLease())
	if l.GetId() == "" || len(l.Slices) > 0 || l.Request == nil {
		return &Result{Err: fmt.Errorf("%w: a pending lease needs an id and a request, and has no slices", ErrInvalid)}, nil
	}
	if ex := w.LeaseByRequest(l.Tenant, l.RequestId); ex != nil {
		return &Result{Lease: ex, Existing: true}, nil
	}
	if w.Lease(l.Id) != nil {
		return &Result{Err: fmt.Errorf("%w: lease id %s already exists", ErrInvalid, l.Id)}, nil
	}
	l.State = gpupoolv1.LeaseState_LEASE_STATE_PENDING
	l.CreateIndex, l.ModifyIndex = index, index
	l.StateChangedAtMs = l.CreatedAtMs
	l.Reason = "waiting in the queue"
	w.PutLease(l)
	return &Result{Lease: l}, []Event{{Lease: l, Type: gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_UPDATED}}
}

// applyPreemptLeases marks granted preemptible leases to be revoked at the
// deadline for a pending lease, or, with deadline 0, withdraws the
// preemption of those leases. The whole command applies or none of it.
func applyPreemptLeases(w *state.Writer, index uint64, c *gpupoolv1.PreemptLeasesCommand) (*Result, []Event) {
	if len(c.LeaseIds) == 0 || c.ForLease == "" {
		return &Result{Err: fmt.Errorf("%w: preemption without leases or the lease it is for", ErrInvalid)}, nil
	}
	withdraw := c.DeadlineMs == 0
	if !withdraw {
		r := w.Lease(c.ForLease)
		if r == nil || r.State != gpupoolv1.LeaseState_LEASE_STATE_PENDING {
			return precondition("lease %s is not pending: nothing to preempt for", c.ForLease)
		}
	}
	var evs []Event
	for _, id := range c.LeaseIds {
		l := w.Lease(id)
		if l == nil {
			return &Result{Err: fmt.Errorf("lease %q: %w", id, ErrNotFound)}, nil
		}
		if withdraw {
			if l.PreemptedFor != c.ForLease || l.State != gpupoolv1.LeaseState_LEASE_STATE_GRANTED {
				continue
			}
			nl := clone(l)
			nl.PreemptAtMs, nl.PreemptedFor, nl.ModifyIndex = 0, "", index
			w.PutLease(nl)
			evs = append(evs, Event{Lease: nl, Type: gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_UPDATED, Message: "preemption withdrawn: " + c.Reason})
			continue
		}
		if l.State != gpupoolv1.LeaseState_LEASE_STATE_GRANTED || l.Class != gpupoolv1.LeaseClass_LEASE_CLASS_PREEMPTIBLE {
			return precondition("lease %s is %s and %s: only granted preemptible leases are preempted",
				id, LeaseStateName(l.State), className(l.Class))
		}
		if l.PreemptAtMs != 0 {
			if l.PreemptedFor == c.ForLease {
				continue // a retry
			}
			return precondition("lease %s is already preempted for %s", id, l.PreemptedFor)
		}
		nl := clone(l)
		nl.PreemptAtMs, nl.PreemptedFor, nl.ModifyIndex = c.DeadlineMs, c.ForLease, index
		w.PutLease(nl)
		evs = append(evs, Event{Lease: nl, Type: gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_PREEMPT_NOTICE,
			Message: c.Reason, DeadlineMs: c.DeadlineMs})
	}
	return &Result{}, evs
}

// checkParent refuses an elastic extra whose parent is not a granted
// elastic lease of the same tenant with room for one more slice.
func checkParent(r *state.Reader, l *gpupoolv1.Lease) error {
	if l.Parent == "" {
		return nil
	}
	p := r.Lease(l.Parent)
	if p == nil || p.State != gpupoolv1.LeaseState_LEASE_STATE_GRANTED || p.Tenant != l.Tenant {
		return &ConflictError{Reason: fmt.Sprintf("elastic lease %s is not granted", l.Parent)}
	}
	if l.Class != gpupoolv1.LeaseClass_LEASE_CLASS_PREEMPTIBLE {
		return fmt.Errorf("%w: an elastic extra must be preemptible", ErrInvalid)
	}
	held := int32(len(p.Slices))
	for _, x := range r.Extras(p.Id) {
		if state.Holding(x.State) {
			held += int32(len(x.Slices))
		}
	}
	if held+int32(len(l.Slices)) > p.GetRequest().GetElasticMax() {
		return &ConflictError{Reason: fmt.Sprintf("elastic lease %s already holds %d of at most %d slices", p.Id, held, p.GetRequest().GetElasticMax())}
	}
	return nil
}

// LeaseStateName is the lower-case name of a lease state ("granted").
func LeaseStateName(s gpupoolv1.LeaseState) string {
	return strings.ToLower(strings.TrimPrefix(s.String(), "LEASE_STATE_"))
}

func className(c gpupoolv1.LeaseClass) string {
	if c == gpupoolv1.LeaseClass_LEASE_CLASS_PREEMPTIBLE {
		return "preemptible"
	}
	return "guaranteed"
}

// waitedText renders a wait in ms, to the second ("2m5s", "0s").
func waitedText(ms int64) string {
	return (time.Duration(max(ms, 0)) * time.Millisecond).Round(time.Second).String()
}
