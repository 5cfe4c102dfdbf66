package broker

import (
	"fmt"
	"slices"
	"strings"

	"google.golang.org/protobuf/proto"

	"github.com/gpupool/gpupool/broker/state"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// hostReport is what a host's agent last measured: the live readings of
// its devices and the usage of its leases. It lives in leader memory only,
// replaced by every heartbeat; a new leader knows it after one heartbeat
// interval.
type hostReport struct {
	devices map[string]*gpupoolv1.DeviceReport // by uuid
	usage   map[string]*gpupoolv1.LeaseUsage   // by lease id
}

// storeReport keeps the live readings of one heartbeat.
func (ls *leaderState) storeReport(hostID string, req *gpupoolv1.HeartbeatRequest) {
	r := &hostReport{
		devices: make(map[string]*gpupoolv1.DeviceReport, len(req.Devices)),
		usage:   make(map[string]*gpupoolv1.LeaseUsage, len(req.Usage)),
	}
	for _, d := range req.Devices {
		r.devices[d.Uuid] = d
	}
	for _, u := range req.Usage {
		u.Host = hostID
		r.usage[u.LeaseId] = u
	}
	ls.mu.Lock()
	ls.reports[hostID] = r
	ls.mu.Unlock()
}

// leaseUsage returns copies of the usage reports for a lease from the
// hosts it holds slices on: another host's agent cannot report for it.
func (ls *leaderState) leaseUsage(l *gpupoolv1.Lease) []*gpupoolv1.LeaseUsage {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	var out []*gpupoolv1.LeaseUsage
	for _, host := range state.LeaseHosts(l) {
		r := ls.reports[host]
		if r == nil {
			continue
		}
		if u := r.usage[l.Id]; u != nil {
			out = append(out, proto.CloneOf(u))
		}
	}
	slices.SortFunc(out, func(a, b *gpupoolv1.LeaseUsage) int { return strings.Compare(a.Host, b.Host) })
	return out
}

// deviceReport returns the last readings of a device, or nil.
func (ls *leaderState) deviceReport(hostID, uuid string) *gpupoolv1.DeviceReport {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	if r := ls.reports[hostID]; r != nil {
		return r.devices[uuid]
	}
	return nil
}

// forgetReport drops a host's readings, when it goes down.
func (ls *leaderState) forgetReport(hostID string) {
	ls.mu.Lock()
	delete(ls.reports, hostID)
	ls.mu.Unlock()
}

// applyAgentReports turns what a heartbeat reports into state changes:
// devices whose health changed, watchdog events, and leases the agent
// refuses, which are revoked. It returns the highest event seq that is
// now applied, for the agent to stop resending.
func (ld *leadership) applyAgentReports(h *gpupoolv1.Host, req *gpupoolv1.HeartbeatRequest) (uint64, error) {
	st := ld.fsm.State()
	var changed []*gpupoolv1.DeviceReport
	for _, d := range req.Devices {
		old := st.Device(d.Uuid)
		if old == nil || old.HostId != h.Id {
			continue // not registered (yet): the next Register carries it
		}
		reason := d.HealthReason
		if d.Health == gpupoolv1.DeviceHealth_DEVICE_HEALTH_HEALTHY {
			reason = "" // as Apply records it
		}
		if d.Health != gpupoolv1.DeviceHealth_DEVICE_HEALTH_UNSPECIFIED && (old.Health != d.Health || old.HealthReason != reason) {
			changed = append(changed, d)
		}
	}
	if len(changed) > 0 {
		if _, err := ld.apply(&gpupoolv1.SetDeviceHealthCommand{HostId: h.Id, Devices: changed, NowMs: ld.nowMs()}); err != nil {
			return 0, err
		}
		for _, d := range changed {
			ld.log.Warn("device health changed", "host", h.Id, "device", d.Uuid, "health", d.Health.String(), "reason", d.HealthReason)
		}
	}
	var acked uint64
	if len(req.Events) > 0 {
		if _, err := ld.apply(&gpupoolv1.RecordAgentEventsCommand{HostId: h.Id, Events: req.Events}); err != nil {
			return 0, err
		}
		for _, e := range req.Events {
			acked = max(acked, e.Seq)
		}
	}
	for _, r := range req.Rejected {
		l := st.Lease(r.LeaseId)
		if l == nil || l.State != gpupoolv1.LeaseState_LEASE_STATE_GRANTED || !slices.Contains(state.LeaseHosts(l), h.Id) {
			continue
		}
		ld.log.Warn("agent refused a lease; revoking it", "host", h.Id, "lease", l.Id, "reason", r.Reason)
		// The reason is the agent's word, not the broker's: it is quoted as
		// such, and the agent is the actor the lease and the audit log name.
		if _, err := ld.apply(&gpupoolv1.EndLeaseCommand{
			LeaseId: l.Id, EndState: gpupoolv1.LeaseState_LEASE_STATE_REVOKED, NowMs: ld.nowMs(),
			Reason: fmt.Sprintf("the agent of host %s refused the lease, saying: %q", h.Id, truncate(r.Reason, maxAgentReason)),
			Actor:  &gpupoolv1.Actor{Name: "agent " + h.Id},
		}); err != nil {
			return 0, err
		}
	}
	return acked, nil
}

// maxAgentReason bounds the part of an agent's refusal the broker keeps.
const maxAgentReason = 512

// truncate cuts s to at most n bytes, marking the cut.
func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}
