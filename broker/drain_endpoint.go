package broker

import (
	"context"
	"fmt"

	"github.com/gpupool/gpupool/broker/fsm"
	"github.com/gpupool/gpupool/broker/planner"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
	"github.com/gpupool/gpupool/protocol"
)

// validateDrain checks a drain request's fields and their combination.
func validateDrain(req *gpupoolv1.DrainHostRequest) error {
	switch {
	case req.HostId == "":
		return refuse(ErrInvalid, "host_id: is required; see 'gpupool host ls'")
	case len(req.Reason) > protocol.MaxDrainReasonLen:
		return refusef(ErrInvalid, "reason: %d bytes, must be at most %d", len(req.Reason), protocol.MaxDrainReasonLen)
	case req.DeadlineAfterMs < 0 || req.DeadlineAfterMs > protocol.MaxDrainDeadline.Milliseconds():
		return refusef(ErrInvalid, "deadline_after_ms %d: must be between 0 (no deadline) and %d (%s)",
			req.DeadlineAfterMs, protocol.MaxDrainDeadline.Milliseconds(), protocol.MaxDrainDeadline)
	case req.Force && req.DeadlineAfterMs != 0:
		return refusef(ErrInvalid, "force true with deadline_after_ms %d: force revokes every lease now, so give one or the other", req.DeadlineAfterMs)
	case req.Cancel && (req.Force || req.DeadlineAfterMs != 0 || req.KeepDeadline):
		return refuse(ErrInvalid, "cancel true: cannot be combined with force, deadline_after_ms or keep_deadline")
	case req.Force && req.KeepDeadline:
		return refuse(ErrInvalid, "force true with keep_deadline true: force revokes every lease now, so give one or the other")
	}
	return nil
}

func (e poolService) DrainHost(ctx context.Context, req *gpupoolv1.DrainHostRequest) (*gpupoolv1.DrainHostResponse, error) {
	if err := validateDrain(req); err != nil {
		return nil, err
	}
	if conn, fctx, err := e.membership.leaderConn(ctx); err != nil {
		return nil, err
	} else if conn != nil {
		return gpupoolv1.NewPoolServiceClient(conn).DrainHost(fctx, req)
	}
	if e.fsm.State().Host(req.HostId) == nil {
		return nil, refusef(ErrNotFound, "host %q: not found; see 'gpupool host ls'", req.HostId)
	}
	now := e.nowMs()
	c := &gpupoolv1.DrainHostCommand{HostId: req.HostId, Cancel: req.Cancel, Reason: req.Reason, Force: req.Force, KeepDeadline: req.KeepDeadline, NowMs: now,
		Actor: callerFrom(ctx).actor()}
	if req.DeadlineAfterMs > 0 {
		c.DeadlineMs = now + req.DeadlineAfterMs
	}
	res, err := e.apply(c)
	if err != nil {
		return nil, err
	}
	resp := &gpupoolv1.DrainHostResponse{Host: res.Host}
	for _, l := range e.fsm.State().HostLeases(req.HostId) {
		if !ended(l.State) {
			resp.Leases++
		}
	}
	e.log.Info("host drain", "host", req.HostId, "cancel", req.Cancel, "force", req.Force, "deadline", fsm.DeadlineText(res.Host.GetDrain().GetDeadlineMs()),
		"status", fsm.HostStatusName(res.Host.GetStatus()), "leases", resp.Leases, "by", protocol.ActorText(callerFrom(ctx).actor()))
	return resp, nil
}

func (e poolService) SetEligibility(ctx context.Context, req *gpupoolv1.SetEligibilityRequest) (*gpupoolv1.SetEligibilityResponse, error) {
	if req.HostId == "" {
		return nil, refuse(ErrInvalid, "host_id: is required; see 'gpupool host ls'")
	}
	if conn, fctx, err := e.membership.leaderConn(ctx); err != nil {
		return nil, err
	} else if conn != nil {
		return gpupoolv1.NewPoolServiceClient(conn).SetEligibility(fctx, req)
	}
	st := e.fsm.State()
	h := st.Host(req.HostId)
	if h == nil {
		return nil, refusef(ErrNotFound, "host %q: not found; see 'gpupool host ls'", req.HostId)
	}
	if req.Eligible && h.Drain != nil && h.Status != gpupoolv1.HostStatus_HOST_STATUS_DRAINED {
		// Draining, or down before it drained: enabling would drop a
		// drain that is still going (and its deadline).
		left := 0
		for _, l := range st.HostLeases(h.Id) {
			if !ended(l.State) {
				left++
			}
		}
		what := fmt.Sprintf("draining with %s left", planner.Plural(left, "lease", "leases"))
		if h.Status != gpupoolv1.HostStatus_HOST_STATUS_DRAINING {
			what = fmt.Sprintf("%s and not drained yet (%s left)", fsm.HostStatusName(h.Status), planner.Plural(left, "lease", "leases"))
		}
		return nil, refuse(ErrPrecondition, fmt.Sprintf(
			"host %s is %s: enable it once it is drained, or cancel the drain with 'gpupool host drain %s --cancel'",
			h.Id, what, h.Id))
	}
	res, err := e.apply(&gpupoolv1.SetHostEligibilityCommand{HostId: req.HostId, Eligible: req.Eligible, NowMs: e.nowMs(),
		Actor: callerFrom(ctx).actor()})
	if err != nil {
		return nil, err
	}
	e.log.Info("host eligibility", "host", req.HostId, "eligible", req.Eligible, "status", fsm.HostStatusName(res.Host.GetStatus()))
	return &gpupoolv1.SetEligibilityResponse{Host: res.Host}, nil
}
