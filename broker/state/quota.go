package state

import (
	"fmt"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// Holding reports whether a lease in state s holds capacity: granted, or
// releasing until FreeLease frees it. Device allocation and tenant usage
// count exactly these leases.
func Holding(s gpupoolv1.LeaseState) bool {
	return s == gpupoolv1.LeaseState_LEASE_STATE_GRANTED || s == gpupoolv1.LeaseState_LEASE_STATE_RELEASING
}

// holdingTenantIndex indexes a lease under its tenant while it holds
// capacity (see Holding), so a tenant's usage is summed over its holding
// leases only, however many ended ones it has.
type holdingTenantIndex struct{}

func (holdingTenantIndex) FromObject(obj any) (bool, []byte, error) {
	l, ok := obj.(*gpupoolv1.Lease)
	if !ok {
		return false, nil, fmt.Errorf("state: holding tenant index: got %T", obj)
	}
	if !Holding(l.State) {
		return false, nil, nil
	}
	return true, []byte(l.Tenant + "\x00"), nil
}

func (holdingTenantIndex) FromArgs(args ...any) ([]byte, error) {
	if len(args) != 1 {
		return nil, fmt.Errorf("state: holding tenant index takes one tenant, got %d args", len(args))
	}
	s, ok := args[0].(string)
	if !ok {
		return nil, fmt.Errorf("state: holding tenant index: got %T, want string", args[0])
	}
	return []byte(s + "\x00"), nil
}

// HoldingLeases returns the tenant's leases that hold capacity (granted or
// releasing), by id.
func (r *Reader) HoldingLeases(tenant string) []*gpupoolv1.Lease {
	return all[gpupoolv1.Lease](r, tableLeases, indexTenant, tenant)
}

// Quota returns a tenant's quota, or nil when the tenant has none.
func (r *Reader) Quota(tenant string) *gpupoolv1.Quota {
	return first[gpupoolv1.Quota](r, tableQuotas, indexID, tenant)
}

// Quotas returns every quota, by tenant.
func (r *Reader) Quotas() []*gpupoolv1.Quota {
	return all[gpupoolv1.Quota](r, tableQuotas, indexID)
}

// PutQuota inserts or replaces a tenant's quota.
func (w *Writer) PutQuota(q *gpupoolv1.Quota) { w.insert(tableQuotas, q) }

// DeleteQuota removes a tenant's quota.
func (w *Writer) DeleteQuota(q *gpupoolv1.Quota) {
	if err := w.txn.Delete(tableQuotas, q); err != nil {
		panic(fmt.Sprintf("state: delete quota of %s: %v", q.Tenant, err))
	}
}
