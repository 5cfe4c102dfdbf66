package top

import (
	"fmt"
	"path"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/gpupool/gpupool/internal/quantity"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// SortKey orders the hosts table.
type SortKey int

// The host orders, in the order the sort key cycles through them.
const (
	SortUtil     SortKey = iota // measured utilisation, busiest first
	SortReserved                // compute reserved by leases
	SortMemory                  // memory reserved by leases
	SortLeases                  // leases on the host
	SortName                    // host id
	numSortKeys
)

var sortNames = [...]string{"util", "reserved", "memory", "leases", "name"}

func (k SortKey) String() string {
	if k < 0 || k >= numSortKeys {
		return fmt.Sprintf("SortKey(%d)", int(k))
	}
	return sortNames[k]
}

// ParseSortKey is the inverse of String.
func ParseSortKey(s string) (SortKey, error) {
	for i, n := range sortNames {
		if n == s {
			return SortKey(i), nil
		}
	}
	return 0, fmt.Errorf("sort %q: must be one of %s", s, strings.Join(sortNames[:], ", "))
}

// Next is the key after k, cycling.
func (k SortKey) Next() SortKey { return (k + 1) % numSortKeys }

// Options are what the keys change: the hosts' order and the filters.
// An empty filter shows everything.
type Options struct {
	Sort   SortKey
	Tenant string
	Model  string
}

// ModelRow is the pool's capacity of one GPU model: what leases reserve
// against what the agents measure.
type ModelRow struct {
	Model string
	GPUs  int
	// Unhealthy GPUs among them.
	Unhealthy int
	// Memory in MiB: total, reserved by leases, used as measured (-1 when
	// no agent reading is known: a follower answered, or none came yet).
	MemoryMiB, ReservedMiB, UsedMiB int64
	// Compute in percent of one GPU, summed: total and reserved.
	ComputePct, ReservedPct int64
	// Mean measured utilisation of the GPUs, 0-100; -1 when unknown.
	Util int
	// Leases holding slices of this model (that the token sees).
	Leases int
}

// HostRow is one pool host.
type HostRow struct {
	ID, Status string
	GPUs       int
	Unhealthy  int
	// Reserved and measured, in percent of the host's GPUs (of the
	// filtered model); -1 when unknown.
	ReservedPct, MemReservedPct, UtilPct, MemUsedPct int
	Leases                                           int
	// HeartbeatAge is -1 when unknown.
	HeartbeatAge time.Duration
	Note         string // status reason or backend note
}

// QueueRow is one pending lease, in queue order.
type QueueRow struct {
	ID, Tenant string
	Priority   int32
	Request    string
	Waited     time.Duration
	Why        string
}

// DrainRow is a host draining.
type DrainRow struct {
	Host   string
	Leases int
	// Deadline is zero for none.
	Deadline time.Time
	Forced   bool
	Reason   string
	By       string
}

// View is what one screen shows.
type View struct {
	Options   Options
	Leader    string
	Index     uint64
	HostsUp   int
	Hosts     int
	GPUs      int
	LeaseSums map[string]int // by state label, of the leases shown
	Models    []ModelRow
	HostRows  []HostRow
	Queue     []QueueRow
	Drains    []DrainRow
	Events    []Event // newest first
	Errors    []string
	Now       time.Time
}

func (o Options) tenantOK(t string) bool { return o.Tenant == "" || o.Tenant == t }
func (o Options) modelOK(m string) bool  { return o.Model == "" || o.Model == m }

// leaseShown says whether a lease passes the filters: its tenant, and a
// slice of the model.
func (o Options) leaseShown(l *gpupoolv1.Lease) bool {
	if !o.tenantOK(l.Tenant) {
		return false
	}
	if o.Model == "" {
		return true
	}
	for _, sl := range l.Slices {
		if sl.Model == o.Model {
			return true
		}
	}
	if len(l.Slices) == 0 { // pending: the model it asks for, if any
		return matchGlob(l.GetRequest().GetConstraints().GetModel(), o.Model)
	}
	return false
}

// matchGlob: a request's model constraint is a glob; an empty one
// matches any model.
func matchGlob(glob, model string) bool {
	if glob == "" {
		return true
	}
	ok, err := path.Match(glob, model)
	return err == nil && ok
}

// Derive computes the screen's rows from the state under o.
func Derive(s *State, o Options) View {
	v := View{Options: o, Now: s.Now, LeaseSums: map[string]int{}}
	if st := s.Status; st != nil {
		v.Leader, v.Index = st.LeaderId, st.AppliedIndex
	}
	leases := make([]*gpupoolv1.Lease, 0, len(s.Leases))
	for _, l := range s.Leases {
		if o.leaseShown(l) {
			leases = append(leases, l)
			v.LeaseSums[stateLabel(l.State)]++
		}
	}
	sort.Slice(leases, func(i, j int) bool { return leases[i].Id < leases[j].Id })

	v.Models = deriveModels(s.Hosts, leases, o)
	v.HostRows = deriveHosts(s.Hosts, leases, o)
	for _, h := range s.Hosts {
		v.Hosts++
		if h.Status == gpupoolv1.HostStatus_HOST_STATUS_READY {
			v.HostsUp++
		}
		for _, d := range h.Devices {
			if o.modelOK(d.Model) {
				v.GPUs++
			}
		}
	}

	queue := make([]*gpupoolv1.Lease, 0, len(s.Queue))
	for _, l := range s.Queue {
		if o.leaseShown(l) {
			queue = append(queue, l)
		}
	}
	// The queue is served by priority, then arrival.
	sort.SliceStable(queue, func(i, j int) bool {
		if queue[i].Priority != queue[j].Priority {
			return queue[i].Priority > queue[j].Priority
		}
		return queue[i].CreateIndex < queue[j].CreateIndex
	})
	for _, l := range queue {
		v.Queue = append(v.Queue, QueueRow{ID: l.Id, Tenant: l.Tenant, Priority: l.Priority, Request: describeRequest(l.Request),
			Waited: age(s.Now, l.CreatedAtMs), Why: l.PendingReason})
	}
	if len(s.Queue) > 0 {
		v.LeaseSums["pending"] = len(v.Queue)
	}

	byHost := map[string]int{}
	for _, l := range leases {
		for _, h := range leaseHosts(l) {
			byHost[h]++
		}
	}
	for _, h := range s.Hosts {
		if h.Status != gpupoolv1.HostStatus_HOST_STATUS_DRAINING || h.Drain == nil {
			continue
		}
		if o.Tenant != "" && byHost[h.Id] == 0 {
			continue
		}
		if o.Model != "" && !hostHasModel(h, o.Model) {
			continue
		}
		d := DrainRow{Host: h.Id, Leases: byHost[h.Id], Reason: h.Drain.Reason, By: h.Drain.GetBy().GetName(), Forced: h.Drain.Force}
		if h.Drain.DeadlineMs > 0 {
			d.Deadline = time.UnixMilli(h.Drain.DeadlineMs)
		}
		v.Drains = append(v.Drains, d)
	}
	sort.Slice(v.Drains, func(i, j int) bool { return v.Drains[i].Host < v.Drains[j].Host })

	for i := len(s.Events) - 1; i >= 0; i-- {
		e := s.Events[i]
		if o.Tenant != "" && e.Tenant != o.Tenant {
			continue
		}
		if o.Model != "" && len(e.Models) > 0 && !slices.Contains(e.Models, o.Model) {
			continue
		}
		v.Events = append(v.Events, e)
	}
	for what, msg := range s.Errors {
		v.Errors = append(v.Errors, what+": "+msg)
	}
	sort.Strings(v.Errors)
	return v
}

func age(now time.Time, ms int64) time.Duration {
	if ms <= 0 || now.IsZero() {
		return 0
	}
	return max(now.Sub(time.UnixMilli(ms)), 0)
}

func leaseHosts(l *gpupoolv1.Lease) []string {
	var out []string
	for _, sl := range l.Slices {
		if len(out) == 0 || out[len(out)-1] != sl.Host {
			out = append(out, sl.Host)
		}
	}
	return out
}

func hostHasModel(h *gpupoolv1.Host, model string) bool {
	for _, d := range h.Devices {
		if d.Model == model {
			return true
		}
	}
	return false
}

func describeRequest(r *gpupoolv1.LeaseRequest) string {
	if r == nil {
		return "-"
	}
	n := max(r.Count, 1)
	var what string
	if r.Exclusive {
		what = fmt.Sprintf("%dx whole", n)
	} else {
		what = fmt.Sprintf("%dx %s %d%%", n, strings.ReplaceAll(quantity.FormatMiB(r.MemoryMib), " ", ""), r.ComputePercent)
	}
	if m := r.GetConstraints().GetModel(); m != "" {
		what += " " + m
	}
	return what
}

func deriveModels(hosts []*gpupoolv1.Host, leases []*gpupoolv1.Lease, o Options) []ModelRow {
	rows := map[string]*ModelRow{}
	type meas struct{ util, n int }
	utils := map[string]*meas{}
	for _, h := range hosts {
		for _, d := range h.Devices {
			if !o.modelOK(d.Model) {
				continue
			}
			r := rows[d.Model]
			if r == nil {
				r = &ModelRow{Model: d.Model}
				rows[d.Model] = r
				utils[d.Model] = &meas{}
			}
			r.GPUs++
			if d.Health == gpupoolv1.DeviceHealth_DEVICE_HEALTH_UNHEALTHY {
				r.Unhealthy++
			}
			r.MemoryMiB += d.MemoryMib
			r.ComputePct += 100
			if o.Tenant == "" {
				r.ReservedMiB += d.AllocatedMemoryMib
				r.ReservedPct += int64(d.AllocatedComputePercent)
				if d.AllocatedExclusive {
					r.ReservedMiB += d.MemoryMib - d.AllocatedMemoryMib
					r.ReservedPct += int64(100 - d.AllocatedComputePercent)
				}
			}
			if d.UsedMemoryMib >= 0 && r.UsedMiB >= 0 {
				r.UsedMiB += d.UsedMemoryMib
			} else {
				r.UsedMiB = -1
			}
			if d.UtilizationPercent >= 0 {
				utils[d.Model].util += int(d.UtilizationPercent)
				utils[d.Model].n++
			}
		}
	}
	memOf := map[string]int64{} // device memory, for exclusive slices
	for _, h := range hosts {
		for _, d := range h.Devices {
			memOf[d.Uuid] = d.MemoryMib
		}
	}
	for _, l := range leases {
		counted := map[string]bool{}
		for _, sl := range l.Slices {
			r := rows[sl.Model]
			if r == nil {
				continue
			}
			if !counted[sl.Model] {
				counted[sl.Model] = true
				r.Leases++
			}
			if o.Tenant != "" {
				if sl.Exclusive {
					r.ReservedMiB += memOf[sl.Device]
					r.ReservedPct += 100
				} else {
					r.ReservedMiB += sl.MemoryMib
					r.ReservedPct += int64(sl.ComputePercent)
				}
			}
		}
	}
	out := make([]ModelRow, 0, len(rows))
	for m, r := range rows {
		r.Util = -1
		if u := utils[m]; u.n > 0 {
			r.Util = u.util / u.n
		}
		out = append(out, *r)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Model < out[j].Model })
	return out
}

func pct(part, total int64) int {
	if total <= 0 {
		return 0
	}
	return int((part*100 + total/2) / total)
}

func deriveHosts(hosts []*gpupoolv1.Host, leases []*gpupoolv1.Lease, o Options) []HostRow {
	byHost := map[string]int{}
	for _, l := range leases {
		for _, h := range leaseHosts(l) {
			byHost[h]++
		}
	}
	var rows []HostRow
	for _, h := range hosts {
		if o.Tenant != "" && byHost[h.Id] == 0 {
			continue
		}
		r := HostRow{ID: h.Id, Status: enumLabel(h.Status.String(), "HOST_STATUS_"), Leases: byHost[h.Id], HeartbeatAge: -1,
			Note: h.StatusReason}
		if r.Note == "" {
			r.Note = h.BackendNote
		}
		if !h.Eligible && h.Status == gpupoolv1.HostStatus_HOST_STATUS_READY {
			r.Status = "cordoned"
		}
		if h.LastHeartbeatAgeMs >= 0 {
			r.HeartbeatAge = time.Duration(h.LastHeartbeatAgeMs) * time.Millisecond
		}
		var mem, memRes, comp, compRes, used int64
		util, utilN, usedKnown := 0, 0, true
		for _, d := range h.Devices {
			if !o.modelOK(d.Model) {
				continue
			}
			r.GPUs++
			if d.Health == gpupoolv1.DeviceHealth_DEVICE_HEALTH_UNHEALTHY {
				r.Unhealthy++
			}
			mem += d.MemoryMib
			comp += 100
			if d.AllocatedExclusive {
				memRes += d.MemoryMib
				compRes += 100
			} else {
				memRes += d.AllocatedMemoryMib
				compRes += int64(d.AllocatedComputePercent)
			}
			if d.UsedMemoryMib >= 0 {
				used += d.UsedMemoryMib
			} else {
				usedKnown = false
			}
			if d.UtilizationPercent >= 0 {
				util += int(d.UtilizationPercent)
				utilN++
			}
		}
		if o.Model != "" && r.GPUs == 0 {
			continue
		}
		r.ReservedPct, r.MemReservedPct = pct(compRes, comp), pct(memRes, mem)
		r.UtilPct, r.MemUsedPct = -1, -1
		if utilN > 0 {
			r.UtilPct = util / utilN
		}
		if usedKnown && r.GPUs > 0 {
			r.MemUsedPct = pct(used, mem)
		}
		rows = append(rows, r)
	}
	less := func(a, b HostRow) (bool, bool) { // (less, decided)
		switch o.Sort {
		case SortUtil:
			if a.UtilPct != b.UtilPct {
				return a.UtilPct > b.UtilPct, true
			}
			if a.ReservedPct != b.ReservedPct {
				return a.ReservedPct > b.ReservedPct, true
			}
		case SortReserved:
			if a.ReservedPct != b.ReservedPct {
				return a.ReservedPct > b.ReservedPct, true
			}
		case SortMemory:
			if a.MemReservedPct != b.MemReservedPct {
				return a.MemReservedPct > b.MemReservedPct, true
			}
		case SortLeases:
			if a.Leases != b.Leases {
				return a.Leases > b.Leases, true
			}
		}
		return false, false
	}
	sort.SliceStable(rows, func(i, j int) bool {
		if l, ok := less(rows[i], rows[j]); ok {
			return l
		}
		return rows[i].ID < rows[j].ID
	})
	return rows
}

// Tenants lists the tenants the state shows, sorted: what the tenant key
// cycles through.
func (s *State) Tenants() []string {
	set := map[string]bool{}
	for _, l := range s.Leases {
		set[l.Tenant] = true
	}
	for _, l := range s.Queue {
		set[l.Tenant] = true
	}
	for _, e := range s.Events {
		if e.Tenant != "" {
			set[e.Tenant] = true
		}
	}
	return sortedKeys(set)
}

// Models lists the GPU models of the pool, sorted.
func (s *State) Models() []string {
	set := map[string]bool{}
	for _, h := range s.Hosts {
		for _, d := range h.Devices {
			set[d.Model] = true
		}
	}
	return sortedKeys(set)
}

func sortedKeys(set map[string]bool) []string {
	out := make([]string, 0, len(set))
	for k := range set {
		if k != "" {
			out = append(out, k)
		}
	}
	sort.Strings(out)
	return out
}

// NextOf returns the value after cur in list, cycling through "" (all)
// after the last: "" -> list[0] -> ... -> list[n-1] -> "".
func NextOf(list []string, cur string) string {
	for i, v := range list {
		if v == cur {
			if i+1 < len(list) {
				return list[i+1]
			}
			return ""
		}
	}
	if len(list) > 0 && cur == "" {
		return list[0]
	}
	return ""
}
