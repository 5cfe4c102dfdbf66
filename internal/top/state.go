package top

import (
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/gpupool/gpupool/internal/quantity"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// MaxEvents is how many recent events a State keeps.
const MaxEvents = 200

// Event is one line of "recent events": a lease change from the watch, or
// an audit entry of something that is not a lease (drains, eligibility,
// quotas, tokens; lease grants and ends come from the watch).
type Event struct {
	At      time.Time
	Kind    string // "granted", "violation", "drain started", ...
	Subject string // a lease id, host id, tenant or token
	Tenant  string
	Text    string
	// Models are the GPU models of the lease's slices, for the model
	// filter; empty for events that are not about a lease's slices.
	Models []string
}

// State is what the updates of a Source add up to. The zero value is
// empty and ready; Apply is its only writer. It is not safe for
// concurrent use.
type State struct {
	Hosts  []*gpupoolv1.Host
	Status *gpupoolv1.StatusResponse
	// Leases the token sees that are not ended, by id.
	Leases map[string]*gpupoolv1.Lease
	// Queue is the pending leases, as last polled.
	Queue []*gpupoolv1.Lease
	// Events, oldest first, at most MaxEvents.
	Events []Event
	// Errors by what failed ("hosts", "lease watch", ...).
	Errors map[string]string
	// Now is the time of the last update, for ages and countdowns.
	Now time.Time
	// Updates counts the updates applied, data and ticks alike.
	Updates int

	audited map[auditKey]bool
}

type auditKey struct {
	index uint64
	seq   uint32
}

// Apply folds u into the state; now stamps events that carry no time.
func (s *State) Apply(u Update, now time.Time) {
	if s.Leases == nil {
		s.Leases = map[string]*gpupoolv1.Lease{}
		s.Errors = map[string]string{}
		s.audited = map[auditKey]bool{}
	}
	s.Now = now
	s.Updates++
	switch u := u.(type) {
	case HostsUpdate:
		s.Hosts = u.Hosts
	case StatusUpdate:
		s.Status = u.Status
	case QueueUpdate:
		s.Queue = u.Pending
	case LeasesReset:
		s.Leases = map[string]*gpupoolv1.Lease{}
	case LeaseUpdate:
		s.applyLease(u.Event, now)
	case AuditUpdate:
		s.applyAudit(u.Entry, now)
	case ErrorUpdate:
		if u.Err == nil {
			delete(s.Errors, u.What)
		} else {
			s.Errors[u.What] = errorText(u.Err)
		}
	case Tick:
		s.Now = u.Now
	}
}

// errorText drops gRPC's "rpc error: code = X desc = " wrapping.
func errorText(err error) string {
	msg := err.Error()
	if i := strings.Index(msg, " desc = "); i >= 0 && strings.HasPrefix(msg, "rpc error: code = ") {
		code := strings.TrimPrefix(msg[:i], "rpc error: code = ")
		return code + ": " + msg[i+len(" desc = "):]
	}
	return msg
}

func isEnded(st gpupoolv1.LeaseState) bool {
	switch st {
	case gpupoolv1.LeaseState_LEASE_STATE_RELEASED, gpupoolv1.LeaseState_LEASE_STATE_EXPIRED, gpupoolv1.LeaseState_LEASE_STATE_REVOKED:
		return true
	}
	return false
}

// enumLabel is an enum value's name less its prefix, in lower case with
// spaces: LEASE_EVENT_TYPE_DRAIN_NOTICE -> "drain notice".
func enumLabel(name, prefix string) string {
	return strings.ReplaceAll(strings.ToLower(strings.TrimPrefix(name, prefix)), "_", " ")
}

func stateLabel(st gpupoolv1.LeaseState) string { return enumLabel(st.String(), "LEASE_STATE_") }

func msTime(ms int64, fallback time.Time) time.Time {
	if ms <= 0 {
		return fallback
	}
	return time.UnixMilli(ms)
}

func (s *State) applyLease(ev *gpupoolv1.LeaseEvent, now time.Time) {
	l := ev.GetLease()
	if l == nil {
		return
	}
	if ev.Type == gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_ENDED || isEnded(l.State) {
		delete(s.Leases, l.Id)
	} else {
		s.Leases[l.Id] = l
	}
	var text string
	at := now
	switch ev.Type {
	case gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_SNAPSHOT, gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_UPDATED,
		gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_UNSPECIFIED:
		return // states, not changes
	case gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_GRANTED:
		at = msTime(l.StateChangedAtMs, now)
		text = describeSlices(l)
	case gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_ENDED:
		at = msTime(l.StateChangedAtMs, now)
		text = stateLabel(l.State)
		if l.Reason != "" {
			text += ": " + l.Reason
		}
	default:
		text = ev.Message
		if text == "" {
			text = l.Reason
		}
	}
	var models []string
	for _, sl := range l.Slices {
		if !slices.Contains(models, sl.Model) {
			models = append(models, sl.Model)
		}
	}
	s.addEvent(Event{At: at, Kind: enumLabel(ev.Type.String(), "LEASE_EVENT_TYPE_"), Subject: l.Id, Tenant: l.Tenant, Text: text, Models: models})
}

// describeSlices says what a lease holds: "A100-SXM4-80GB 20GiB/25% on host-1".
func describeSlices(l *gpupoolv1.Lease) string {
	var parts []string
	for _, sl := range l.Slices {
		what := quantity.FormatMiB(sl.MemoryMib) + " " + strconv.Itoa(int(sl.ComputePercent)) + "%"
		if sl.Exclusive {
			what = "whole"
		}
		parts = append(parts, sl.Model+" "+what+" on "+sl.Host)
	}
	return strings.Join(parts, ", ")
}

func (s *State) applyAudit(a *gpupoolv1.AuditEntry, now time.Time) {
	if a == nil {
		return
	}
	k := auditKey{a.Index, a.Seq}
	if s.audited[k] {
		return
	}
	s.audited[k] = true
	if len(s.audited) > 4*MaxEvents {
		// Entries come in index order: forget the oldest keys.
		keys := make([]auditKey, 0, len(s.audited))
		for k := range s.audited {
			keys = append(keys, k)
		}
		sort.Slice(keys, func(i, j int) bool {
			return keys[i].index < keys[j].index || keys[i].index == keys[j].index && keys[i].seq < keys[j].seq
		})
		for _, k := range keys[:len(keys)-2*MaxEvents] {
			delete(s.audited, k)
		}
	}
	switch a.Kind {
	case gpupoolv1.AuditKind_AUDIT_KIND_LEASE_GRANTED, gpupoolv1.AuditKind_AUDIT_KIND_LEASE_RELEASED,
		gpupoolv1.AuditKind_AUDIT_KIND_LEASE_EXPIRED, gpupoolv1.AuditKind_AUDIT_KIND_LEASE_REVOKED,
		gpupoolv1.AuditKind_AUDIT_KIND_LEASE_PREEMPTED:
		return // the lease watch tells these
	}
	text := a.Detail
	if by := a.GetActor().GetName(); by != "" {
		text = strings.TrimSpace(text + " (by " + by + ")")
	}
	s.addEvent(Event{At: msTime(a.AtMs, now), Kind: enumLabel(a.Kind.String(), "AUDIT_KIND_"), Subject: a.Subject, Tenant: a.Tenant, Text: text})
}

func (s *State) addEvent(e Event) {
	s.Events = append(s.Events, e)
	if len(s.Events) > MaxEvents {
		s.Events = append([]Event(nil), s.Events[len(s.Events)-MaxEvents:]...)
	}
}
