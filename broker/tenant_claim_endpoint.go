package broker

import (
	"context"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
	"github.com/gpupool/gpupool/protocol"
)

// maxClusterIDLen bounds a tenant claim's cluster id (a Kubernetes UID is
// 36 characters).
const maxClusterIDLen = 128

// ClaimTenant records that one Kubernetes cluster manages the tenant's
// leases; see gpupoolv1.TenantClaim.
func (e leaseService) ClaimTenant(ctx context.Context, req *gpupoolv1.ClaimTenantRequest) (*gpupoolv1.ClaimTenantResponse, error) {
	if err := protocol.ValidateTenant("tenant", req.GetTenant()); err != nil {
		return nil, err
	}
	switch n := len(req.GetClusterId()); {
	case n == 0:
		return nil, refuse(ErrInvalid, "cluster_id: is required (the controller sends its kube-system namespace's UID)")
	case n > maxClusterIDLen:
		return nil, refusef(ErrInvalid, "cluster_id: %d bytes, must be at most %d", n, maxClusterIDLen)
	}
	c := callerFrom(ctx)
	if err := c.mayActFor(req.GetTenant(), "claim tenant"); err != nil {
		return nil, err
	}
	if conn, fctx, err := e.membership.leaderConn(ctx); err != nil {
		return nil, err
	} else if conn != nil {
		return gpupoolv1.NewLeaseServiceClient(conn).ClaimTenant(fctx, req)
	}
	res, err := e.apply(&gpupoolv1.ClaimTenantCommand{
		Claim:    &gpupoolv1.TenantClaim{Tenant: req.GetTenant(), ClusterId: req.GetClusterId(), ClaimedAtMs: e.nowMs(), By: c.actor()},
		TakeOver: req.GetTakeOver(),
	})
	if err != nil {
		return nil, err
	}
	if res.Replaced != nil {
		e.log.Warn("tenant taken over by another Kubernetes cluster", "tenant", req.GetTenant(),
			"cluster", req.GetClusterId(), "previous_cluster", res.Replaced.GetClusterId(), "by", protocol.ActorText(c.actor()))
	}
	return &gpupoolv1.ClaimTenantResponse{Claim: res.Claim, Replaced: res.Replaced}, nil
}
