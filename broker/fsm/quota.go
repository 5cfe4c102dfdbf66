package fsm

import (
	"cmp"
	"fmt"
	"math/big"
	"strconv"

	"github.com/gpupool/gpupool/broker/state"
	"github.com/gpupool/gpupool/internal/quantity"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
	"github.com/gpupool/gpupool/protocol"
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

// LeaseUsage is what a lease counts against its tenant's quota, with its
// GPUs rounded up to whole ones (see addGPUShare).
func LeaseUsage(r *state.Reader, l *gpupoolv1.Lease) *gpupoolv1.TenantUsage {
	return leaseUsage(r, l).proto(l.GetTenant())
}

// TenantUsage sums what the tenant's leases that hold capacity (granted or
// releasing, as device allocation counts them) count, with the GPU shares
// summed exactly and rounded up once, not per lease. Its cost is linear in those leases.
func TenantUsage(r *state.Reader, tenant string) *gpupoolv1.TenantUsage {
	return tenantUsage(r, tenant).proto(tenant)
}

// usage is what leases count against a quota, with GPUs kept exact: a
// tenant's GPUs are its slices' shares summed, then rounded up.
type usage struct {
	gpus            shares
	memory, compute int64
	leases          int32
}

// shares is an exact sum of GPU shares without an allocation per share:
// whole GPUs, percents of one (compute shares) and, per device memory
// size, MiB of it (memory shares). A pool has few device sizes, so fracs
// stays short.
type shares struct {
	whole, percent int64
	fracs          []frac
}

// frac is num MiB of devices of den MiB.
type frac struct{ num, den int64 }

func (g *shares) addFrac(num, den int64) {
	for i := range g.fracs {
		if g.fracs[i].den == den {
			g.fracs[i].num += num
			return
		}
	}
	g.fracs = append(g.fracs, frac{num, den})
}

// add adds sign × o to g (sign 1 or -1).
func (g *shares) add(o shares, sign int64) {
	g.whole += sign * o.whole
	g.percent += sign * o.percent
	for _, f := range o.fracs {
		g.addFrac(sign*f.num, f.den)
	}
}

// ceil is the sum rounded up to whole GPUs.
func (g shares) ceil() int64 {
	sum := new(big.Rat).SetFrac64(g.whole*100+g.percent, 100)
	for _, f := range g.fracs {
		sum.Add(sum, new(big.Rat).SetFrac64(f.num, f.den))
	}
	q, m := new(big.Int).QuoRem(sum.Num(), sum.Denom(), new(big.Int))
	if m.Sign() > 0 {
		q.Add(q, big.NewInt(1))
	}
	return q.Int64()
}

func (u *usage) add(o usage) {
	u.gpus.add(o.gpus, 1)
	u.memory += o.memory
	u.compute += o.compute
	u.leases += o.leases
}

func (u usage) proto(tenant string) *gpupoolv1.TenantUsage {
	return &gpupoolv1.TenantUsage{Tenant: tenant, Gpus: int32(u.gpus.ceil()),
		MemoryMib: u.memory, ComputePercent: u.compute, Leases: u.leases}
}

func leaseUsage(r *state.Reader, l *gpupoolv1.Lease) usage {
	u := usage{leases: 1}
	for _, s := range l.GetSlices() {
		addGPUShare(r, s, &u.gpus)
		u.memory += s.MemoryMib
		u.compute += int64(s.ComputePercent)
	}
	return u
}

func tenantUsage(r *state.Reader, tenant string) usage {
	var u usage
	for _, l := range r.HoldingLeases(tenant) {
		u.add(leaseUsage(r, l))
	}
	return u
}

// addGPUShare adds to g how much of a GPU a slice counts against a --gpus
// quota: 1 when it is exclusive or takes the whole device (100 % compute,
// or all its memory), else the larger of its compute/100 and its memory
// over the device's memory. Counting the larger share means a slice
// cannot hold most of a GPU in one dimension while counting little in the
// other; a tenant's shares are summed and rounded up, so eight 50 % slices
// count 4 GPUs. A slice whose device is not in the state (which a holding
// lease's cannot be) counts 1, so an inconsistency never undercounts.
func addGPUShare(r *state.Reader, s *gpupoolv1.Slice, g *shares) {
	if s.Exclusive || s.ComputePercent >= 100 {
		g.whole++
		return
	}
	d := r.Device(s.Device)
	if d == nil || d.MemoryMib <= 0 || s.MemoryMib >= d.MemoryMib {
		g.whole++
		return
	}
	compute, mem := max(int64(s.ComputePercent), 0), max(s.MemoryMib, 0)
	// mem/d.MemoryMib > compute/100, compared without division.
	if mem*100 > compute*d.MemoryMib {
		g.addFrac(mem, d.MemoryMib)
		return
	}
	g.percent += compute
}

// CheckQuota returns a *QuotaError when granting l would take its tenant
// over quota in a dimension the lease needs, else nil. A tenant without a
// quota, and a dimension whose quota is 0, are unlimited.
func CheckQuota(r *state.Reader, l *gpupoolv1.Lease) error {
	return CheckQuotaWithout(r, l, nil)
}

// CheckQuotaWithout is CheckQuota as if the tenant's leases in gone had
// freed their capacity: the quota a preemption would make room in.
func CheckQuotaWithout(r *state.Reader, l *gpupoolv1.Lease, gone []*gpupoolv1.Lease) error {
	return CheckQuotaAfter(r, l, gone, nil)
}

// CheckQuotaAfter is CheckQuotaWithout as if the tenant's leases in added
// were granted too: the quota a plan of several grants decides on before
// any of them commits.
func CheckQuotaAfter(r *state.Reader, l *gpupoolv1.Lease, gone, added []*gpupoolv1.Lease) error {
	q := r.Quota(l.GetTenant())
	if q == nil {
		return nil
	}
	used, need := tenantUsage(r, l.Tenant), leaseUsage(r, l)
	for _, a := range added {
		if a.Tenant == l.Tenant {
			used.add(leaseUsage(r, a))
		}
	}
	for _, g := range gone {
		if g.Tenant == l.Tenant && state.Holding(g.State) {
			u := leaseUsage(r, g)
			used.gpus.add(u.gpus, -1)
			used.memory -= u.memory
			used.compute -= u.compute
			used.leases -= u.leases
		}
	}
	var after usage
	after.gpus.fracs = make([]frac, 0, len(used.gpus.fracs)+len(need.gpus.fracs))
	after.add(used)
	after.add(need)
	ds := dimensions(q, used.proto(l.Tenant), need.proto(l.Tenant))
	// GPUs are rounded up on the tenant's total, not summed rounded: the
	// lease fits when the total after it, rounded up, is within the quota.
	ds[0].after = after.gpus.ceil()
	for _, d := range ds {
		if d.quota > 0 && d.need > 0 && d.after > d.quota {
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

// ValidateQuota checks a quota a caller asks to set: a valid tenant name,
// no negative limit, and at least one limit, since a quota of 0 (unlimited) in every
// dimension limits nothing and is only mistaken for one; removing the quota
// says that. The error is a *protocol.FieldError naming the field.
func ValidateQuota(q *gpupoolv1.Quota) error {
	if err := validateQuotaLimits(q); err != nil {
		return err
	}
	if err := protocol.ValidateTenant("quota.tenant", q.Tenant); err != nil {
		return err
	}
	if q.GetGpus() == 0 && q.GetMemoryMib() == 0 && q.GetComputePercent() == 0 {
		return &protocol.FieldError{Field: "quota", Value: "gpus=0 memory_mib=0 compute_percent=0",
			Allowed: fmt.Sprintf("limits nothing (0 is unlimited); set at least one limit above 0, or lift tenant %s's limits with 'gpupool operator quota rm %s'", q.Tenant, q.Tenant)}
	}
	return nil
}

// validateQuotaLimits is what Apply checks: a tenant and no negative
// limit. It does not refuse a quota without limits, which entries already
// in a log may hold: replaying them must give the state it gave.
func validateQuotaLimits(q *gpupoolv1.Quota) error {
	if q.GetTenant() == "" {
		return &protocol.FieldError{Field: "quota.tenant", Value: `""`, Allowed: "is required"}
	}
	for _, d := range dimensions(q, &gpupoolv1.TenantUsage{}, &gpupoolv1.TenantUsage{}) {
		if d.quota < 0 {
			return &protocol.FieldError{Field: "quota." + d.field, Value: d.quota, Allowed: "must be 0 (unlimited) or more"}
		}
	}
	return nil
}

// dimension is one limited quantity of a quota, with the tenant's use and a
// lease's need of it.
type dimension struct {
	name, field              string
	quota, used, need, after int64 // after: used with the need granted
}

func dimensions(q *gpupoolv1.Quota, used, need *gpupoolv1.TenantUsage) []dimension {
	ds := []dimension{
		{name: "gpus", field: "gpus", quota: int64(q.GetGpus()), used: int64(used.GetGpus()), need: int64(need.GetGpus())},
		{name: "memory", field: "memory_mib", quota: q.GetMemoryMib(), used: used.GetMemoryMib(), need: need.GetMemoryMib()},
		{name: "compute", field: "compute_percent", quota: q.GetComputePercent(), used: used.GetComputePercent(), need: need.GetComputePercent()},
	}
	for i := range ds {
		ds[i].after = ds[i].used + ds[i].need
	}
	return ds
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
		w.Audit(&gpupoolv1.AuditEntry{AtMs: c.NowMs, Kind: gpupoolv1.AuditKind_AUDIT_KIND_QUOTA_REMOVED, Actor: actorOr(c.Actor),
			Subject: c.Tenant, Tenant: c.Tenant, Detail: "was " + quotaText(old)})
		return &Result{}
	}
	q := clone(c.Quota)
	q.Tenant = c.Tenant
	if c.Actor != nil {
		q.UpdatedBy = clone(c.Actor)
	}
	if err := validateQuotaLimits(q); err != nil {
		return &Result{Err: err}
	}
	w.PutQuota(q)
	w.Audit(&gpupoolv1.AuditEntry{AtMs: cmp.Or(c.NowMs, q.UpdatedAtMs), Kind: gpupoolv1.AuditKind_AUDIT_KIND_QUOTA_SET, Actor: actorOr(c.Actor),
		Subject: c.Tenant, Tenant: c.Tenant, Detail: quotaText(q)})
	return &Result{}
}
