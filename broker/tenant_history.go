package broker

import (
	"context"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/gpupool/gpupool/broker/fsm"
	"github.com/gpupool/gpupool/broker/state"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
	"github.com/gpupool/gpupool/protocol"
)

// Tenant usage history: every server samples, from its own state, what
// each tenant's leases hold, and keeps the newest samples in memory. It is
// not replicated and a restart loses it; it is a picture for the console,
// not a record (the audit log is the record).
const (
	// DefaultUsageHistoryInterval is how often a server samples.
	DefaultUsageHistoryInterval = 10 * time.Second
	// usageHistorySamples is how many samples a tenant keeps (an hour at
	// the default interval).
	usageHistorySamples = 360
	// usageHistoryTenants bounds how many tenants are kept; those sampled
	// longest ago go first.
	usageHistoryTenants = 1000
)

// usageHistory is each tenant's recent usage, bounded in samples and
// tenants.
type usageHistory struct {
	mu      sync.Mutex
	tenants map[string]*tenantSamples // guarded by mu
}

type tenantSamples struct {
	samples []*gpupoolv1.TenantUsageSample // oldest first; at most usageHistorySamples
	lastAt  int64
}

func newUsageHistory() *usageHistory {
	return &usageHistory{tenants: map[string]*tenantSamples{}}
}

// record adds one sample per tenant that holds capacity or has a quota;
// a tenant already known that holds nothing gets a zero sample, so its
// history shows the drop.
func (h *usageHistory) record(st *state.Reader, atMs int64) {
	tenants := map[string]bool{}
	for _, t := range activeTenants(st) {
		tenants[t] = true
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	for t := range h.tenants {
		tenants[t] = true
	}
	for t := range tenants {
		u := fsm.TenantUsage(st, t)
		ts := h.tenants[t]
		if ts == nil {
			ts = &tenantSamples{}
			h.tenants[t] = ts
		}
		if u.Leases == 0 && len(ts.samples) > 0 && ts.samples[len(ts.samples)-1].Leases == 0 && !tenantHasQuota(st, t) {
			continue // idle and already shown idle: keep its place, add nothing
		}
		ts.samples = append(ts.samples, &gpupoolv1.TenantUsageSample{AtMs: atMs, Gpus: u.Gpus, MemoryMib: u.MemoryMib, ComputePercent: u.ComputePercent, Leases: u.Leases})
		if n := len(ts.samples) - usageHistorySamples; n > 0 {
			ts.samples = slices.Delete(ts.samples, 0, n)
		}
		ts.lastAt = atMs
	}
	for len(h.tenants) > usageHistoryTenants {
		oldest, at := "", int64(0)
		for t, ts := range h.tenants {
			if oldest == "" || ts.lastAt < at {
				oldest, at = t, ts.lastAt
			}
		}
		delete(h.tenants, oldest)
	}
}

// activeTenants are the tenants with a quota or a lease holding capacity.
func activeTenants(st *state.Reader) []string {
	seen := map[string]bool{}
	var out []string
	add := func(t string) {
		if !seen[t] {
			seen[t] = true
			out = append(out, t)
		}
	}
	for _, q := range st.Quotas() {
		add(q.Tenant)
	}
	for _, l := range st.Leases() {
		if state.Holding(l.State) {
			add(l.Tenant)
		}
	}
	return out
}

func tenantHasQuota(st *state.Reader, t string) bool { return st.Quota(t) != nil }

// snapshot returns the histories of the tenants may reports true for, by
// tenant name.
func (h *usageHistory) snapshot(may func(string) bool) []*gpupoolv1.TenantUsageHistory {
	h.mu.Lock()
	defer h.mu.Unlock()
	var out []*gpupoolv1.TenantUsageHistory
	for t, ts := range h.tenants {
		if may(t) {
			out = append(out, &gpupoolv1.TenantUsageHistory{Tenant: t, Samples: slices.Clone(ts.samples)})
		}
	}
	slices.SortFunc(out, func(a, b *gpupoolv1.TenantUsageHistory) int {
		switch {
		case a.Tenant < b.Tenant:
			return -1
		case a.Tenant > b.Tenant:
			return 1
		}
		return 0
	})
	return out
}

// sampleTenantUsage records the tenants' usage every interval until the
// server shuts down.
func (s *Server) sampleTenantUsage() {
	t := time.NewTicker(s.cfg.UsageHistoryInterval)
	defer t.Stop()
	for {
		s.history.record(s.fsm.State(), s.nowMs())
		select {
		case <-s.ctx.Done():
			return
		case <-t.C:
		}
	}
}

func (e operatorService) TenantHistory(ctx context.Context, req *gpupoolv1.TenantHistoryRequest) (*gpupoolv1.TenantHistoryResponse, error) {
	c := callerFrom(ctx)
	if req.Tenant != "" {
		if err := protocol.ValidateTenant("tenant", req.Tenant); err != nil {
			return nil, toStatus(err)
		}
		if err := c.mayActFor(req.Tenant, "tenant"); err != nil {
			return nil, err
		}
	}
	may := func(t string) bool { return (req.Tenant == "" || t == req.Tenant) && c.mayActFor(t, "") == nil }
	hs := e.history.snapshot(may)
	// The last sample is now, from this server's state, so that a tenant
	// shows at once and its history ends with its current use.
	st, now := e.fsm.State(), e.nowMs()
	byTenant := map[string]*gpupoolv1.TenantUsageHistory{}
	for _, h := range hs {
		byTenant[h.Tenant] = h
	}
	for _, t := range activeTenants(st) {
		if !may(t) {
			continue
		}
		h := byTenant[t]
		if h == nil {
			h = &gpupoolv1.TenantUsageHistory{Tenant: t}
			byTenant[t] = h
			hs = append(hs, h)
		}
		u := fsm.TenantUsage(st, t)
		h.Samples = append(h.Samples, &gpupoolv1.TenantUsageSample{AtMs: now, Gpus: u.Gpus, MemoryMib: u.MemoryMib, ComputePercent: u.ComputePercent, Leases: u.Leases})
	}
	slices.SortFunc(hs, func(a, b *gpupoolv1.TenantUsageHistory) int { return strings.Compare(a.Tenant, b.Tenant) })
	return &gpupoolv1.TenantHistoryResponse{Tenants: hs, IntervalMs: e.cfg.UsageHistoryInterval.Milliseconds(), ServerId: e.cfg.NodeID}, nil
}
