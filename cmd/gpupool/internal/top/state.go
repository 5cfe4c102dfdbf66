package top

import (
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/gpupool/gpupool/internal/quantity"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
	"github.com/gpupool/gpupool/protocol"
)

// MaxEvents is how many recent events a State keeps.
const MaxEvents = 200

// Event is one line of "recent events": a lease change from the watch or
// an entry of the audit log (drains, eligibility, quotas, tokens, lease
// grants and ends; a grant or end both tell is shown once).
type Event struct {
	At      time.Time
	Kind    string // "granted", "violation", "drain started", ...
	Subject string // a lease id, host id, tenant or token
	Tenant  string
	Text    string
	// Models are the GPU models of the lease's slices, for the model
	// filter; empty for events that are not about a lease's slices.
	Models []string

	once string // the onceKey of a lease's grant or end
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
	// told are the lease grants and ends shown (onceKey), oldest first in
	// toldOrder, so that the watch and the audit log do not both show one.
	told      map[string]bool
	toldOrder []string
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
	if ev.Type == gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_ENDED || protocol.LeaseEnded(l.State) {
		delete(s.Leases, l.Id)
	} else {
		s.Leases[l.Id] = l
	}
	kind := enumLabel(ev.Type.String(), "LEASE_EVENT_TYPE_")
	var text string
	at := now
	switch ev.Type {
	case gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_SNAPSHOT, gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_UPDATED,
		gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_RELEASING, gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_UNSPECIFIED:
		return // states, not news (a release is told by the audit log or the end)
	case gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_GRANTED:
		at = msTime(l.StateChangedAtMs, now)
		text = describeSlices(l)
	case gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_ENDED:
		at = msTime(l.StateChangedAtMs, now)
		kind = stateLabel(l.State)
		text = l.Reason
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
	e := Event{At: at, Kind: kind, Subject: l.Id, Tenant: l.Tenant, Text: text, Models: models, once: onceKey(kind, l.Id)}
	if e.once != "" && s.told[e.once] {
		// The audit log told it first: the watch knows more (the
		// slices' models and sizes), so its text replaces the entry's.
		for i := len(s.Events) - 1; i >= 0; i-- {
			if s.Events[i].once == e.once {
				s.Events[i].Text, s.Events[i].Models = e.Text, e.Models
				break
			}
		}
		return
	}
	s.addEventOnce(e.once, e)
}

// onceKey names a lease's grant or end, which both the lease watch and
// the audit log tell: whichever comes first is shown.
func onceKey(kind, lease string) string {
	switch kind {
	case "granted":
		return "granted/" + lease
	case "released", "expired", "revoked", "preempted":
		return "ended/" + lease
	}
	return ""
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
	kind := enumLabel(a.Kind.String(), "AUDIT_KIND_")
	once := ""
	var models []string
	if lease, ok := strings.CutPrefix(kind, "lease "); ok {
		kind = lease
		once = onceKey(kind, a.Subject)
		if l := s.Leases[a.Subject]; l != nil {
			for _, sl := range l.Slices {
				if !slices.Contains(models, sl.Model) {
					models = append(models, sl.Model)
				}
			}
		}
	}
	text := a.Detail
	if by := a.GetActor().GetName(); by != "" {
		text = strings.TrimSpace(text + " (by " + by + ")")
	}
	s.addEventOnce(once, Event{At: msTime(a.AtMs, now), Kind: kind, Subject: a.Subject, Tenant: a.Tenant, Text: text, Models: models, once: once})
}

// addEventOnce adds e unless an event of the same non-empty key was
// added already.
func (s *State) addEventOnce(key string, e Event) {
	if key != "" {
		if s.told[key] {
			return
		}
		if s.told == nil {
			s.told = map[string]bool{}
		}
		s.told[key] = true
		s.toldOrder = append(s.toldOrder, key)
		if len(s.toldOrder) > 4*MaxEvents {
			for _, k := range s.toldOrder[:2*MaxEvents] {
				delete(s.told, k)
			}
			s.toldOrder = append([]string(nil), s.toldOrder[2*MaxEvents:]...)
		}
	}
	s.addEvent(e)
}

func (s *State) addEvent(e Event) {
	s.Events = append(s.Events, e)
	if len(s.Events) > MaxEvents {
		s.Events = append([]Event(nil), s.Events[len(s.Events)-MaxEvents:]...)
	}
}
