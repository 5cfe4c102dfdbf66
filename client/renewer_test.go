package client

import (
	"strings"
	"testing"
	"time"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

var noon = time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC).UnixMilli()

// extraLease is an extra of parent with one slice on h2.
func extraLease(id, parent string) *gpupoolv1.Lease {
	return &gpupoolv1.Lease{Id: id, Parent: parent, State: gpupoolv1.LeaseState_LEASE_STATE_GRANTED, Class: gpupoolv1.LeaseClass_LEASE_CLASS_PREEMPTIBLE,
		Slices: []*gpupoolv1.Slice{{Host: "h2", DeviceIndex: 1, MemoryMib: 20480, ComputePercent: 25}}}
}

// grownResp announces extra x.
func grownResp(x *gpupoolv1.Lease) *gpupoolv1.KeepAliveResponse {
	return &gpupoolv1.KeepAliveResponse{LeaseId: x.Id, State: x.State, Event: &gpupoolv1.LeaseEvent{Type: gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_GROWN, Lease: x}}
}

// extraEvent is an event about extra id of parent.
func extraEvent(typ gpupoolv1.LeaseEventType, id, parent, msg string, deadlineMs int64) *gpupoolv1.KeepAliveResponse {
	return &gpupoolv1.KeepAliveResponse{LeaseId: id, Event: &gpupoolv1.LeaseEvent{Type: typ, Lease: extraLease(id, parent), Message: msg, DeadlineMs: deadlineMs}}
}

// endedResp says lease id ended.
func endedResp(id, msg string) *gpupoolv1.KeepAliveResponse {
	return &gpupoolv1.KeepAliveResponse{LeaseId: id, Event: &gpupoolv1.LeaseEvent{Type: gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_ENDED,
		Lease: &gpupoolv1.Lease{Id: id}, Message: msg}}
}

func granted(id string, ttl time.Duration) *gpupoolv1.KeepAliveResponse {
	return &gpupoolv1.KeepAliveResponse{LeaseId: id, TtlMs: ttl.Milliseconds(), State: gpupoolv1.LeaseState_LEASE_STATE_GRANTED}
}

func TestRenewalsPaceEachLeaseAtAThirdOfItsTTL(t *testing.T) {
	t0 := time.Unix(1000, 0)
	r := newRenewSchedule([]string{"l-1", "l-2", "l-1"}, 0, false)
	if got := r.due(t0, true); strings.Join(got, ",") != "l-1,l-2" {
		t.Fatalf("first send = %v, want l-1,l-2 (repeats dropped)", got)
	}
	r.sent("l-1", t0)
	r.sent("l-2", t0)
	if _, ok := r.wake(); ok {
		t.Errorf("wake is set before any answer; want renewals to wait for the TTL")
	}
	r.answer(granted("l-1", 30*time.Second), t0)
	r.answer(granted("l-2", 900*time.Millisecond), t0)
	if at, _ := r.wake(); !at.Equal(t0.Add(minRenewEvery)) {
		t.Errorf("wake = %v, want t0+500ms (a third of 900ms is under the minimum)", at.Sub(t0))
	}
	if got := r.due(t0.Add(time.Second), false); strings.Join(got, ",") != "l-2" {
		t.Errorf("due at t0+1s = %v, want l-2", got)
	}
	if got := r.due(t0.Add(10*time.Second), false); strings.Join(got, ",") != "l-1,l-2" {
		t.Errorf("due at t0+10s = %v, want l-1,l-2", got)
	}
	r.answer(&gpupoolv1.KeepAliveResponse{LeaseId: "l-2", Error: "lease l-2 not found"}, t0)
	r.answer(granted("l-other", time.Second), t0)
	if r.done() || strings.Join(r.pending(), ",") != "l-1" {
		t.Errorf("pending = %v, want l-1 only", r.pending())
	}
	r.answer(&gpupoolv1.KeepAliveResponse{Event: &gpupoolv1.LeaseEvent{Type: gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_ENDED,
		Lease: &gpupoolv1.Lease{Id: "l-1"}, Message: "revoked"}}, t0)
	if !r.done() {
		t.Errorf("an ended lease is still renewed")
	}
	if err := r.err(); err == nil || !strings.Contains(err.Error(), "2 of 2 leases not renewed: l-1: lease ended: revoked; l-2: lease l-2 not found") {
		t.Errorf("err = %v, want both failures in order", err)
	}
}

func TestRenewalsAtAFixedInterval(t *testing.T) {
	t0 := time.Unix(1000, 0)
	r := newRenewSchedule([]string{"l-1"}, 10*time.Second, false)
	r.sent("l-1", t0)
	if at, ok := r.wake(); !ok || !at.Equal(t0.Add(10*time.Second)) {
		t.Errorf("wake = %v, %v; want t0+10s even before an answer", at, ok)
	}
	r.answer(granted("l-1", time.Hour), t0.Add(time.Second))
	if at, _ := r.wake(); !at.Equal(t0.Add(10 * time.Second)) {
		t.Errorf("an answer moved the fixed schedule to %v", at.Sub(t0))
	}
}

func TestRenewalsOnceDropsEachLeaseWhenAnswered(t *testing.T) {
	r := newRenewSchedule([]string{"l-1", "l-2"}, 0, true)
	r.answer(granted("l-1", time.Minute), time.Time{})
	if r.done() {
		t.Fatal("done before l-2 was answered")
	}
	r.answer(granted("l-2", time.Minute), time.Time{})
	if !r.done() || r.err() != nil {
		t.Errorf("done = %v, err = %v; want done with no error", r.done(), r.err())
	}
}

func TestRenewalsFollowTheExtrasOfAnElasticLease(t *testing.T) {
	t0 := time.Unix(1000, 0)
	r := newRenewSchedule([]string{"l-1", "l-2"}, 0, false)
	r.sent("l-1", t0)
	r.sent("l-2", t0)
	r.answer(granted("l-1", 30*time.Second), t0)
	r.answer(granted("l-2", 30*time.Second), t0)

	r.answer(grownResp(extraLease("x-1", "l-1")), t0)
	r.answer(grownResp(extraLease("x-2", "l-1")), t0)
	r.answer(grownResp(extraLease("x-3", "l-other")), t0) // not a lease being renewed
	if got := r.due(t0, false); strings.Join(got, ",") != "x-1,x-2" {
		t.Fatalf("due after growing = %v, want the new extras at once", got)
	}
	if !r.repeated(grownResp(extraLease("x-1", "l-1"))) || r.repeated(grownResp(extraLease("x-4", "l-1"))) {
		t.Errorf("repeated: want true for x-1 (known), false for x-4 (new)")
	}
	r.sent("x-1", t0)
	r.sent("x-2", t0)
	r.answer(granted("x-1", 30*time.Second), t0)
	r.answer(granted("x-2", 30*time.Second), t0)
	if got := r.due(t0.Add(10*time.Second), false); strings.Join(got, ",") != "l-1,l-2,x-1,x-2" {
		t.Errorf("due at t0+10s = %v, want the leases given, then the extras", got)
	}
	if got := r.due(t0, true); strings.Join(got, ",") != "l-1,l-2,x-1,x-2" {
		t.Errorf("due on a new stream = %v, want the extras too", got)
	}

	// An extra that ends, or cannot be renewed, is dropped quietly.
	r.answer(extraEvent(gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_ENDED, "x-1", "l-1", "revoked", 0), t0)
	r.answer(&gpupoolv1.KeepAliveResponse{LeaseId: "x-2", Error: "lease x-2 not found"}, t0)
	if got := r.due(t0, true); strings.Join(got, ",") != "l-1,l-2" {
		t.Errorf("due after the extras ended = %v, want l-1,l-2", got)
	}
	if err := r.err(); err != nil {
		t.Errorf("err = %v, want none: an extra's end is not a failure", err)
	}

	// A lease that ends takes its extras with it.
	r.answer(grownResp(extraLease("x-5", "l-1")), t0)
	r.answer(endedResp("l-1", "released"), t0)
	if got := r.due(t0, true); strings.Join(got, ",") != "l-2" {
		t.Errorf("due after l-1 ended = %v, want l-2 alone", got)
	}
	if err := r.err(); err == nil || !strings.Contains(err.Error(), "1 of 2 leases not renewed: l-1: lease ended: released") {
		t.Errorf("err = %v, want l-1's end counted among the leases given", err)
	}
}

func TestRenewalsOnceDoesNotTakeOnExtras(t *testing.T) {
	r := newRenewSchedule([]string{"l-1"}, 0, true)
	r.answer(grownResp(extraLease("x-1", "l-1")), time.Time{})
	if got := r.due(time.Time{}, true); strings.Join(got, ",") != "l-1" {
		t.Errorf("due = %v, want l-1 alone with --once", got)
	}
}
