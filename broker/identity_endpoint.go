package broker

import (
	"context"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
	"github.com/gpupool/gpupool/protocol"
)

// ResetHostIdentity forgets a host's data-plane address and certificate
// fingerprint, so that its next registration may set new ones while it
// holds leases.
func (e poolService) ResetHostIdentity(ctx context.Context, req *gpupoolv1.ResetHostIdentityRequest) (*gpupoolv1.ResetHostIdentityResponse, error) {
	switch {
	case req.GetHostId() == "":
		return nil, refuse(ErrInvalid, "host_id: is required; see 'gpupool host ls'")
	case len(req.GetReason()) > 256:
		return nil, refusef(ErrInvalid, "reason: %d bytes, must be at most 256", len(req.GetReason()))
	}
	if conn, fctx, err := e.membership.leaderConn(ctx); err != nil {
		return nil, err
	} else if conn != nil {
		return gpupoolv1.NewPoolServiceClient(conn).ResetHostIdentity(fctx, req)
	}
	if e.fsm.State().Host(req.HostId) == nil {
		return nil, refusef(ErrNotFound, "host %q: not found; see 'gpupool host ls'", req.HostId)
	}
	res, err := e.apply(&gpupoolv1.ResetHostIdentityCommand{HostId: req.HostId, Reason: req.Reason, NowMs: e.nowMs(), Actor: callerFrom(ctx).actor()})
	if err != nil {
		return nil, err
	}
	resp := &gpupoolv1.ResetHostIdentityResponse{Host: res.Host}
	for _, l := range e.fsm.State().HostLeases(req.HostId) {
		if !ended(l.State) {
			resp.Leases++
		}
	}
	e.log.Warn("host identity reset: its next registration sets a new data-plane address and certificate", "host", req.HostId,
		"leases", resp.Leases, "by", protocol.ActorText(callerFrom(ctx).actor()))
	return resp, nil
}
