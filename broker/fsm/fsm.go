// Package fsm is the broker's deterministic state machine: it applies
// Raft log commands to the state store.
//
// Apply is a pure function of the current state and the command: no
// clocks, no randomness, no I/O. Times and ids are stamped by the RPC
// handler before the command enters the log. Apply, Snapshot and Restore
// are always called from raft's FSM goroutine.
package fsm

import (
	"errors"
	"fmt"
	"google.golang.org/protobuf/encoding/protojson"
	"io"
	"log/slog"
	"sync/atomic"

	"github.com/hashicorp/raft"
	"google.golang.org/protobuf/proto"

	"github.com/gpupool/gpupool/broker/placement"
	"github.com/gpupool/gpupool/broker/state"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

var (
	// ErrNotFound wraps lookups of an unknown lease or host.
	ErrNotFound = errors.New("not found")
	// ErrInvalid wraps a command that is malformed; it changes nothing.
	ErrInvalid = errors.New("invalid command")
)

// ConflictError is a grant that no longer fits the state it is applied to:
// something changed between placement and Apply.
type ConflictError struct{ Reason string }

func (e *ConflictError) Error() string { return "grant no longer fits: " + e.Reason }

// PreconditionError is a command the state does not allow as it is, such
// as cancelling a drain that is not under way. Retrying will not help
// until the state changes.
type PreconditionError struct{ Reason string }

func (e *PreconditionError) Error() string { return e.Reason }

// Result is what Apply returns for every command.
type Result struct {
	Lease *gpupoolv1.Lease
	Host  *gpupoolv1.Host
	// Token is the ACL token a token command created or revoked.
	Token *gpupoolv1.AclToken
	// Ended are the leases a command ended besides its subject (a revoked
	// token's).
	Ended []string
	// Collected is how many ended leases a CollectEndedLeases removed.
	Collected int
	// Claim is the tenant claim in force after a ClaimTenant, Replaced the
	// other cluster's claim it took over.
	Claim, Replaced *gpupoolv1.TenantClaim
	// Existing is set when a grant matched an earlier one by request id.
	Existing bool
	Err      error
	// RecordRefusal, with Err, commits the audit entries Apply wrote and
	// nothing else: the refusal itself is recorded.
	RecordRefusal bool
}

// FSM implements raft.FSM over a state store.
type FSM struct {
	store *state.Store
	index *placement.Index
	log   *slog.Logger
	pub   publisher
	// sink receives the audit entries of every applied command as JSON
	// lines; nil for none. Written only from Apply.
	sink io.Writer
	// unknown counts log entries of command types this binary does not
	// know, which it did not apply.
	unknown atomic.Uint64
}

// Option configures an FSM.
type Option func(*FSM)

// WithAuditSink makes Apply write every audit entry it commits to w, as
// one JSON object per line (protojson), after the commit. A nil w writes
// nothing. A failed write is logged; it never fails the command.
func WithAuditSink(w io.Writer) Option { return func(f *FSM) { f.sink = w } }

// UnknownCommands is how many log entries of unknown command types this
// FSM skipped.
func (f *FSM) UnknownCommands() uint64 { return f.unknown.Load() }

// New returns an FSM over an empty store.
func New(logger *slog.Logger, opts ...Option) *FSM {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	f := &FSM{store: state.New(), index: placement.NewIndex(nil, nil), log: logger}
	f.store.ObservePool(f.index)
	for _, o := range opts {
		o(f)
	}
	return f
}

// writeAudit writes entries to the sink.
func (f *FSM) writeAudit(entries []*gpupoolv1.AuditEntry) {
	if f.sink == nil || len(entries) == 0 {
		return
	}
	var buf []byte
	for _, e := range entries {
		b, err := protojson.MarshalOptions{UseEnumNumbers: false}.Marshal(e)
		if err != nil {
			f.log.Error("audit sink: encoding an entry failed", "index", e.Index, "err", err)
			continue
		}
		buf = append(append(buf, b...), '\n')
	}
	if _, err := f.sink.Write(buf); err != nil {
		f.log.Error("audit sink: writing failed", "err", err)
	}
}

// PoolIndex is the placement index of the pool, kept up to date by every applied change and
// rebuilt by a restore. It is never behind State(): a change reaches it before it becomes
// visible there.
func (f *FSM) PoolIndex() *placement.Index { return f.index }

// State returns a consistent read view of the current state.
func (f *FSM) State() *state.Reader { return f.store.Read() }

// TokensVersion changes whenever an applied entry changed an ACL token,
// or a restore replaced them: see state.Store.TokensVersion.
func (f *FSM) TokensVersion() uint64 { return f.store.TokensVersion() }

// Apply applies one log entry and returns a *Result.
func (f *FSM) Apply(l *raft.Log) any {
	if l.Type != raft.LogCommand {
		return &Result{}
	}
	t, msg, err := Decode(l.Data)
	if errors.Is(err, ErrUnknownCommand) {
		// A command this binary cannot read. Leaders propose a command
		// only once every server reports a version that knows it, so this
		// is a server that joined or went back to an older binary
		// meanwhile. Applying nothing is the only safe choice: guessing
		// would misapply it, and stopping would take the server down.
		f.unknown.Add(1)
		if t&IgnoreUnknownTypeFlag != 0 {
			f.log.Warn("skipping unknown ignorable command; upgrade this server", "type", t&^IgnoreUnknownTypeFlag, "index", l.Index)
			return &Result{}
		}
		f.log.Error("refusing an unknown command: this server is older than the command's writer; its state now lags the cluster's until it is upgraded",
			"type", t, "index", l.Index, "fsm_version", Version)
		return &Result{Err: fmt.Errorf("log index %d: %w", l.Index, err)}
	}
	if err != nil {
		// A known command that does not decode: the log is corrupt here.
		// Stop rather than serve wrong answers.
		panic(fmt.Sprintf("fsm: log index %d: %v", l.Index, err))
	}
	return f.apply(l.Index, msg)
}

// apply runs one decoded command in a write transaction.
func (f *FSM) apply(index uint64, msg proto.Message) *Result {
	w := f.store.Write()
	var res *Result
	var evs []Event
	switch c := msg.(type) {
	case *gpupoolv1.UpsertServerCommand:
		w.PutServer(c)
		res = &Result{}
	case *gpupoolv1.RegisterHostCommand:
		res, evs = applyRegisterHost(w, index, c)
	case *gpupoolv1.SetHostStatusCommand:
		res, evs = applySetHostStatus(w, index, c)
	case *gpupoolv1.GrantLeaseCommand:
		res, evs = applyGrantLease(w, index, c)
	case *gpupoolv1.EndLeaseCommand:
		res, evs = applyEndLease(w, index, c)
	case *gpupoolv1.FreeLeaseCommand:
		res, evs = applyFreeLease(w, index, c)
	case *gpupoolv1.SetDeviceHealthCommand:
		res, evs = applySetDeviceHealth(w, index, c)
	case *gpupoolv1.RecordAgentEventsCommand:
		res, evs = applyRecordAgentEvents(w, index, c)
	case *gpupoolv1.SetSigningKeysCommand:
		res = applySetSigningKeys(w, c)
	case *gpupoolv1.DrainHostCommand:
		res, evs = applyDrainHost(w, index, c)
	case *gpupoolv1.SetHostEligibilityCommand:
		res, evs = applySetHostEligibility(w, c)
	case *gpupoolv1.SetQuotaCommand:
		res = applySetQuota(w, c)
	case *gpupoolv1.EnqueueLeaseCommand:
		res, evs = applyEnqueueLease(w, index, c)
	case *gpupoolv1.PreemptLeasesCommand:
		res, evs = applyPreemptLeases(w, index, c)
	case *gpupoolv1.CreateAclTokenCommand:
		res = applyCreateACLToken(w, index, c)
	case *gpupoolv1.RevokeAclTokenCommand:
		res, evs = applyRevokeACLToken(w, index, c)
	case *gpupoolv1.ResetHostIdentityCommand:
		res, evs = applyResetHostIdentity(w, c)
	case *gpupoolv1.CollectEndedLeasesCommand:
		res = applyCollectEndedLeases(w, c)
	case *gpupoolv1.ClaimTenantCommand:
		res = applyClaimTenant(w, c)
	default:
		res = &Result{Err: fmt.Errorf("%w: %T", ErrInvalid, msg)}
	}
	if res.Err != nil && !res.RecordRefusal {
		w.Abort()
		return res
	}
	w.Commit(index)
	f.writeAudit(w.Audited())
	for _, e := range w.Audited() {
		evs = append(evs, Event{Audit: e})
	}
	for i := range evs {
		evs[i].Index = index
	}
	f.pub.publish(evs)
	return res
}

// applySetSigningKeys replaces the token signing keys. Exactly one key
// signs (verify_until_ms 0); the others only verify.
func applySetSigningKeys(w *state.Writer, c *gpupoolv1.SetSigningKeysCommand) *Result {
	current := 0
	for _, k := range c.Keys {
		if k.Id == "" || len(k.PublicKey) != 32 || len(k.PrivateKey) != 64 {
			return &Result{Err: fmt.Errorf("%w: signing key %q is not an Ed25519 key pair", ErrInvalid, k.Id)}
		}
		if k.VerifyUntilMs == 0 {
			current++
		}
	}
	if current != 1 {
		return &Result{Err: fmt.Errorf("%w: %d current signing keys, want exactly 1", ErrInvalid, current)}
	}
	w.SetSigningKeys(c.Keys)
	return &Result{}
}

func clone[T proto.Message](m T) T { return proto.Clone(m).(T) }

func applyRegisterHost(w *state.Writer, index uint64, c *gpupoolv1.RegisterHostCommand) (*Result, []Event) {
	if c.GetHost().GetId() == "" {
		return &Result{Err: fmt.Errorf("%w: host id is empty", ErrInvalid)}, nil
	}
	h := clone(c.Host)
	h.Devices = nil
	old := w.Host(h.Id)
	if res := checkIdentity(w, old, h, c.NowMs); res != nil {
		return res, nil
	}
	if old == nil {
		h.RegisteredAtMs = c.NowMs
		h.Status = gpupoolv1.HostStatus_HOST_STATUS_READY
		h.Eligible = true
		h.StatusChangedAtMs = c.NowMs
		h.StatusReason = "registered"
		h.AllocatedCpuMillicores, h.AllocatedMemoryMib = 0, 0
		h.Drain = nil // only DrainHost starts a drain
	} else {
		h.RegisteredAtMs = old.RegisteredAtMs
		h.Eligible = old.Eligible
		h.AllocatedCpuMillicores = old.AllocatedCpuMillicores
		h.AllocatedMemoryMib = old.AllocatedMemoryMib
		h.Status, h.StatusReason, h.StatusChangedAtMs = old.Status, old.StatusReason, old.StatusChangedAtMs
		h.Drain = old.Drain // the agent does not know of drains
		switch old.Status {
		case gpupoolv1.HostStatus_HOST_STATUS_DRAINING, gpupoolv1.HostStatus_HOST_STATUS_DRAINED:
		case gpupoolv1.HostStatus_HOST_STATUS_READY:
		default:
			h.Status = upStatus(&w.Reader, old)
			h.StatusReason = "agent registered again"
			h.StatusChangedAtMs = c.NowMs
		}
	}
	h.LastHeartbeatAgeMs = 0
	reported := map[string]bool{}
	for _, d := range c.Devices {
		if d.GetUuid() == "" {
			return &Result{Err: fmt.Errorf("%w: host %s: a device has no uuid", ErrInvalid, h.Id)}, nil
		}
		if reported[d.Uuid] {
			return &Result{Err: fmt.Errorf("%w: host %s: device %s reported twice", ErrInvalid, h.Id, d.Uuid)}, nil
		}
		reported[d.Uuid] = true
		nd := clone(d)
		nd.HostId = h.Id
		if nd.Health == gpupoolv1.DeviceHealth_DEVICE_HEALTH_UNSPECIFIED {
			nd.Health = gpupoolv1.DeviceHealth_DEVICE_HEALTH_HEALTHY
		}
		nd.AllocatedMemoryMib, nd.AllocatedComputePercent, nd.AllocatedExclusive, nd.LeaseCount = 0, 0, false, 0
		if od := w.Device(d.Uuid); od != nil {
			if od.HostId != h.Id {
				return &Result{Err: fmt.Errorf("%w: device %s is already registered by host %s", ErrInvalid, d.Uuid, od.HostId)}, nil
			}
			nd.AllocatedMemoryMib, nd.AllocatedComputePercent = od.AllocatedMemoryMib, od.AllocatedComputePercent
			nd.AllocatedExclusive, nd.LeaseCount = od.AllocatedExclusive, od.LeaseCount
		}
		w.PutDevice(nd)
	}
	for _, od := range w.HostDevices(h.Id) {
		if reported[od.Uuid] {
			continue
		}
		if od.LeaseCount == 0 {
			w.DeleteDevice(od)
			continue
		}
		// Leases still hold it: keep it, but take no new ones.
		nd := clone(od)
		nd.Health = gpupoolv1.DeviceHealth_DEVICE_HEALTH_UNHEALTHY
		w.PutDevice(nd)
	}
	w.PutHost(h)
	return &Result{Host: h}, []Event{{Host: h}}
}

func applySetHostStatus(w *state.Writer, index uint64, c *gpupoolv1.SetHostStatusCommand) (*Result, []Event) {
	old := w.Host(c.HostId)
	if old == nil {
		return &Result{Err: fmt.Errorf("host %q: %w", c.HostId, ErrNotFound)}, nil
	}
	newStatus := c.Status
	if newStatus == gpupoolv1.HostStatus_HOST_STATUS_READY {
		newStatus = upStatus(&w.Reader, old) // a drain outlives a down
	}
	if old.Status == newStatus {
		return &Result{Host: old}, nil
	}
	h := clone(old)
	h.Status, h.StatusReason, h.StatusChangedAtMs = newStatus, c.Reason, c.NowMs
	w.PutHost(h)
	evs := []Event{{Host: h}}
	if c.Status == gpupoolv1.HostStatus_HOST_STATUS_DOWN {
		for _, l := range w.HostLeases(h.Id) {
			if l.State != gpupoolv1.LeaseState_LEASE_STATE_GRANTED && l.State != gpupoolv1.LeaseState_LEASE_STATE_PENDING {
				continue
			}
			nl := endLease(l, index, gpupoolv1.LeaseState_LEASE_STATE_REVOKED,
				fmt.Sprintf("host %s down: %s", h.Id, c.Reason), c.NowMs)
			nl.Lost = true
			w.PutLease(nl)
			auditLeaseEnd(w, nl, leaseEndKind(nl.EndState), c.NowMs)
			evs = append(evs, Event{Lease: nl, Type: gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_LOST})
		}
	}
	return &Result{Host: h}, evs
}

func applyGrantLease(w *state.Writer, index uint64, c *gpupoolv1.GrantLeaseCommand) (*Result, []Event) {
	l := clone(c.GetLease())
	if l.GetId() == "" || len(l.Slices) == 0 {
		return &Result{Err: fmt.Errorf("%w: grant without lease id or slices", ErrInvalid)}, nil
	}
	pending := w.Lease(l.Id)
	if pending != nil && pending.State != gpupoolv1.LeaseState_LEASE_STATE_PENDING {
		if pending.Tenant == l.Tenant && pending.RequestId == l.RequestId && l.RequestId != "" {
			return &Result{Lease: pending, Existing: true}, nil
		}
		return &Result{Err: fmt.Errorf("%w: lease id %s already exists", ErrInvalid, l.Id)}, nil
	}
	if pending == nil {
		if ex := w.LeaseByRequest(l.Tenant, l.RequestId); ex != nil {
			return &Result{Lease: ex, Existing: true}, nil
		}
	} else if pending.Tenant != l.Tenant || pending.RequestId != l.RequestId {
		return &Result{Err: fmt.Errorf("%w: grant of pending lease %s with another tenant or request id", ErrInvalid, l.Id)}, nil
	}
	if err := checkParent(&w.Reader, l); err != nil {
		return &Result{Err: err}, nil
	}
	if err := CheckQuota(&w.Reader, l); err != nil {
		return &Result{Err: err}, nil
	}
	devs := map[string]*gpupoolv1.Device{}
	hosts := map[string]*gpupoolv1.Host{}
	var order []string
	for _, s := range l.Slices {
		h := hosts[s.Host]
		if h == nil {
			old := w.Host(s.Host)
			if old == nil {
				return conflict("host %s is not registered", s.Host)
			}
			if old.Status != gpupoolv1.HostStatus_HOST_STATUS_READY || !old.Eligible {
				return conflict("host %s is %s and eligible=%t", s.Host, HostStatusName(old.Status), old.Eligible)
			}
			h = clone(old)
			hosts[s.Host] = h
		}
		d := devs[s.Device]
		if d == nil {
			old := w.Device(s.Device)
			if old == nil || old.HostId != s.Host {
				return conflict("device %s is not on host %s", s.Device, s.Host)
			}
			if old.Health == gpupoolv1.DeviceHealth_DEVICE_HEALTH_UNHEALTHY {
				return conflict("device %s on host %s is unhealthy", s.Device, s.Host)
			}
			d = clone(old)
			devs[s.Device] = d
			order = append(order, s.Device)
		}
		if err := placement.CheckSlice(d, s); err != nil {
			return conflict("%v", err)
		}
		placement.Allocate(d, s)
	}
	if l.HostCpuMillicores > 0 || l.HostMemoryMib > 0 {
		if len(hosts) != 1 {
			return conflict("host cpu and memory need every slice on one host, got %d hosts", len(hosts))
		}
		for _, h := range hosts {
			if free := h.CpuMillicores - h.AllocatedCpuMillicores; l.HostCpuMillicores > free {
				return conflict("host %s: %d millicores requested, %d free", h.Id, l.HostCpuMillicores, free)
			}
			if free := h.MemoryMib - h.AllocatedMemoryMib; l.HostMemoryMib > free {
				return conflict("host %s: %d MiB host memory requested, %d free", h.Id, l.HostMemoryMib, free)
			}
			h.AllocatedCpuMillicores += l.HostCpuMillicores
			h.AllocatedMemoryMib += l.HostMemoryMib
			w.PutHost(h)
		}
	}
	for _, id := range order {
		w.PutDevice(devs[id])
	}
	l.State = gpupoolv1.LeaseState_LEASE_STATE_GRANTED
	l.FencingToken = index
	l.CreateIndex, l.ModifyIndex = index, index
	l.StateChangedAtMs = l.CreatedAtMs
	l.Reason = "granted"
	l.GrantedBy = actorOr(l.GrantedBy)
	if pending != nil {
		if pending.GrantedBy != nil {
			l.GrantedBy = clone(pending.GrantedBy)
		}
		// The queue's arrival order and the wait stay on the record.
		l.CreateIndex, l.CreatedAtMs = pending.CreateIndex, pending.CreatedAtMs
		l.StateChangedAtMs = max(c.NowMs, l.CreatedAtMs)
		l.Reason = fmt.Sprintf("granted from the queue after %s", waitedText(l.StateChangedAtMs-l.CreatedAtMs))
	}
	w.ShareLease(l)
	w.PutLease(l)
	auditGrant(w, l, pending != nil)
	return &Result{Lease: l}, []Event{{Lease: l, Type: gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_GRANTED}}
}

// AnyHostDown reports whether a host of the lease is down or gone, so its
// agent cannot confirm teardown.
func AnyHostDown(r *state.Reader, l *gpupoolv1.Lease) bool {
	for _, id := range state.LeaseHosts(l) {
		h := r.Host(id)
		if h == nil || h.Status == gpupoolv1.HostStatus_HOST_STATUS_DOWN {
			return true
		}
	}
	return false
}

func conflict(format string, a ...any) (*Result, []Event) {
	return &Result{Err: &ConflictError{Reason: fmt.Sprintf(format, a...)}}, nil
}

func precondition(format string, a ...any) (*Result, []Event) {
	return &Result{Err: &PreconditionError{Reason: fmt.Sprintf(format, a...)}}, nil
}

// HostStatusName is the lower-case name of a host status ("ready",
// "down"), as the CLI, logs and metrics spell it.
func HostStatusName(s gpupoolv1.HostStatus) string {
	switch s {
	case gpupoolv1.HostStatus_HOST_STATUS_READY:
		return "ready"
	case gpupoolv1.HostStatus_HOST_STATUS_DRAINING:
		return "draining"
	case gpupoolv1.HostStatus_HOST_STATUS_DRAINED:
		return "drained"
	case gpupoolv1.HostStatus_HOST_STATUS_DOWN:
		return "down"
	}
	return "unknown"
}

// endLease returns a copy of l moved to RELEASING on its way to end.
func endLease(l *gpupoolv1.Lease, index uint64, end gpupoolv1.LeaseState, reason string, nowMs int64) *gpupoolv1.Lease {
	nl := clone(l)
	nl.State = gpupoolv1.LeaseState_LEASE_STATE_RELEASING
	nl.EndState = end
	nl.Reason = reason
	nl.StateChangedAtMs = nowMs
	nl.ModifyIndex = index
	nl.ExpiresAtMs = 0
	nl.EndedBy = BrokerActor()
	return nl
}

// endLeaseKind is the audit kind of what c does: a preemption, or the
// end its end state says.
func endLeaseKind(c *gpupoolv1.EndLeaseCommand) gpupoolv1.AuditKind {
	if c.Preempted && c.EndState == gpupoolv1.LeaseState_LEASE_STATE_REVOKED {
		return gpupoolv1.AuditKind_AUDIT_KIND_LEASE_PREEMPTED
	}
	return leaseEndKind(c.EndState)
}

func applyEndLease(w *state.Writer, index uint64, c *gpupoolv1.EndLeaseCommand) (*Result, []Event) {
	switch c.EndState {
	case gpupoolv1.LeaseState_LEASE_STATE_RELEASED, gpupoolv1.LeaseState_LEASE_STATE_EXPIRED, gpupoolv1.LeaseState_LEASE_STATE_REVOKED:
	default:
		return &Result{Err: fmt.Errorf("%w: end state %v", ErrInvalid, c.EndState)}, nil
	}
	l := w.Lease(c.LeaseId)
	if l == nil {
		return &Result{Err: fmt.Errorf("lease %q: %w", c.LeaseId, ErrNotFound)}, nil
	}
	if c.IfPending && l.State != gpupoolv1.LeaseState_LEASE_STATE_PENDING {
		return &Result{Lease: l}, nil
	}
	if l.State == gpupoolv1.LeaseState_LEASE_STATE_PENDING {
		// A pending lease holds nothing: it ends at once.
		nl := endLease(l, index, c.EndState, c.Reason, c.NowMs)
		nl.EndedBy = actorOr(c.Actor)
		nl.State, nl.EndState = c.EndState, gpupoolv1.LeaseState_LEASE_STATE_UNSPECIFIED
		w.PutLease(nl)
		auditLeaseEnd(w, nl, endLeaseKind(c), c.NowMs)
		return &Result{Lease: nl}, []Event{{Lease: nl, Type: gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_ENDED}}
	}
	if l.State != gpupoolv1.LeaseState_LEASE_STATE_GRANTED {
		// Already ending or ended: ending is idempotent.
		return &Result{Lease: l}, nil
	}
	nl := endLease(l, index, c.EndState, c.Reason, c.NowMs)
	nl.EndedBy = actorOr(c.Actor)
	nl.Lost = c.Lost
	w.PutLease(nl)
	auditLeaseEnd(w, nl, endLeaseKind(c), c.NowMs)
	return &Result{Lease: nl}, []Event{{Lease: nl, Type: gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_RELEASING}}
}

func applyFreeLease(w *state.Writer, index uint64, c *gpupoolv1.FreeLeaseCommand) (*Result, []Event) {
	l := w.Lease(c.LeaseId)
	if l == nil {
		return &Result{Err: fmt.Errorf("lease %q: %w", c.LeaseId, ErrNotFound)}, nil
	}
	if l.State != gpupoolv1.LeaseState_LEASE_STATE_RELEASING {
		return &Result{Lease: l}, nil
	}
	if c.RequireHostDown && !AnyHostDown(&w.Reader, l) {
		// The host came back before the lock-delay passed: only its
		// agent's teardown confirmation may free the capacity now.
		return &Result{Lease: l}, nil
	}
	devs := map[string]*gpupoolv1.Device{}
	var order []string
	for _, s := range l.Slices {
		d := devs[s.Device]
		if d == nil {
			old := w.Device(s.Device)
			if old == nil {
				continue // devices that hold leases are never deleted; be safe anyway
			}
			d = clone(old)
			devs[s.Device] = d
			order = append(order, s.Device)
		}
		placement.Free(d, s)
	}
	for _, id := range order {
		w.PutDevice(devs[id])
	}
	if l.HostCpuMillicores > 0 || l.HostMemoryMib > 0 {
		for _, hid := range state.LeaseHosts(l) {
			if old := w.Host(hid); old != nil {
				h := clone(old)
				h.AllocatedCpuMillicores = max(0, h.AllocatedCpuMillicores-l.HostCpuMillicores)
				h.AllocatedMemoryMib = max(0, h.AllocatedMemoryMib-l.HostMemoryMib)
				w.PutHost(h)
			}
		}
	}
	nl := clone(l)
	nl.State = l.EndState
	if c.Reason != "" {
		nl.Reason = l.Reason + "; " + c.Reason
	}
	nl.StateChangedAtMs = c.NowMs
	nl.ModifyIndex = index
	w.PutLease(nl)
	evs := []Event{{Lease: nl, Type: gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_ENDED}}
	return &Result{Lease: nl}, append(evs, settleDrains(w, nl, c.NowMs)...)
}

// Snapshot captures the state for raft. The returned snapshot is immutable.
//
// It only takes a read transaction, which go-memdb keeps consistent while
// writes go on: Persist encodes it, on Raft's snapshot goroutine, so that
// encoding a large state does not hold up Apply.
func (f *FSM) Snapshot() (raft.FSMSnapshot, error) {
	return &snapshot{state: f.store.Read()}, nil
}

// Restore replaces the state with a snapshot written by Persist.
func (f *FSM) Restore(rc io.ReadCloser) error {
	defer rc.Close()
	b, err := io.ReadAll(rc)
	if err != nil {
		return fmt.Errorf("fsm: read snapshot: %w", err)
	}
	if err := f.store.Restore(b, checkSnapshotVersion); err != nil {
		return err
	}
	f.pub.publish([]Event{{Reset: true, Index: f.store.Read().Index()}})
	return nil
}

type snapshot struct{ state *state.Reader }

func (s *snapshot) Persist(sink raft.SnapshotSink) error {
	b, err := s.state.Encode(SnapshotVersion)
	if err != nil {
		sink.Cancel()
		return err
	}
	if _, err := sink.Write(b); err != nil {
		sink.Cancel()
		return fmt.Errorf("fsm: write snapshot: %w", err)
	}
	return sink.Close()
}

func (s *snapshot) Release() {}
