// Package lease holds the broker's lease mechanics that do not depend on
// the pool: building a lease from its request (New), and the leader's
// keyed deadlines (Timers: TTLs, heartbeats, lock-delays). The rules of a
// request (validation, limits, defaults) are the protocol package's.
package lease

import gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"

// New is the one place a lease is built from its request: an acquire's
// grant, a pending lease entering the queue, an elastic lease's extra.
// Everything the lease repeats from r (tenant, holder, class, priority,
// TTL, request id, host resources) is copied from r here, so a lease never
// disagrees with its own request. r must be defaulted (tenant, class) and
// is kept, not copied; id, nowMs and by are stamped by the caller (the
// leader), never inside FSM Apply. ss may be nil for a pending lease.
func New(id string, r *gpupoolv1.LeaseRequest, ss []*gpupoolv1.Slice, nowMs int64, by *gpupoolv1.Actor) *gpupoolv1.Lease {
	return &gpupoolv1.Lease{
		Id:                id,
		Tenant:            r.Tenant,
		Holder:            r.Holder,
		Request:           r,
		Slices:            ss,
		Class:             r.Class,
		Priority:          r.Priority,
		TtlMs:             r.TtlMs,
		CreatedAtMs:       nowMs,
		RequestId:         r.RequestId,
		HostCpuMillicores: r.HostCpuMillicores,
		HostMemoryMib:     r.HostMemoryMib,
		GrantedBy:         by,
	}
}
