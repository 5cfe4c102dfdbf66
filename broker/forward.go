package broker

import (
	"context"
	"fmt"

	"github.com/hashicorp/raft"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"

	"github.com/gpupool/gpupool/protocol"
)

// forwardedKey marks a call one server forwarded to another, so that a
// call never bounces between servers that disagree about the leader.
const forwardedKey = "gpupool-forwarded"

// leaderConn decides where a write (or a consistent read) runs. It returns
// a nil conn when this server is the leader and should serve the call
// itself; otherwise a connection to the leader and the context to forward
// the call with. With no known leader it waits for an election (see
// awaitLeader), then returns Unavailable, which clients retry.
func (m *membership) leaderConn(ctx context.Context) (*grpc.ClientConn, context.Context, error) {
	if m.isLeader() {
		return nil, ctx, nil
	}
	if md, ok := metadata.FromIncomingContext(ctx); ok && len(md.Get(forwardedKey)) > 0 {
		return nil, nil, refuse(ErrUnavailable, fmt.Sprintf("server %s was forwarded a call but is not the leader; retry", m.cfg.NodeID))
	}
	_, id := m.raft.LeaderWithID()
	if id == "" {
		// An election is under way: answer as soon as it ends rather
		// than have the client guess when to retry.
		if id = m.awaitLeader(ctx); id == "" {
			return nil, nil, refuse(ErrUnavailable, ErrNoLeader.Error())
		}
		if id == raft.ServerID(m.cfg.NodeID) {
			return nil, ctx, nil
		}
	}
	addr := m.rpcAddrOf(string(id))
	if addr == "" {
		return nil, nil, refusef(ErrUnavailable, "leader %s has no known address yet; retry", id)
	}
	conn, err := m.connTo(addr)
	if err != nil {
		return nil, nil, refusef(ErrUnavailable, "connect to leader %s at %s: %v", id, addr, err)
	}
	// The caller's own token goes along and the leader checks it again:
	// the forwarded marker grants nothing.
	out := metadata.AppendToOutgoingContext(forwardAuth(ctx, ctx), forwardedKey, m.cfg.NodeID)
	return conn, out, nil
}

// readConn is leaderConn for reads: stale reads are served locally. A
// consistent read on the leader first confirms it still leads, so it never
// answers from a deposed leader's state.
func (m *membership) readConn(ctx context.Context, stale bool) (*grpc.ClientConn, context.Context, error) {
	if stale {
		return nil, ctx, nil
	}
	conn, fctx, err := m.leaderConn(ctx)
	if err != nil || conn != nil {
		return conn, fctx, err
	}
	if m.leadership.currentLeader() == nil {
		// Until its barrier, a new leader may not have applied everything
		// its predecessor acknowledged.
		return nil, nil, refuse(ErrUnavailable, "leader is still catching up; retry")
	}
	if err := m.raft.VerifyLeader().Error(); err != nil {
		return nil, nil, raftError(err)
	}
	return nil, ctx, nil
}

// nameLeader tells the caller of every unary call which server leads, in
// the protocol.LeaderHeader response header, so that clients can send their
// next calls there instead of through a follower.
func (m *membership) nameLeader(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	resp, err := handler(ctx, req)
	// After the call: one that waited out an election names the new
	// leader.
	addr := ""
	if m.isLeader() {
		addr = m.addr()
	} else if _, id := m.raft.LeaderWithID(); id != "" {
		addr = m.rpcAddrOf(string(id))
	}
	_ = grpc.SetHeader(ctx, metadata.Pairs(protocol.LeaderHeader, addr))
	return resp, err
}
