package fsm

import (
	"fmt"
	"strconv"

	"github.com/gpupool/gpupool/broker/lease"
	"github.com/gpupool/gpupool/broker/state"
	"github.com/gpupool/gpupool/internal/quantity"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// QuotaError is a grant that would take its tenant over quota in one
// dimension. Apply refuses such a grant in the same entry that would have
// granted it, so concurrent grants can never exceed a quota together.
type QuotaError struct {
	Tenant string
	// Dimension is "gpus", "memory" or "compute".
	Dimension string
	// Used is what the tenant holds now, Quota its limit and Need what the
	// refused lease would add, in the dimension's unit (GPUs, MiB, percent).
	Used, Quota, Need int64
}

func (e *QuotaError) Error() string {
	f := formatterOf(e.Dimension)
	return fmt.Sprintf("tenant %s: %s %s of %s quota used, the lease needs %s",
		e.Tenant, e.Dimension, f(e.Used), f(e.Quota), f(e.Need))
}

// LeaseUsage is what a lease counts against its tenant's quota: an
// exclusive slice 1 GPU, its memory (the whole device's) and its compute
// (100 %); a fractional slice its memory and compute, and no GPU.
func LeaseUsage(l *gpupoolv1.Lease) *gpupoolv1.TenantUsage {
	u := &gpupoolv1.TenantUsage{Tenant: l.GetTenant(), Leases: 1}
	for _, s := range l.GetSlices() {
		if s.Exclusive {
			u.Gpus++
		}
		u.MemoryMib += s.MemoryMib
		u.ComputePercent += int64(s.ComputePercent)
	}
	return u
}

// TenantUsage sums LeaseUsage over the tenant's leases that hold capacity
// (granted or releasing, as device allocation counts them). Its cost is
// linear in those leases.
func TenantUsage(r *state.Reader, tenant string) *gpupoolv1.TenantUsage {
	u := &gpupoolv1.TenantUsage{Tenant: tenant}
	for _, l := range r.HoldingLeases(tenant) {
		lu := LeaseUsage(l)
		u.Gpus += lu.Gpus
		u.MemoryMib += lu.MemoryMib
		u.ComputePercent += lu.ComputePercent
		u.Leases++
	}
	return u
}

// CheckQuota returns a *QuotaError when granting l would take its tenant
// over quota in a dimension the lease needs, else nil. A tenant without a
// quota, and a dimension whose quota is 0, are unlimited.
func CheckQuota(r *state.Reader, l *gpupoolv1.Lease) error {
	q := r.Quota(l.GetTenant())
	if q == nil {
		return nil
	}
	used := TenantUsage(r, l.Tenant)
	for _, d := range dimensions(q, used, LeaseUsage(l)) {
		if d.quota > 0 && d.need > 0 && d.used+d.need > d.quota {
			return &QuotaError{Tenant: l.Tenant, Dimension: d.name, Used: d.used, Quota: d.quota, Need: d.need}
		}
	}
	return nil
}

// OverQuota says, one sentence per dimension, where used is above q: what
// an operator who just lowered a quota needs to know.
func OverQuota(q *gpupoolv1.Quota, used *gpupoolv1.TenantUsage) []string {
	var out []string
	for _, d := range dimensions(q, used, &gpupoolv1.TenantUsage{}) {
		if d.quota > 0 && d.used > d.quota {
			f := formatterOf(d.name)
			out = append(out, fmt.Sprintf("tenant %s: %s %s used is over the new %s quota by %s; its leases keep their capacity, but new grants are refused until usage is under the quota",
				q.Tenant, d.name, f(d.used), f(d.quota), f(d.used-d.quota)))
		}
	}
	return out
}

// ValidateQuota checks a quota on its own: a tenant, and no negative limit.
// The error is a *lease.FieldError naming the field.
func ValidateQuota(q *gpupoolv1.Quota) error {
	if q.GetTenant() == "" {
		return &lease.FieldError{Field: "quota.tenant", Value: `""`, Allowed: "is required"}
	}
	for _, d := range dimensions(q, &gpupoolv1.TenantUsage{}, &gpupoolv1.TenantUsage{}) {
		if d.quota < 0 {
			return &lease.FieldError{Field: "quota." + d.field, Value: d.quota, Allowed: "must be 0 (unlimited) or more"}
		}
	}
	return nil
}

// dimension is one limited quantity of a quota, with the tenant's use and a
// lease's need of it.
type dimension struct {
	name, field       string
	quota, used, need int64
}

func dimensions(q *gpupoolv1.Quota, used, need *gpupoolv1.TenantUsage) []dimension {
	return []dimension{
		{"gpus", "gpus", int64(q.GetGpus()), int64(used.GetGpus()), int64(need.GetGpus())},
		{"memory", "memory_mib", q.GetMemoryMib(), used.GetMemoryMib(), need.GetMemoryMib()},
		{"compute", "compute_percent", q.GetComputePercent(), used.GetComputePercent(), need.GetComputePercent()},
	}
}

// formatterOf formats an amount of a dimension the way users write it:
// 8, 320 GiB, 800%.
func formatterOf(dimension string) func(int64) string {
	switch dimension {
	case "memory":
		return quantity.FormatMiB
	case "compute":
		return func(n int64) string { return strconv.FormatInt(n, 10) + "%" }
	}
	return func(n int64) string { return strconv.FormatInt(n, 10) }
}

// applySetQuota sets or, without a quota, removes a tenant's quota.
// Lowering a quota below the tenant's usage is allowed: it refuses new
// grants, it never ends leases.
func applySetQuota(w *state.Writer, c *gpupoolv1.SetQuotaCommand) *Result {
	if c.Tenant == "" {
		return &Result{Err: fmt.Errorf("%w: quota without a tenant", ErrInvalid)}
	}
	if c.Quota == nil {
		old := w.Quota(c.Tenant)
		if old == nil {
			return &Result{Err: fmt.Errorf("tenant %q has no quota: %w", c.Tenant, ErrNotFound)}
		}
		w.DeleteQuota(old)
		return &Result{}
	}
	q := clone(c.Quota)
	q.Tenant = c.Tenant
	if err := ValidateQuota(q); err != nil {
		return &Result{Err: err}
	}
	w.PutQuota(q)
	return &Result{}
}
