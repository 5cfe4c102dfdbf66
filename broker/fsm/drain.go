package fsm

import (
	"cmp"
	"fmt"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/gpupool/gpupool/broker/state"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// A host's drain lives in Host.drain. While the record exists the host is
// ineligible and, unless down, its status follows from the leases on it:
// draining while any lease (granted or releasing) holds capacity there,
// drained once the last one is freed. Status is derived in Apply only, so
// every server agrees on it and a new leader needs nothing from the old.

// liveOnHost counts the leases that still hold capacity on hostID.
func liveOnHost(r *state.Reader, hostID string) int {
	n := 0
	for _, l := range r.HostLeases(hostID) {
		switch l.State {
		case gpupoolv1.LeaseState_LEASE_STATE_PENDING, gpupoolv1.LeaseState_LEASE_STATE_GRANTED, gpupoolv1.LeaseState_LEASE_STATE_RELEASING:
			n++
		}
	}
	return n
}

// drainStatus is the status of an up host whose drain record exists.
func drainStatus(r *state.Reader, hostID string) gpupoolv1.HostStatus {
	if liveOnHost(r, hostID) > 0 {
		return gpupoolv1.HostStatus_HOST_STATUS_DRAINING
	}
	return gpupoolv1.HostStatus_HOST_STATUS_DRAINED
}

// upStatus is the status of a host that is up: ready, or, while its drain
// record exists, draining or drained.
func upStatus(r *state.Reader, h *gpupoolv1.Host) gpupoolv1.HostStatus {
	if h.GetDrain() == nil {
		return gpupoolv1.HostStatus_HOST_STATUS_READY
	}
	return drainStatus(r, h.Id)
}

// settleDrains moves the draining hosts of a lease just freed to drained
// when no lease is left on them.
func settleDrains(w *state.Writer, l *gpupoolv1.Lease, nowMs int64) []Event {
	var evs []Event
	for _, id := range state.LeaseHosts(l) {
		old := w.Host(id)
		if old == nil || old.Drain == nil || old.Status != gpupoolv1.HostStatus_HOST_STATUS_DRAINING || liveOnHost(&w.Reader, id) > 0 {
			continue
		}
		h := clone(old)
		h.Status, h.StatusChangedAtMs = gpupoolv1.HostStatus_HOST_STATUS_DRAINED, nowMs
		w.PutHost(h)
		auditHost(w, gpupoolv1.AuditKind_AUDIT_KIND_HOST_DRAINED, id, nil, nowMs, "the last lease on the host ended")
		evs = append(evs, Event{Host: h})
	}
	return evs
}

// DeadlineText is how a drain deadline reads in notices and reasons.
func DeadlineText(deadlineMs int64) string {
	if deadlineMs == 0 {
		return "no deadline"
	}
	return "deadline " + time.UnixMilli(deadlineMs).UTC().Format(time.RFC3339)
}

// DrainNotice is the DRAIN_NOTICE telling the holder of l, a lease on h,
// that h is draining and when the lease is revoked. h must have a drain.
// Apply sends it when a drain starts or its deadline changes; the leader
// sends it again to each KeepAlive stream that starts renewing l later.
func DrainNotice(h *gpupoolv1.Host, l *gpupoolv1.Lease) Event {
	return Event{
		Lease: l, Type: gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_DRAIN_NOTICE, DeadlineMs: h.Drain.DeadlineMs, Actor: h.Drain.By,
		Message: fmt.Sprintf("host %s draining (%s), %s: release the lease before then or it is revoked", h.Id, h.Drain.Reason, DeadlineText(h.Drain.DeadlineMs)),
	}
}

// applyDrainHost starts, updates or (with cancel) ends a host's drain.
//
// Starting or updating records the drain, makes the host ineligible, and
// revokes at once the host's preemptible leases, or every lease with force.
// Leases that stay get a DRAIN_NOTICE carrying the deadline whenever the
// drain starts or its deadline changes. A down host stays down; its status
// follows the record once it is back.
func applyDrainHost(w *state.Writer, index uint64, c *gpupoolv1.DrainHostCommand) (*Result, []Event) {
	old := w.Host(c.HostId)
	if old == nil {
		return &Result{Err: fmt.Errorf("host %q: %w", c.HostId, ErrNotFound)}, nil
	}
	if c.IfDeadlineMs != 0 && (old.Drain == nil || old.Drain.Force || old.Drain.DeadlineMs != c.IfDeadlineMs) {
		// A deadline timer for a drain that was cancelled, changed or
		// already forced: nothing to do.
		return &Result{Host: old}, nil
	}
	if c.Cancel {
		return applyCancelDrain(w, old, c)
	}
	if c.DeadlineMs < 0 || (c.Force && (c.DeadlineMs != 0 || c.KeepDeadline)) {
		return &Result{Err: fmt.Errorf("%w: drain of host %s with deadline %d, force %t and keep_deadline %t", ErrInvalid, c.HostId, c.DeadlineMs, c.Force, c.KeepDeadline)}, nil
	}
	h := clone(old)
	if h.Drain == nil {
		h.Drain = &gpupoolv1.HostDrain{StartedAtMs: c.NowMs, Reason: "drain requested"}
	}
	// keep_deadline leaves a drain under way as it is (a new reason only);
	// deadline_ms is for a drain this command starts.
	if c.IfDeadlineMs == 0 && (old.Drain == nil || !c.KeepDeadline) {
		h.Drain.DeadlineMs = c.DeadlineMs
	}
	h.Drain.Reason = cmp.Or(c.Reason, h.Drain.Reason)
	if c.Actor != nil && c.IfDeadlineMs == 0 {
		h.Drain.By = clone(c.Actor)
	}
	h.Drain.Force = h.Drain.Force || c.Force
	h.Eligible = false
	h.StatusReason = h.Drain.Reason
	renotify := old.Drain == nil || old.Drain.DeadlineMs != h.Drain.DeadlineMs

	why := "preemptible leases are revoked at once"
	switch {
	case c.IfDeadlineMs != 0:
		why = "the drain deadline passed"
	case c.Force:
		why = "forced"
	}
	var evs []Event
	var revoked []*gpupoolv1.Lease
	for _, l := range w.HostLeases(h.Id) {
		if l.State != gpupoolv1.LeaseState_LEASE_STATE_GRANTED && l.State != gpupoolv1.LeaseState_LEASE_STATE_PENDING {
			continue
		}
		if h.Drain.Force || l.Class == gpupoolv1.LeaseClass_LEASE_CLASS_PREEMPTIBLE {
			nl := endLease(l, index, gpupoolv1.LeaseState_LEASE_STATE_REVOKED, fmt.Sprintf("host %s drained: %s", h.Id, why), c.NowMs)
			nl.EndedBy = actorOr(c.Actor)
			w.PutLease(nl)
			revoked = append(revoked, nl)
			evs = append(evs, Event{Lease: nl, Type: gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_RELEASING})
			continue
		}
		if renotify {
			evs = append(evs, DrainNotice(h, l))
		}
	}
	if old.Status != gpupoolv1.HostStatus_HOST_STATUS_DOWN {
		// After the revocations above: a revoked lease holds capacity
		// until it is freed, so the host is draining until then.
		if s := drainStatus(&w.Reader, h.Id); s != old.Status {
			h.Status, h.StatusChangedAtMs = s, c.NowMs
		}
	}
	if proto.Equal(h, old) && len(evs) == 0 {
		return &Result{Host: old}, nil
	}
	w.PutHost(h)
	switch {
	case c.IfDeadlineMs != 0:
		auditHost(w, gpupoolv1.AuditKind_AUDIT_KIND_HOST_DRAIN_UPDATED, h.Id, nil, c.NowMs, "the drain deadline passed: the leases left are revoked")
	case old.Drain == nil:
		auditHost(w, gpupoolv1.AuditKind_AUDIT_KIND_HOST_DRAIN_STARTED, h.Id, c.Actor, c.NowMs, drainText(h.Drain))
	default:
		auditHost(w, gpupoolv1.AuditKind_AUDIT_KIND_HOST_DRAIN_UPDATED, h.Id, c.Actor, c.NowMs, drainText(h.Drain))
	}
	for _, l := range revoked {
		auditLeaseEnd(w, l, leaseEndKind(l.EndState), c.NowMs)
	}
	if h.Status == gpupoolv1.HostStatus_HOST_STATUS_DRAINED && old.Status != gpupoolv1.HostStatus_HOST_STATUS_DRAINED {
		auditHost(w, gpupoolv1.AuditKind_AUDIT_KIND_HOST_DRAINED, h.Id, nil, c.NowMs, "no lease on the host")
	}
	return &Result{Host: h}, append([]Event{{Host: h}}, evs...)
}

// applyCancelDrain drops the drain record: the host is ready (unless down)
// and eligible. Leases already revoked stay revoked. A host without a drain
// is refused: making it eligible would undo 'host eligibility --disable'.
func applyCancelDrain(w *state.Writer, old *gpupoolv1.Host, c *gpupoolv1.DrainHostCommand) (*Result, []Event) {
	if old.Drain == nil {
		return precondition("host %s is not draining", old.Id)
	}
	h := clone(old)
	h.Drain = nil
	h.Eligible = true
	switch old.Status {
	case gpupoolv1.HostStatus_HOST_STATUS_DRAINING, gpupoolv1.HostStatus_HOST_STATUS_DRAINED:
		h.Status, h.StatusReason, h.StatusChangedAtMs = gpupoolv1.HostStatus_HOST_STATUS_READY, cmp.Or(c.Reason, "drain cancelled"), c.NowMs
	}
	if proto.Equal(h, old) {
		return &Result{Host: old}, nil
	}
	w.PutHost(h)
	auditHost(w, gpupoolv1.AuditKind_AUDIT_KIND_HOST_DRAIN_CANCELLED, h.Id, c.Actor, c.NowMs, cmp.Or(c.Reason, "drain cancelled"))
	return &Result{Host: h}, []Event{{Host: h}}
}

// applySetHostEligibility makes a host eligible or not. Enabling a host
// ends its drain record, which needs the drain to be over: a host with a
// drain that is not drained (draining, or down before it drained) is
// refused (cancel the drain instead).
func applySetHostEligibility(w *state.Writer, c *gpupoolv1.SetHostEligibilityCommand) (*Result, []Event) {
	old := w.Host(c.HostId)
	if old == nil {
		return &Result{Err: fmt.Errorf("host %q: %w", c.HostId, ErrNotFound)}, nil
	}
	h := clone(old)
	h.Eligible = c.Eligible
	if c.Eligible && old.Drain != nil {
		if old.Status != gpupoolv1.HostStatus_HOST_STATUS_DRAINED {
			return precondition("host %s is %s and not drained yet: cancel the drain with 'gpupool host drain %s --cancel' to make it eligible now",
				old.Id, HostStatusName(old.Status), old.Id)
		}
		h.Drain = nil
		h.Status, h.StatusReason, h.StatusChangedAtMs = gpupoolv1.HostStatus_HOST_STATUS_READY, "enabled after drain", c.NowMs
	}
	if proto.Equal(h, old) {
		return &Result{Host: old}, nil
	}
	w.PutHost(h)
	detail := "not eligible for new leases"
	if h.Eligible {
		detail = "eligible for new leases"
		if old.Drain != nil {
			detail += "; its drain is over"
		}
	}
	auditHost(w, gpupoolv1.AuditKind_AUDIT_KIND_HOST_ELIGIBILITY, h.Id, c.Actor, c.NowMs, detail)
	return &Result{Host: h}, []Event{{Host: h}}
}
