package broker

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
	"github.com/gpupool/gpupool/protocol"
)

// ACL tokens travel as gRPC metadata "authorization: Bearer <secret>".
//
// Every RPC but the brokers' own ClusterService and AclService.Bootstrap
// needs a token. The interceptors authenticate it on the server the call
// reaches (Unauthenticated for a missing, unknown, revoked or expired
// token) and check the method's right (PermissionDenied). Handlers then
// check what depends on the request: the tenant of a lease, an agent's
// host id.
//
// Forwarding: a follower forwards a call to the leader with the caller's
// own authorization header (leaderConn copies it), never with a token of
// its own, and the leader authenticates and authorizes the call again
// from scratch. The forwarded marker carries no authority, so a forwarded
// call can do exactly what the caller could do on the leader directly.

// AuthHeader is the gRPC metadata key of the ACL token.
const AuthHeader = "authorization"

// right is what a method needs of the caller's token.
type right int

const (
	// rightOpen: no token (the brokers' cluster forming; ACL bootstrap).
	rightOpen right = iota + 1
	// rightAny: any valid token.
	rightAny
	// rightLeases: a client token (leases of its tenants) or management.
	rightLeases
	// rightPoolRead: a client token or management.
	rightPoolRead
	// rightAgent: an agent token (its own host) or management.
	rightAgent
	// rightManage: a management token.
	rightManage
	// rightJoin: open while the cluster forms (before the ACL bootstrap),
	// then a management token: otherwise anyone could join as a voter and
	// read the whole state from the log.
	rightJoin
)

func (r right) String() string {
	switch r {
	case rightLeases:
		return "lease access (a client or management token)"
	case rightPoolRead:
		return "pool read access (a client or management token)"
	case rightAgent:
		return "agent access (an agent join token or a management token)"
	case rightManage, rightJoin:
		return "management (a management token)"
	}
	return "a valid token"
}

// methodRights is what every method needs. A method missing here is
// refused to everyone but management tokens (fail closed);
// TestEveryMethodHasARight keeps it complete.
var methodRights = map[string]right{
	gpupoolv1.ClusterService_ServerInfo_FullMethodName: rightOpen,
	gpupoolv1.ClusterService_Join_FullMethodName:       rightJoin,
	gpupoolv1.AclService_Bootstrap_FullMethodName:      rightOpen,
	healthpb.Health_Check_FullMethodName:               rightOpen,
	healthpb.Health_Watch_FullMethodName:               rightOpen,
	healthpb.Health_List_FullMethodName:                rightOpen,

	gpupoolv1.AclService_WhoAmI_FullMethodName:      rightAny,
	gpupoolv1.AclService_CreateToken_FullMethodName: rightManage,
	gpupoolv1.AclService_ListTokens_FullMethodName:  rightManage,
	gpupoolv1.AclService_RevokeToken_FullMethodName: rightManage,

	gpupoolv1.LeaseService_Acquire_FullMethodName:   rightLeases,
	gpupoolv1.LeaseService_KeepAlive_FullMethodName: rightLeases,
	gpupoolv1.LeaseService_Release_FullMethodName:   rightLeases,
	gpupoolv1.LeaseService_Get_FullMethodName:       rightLeases,
	gpupoolv1.LeaseService_List_FullMethodName:      rightLeases,
	gpupoolv1.LeaseService_Watch_FullMethodName:     rightLeases,
	// A client token claims its own tenants only (ClaimTenant checks).
	gpupoolv1.LeaseService_ClaimTenant_FullMethodName: rightLeases,

	gpupoolv1.PoolService_ListHosts_FullMethodName:         rightPoolRead,
	gpupoolv1.PoolService_GetHost_FullMethodName:           rightPoolRead,
	gpupoolv1.PoolService_ListDevices_FullMethodName:       rightPoolRead,
	gpupoolv1.PoolService_Status_FullMethodName:            rightPoolRead,
	gpupoolv1.PoolService_DrainHost_FullMethodName:         rightManage,
	gpupoolv1.PoolService_SetEligibility_FullMethodName:    rightManage,
	gpupoolv1.PoolService_ResetHostIdentity_FullMethodName: rightManage,
	gpupoolv1.PoolService_ClearDeviceHealth_FullMethodName: rightManage,

	gpupoolv1.AgentService_Register_FullMethodName:  rightAgent,
	gpupoolv1.AgentService_Heartbeat_FullMethodName: rightAgent,

	gpupoolv1.OperatorService_RaftPeers_FullMethodName:          rightManage,
	gpupoolv1.OperatorService_RemovePeer_FullMethodName:         rightManage,
	gpupoolv1.OperatorService_TransferLeadership_FullMethodName: rightManage,
	gpupoolv1.OperatorService_SnapshotSave_FullMethodName:       rightManage,
	gpupoolv1.OperatorService_SnapshotRestore_FullMethodName:    rightManage,
	gpupoolv1.OperatorService_RotateSigningKey_FullMethodName:   rightManage,
	gpupoolv1.OperatorService_ListSigningKeys_FullMethodName:    rightManage,
	gpupoolv1.OperatorService_SetQuota_FullMethodName:           rightManage,
	gpupoolv1.OperatorService_RemoveQuota_FullMethodName:        rightManage,
	gpupoolv1.OperatorService_ListQuotas_FullMethodName:         rightPoolRead, // a client sees its tenants' quotas
	gpupoolv1.OperatorService_AuditLog_FullMethodName:           rightLeases,   // a client sees its tenants' entries

	// Watch streams and history (console): the same rights as the reads
	// they follow; the queue and history show a client its tenants only.
	gpupoolv1.PoolService_WatchHosts_FullMethodName:        rightPoolRead,
	gpupoolv1.PoolService_WatchDevices_FullMethodName:      rightPoolRead,
	gpupoolv1.LeaseService_WatchQueue_FullMethodName:       rightLeases,
	gpupoolv1.OperatorService_TenantHistory_FullMethodName: rightPoolRead,
}

// caller is who makes a call: a verified token, or, with ACL off, anyone.
type caller struct {
	// token is nil when the broker runs without ACL; the caller may then
	// do everything.
	token *gpupoolv1.AclToken
}

var anonymous = &caller{}

type callerKey struct{}

// callerFrom returns the caller the interceptors verified; a context they
// did not see (the server's own in-process calls) gets the anonymous
// caller, which may do everything.
func callerFrom(ctx context.Context) *caller {
	if c, ok := ctx.Value(callerKey{}).(*caller); ok {
		return c
	}
	return anonymous
}

// actor is the caller for the audit trail.
func (c *caller) actor() *gpupoolv1.Actor {
	if c.token == nil {
		return &gpupoolv1.Actor{Name: "anonymous"}
	}
	return &gpupoolv1.Actor{AccessorId: c.token.AccessorId, Name: c.token.Name}
}

// management reports whether the caller may do everything.
func (c *caller) management() bool {
	return c.token == nil || c.token.Kind == gpupoolv1.TokenKind_TOKEN_KIND_MANAGEMENT
}

func (c *caller) String() string {
	t := c.token
	return fmt.Sprintf("token %s (%q, %s)", t.AccessorId, t.Name, protocol.TokenKindName(t.Kind))
}

// tenants are the tenants the caller may act for; nil for all.
func (c *caller) tenants() []string {
	if c.management() {
		return nil
	}
	return c.token.Tenants
}

// mayActFor returns PermissionDenied unless the caller may act for tenant.
func (c *caller) mayActFor(tenant, what string) error {
	if c.management() || slices.Contains(c.token.Tenants, tenant) {
		return nil
	}
	return refusef(ErrDenied, "%s: %s may act for tenants %s only, not tenant %q",
		what, c, strings.Join(c.token.Tenants, ", "), tenant)
}

// sees reports whether the caller may see a lease.
func (c *caller) sees(l *gpupoolv1.Lease) bool {
	return c.management() || slices.Contains(c.token.Tenants, l.GetTenant())
}

// scopeRequest fills in the request's tenant and class for the caller
// (protocol.FillDefaults) and refuses a request outside the caller's
// scope: another tenant, a priority above its limit, a guaranteed lease
// from a preemptible-only token.
func (c *caller) scopeRequest(r *gpupoolv1.LeaseRequest) error {
	if err := protocol.FillDefaults(r, c.token); err != nil {
		var te *protocol.TenantError
		if errors.As(err, &te) {
			return refusef(ErrDenied, "request.%s: %s may act for tenants %s only, not tenant %q",
				te.Field, c, strings.Join(te.Allowed, ", "), te.Tenant)
		}
		return err
	}
	if c.management() {
		return nil
	}
	t := c.token
	if t.MaxPriority != nil && r.Priority > *t.MaxPriority {
		return refusef(ErrDenied, "request.priority %d: %s may ask for priority %d at most", r.Priority, c, *t.MaxPriority)
	}
	if t.PreemptibleOnly && r.Class != gpupoolv1.LeaseClass_LEASE_CLASS_PREEMPTIBLE {
		return refusef(ErrDenied, "request.class guaranteed: %s may ask for preemptible leases only", c)
	}
	return nil
}

// mayActAsHost returns PermissionDenied unless the caller may register and
// heartbeat as host id.
func (c *caller) mayActAsHost(id string) error {
	if c.management() || (c.token.Kind == gpupoolv1.TokenKind_TOKEN_KIND_AGENT && c.token.HostId == id) {
		return nil
	}
	return refusef(ErrDenied, "host_id %q: %s is the join token of host %q, not of host %q",
		id, c, c.token.HostId, id)
}

// hashSecret is how a token's secret is stored.
func hashSecret(secret string) []byte {
	h := sha256.Sum256([]byte(secret))
	return h[:]
}

// secretFrom reads the bearer token of an incoming call.
func secretFrom(ctx context.Context) (string, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	vals := md.Get(AuthHeader)
	if len(vals) == 0 {
		return "", refuse(ErrUnauthenticated, "no ACL token: pass --token or set GPUPOOL_TOKEN (gRPC metadata \"authorization: Bearer <secret>\")")
	}
	v := strings.TrimSpace(vals[0])
	scheme, secret, ok := strings.Cut(v, " ")
	secret = strings.TrimSpace(secret)
	if !ok || !strings.EqualFold(scheme, "bearer") || secret == "" {
		return "", refuse(ErrUnauthenticated, "authorization metadata: must be \"Bearer <secret>\"")
	}
	return secret, nil
}

// authenticate verifies the caller's token: Unauthenticated when it is
// missing, unknown, revoked or expired, saying which.
func (gk *gatekeeper) authenticate(ctx context.Context) (*caller, error) {
	if !gk.cfg.ACL {
		return anonymous, nil
	}
	secret, err := secretFrom(ctx)
	if err != nil {
		return nil, err
	}
	hash := hashSecret(secret)
	t := gk.fsm.State().ACLTokenBySecret(hash)
	if t == nil && !gk.membership.isLeader() {
		// A token created a moment ago on the leader may not have
		// reached this server yet.
		gk.catchUpWithLeader(ctx)
		t = gk.fsm.State().ACLTokenBySecret(hash)
	}
	if t == nil {
		return nil, refuse(ErrUnauthenticated, "ACL token not recognised: no such token (check --token / GPUPOOL_TOKEN)")
	}
	if err := gk.stillValid(t); err != nil {
		return nil, err
	}
	return &caller{token: t}, nil
}

// stillValid returns Unauthenticated for a revoked or expired token.
func (gk *gatekeeper) stillValid(t *gpupoolv1.AclToken) error {
	if t.Revoked {
		return refusef(ErrUnauthenticated, "ACL token %s (%q) was revoked at %s by %s",
			t.AccessorId, t.Name, time.UnixMilli(t.RevokedAtMs).UTC().Format(time.RFC3339), protocol.ActorText(t.RevokedBy))
	}
	if tokenExpired(t, gk.cfg.Clock.Now()) {
		return refusef(ErrUnauthenticated, "ACL token %s (%q) expired at %s",
			t.AccessorId, t.Name, time.UnixMilli(t.ExpiresAtMs).UTC().Format(time.RFC3339))
	}
	return nil
}

func tokenExpired(t *gpupoolv1.AclToken, now time.Time) bool {
	return t.ExpiresAtMs != 0 && now.UnixMilli() >= t.ExpiresAtMs
}

// recheck verifies again, on a long-lived stream, that the token the
// stream began with has not been revoked or expired since.
func (gk *gatekeeper) recheck(c *caller) error {
	if c.token == nil {
		return nil
	}
	return gk.validAsRead(c, gk.fsm.State().ACLToken(c.token.AccessorId))
}

// validAsRead checks c's token t as read from the state: nil if it is
// gone.
func (gk *gatekeeper) validAsRead(c *caller, t *gpupoolv1.AclToken) error {
	if t == nil {
		return refusef(ErrUnauthenticated, "ACL token %s is gone (snapshot restore?)", c.token.AccessorId)
	}
	return gk.stillValid(t)
}

// catchUpWithLeader waits, for at most a few seconds, until this server
// has applied as much of the log as the leader had when asked.
func (gk *gatekeeper) catchUpWithLeader(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	conn := gk.membership.dialLeader()
	if conn == nil {
		return
	}
	info, err := gpupoolv1.NewClusterServiceClient(conn).ServerInfo(ctx, &gpupoolv1.ServerInfoRequest{})
	if err != nil {
		return
	}
	for {
		idx, changed := gk.fsm.State().IndexWatch()
		if idx >= info.AppliedIndex {
			return
		}
		select {
		case <-changed:
		case <-ctx.Done():
			return
		}
	}
}

// authorize returns PermissionDenied unless the caller has the method's right.
func authorize(c *caller, method string) error {
	r, ok := methodRights[method]
	if !ok {
		r = rightManage
	}
	if r == rightOpen || r == rightAny || c.management() {
		return nil
	}
	kind := c.token.Kind
	switch {
	case r == rightLeases && kind == gpupoolv1.TokenKind_TOKEN_KIND_CLIENT,
		r == rightPoolRead && kind == gpupoolv1.TokenKind_TOKEN_KIND_CLIENT,
		r == rightAgent && kind == gpupoolv1.TokenKind_TOKEN_KIND_AGENT:
		return nil
	}
	return refusef(ErrDenied, "%s: %s lacks %s", method, c, r)
}

// check authenticates and authorizes one call.
func (gk *gatekeeper) check(ctx context.Context, method string) (*caller, error) {
	if methodRights[method] == rightOpen {
		return anonymous, nil
	}
	if gk.membership.isLeader() && gk.leadership.currentLeader() == nil {
		// A new leader decides on tokens only once it has applied what
		// earlier leaders committed (its barrier): a revocation already
		// acknowledged, or the bootstrap, may not be in its state yet.
		return nil, refuse(ErrUnavailable, "this broker just became leader and is catching up with the log; retry")
	}
	switch methodRights[method] {
	case rightJoin:
		if gk.fsm.State().ACLBootstrapIndex() == 0 {
			return anonymous, nil
		}
	}
	c, err := gk.authenticate(ctx)
	if err != nil {
		return nil, err
	}
	if err := authorize(c, method); err != nil {
		return nil, err
	}
	return c, nil
}

func (gk *gatekeeper) unaryACL(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	c, err := gk.check(ctx, info.FullMethod)
	if err != nil {
		return nil, err
	}
	if r, ok := req.(*gpupoolv1.RegisterRequest); ok {
		if err := c.mayActAsHost(r.GetHost().GetId()); err != nil {
			return nil, err
		}
	}
	return handler(context.WithValue(ctx, callerKey{}, c), req)
}

func (gk *gatekeeper) streamACL(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	c, err := gk.check(ss.Context(), info.FullMethod)
	if err != nil {
		return err
	}
	return handler(srv, &aclStream{ServerStream: ss, gk: gk, c: c, ctx: context.WithValue(ss.Context(), callerKey{}, c)})
}

// aclStream carries the caller in its context and checks, on every
// message, that its token is still valid and that an agent speaks only
// for its own host.
type aclStream struct {
	grpc.ServerStream
	gk  *gatekeeper
	c   *caller
	ctx context.Context
	// read is the caller's token as last read from the state, and the
	// state's TokensVersion before: a watch sends each event without
	// looking its token up again while no token changed.
	read atomic.Pointer[tokenRead]
}

type tokenRead struct {
	version uint64
	token   *gpupoolv1.AclToken
}

// recheck is gatekeeper.recheck, reading the token again only if a token
// changed since the stream last did.
func (a *aclStream) recheck() error {
	if a.c.token == nil {
		return nil
	}
	v := a.gk.fsm.TokensVersion() // before the read: see TokensVersion
	if r := a.read.Load(); r != nil && r.version == v {
		return a.gk.validAsRead(a.c, r.token)
	}
	t := a.gk.fsm.State().ACLToken(a.c.token.AccessorId)
	a.read.Store(&tokenRead{version: v, token: t})
	return a.gk.validAsRead(a.c, t)
}

func (a *aclStream) Context() context.Context { return a.ctx }

func (a *aclStream) RecvMsg(m any) error {
	if err := a.ServerStream.RecvMsg(m); err != nil {
		return err
	}
	if err := a.recheck(); err != nil {
		return err
	}
	if h, ok := m.(*gpupoolv1.HeartbeatRequest); ok {
		return a.c.mayActAsHost(h.HostId)
	}
	return nil
}

func (a *aclStream) SendMsg(m any) error {
	if err := a.recheck(); err != nil {
		return err
	}
	return a.ServerStream.SendMsg(m)
}

// withOwnToken adds the server's own token (Config.Token) to an outgoing
// call to another server: the Join of a server joining or moving.
func (m *membership) withOwnToken(ctx context.Context) context.Context {
	if m.cfg.Token == "" {
		return ctx
	}
	return metadata.AppendToOutgoingContext(ctx, AuthHeader, "Bearer "+m.cfg.Token)
}

// forwardAuth copies the caller's authorization header from an incoming
// context to an outgoing one, so the leader checks the caller's own token.
func forwardAuth(in, out context.Context) context.Context {
	md, _ := metadata.FromIncomingContext(in)
	if v := md.Get(AuthHeader); len(v) > 0 {
		return metadata.AppendToOutgoingContext(out, AuthHeader, v[0])
	}
	return out
}

// mayTouch returns NotFound, as for a lease that does not exist, when
// the caller may not act on lease l (another tenant's): a tenant cannot
// even tell whether another tenant's lease id exists. A nil lease passes:
// the handler reports NotFound itself.
func (c *caller) mayTouch(l *gpupoolv1.Lease, what string) error {
	if l == nil || c.sees(l) {
		return nil
	}
	return refusef(ErrNotFound, "lease %q: not found", l.Id)
}
