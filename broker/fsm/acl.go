package fsm

import (
	"fmt"
	"slices"

	"github.com/gpupool/gpupool/broker/state"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
	"github.com/gpupool/gpupool/protocol"
)

// BrokerActor is the actor of what the leader does on its own: lease
// expiry, a host going down, a drain deadline, preemption, elastic growth.
func BrokerActor() *gpupoolv1.Actor { return &gpupoolv1.Actor{Name: "broker"} }

// actorOr returns a, or the broker when a is unset.
func actorOr(a *gpupoolv1.Actor) *gpupoolv1.Actor {
	if a == nil {
		return BrokerActor()
	}
	return clone(a)
}

// SecretHashLen is the length of a token secret's SHA-256.
const SecretHashLen = 32

// ValidateACLToken checks that a token's kind and scope fit together. It
// returns a *protocol.FieldError naming the field, so the API and Apply refuse
// the same tokens with the same words.
func ValidateACLToken(t *gpupoolv1.AclToken) error {
	if t.GetName() == "" {
		return &protocol.FieldError{Field: "name", Value: `""`, Allowed: "is required"}
	}
	if len(t.Name) > 128 {
		return &protocol.FieldError{Field: "name", Value: fmt.Sprintf("of %d bytes", len(t.Name)), Allowed: "must be at most 128 bytes"}
	}
	client := t.Kind == gpupoolv1.TokenKind_TOKEN_KIND_CLIENT
	switch t.Kind {
	case gpupoolv1.TokenKind_TOKEN_KIND_MANAGEMENT, gpupoolv1.TokenKind_TOKEN_KIND_CLIENT, gpupoolv1.TokenKind_TOKEN_KIND_AGENT:
	default:
		return &protocol.FieldError{Field: "kind", Value: t.Kind, Allowed: "must be management, client or agent"}
	}
	if client && len(t.Tenants) == 0 {
		return &protocol.FieldError{Field: "tenants", Value: "[]", Allowed: "a client token needs at least one tenant"}
	}
	if !client && len(t.Tenants) > 0 {
		return &protocol.FieldError{Field: "tenants", Value: t.Tenants, Allowed: "only client tokens have tenants"}
	}
	for i, tn := range t.Tenants {
		if err := protocol.ValidateTenant(fmt.Sprintf("tenants[%d]", i), tn); err != nil {
			return err
		}
		if slices.Index(t.Tenants, tn) != i {
			return &protocol.FieldError{Field: fmt.Sprintf("tenants[%d]", i), Value: fmt.Sprintf("%q", tn), Allowed: "is listed twice"}
		}
	}
	if t.MaxPriority != nil {
		if !client {
			return &protocol.FieldError{Field: "max_priority", Value: *t.MaxPriority, Allowed: "only client tokens have a priority limit"}
		}
		if *t.MaxPriority < 0 || *t.MaxPriority > protocol.MaxPriority {
			return &protocol.FieldError{Field: "max_priority", Value: *t.MaxPriority, Allowed: fmt.Sprintf("must be between 0 and %d", protocol.MaxPriority)}
		}
	}
	if t.PreemptibleOnly && !client {
		return &protocol.FieldError{Field: "preemptible_only", Value: true, Allowed: "only client tokens can be limited to preemptible leases"}
	}
	agent := t.Kind == gpupoolv1.TokenKind_TOKEN_KIND_AGENT
	if agent && t.HostId == "" {
		return &protocol.FieldError{Field: "host_id", Value: `""`, Allowed: "an agent token needs the host id it joins as"}
	}
	if !agent && t.HostId != "" {
		return &protocol.FieldError{Field: "host_id", Value: fmt.Sprintf("%q", t.HostId), Allowed: "only agent tokens have a host id"}
	}
	if t.ExpiresAtMs < 0 {
		return &protocol.FieldError{Field: "expires_at_ms", Value: t.ExpiresAtMs, Allowed: "must be 0 (never) or a time"}
	}
	return nil
}

// applyCreateACLToken stores a new token, refused whole when it is
// malformed, collides with a stored one, or is a second bootstrap.
func applyCreateACLToken(w *state.Writer, index uint64, c *gpupoolv1.CreateAclTokenCommand) *Result {
	t := clone(c.GetToken())
	if t.GetAccessorId() == "" || len(t.SecretSha256) != SecretHashLen {
		return &Result{Err: fmt.Errorf("%w: token without accessor id or a %d-byte secret hash", ErrInvalid, SecretHashLen)}
	}
	if err := ValidateACLToken(t); err != nil {
		return &Result{Err: fmt.Errorf("%w: token %s: %v", ErrInvalid, t.AccessorId, err)}
	}
	if t.Revoked || t.Expired {
		return &Result{Err: fmt.Errorf("%w: token %s: a new token cannot be revoked or expired", ErrInvalid, t.AccessorId)}
	}
	if c.Bootstrap {
		if t.Kind != gpupoolv1.TokenKind_TOKEN_KIND_MANAGEMENT {
			return &Result{Err: fmt.Errorf("%w: the bootstrap token must be a management token", ErrInvalid)}
		}
		if at := w.ACLBootstrapIndex(); at != 0 {
			return &Result{Err: &PreconditionError{Reason: fmt.Sprintf("ACL already bootstrapped (log index %d): a cluster has one bootstrap token; create more tokens with a management token ('gpupool operator acl token create')", at)}}
		}
		t.Bootstrap = true
		w.SetACLBootstrapIndex(index)
	} else {
		t.Bootstrap = false
	}
	if w.ACLToken(t.AccessorId) != nil {
		return &Result{Err: fmt.Errorf("%w: token accessor id %s already exists", ErrInvalid, t.AccessorId)}
	}
	if w.ACLTokenBySecret(t.SecretSha256) != nil {
		return &Result{Err: fmt.Errorf("%w: token %s: its secret hash is already stored", ErrInvalid, t.AccessorId)}
	}
	w.PutACLToken(t)
	kind := gpupoolv1.AuditKind_AUDIT_KIND_ACL_TOKEN_CREATED
	if t.Bootstrap {
		kind = gpupoolv1.AuditKind_AUDIT_KIND_ACL_BOOTSTRAP
	}
	w.Audit(&gpupoolv1.AuditEntry{AtMs: t.CreatedAtMs, Kind: kind, Actor: actorOr(t.CreatedBy), Subject: t.AccessorId, Detail: tokenText(t)})
	return &Result{Token: t}
}

// applyRevokeACLToken marks a token revoked, and with revoke_leases
// revokes the granted and pending leases it acquired. A revoked token
// keeps its first revocation.
func applyRevokeACLToken(w *state.Writer, index uint64, c *gpupoolv1.RevokeAclTokenCommand) (*Result, []Event) {
	old := w.ACLToken(c.GetAccessorId())
	if old == nil {
		return &Result{Err: fmt.Errorf("token %q: %w", c.GetAccessorId(), ErrNotFound)}, nil
	}
	if old.Revoked {
		return &Result{Token: old}, nil
	}
	t := clone(old)
	t.Revoked = true
	t.RevokedAtMs = c.NowMs
	t.RevokedBy = actorOr(c.Actor)
	w.PutACLToken(t)
	w.Audit(&gpupoolv1.AuditEntry{AtMs: c.NowMs, Kind: gpupoolv1.AuditKind_AUDIT_KIND_ACL_TOKEN_REVOKED, Actor: clone(t.RevokedBy),
		Subject: t.AccessorId, Detail: tokenText(t)})
	res := &Result{Token: t}
	if !c.RevokeLeases {
		return res, nil
	}
	var evs []Event
	for _, l := range w.Leases() {
		if l.GetGrantedBy().GetAccessorId() != t.AccessorId ||
			(l.State != gpupoolv1.LeaseState_LEASE_STATE_GRANTED && l.State != gpupoolv1.LeaseState_LEASE_STATE_PENDING) {
			continue
		}
		r, e := applyEndLease(w, index, &gpupoolv1.EndLeaseCommand{LeaseId: l.Id, EndState: gpupoolv1.LeaseState_LEASE_STATE_REVOKED,
			Reason: "the ACL token that acquired it (" + t.AccessorId + ") was revoked", NowMs: c.NowMs, Actor: c.Actor})
		if r.Err != nil {
			return r, nil
		}
		res.Ended = append(res.Ended, l.Id)
		evs = append(evs, e...)
	}
	return res, evs
}
