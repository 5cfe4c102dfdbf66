package state

import (
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// TenantClaim returns the claim on tenant, or nil when no cluster has
// claimed it.
func (r *Reader) TenantClaim(tenant string) *gpupoolv1.TenantClaim {
	return first[gpupoolv1.TenantClaim](r, tableClaims, indexID, tenant)
}

// TenantClaims returns every tenant claim, by tenant.
func (r *Reader) TenantClaims() []*gpupoolv1.TenantClaim {
	return all[gpupoolv1.TenantClaim](r, tableClaims, indexID)
}

// PutTenantClaim inserts or replaces the claim on a tenant.
func (w *Writer) PutTenantClaim(c *gpupoolv1.TenantClaim) { w.insert(tableClaims, c) }
