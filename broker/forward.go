package broker

import (
	"context"
	"errors"
	"fmt"
	"io"

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
func (s *Server) leaderConn(ctx context.Context) (*grpc.ClientConn, context.Context, error) {
	if s.IsLeader() {
		return nil, ctx, nil
	}
	if md, ok := metadata.FromIncomingContext(ctx); ok && len(md.Get(forwardedKey)) > 0 {
		return nil, nil, refuse(ErrUnavailable, fmt.Sprintf("server %s was forwarded a call but is not the leader; retry", s.cfg.NodeID))
	}
	_, id := s.raft.LeaderWithID()
	if id == "" {
		// An election is under way: answer as soon as it ends rather
		// than have the client guess when to retry.
		if id = s.awaitLeader(ctx); id == "" {
			return nil, nil, refuse(ErrUnavailable, ErrNoLeader.Error())
		}
		if id == raft.ServerID(s.cfg.NodeID) {
			return nil, ctx, nil
		}
	}
	addr := s.rpcAddrOf(string(id))
	if addr == "" {
		return nil, nil, refusef(ErrUnavailable, "leader %s has no known address yet; retry", id)
	}
	conn, err := s.connTo(addr)
	if err != nil {
		return nil, nil, refusef(ErrUnavailable, "connect to leader %s at %s: %v", id, addr, err)
	}
	// The caller's own token goes along and the leader checks it again:
	// the forwarded marker grants nothing.
	out := metadata.AppendToOutgoingContext(forwardAuth(ctx, ctx), forwardedKey, s.cfg.NodeID)
	return conn, out, nil
}

// readConn is leaderConn for reads: stale reads are served locally. A
// consistent read on the leader first confirms it still leads, so it never
// answers from a deposed leader's state.
func (s *Server) readConn(ctx context.Context, stale bool) (*grpc.ClientConn, context.Context, error) {
	if stale {
		return nil, ctx, nil
	}
	conn, fctx, err := s.leaderConn(ctx)
	if err != nil || conn != nil {
		return conn, fctx, err
	}
	if s.currentLeader() == nil {
		// Until its barrier, a new leader may not have applied everything
		// its predecessor acknowledged.
		return nil, nil, refuse(ErrUnavailable, "leader is still catching up; retry")
	}
	if err := s.raft.VerifyLeader().Error(); err != nil {
		return nil, nil, raftError(err)
	}
	return nil, ctx, nil
}

// proxyBidi pipes a bidi stream to the same method on the leader until
// either side ends. Errors from the leader reach the caller unchanged.
func proxyBidi[Req, Resp any](in grpc.BidiStreamingServer[Req, Resp], out grpc.BidiStreamingClient[Req, Resp]) error {
	errc := make(chan error, 1)
	go func() {
		for {
			m, err := in.Recv()
			if err != nil {
				if !errors.Is(err, io.EOF) {
					// Before CloseSend: the leader may end its side at
					// once, and the caller must get this error, not EOF.
					errc <- err
				}
				out.CloseSend()
				return
			}
			if err := out.Send(m); err != nil {
				// The receive side below reports the leader's error.
				return
			}
		}
	}()
	for {
		m, err := out.Recv()
		if err != nil {
			// The caller's own stream failed (its token was revoked, a
			// malformed message): that error, unchanged, wins over how the
			// leader's side ended.
			select {
			case e := <-errc:
				return e
			default:
			}
			if errors.Is(err, io.EOF) {
				return nil
			}
			return err
		}
		if err := in.Send(m); err != nil {
			return err
		}
	}
}

// proxyServerStream copies a server stream, and its trailer, from the
// leader to the caller.
func proxyServerStream[Resp any](in grpc.ServerStreamingServer[Resp], out grpc.ServerStreamingClient[Resp]) error {
	for {
		m, err := out.Recv()
		if errors.Is(err, io.EOF) {
			in.SetTrailer(out.Trailer())
			return nil
		}
		if err != nil {
			return err
		}
		if err := in.Send(m); err != nil {
			return err
		}
	}
}

// nameLeader tells the caller of every unary call which server leads, in
// the protocol.LeaderHeader response header, so that clients can send their
// next calls there instead of through a follower.
func (s *Server) nameLeader(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	resp, err := handler(ctx, req)
	// After the call: one that waited out an election names the new
	// leader.
	addr := ""
	if s.IsLeader() {
		addr = s.Addr()
	} else if _, id := s.raft.LeaderWithID(); id != "" {
		addr = s.rpcAddrOf(string(id))
	}
	_ = grpc.SetHeader(ctx, metadata.Pairs(protocol.LeaderHeader, addr))
	return resp, err
}
