package broker

import (
	"fmt"
	"slices"
	"strings"

	"google.golang.org/grpc"

	"github.com/gpupool/gpupool/broker/fsm"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
	"github.com/gpupool/gpupool/protocol"
)

// AuditLog is served from this server's own state, like Watch: every
// server applies the same log and so holds the same audit entries. A
// follower may be a little behind the leader; it never shows an entry the
// leader has not committed.
//
// A client token sees the entries of its tenants only (its leases and
// quotas); drains, eligibility and token changes, which have no tenant,
// are for management tokens.
func (e operatorService) AuditLog(req *gpupoolv1.AuditLogRequest, stream grpc.ServerStreamingServer[gpupoolv1.AuditEntry]) error {
	c := callerFrom(stream.Context())
	if req.Tenant != "" {
		if err := protocol.ValidateTenant("tenant", req.Tenant); err != nil {
			return err
		}
		if err := c.mayActFor(req.Tenant, "tenant"); err != nil {
			return err
		}
	}
	for i, k := range req.Kinds {
		if fsm.AuditKindName(k) == "" || gpupoolv1.AuditKind_name[int32(k)] == "" {
			return refusef(ErrInvalid, "kinds[%d] %d: must be one of %s", i, k, auditKindList())
		}
	}
	match := func(a *gpupoolv1.AuditEntry) bool {
		if req.Tenant != "" && a.Tenant != req.Tenant {
			return false
		}
		if len(req.Kinds) > 0 && !slices.Contains(req.Kinds, a.Kind) {
			return false
		}
		return c.management() || (a.Tenant != "" && slices.Contains(c.token.Tenants, a.Tenant))
	}
	var events <-chan fsm.Event
	if req.Follow {
		// Subscribe before reading the stored entries, so that none
		// applied in between is missed; those read are skipped below.
		ch, cancel := e.fsm.Subscribe()
		defer cancel()
		events = ch
	}
	// last is the index up to which every matching entry was sent.
	last := req.SinceIndex
	sendStored := func(limit int) error {
		st := e.fsm.State()
		var out []*gpupoolv1.AuditEntry
		for _, a := range st.AuditLog(last) {
			if match(a) {
				out = append(out, a)
			}
		}
		if limit > 0 && len(out) > limit {
			out = out[len(out)-limit:]
		}
		for _, a := range out {
			if err := stream.Send(a); err != nil {
				return err
			}
		}
		last = max(last, st.Index())
		return nil
	}
	if err := sendStored(int(req.Limit)); err != nil {
		return err
	}
	if !req.Follow {
		return nil
	}
	for {
		select {
		case <-stream.Context().Done():
			return nil
		case <-e.ctx.Done():
			return refuse(ErrUnavailable, "server shutting down")
		case ev, ok := <-events:
			if !ok {
				return refusef(ErrExhausted, "audit log follow fell too far behind; resume with since_index %d", last)
			}
			if ev.Reset {
				// A restored snapshot: send what it holds after what was sent.
				if err := sendStored(0); err != nil {
					return err
				}
				continue
			}
			if ev.Audit == nil || ev.Index <= last || !match(ev.Audit) {
				continue
			}
			if err := stream.Send(ev.Audit); err != nil {
				return err
			}
			// The entries of one index are published together: those
			// before it are all sent.
			last = max(last, ev.Index-1)
		}
	}
}

// auditKindList is the kinds as the CLI spells them, for error messages.
func auditKindList() string {
	var names []string
	for _, k := range fsm.AuditKinds() {
		names = append(names, fmt.Sprintf("%s (%d)", fsm.AuditKindName(k), k))
	}
	return strings.Join(names, ", ")
}
