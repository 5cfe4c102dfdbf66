package fsm

import (
	"fmt"

	"github.com/gpupool/gpupool/broker/state"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// A host's identity is its data-plane address and the fingerprint of its
// data-plane certificate: lease holders dial the one and pin the other.
// Whoever can change them while the host holds leases can capture the
// holders' lease tokens, so a registration that changes them is audited,
// and refused while the host holds a live lease unless an operator reset
// the identity first (ResetHostIdentityCommand).

// IdentityError is a registration refused because it would change the
// identity of a host that holds live leases.
type IdentityError struct {
	Host   string
	Change string
	Leases int
}

func (e *IdentityError) Error() string {
	return fmt.Sprintf("host %s registered with a new %s while it holds %d live %s: refused; if the host really changed, an operator confirms with 'gpupool host reset-identity %s'",
		e.Host, e.Change, e.Leases, pluralWord(e.Leases, "lease", "leases"), e.Host)
}

// identityChange describes how h's identity differs from old's, "" if it
// does not.
func identityChange(old, h *gpupoolv1.Host) string {
	var parts []string
	if old.GetAddress() != h.GetAddress() {
		parts = append(parts, fmt.Sprintf("data-plane address %q (was %q)", h.GetAddress(), old.GetAddress()))
	}
	if old.GetCertSha256() != h.GetCertSha256() {
		parts = append(parts, fmt.Sprintf("certificate fingerprint %s (was %s)", short(h.GetCertSha256()), short(old.GetCertSha256())))
	}
	switch len(parts) {
	case 0:
		return ""
	case 1:
		return parts[0]
	}
	return parts[0] + " and " + parts[1]
}

func short(sha string) string {
	if sha == "" {
		return "none"
	}
	if len(sha) > 16 {
		return sha[:16] + "…"
	}
	return sha
}

// liveLeases counts the leases on a host that are not ended.
func liveLeases(r *state.Reader, hostID string) int {
	n := 0
	for _, l := range r.HostLeases(hostID) {
		switch l.State {
		case gpupoolv1.LeaseState_LEASE_STATE_GRANTED, gpupoolv1.LeaseState_LEASE_STATE_RELEASING, gpupoolv1.LeaseState_LEASE_STATE_PENDING:
			n++
		}
	}
	return n
}

// checkIdentity audits a registration's identity and returns the result
// of a refused one, nil if it may apply. A new host's identity, a change
// of a host without live leases, and a change after a reset (the stored
// identity is empty) are recorded; a change under live leases is refused
// and recorded.
func checkIdentity(w *state.Writer, old, h *gpupoolv1.Host, nowMs int64) *Result {
	actor := &gpupoolv1.Actor{Name: "agent " + h.Id}
	if old == nil {
		w.Audit(&gpupoolv1.AuditEntry{AtMs: nowMs, Kind: gpupoolv1.AuditKind_AUDIT_KIND_HOST_REGISTERED, Actor: actor, Subject: h.Id,
			Detail: fmt.Sprintf("data-plane address %q, certificate fingerprint %s", h.GetAddress(), short(h.GetCertSha256()))})
		return nil
	}
	change := identityChange(old, h)
	if change == "" {
		return nil
	}
	reset := old.GetAddress() == "" && old.GetCertSha256() == ""
	if n := liveLeases(&w.Reader, h.Id); n > 0 && !reset {
		err := &IdentityError{Host: h.Id, Change: change, Leases: n}
		w.Audit(&gpupoolv1.AuditEntry{AtMs: nowMs, Kind: gpupoolv1.AuditKind_AUDIT_KIND_HOST_IDENTITY_REFUSED, Actor: actor, Subject: h.Id,
			Detail: fmt.Sprintf("new %s refused: %d live %s", change, n, pluralWord(n, "lease", "leases"))})
		return &Result{Err: err, RecordRefusal: true}
	}
	detail := "new " + change
	if reset {
		detail += ", after an operator's reset"
	}
	w.Audit(&gpupoolv1.AuditEntry{AtMs: nowMs, Kind: gpupoolv1.AuditKind_AUDIT_KIND_HOST_IDENTITY_CHANGED, Actor: actor, Subject: h.Id, Detail: detail})
	return nil
}

// applyResetHostIdentity forgets a host's address and certificate
// fingerprint.
func applyResetHostIdentity(w *state.Writer, c *gpupoolv1.ResetHostIdentityCommand) (*Result, []Event) {
	old := w.Host(c.HostId)
	if old == nil {
		return &Result{Err: fmt.Errorf("host %q: %w", c.HostId, ErrNotFound)}, nil
	}
	h := clone(old)
	h.Address, h.CertSha256 = "", ""
	w.PutHost(h)
	detail := fmt.Sprintf("forgot data-plane address %q and certificate fingerprint %s", old.GetAddress(), short(old.GetCertSha256()))
	if c.Reason != "" {
		detail += ": " + c.Reason
	}
	w.Audit(&gpupoolv1.AuditEntry{AtMs: c.NowMs, Kind: gpupoolv1.AuditKind_AUDIT_KIND_HOST_IDENTITY_RESET, Actor: actorOr(c.Actor), Subject: h.Id, Detail: detail})
	return &Result{Host: h}, []Event{{Host: h}}
}
