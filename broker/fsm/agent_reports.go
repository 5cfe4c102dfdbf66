package fsm

import (
	"fmt"

	"github.com/gpupool/gpupool/broker/state"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// applySetDeviceHealth records the health an agent reports for its
// devices. A device turning unhealthy takes no new leases (placement and
// GrantLease skip it) and every lease holding it gets a
// DEVICE_UNHEALTHY event; the leases themselves go on. Reports about
// devices of another host are refused whole: an agent speaks only for its
// own host.
func applySetDeviceHealth(w *state.Writer, index uint64, c *gpupoolv1.SetDeviceHealthCommand) (*Result, []Event) {
	h := w.Host(c.HostId)
	if h == nil {
		return &Result{Err: fmt.Errorf("host %q: %w", c.HostId, ErrNotFound)}, nil
	}
	var changed []*gpupoolv1.Device
	for _, r := range c.Devices {
		switch r.Health {
		case gpupoolv1.DeviceHealth_DEVICE_HEALTH_HEALTHY, gpupoolv1.DeviceHealth_DEVICE_HEALTH_UNHEALTHY:
		default:
			return &Result{Err: fmt.Errorf("%w: device %s: health %v", ErrInvalid, r.Uuid, r.Health)}, nil
		}
		old := w.Device(r.Uuid)
		if old == nil || old.HostId != h.Id {
			return &Result{Err: fmt.Errorf("%w: device %s is not on host %s", ErrInvalid, r.Uuid, h.Id)}, nil
		}
		if old.Health == r.Health && old.HealthReason == r.HealthReason {
			continue
		}
		d := clone(old)
		d.Health, d.HealthReason = r.Health, r.HealthReason
		if d.Health == gpupoolv1.DeviceHealth_DEVICE_HEALTH_HEALTHY {
			d.HealthReason = ""
		}
		changed = append(changed, d)
	}
	if len(changed) == 0 {
		return &Result{Host: h}, nil
	}
	var evs []Event
	sick := map[string]*gpupoolv1.Device{}
	for _, d := range changed {
		w.PutDevice(d)
		if d.Health == gpupoolv1.DeviceHealth_DEVICE_HEALTH_UNHEALTHY {
			sick[d.Uuid] = d
		}
	}
	for _, l := range w.HostLeases(h.Id) {
		if l.State != gpupoolv1.LeaseState_LEASE_STATE_GRANTED {
			continue
		}
		for _, s := range l.Slices {
			if d := sick[s.Device]; d != nil {
				evs = append(evs, Event{Lease: l, Type: gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_DEVICE_UNHEALTHY,
					Message: fmt.Sprintf("GPU %d (%s) on host %s is unhealthy: %s", d.Index, d.Uuid, h.Id, d.HealthReason)})
				break
			}
		}
	}
	evs = append(evs, Event{Host: h})
	return &Result{Host: h}, evs
}

// applyRecordAgentEvents records watchdog violations on their leases.
// Events are deduplicated by seq per lease and reporting host (each agent
// numbers its own), so an agent may resend an event until it is
// acknowledged. Events about leases that are gone or
// hold nothing on the reporting host are skipped.
func applyRecordAgentEvents(w *state.Writer, index uint64, c *gpupoolv1.RecordAgentEventsCommand) (*Result, []Event) {
	var evs []Event
	for _, e := range c.Events {
		if e.Type != gpupoolv1.AgentEventType_AGENT_EVENT_TYPE_VIOLATION {
			continue
		}
		l := w.Lease(e.LeaseId)
		if l == nil || e.Seq <= l.LastEventSeq[c.HostId] || !holdsOnHost(l, c.HostId) {
			continue
		}
		nl := clone(l)
		nl.Violations++
		nl.LastViolation = e.Message
		if nl.LastEventSeq == nil {
			nl.LastEventSeq = map[string]uint64{}
		}
		nl.LastEventSeq[c.HostId] = e.Seq
		nl.ModifyIndex = index
		w.PutLease(nl)
		evs = append(evs, Event{Lease: nl, Type: gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_VIOLATION, Message: e.Message})
	}
	return &Result{}, evs
}

func holdsOnHost(l *gpupoolv1.Lease, hostID string) bool {
	for _, s := range l.Slices {
		if s.Host == hostID {
			return true
		}
	}
	return false
}
