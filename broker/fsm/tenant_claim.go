package fsm

import (
	"fmt"
	"time"

	"github.com/gpupool/gpupool/broker/state"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// TenantClaimedError is a claim on a tenant that another Kubernetes
// cluster holds.
type TenantClaimedError struct {
	// Held is the claim in force.
	Held *gpupoolv1.TenantClaim
	// Cluster is the cluster whose claim was refused.
	Cluster string
}

func (e *TenantClaimedError) Error() string {
	return fmt.Sprintf("tenant %q is claimed by Kubernetes cluster %s since %s, and this is cluster %s: "+
		"two clusters on one tenant would release each other's leases. Give this cluster's controller another --tenant, "+
		"or, if cluster %s is gone for good, start this one once with --take-over-tenant",
		e.Held.GetTenant(), e.Held.GetClusterId(), time.UnixMilli(e.Held.GetClaimedAtMs()).UTC().Format(time.RFC3339),
		e.Cluster, e.Held.GetClusterId())
}

// applyClaimTenant records c's claim unless another cluster holds the
// tenant and c does not take it over. A claim by the cluster that holds
// the tenant changes nothing and returns the claim in force.
func applyClaimTenant(w *state.Writer, c *gpupoolv1.ClaimTenantCommand) *Result {
	claim := c.GetClaim()
	switch {
	case claim.GetTenant() == "":
		return &Result{Err: fmt.Errorf("%w: tenant claim without a tenant", ErrInvalid)}
	case claim.GetClusterId() == "":
		return &Result{Err: fmt.Errorf("%w: claim on tenant %s without a cluster id", ErrInvalid, claim.GetTenant())}
	}
	held := w.TenantClaim(claim.GetTenant())
	switch {
	case held == nil:
	case held.GetClusterId() == claim.GetClusterId():
		return &Result{Claim: held}
	case !c.GetTakeOver():
		return &Result{Err: &TenantClaimedError{Held: held, Cluster: claim.GetClusterId()}}
	}
	nc := clone(claim)
	w.PutTenantClaim(nc)
	return &Result{Claim: nc, Replaced: held}
}
