package broker

import (
	"context"
	"fmt"
	"net"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/tap"

	"github.com/gpupool/gpupool/internal/limits"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// Limits bounds what one caller may make a broker do (see
// internal/limits). Each limit is per server: a follower and the leader
// it forwards to each count a forwarded call. A field of 0 is no limit.
//
// The per-token limits apply to ACL tokens: with ACL off every caller is
// anonymous and only the connection and tenant limits apply.
type Limits struct {
	// TokenRate is the requests (unary calls and new streams) one token
	// may make per second.
	TokenRate limits.Rate
	// TokenStreams is the streams (Watch, KeepAlive, heartbeats, ...) one
	// token may hold open at once.
	TokenStreams int
	// ClientConnRate is the new connections one client address may open
	// per second.
	ClientConnRate limits.Rate
	// TenantPending is the acquires with a wait that one tenant may have
	// in progress on the leader at once (waiting in the queue, or being
	// placed).
	TenantPending int
	// Writes shares the leader's writes in flight (acquires, releases,
	// admin changes: every call that proposes to the log) fairly between
	// tokens: Seats at once in all, at most Share per token, and up to
	// Queue more of a token's calls waiting for a seat, the seat that
	// frees going to the waiting token that holds the fewest. A busy
	// leader's Raft log is what one token would otherwise take from all
	// the others.
	Writes limits.FairLimit
}

// DefaultLimits are well above what the benchmarks and the test suites
// need. The request rate is above what one token's honest clients send
// to a leader on two cores (four clients looping acquire and release
// send about 300 calls a second on a quiet machine): what keeps one token
// from taking the leader's writes from the others is the fair share of
// writes, not the rate.
func DefaultLimits() Limits {
	return Limits{
		TokenRate:      limits.Rate{PerSecond: 1000, Burst: 2000},
		TokenStreams:   256,
		ClientConnRate: limits.Rate{PerSecond: 200, Burst: 400},
		TenantPending:  1000,
		Writes:         limits.FairLimit{Seats: 8, Share: 8, Queue: 512},
	}
}

// The names of the broker's limits, as in /metrics, and their flags.
const (
	LimitTokenRate      = "token-request-rate"
	LimitTokenStreams   = "token-streams"
	LimitClientConnRate = "client-connection-rate"
	LimitTenantPending  = "tenant-pending-acquires"
	LimitTokenWrites    = "token-write-queue"

	FlagTokenRate       = "limit-token-rate"
	FlagTokenBurst      = "limit-token-burst"
	FlagTokenStreams    = "limit-token-streams"
	FlagClientConnRate  = "limit-client-conn-rate"
	FlagClientConnBurst = "limit-client-conn-burst"
	FlagTenantPending   = "limit-tenant-pending"
	FlagWriteSeats      = "limit-write-seats"
	FlagTokenWrites     = "limit-token-writes"
	FlagTokenWriteQueue = "limit-token-write-queue"
)

// Validate checks every limit, naming the flag of a wrong one.
func (l Limits) Validate() error {
	for _, err := range []error{
		l.TokenRate.Validate(FlagTokenRate, FlagTokenBurst),
		limits.ValidateMax(FlagTokenStreams, l.TokenStreams),
		l.ClientConnRate.Validate(FlagClientConnRate, FlagClientConnBurst),
		limits.ValidateMax(FlagTenantPending, l.TenantPending),
		l.Writes.Validate(FlagWriteSeats, FlagTokenWrites, FlagTokenWriteQueue),
	} {
		if err != nil {
			return fmt.Errorf("broker: %w", err)
		}
	}
	return nil
}

// limiters are one server's limiters.
type limiters struct {
	set       *limits.Set
	rate      *limits.RateLimiter
	streams   *limits.Concurrency
	conns     *limits.RateLimiter
	pending   *limits.Concurrency
	writes    *limits.Fair
	refusedMu sync.Mutex
	refused   map[string]error // guarded by refusedMu; remote address of a connection over its limit
}

func newLimiters(l Limits, now func() time.Time) *limiters {
	set := limits.NewSet(now)
	return &limiters{
		set:     set,
		rate:    set.Rate(LimitTokenRate, FlagTokenRate, l.TokenRate),
		streams: set.Concurrency(LimitTokenStreams, FlagTokenStreams, l.TokenStreams, "streams open at once"),
		conns:   set.Rate(LimitClientConnRate, FlagClientConnRate, l.ClientConnRate),
		pending: set.Concurrency(LimitTenantPending, FlagTenantPending, l.TenantPending, "acquires waiting at once"),
		writes:  set.Fair(LimitTokenWrites, FlagTokenWriteQueue, l.Writes),
		refused: map[string]error{},
	}
}

// limitKey is who a per-token limit counts: the token's accessor, or
// nothing for the anonymous caller (ACL off, open methods).
func limitKey(c *caller) (key, who string) {
	if c.token == nil {
		return "", ""
	}
	return c.token.AccessorId, c.String()
}

// unaryLimits applies the token's request rate and, to a write on the
// leader, its fair share of the leader's writes; after the ACL check,
// which names the token.
func (s *Server) unaryLimits(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	key, who := limitKey(callerFrom(ctx))
	if key == "" {
		return handler(ctx, req)
	}
	if err := s.limits.rate.Allow(key, who); err != nil {
		return nil, err
	}
	if !writeMethods[info.FullMethod] || !s.IsLeader() {
		// A follower forwards its writes, with the caller's token, to
		// the leader, which shares its log: a forwarded acquire that
		// waits must not hold a seat of the follower meanwhile.
		return handler(ctx, req)
	}
	release, err := s.limits.writes.Acquire(ctx, key, who)
	if err != nil {
		return nil, err
	}
	defer release()
	return handler(context.WithValue(ctx, writeSeatKey{}, release), req)
}

// writeMethods are the calls that propose to the log: they share the
// server's writes (Limits.Writes).
var writeMethods = map[string]bool{
	gpupoolv1.LeaseService_Acquire_FullMethodName:               true,
	gpupoolv1.LeaseService_Release_FullMethodName:               true,
	gpupoolv1.LeaseService_ClaimTenant_FullMethodName:           true,
	gpupoolv1.AclService_CreateToken_FullMethodName:             true,
	gpupoolv1.AclService_RevokeToken_FullMethodName:             true,
	gpupoolv1.PoolService_DrainHost_FullMethodName:              true,
	gpupoolv1.PoolService_SetEligibility_FullMethodName:         true,
	gpupoolv1.PoolService_ResetHostIdentity_FullMethodName:      true,
	gpupoolv1.PoolService_ClearDeviceHealth_FullMethodName:      true,
	gpupoolv1.AgentService_Register_FullMethodName:              true,
	gpupoolv1.OperatorService_RotateSigningKey_FullMethodName:   true,
	gpupoolv1.OperatorService_SetQuota_FullMethodName:           true,
	gpupoolv1.OperatorService_RemoveQuota_FullMethodName:        true,
	gpupoolv1.OperatorService_SnapshotRestore_FullMethodName:    true,
	gpupoolv1.OperatorService_TransferLeadership_FullMethodName: true,
	gpupoolv1.OperatorService_RemovePeer_FullMethodName:         true,
	gpupoolv1.ClusterService_Join_FullMethodName:                true,
}

type writeSeatKey struct{}

// yieldWriteSeat gives back the call's seat of the server's writes, if it
// holds one: an acquire that waits in the queue for its grant is bounded
// by its tenant's pending cap instead, and must not keep a seat meanwhile.
func yieldWriteSeat(ctx context.Context) {
	if release, ok := ctx.Value(writeSeatKey{}).(func()); ok {
		release()
	}
}

// streamLimits applies the token's request rate to a new stream and holds
// one of its streams until the stream ends.
func (s *Server) streamLimits(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	key, who := limitKey(callerFrom(ss.Context()))
	if key == "" {
		return handler(srv, ss)
	}
	if err := s.limits.rate.Allow(key, who); err != nil {
		return err
	}
	release, err := s.limits.streams.Acquire(key, who)
	if err != nil {
		return err
	}
	defer release()
	return handler(srv, ss)
}

// holdPending holds one of the tenant's waiting acquires on the leader
// until release. tenant is the request's after protocol.FillDefaults
// (Acquire's ACL check), never empty.
func (l *limiters) holdPending(tenant string) (release func(), err error) {
	return l.pending.Acquire(tenant, fmt.Sprintf("tenant %q", tenant))
}

// limitListener applies the client connection rate. A connection over the
// limit is still accepted, so that its calls can be answered with the
// reason (tapLimits) rather than a reset, and closed a moment later.
type limitListener struct {
	net.Listener
	l *limiters
}

// refusedConnLinger is how long a connection over its limit stays open to
// carry its refusals.
const refusedConnLinger = 2 * time.Second

func (ln limitListener) Accept() (net.Conn, error) {
	c, err := ln.Listener.Accept()
	if err != nil {
		return c, err
	}
	host, _, _ := net.SplitHostPort(c.RemoteAddr().String())
	if err := ln.l.conns.Allow(host, "client "+host); err != nil {
		addr := c.RemoteAddr().String()
		ln.l.refusedMu.Lock()
		ln.l.refused[addr] = err
		ln.l.refusedMu.Unlock()
		rc := &refusedConn{Conn: c, l: ln.l, addr: addr}
		// Not a deadline: grpc clears the connection's deadline once its
		// handshake ends, which would keep a refused connection, and
		// every call on it refused, for good.
		time.AfterFunc(refusedConnLinger, func() { _ = rc.Close() })
		return rc, nil
	}
	return c, nil
}

// refusedConn is a connection over its limit.
type refusedConn struct {
	net.Conn
	l    *limiters
	addr string
	once sync.Once
}

func (c *refusedConn) Close() error {
	c.once.Do(func() {
		c.l.refusedMu.Lock()
		delete(c.l.refused, c.addr)
		c.l.refusedMu.Unlock()
	})
	return c.Conn.Close()
}

// tapLimits refuses every call on a connection over its limit, before it
// reaches a handler. grpc answers the status it returns as is, so it is
// made by toStatus like every other.
func (l *limiters) tapLimits(ctx context.Context, _ *tap.Info) (context.Context, error) {
	p, ok := peer.FromContext(ctx)
	if !ok || p.Addr == nil {
		return ctx, nil
	}
	l.refusedMu.Lock()
	err := l.refused[p.Addr.String()]
	l.refusedMu.Unlock()
	if err != nil {
		return ctx, toStatus(err)
	}
	return ctx, nil
}
