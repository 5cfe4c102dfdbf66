package planner

import (
	"fmt"
	"strings"
	"time"

	"github.com/gpupool/gpupool/broker/fsm"
	"github.com/gpupool/gpupool/broker/placement"
	"github.com/gpupool/gpupool/broker/state"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// Explainer explains why the pending leases of one state snapshot are not
// granted, from the real blockers: the leases each is preempting and when
// they go, what placement finds short in the pool (less what others
// reserve), hosts out of service, its tenant's quota, and the requests
// ahead of it. The pool less the reservations and the queue's order are
// computed once, however many leases a List explains. Like Make, it reads
// its snapshot and changes nothing.
type Explainer struct {
	st     *state.Reader
	placer Placer
	now    time.Time
	hosts  []*gpupoolv1.Host
	ahead  map[string]int // pending lease → requests ahead of it
}

// NewExplainer explains the pending leases of st at time now.
func NewExplainer(st *state.Reader, pl Placer, now time.Time) *Explainer {
	e := &Explainer{st: st, placer: pl, now: now, ahead: map[string]int{}}
	for i, r := range st.PendingLeases() {
		e.ahead[r.Id] = i
	}
	return e
}

// Why is the reason pending lease l waits, as sentences joined by "; ".
func (e *Explainer) Why(l *gpupoolv1.Lease) string {
	st := e.st
	var parts []string
	if vs := st.PreemptedFor(l.Id); len(vs) > 0 {
		var last int64
		for _, v := range vs {
			last = max(last, v.PreemptAtMs)
		}
		parts = append(parts, fmt.Sprintf("preempting %s (%s), revoked in %s", Plural(len(vs), "lease", "leases"),
			strings.Join(IDs(vs), ", "), max(0, time.UnixMilli(last).Sub(e.now)).Round(time.Second)))
	} else {
		if e.hosts == nil {
			// Its own reservation is not in it: only leases with victims have one.
			e.hosts = Reserved(st, st.HostsWithDevices(), e.placer)
		}
		ss, err := e.placer.Place(e.hosts, l.Request)
		switch {
		case err != nil:
			parts = append(parts, err.Error())
		case fsm.CheckQuota(st, GrantOf(l, ss)) != nil:
			parts = append(parts, fsm.CheckQuota(st, GrantOf(l, ss)).Error())
		default:
			parts = append(parts, "fits now: the queue grants it next")
		}
	}
	parts = append(parts, quotaPressure(st, l.Tenant)...)
	if n := e.ahead[l.Id]; n > 0 {
		parts = append(parts, fmt.Sprintf("%s ahead in the queue", Plural(n, "request", "requests")))
	}
	return strings.Join(parts, "; ")
}

// quotaPressure names each dimension of a tenant's quota that is at least
// 80% used: "tenant sim at 90% of memory quota".
func quotaPressure(st *state.Reader, tenant string) []string {
	q := st.Quota(tenant)
	if q == nil {
		return nil
	}
	use := fsm.TenantUsage(st, tenant)
	var out []string
	for _, d := range []struct {
		name      string
		used, max int64
	}{
		{"gpus", int64(use.Gpus), int64(q.Gpus)},
		{"memory", use.MemoryMib, q.MemoryMib},
		{"compute", use.ComputePercent, q.ComputePercent},
	} {
		if d.max > 0 && d.used*100 >= 80*d.max {
			out = append(out, fmt.Sprintf("tenant %s at %d%% of %s quota", tenant, d.used*100/d.max, d.name))
		}
	}
	return out
}

// Plural is n with the word for n things: "1 lease", "2 leases".
func Plural(n int, one, many string) string {
	if n == 1 {
		return "1 " + one
	}
	return fmt.Sprintf("%d %s", n, many)
}

// PreemptionHint is the error for a guaranteed request without a wait
// that does not fit hosts now: placement's reason pe, and, when preempting
// preemptible leases would make room, how to get it (grace is how long a
// preempted lease keeps running).
func PreemptionHint(st *state.Reader, hosts []*gpupoolv1.Host, r *gpupoolv1.LeaseRequest, pe *placement.Error, pl Placer, grace time.Duration) error {
	if r.Class == gpupoolv1.LeaseClass_LEASE_CLASS_PREEMPTIBLE {
		return pe
	}
	cands := Candidates(st, &gpupoolv1.Lease{Priority: r.Priority})
	if len(cands) == 0 {
		return pe // the common case of a full pool: nothing to copy
	}
	victims, _ := Victims(NewPool(hosts), r, pl, cands)
	if victims == nil {
		return pe
	}
	return &placement.Error{Reason: fmt.Sprintf("%s; preempting %s would make room: acquire with a wait of more than the %s grace (e.g. --wait 2m)",
		pe.Reason, Plural(len(victims), "preemptible lease", "preemptible leases"), grace)}
}
