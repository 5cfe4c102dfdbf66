package fsm

import (
	"fmt"
	"strings"

	"github.com/gpupool/gpupool/broker/state"
	"github.com/gpupool/gpupool/internal/quantity"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// The audit log records, for every change of who holds what or who may do
// what, who made it. Apply writes an entry with the change, in the same
// transaction, only when the command changes something: a retried or
// refused command writes none. An entry's time is the command's stamped
// time and its actor the one the command carries, or "broker" for the
// leader's timers, so replaying a log writes the same entries everywhere.

// AuditKindName is the lower-case, dashed name of an audit kind
// ("lease-granted"), as the CLI spells it; "" for UNSPECIFIED.
func AuditKindName(k gpupoolv1.AuditKind) string {
	if k == gpupoolv1.AuditKind_AUDIT_KIND_UNSPECIFIED {
		return ""
	}
	return strings.ReplaceAll(strings.ToLower(strings.TrimPrefix(k.String(), "AUDIT_KIND_")), "_", "-")
}

// AuditKinds returns every audit kind but UNSPECIFIED, in number order.
func AuditKinds() []gpupoolv1.AuditKind {
	var out []gpupoolv1.AuditKind
	for n := int32(1); ; n++ {
		if _, ok := gpupoolv1.AuditKind_name[n]; !ok {
			return out
		}
		out = append(out, gpupoolv1.AuditKind(n))
	}
}

// ParseAuditKind is the inverse of AuditKindName.
func ParseAuditKind(s string) (gpupoolv1.AuditKind, bool) {
	for _, k := range AuditKinds() {
		if AuditKindName(k) == s {
			return k, true
		}
	}
	return 0, false
}

// leaseEndKind is the audit kind of a lease ending in state end.
func leaseEndKind(end gpupoolv1.LeaseState) gpupoolv1.AuditKind {
	switch end {
	case gpupoolv1.LeaseState_LEASE_STATE_RELEASED:
		return gpupoolv1.AuditKind_AUDIT_KIND_LEASE_RELEASED
	case gpupoolv1.LeaseState_LEASE_STATE_EXPIRED:
		return gpupoolv1.AuditKind_AUDIT_KIND_LEASE_EXPIRED
	}
	return gpupoolv1.AuditKind_AUDIT_KIND_LEASE_REVOKED
}

// auditLeaseEnd records lease l ending, by its ender.
func auditLeaseEnd(w *state.Writer, l *gpupoolv1.Lease, kind gpupoolv1.AuditKind, nowMs int64) {
	w.Audit(&gpupoolv1.AuditEntry{AtMs: nowMs, Kind: kind, Actor: actorOr(l.EndedBy),
		Subject: l.Id, Tenant: l.Tenant, Detail: l.Reason})
}

// auditGrant records a lease granted.
func auditGrant(w *state.Writer, l *gpupoolv1.Lease, fromQueue bool) {
	hosts := state.LeaseHosts(l)
	n := len(l.Slices)
	detail := fmt.Sprintf("%d %s on %s %s, %s", n, pluralWord(n, "slice", "slices"),
		pluralWord(len(hosts), "host", "hosts"), strings.Join(hosts, ", "), className(l.Class))
	if l.Parent != "" {
		detail += "; extra of elastic lease " + l.Parent
	}
	if fromQueue {
		detail += "; " + l.Reason
	}
	w.Audit(&gpupoolv1.AuditEntry{AtMs: l.StateChangedAtMs, Kind: gpupoolv1.AuditKind_AUDIT_KIND_LEASE_GRANTED,
		Actor: actorOr(l.GrantedBy), Subject: l.Id, Tenant: l.Tenant, Detail: detail})
}

// auditHost records a change of a host's drain or eligibility.
func auditHost(w *state.Writer, kind gpupoolv1.AuditKind, hostID string, by *gpupoolv1.Actor, nowMs int64, detail string) {
	w.Audit(&gpupoolv1.AuditEntry{AtMs: nowMs, Kind: kind, Actor: actorOr(by), Subject: hostID, Detail: detail})
}

// drainText says what a drain does: its reason, deadline and force.
func drainText(d *gpupoolv1.HostDrain) string {
	s := fmt.Sprintf("%s; %s", d.Reason, DeadlineText(d.DeadlineMs))
	if d.Force {
		s += "; forced: every lease revoked"
	}
	return s
}

// quotaText is a quota's limits as people write them.
func quotaText(q *gpupoolv1.Quota) string {
	limit := func(n int64, f func(int64) string) string {
		if n == 0 {
			return "unlimited"
		}
		return f(n)
	}
	return fmt.Sprintf("gpus %s, memory %s, compute %s",
		limit(int64(q.Gpus), formatterOf("gpus")), limit(q.MemoryMib, quantity.FormatMiB), limit(q.ComputePercent, formatterOf("compute")))
}

// tokenText describes a token without its secret: kind, name and scope.
func tokenText(t *gpupoolv1.AclToken) string {
	kind := strings.ToLower(strings.TrimPrefix(t.Kind.String(), "TOKEN_KIND_"))
	s := fmt.Sprintf("%s token %q", kind, t.Name)
	if len(t.Tenants) > 0 {
		s += " for tenants " + strings.Join(t.Tenants, ", ")
	}
	if t.HostId != "" {
		s += " for host " + t.HostId
	}
	return s
}

func pluralWord(n int, one, many string) string {
	if n == 1 {
		return one
	}
	return many
}
