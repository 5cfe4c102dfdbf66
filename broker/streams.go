package broker

import (
	"context"
	"errors"
	"io"

	"google.golang.org/grpc"

	"github.com/gpupool/gpupool/broker/fsm"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// The gRPC stream helpers live here: the boundary interceptor of
// streams, the proxies a follower forwards a stream to the leader with,
// and the loops that serve a stream on the leader.

// maxStreamsPerConn is how many calls one connection may have open on a
// broker at once (HTTP/2's SETTINGS_MAX_CONCURRENT_STREAMS): a client
// sending more waits in its own gRPC transport for one of its calls to end,
// instead of handing the broker thousands of calls to decode and hold.
// Far above what a process needs (each Watch, heartbeat stream and call
// in flight is one; the lease benchmark's 256 clients share one
// connection).
const maxStreamsPerConn = 1024

// statusStream is statusUnary (errors.go) for streams: every error a
// stream's handler returns leaves as a gRPC status, by toStatus.
func statusStream(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	return toStatus(handler(srv, ss))
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

// watchOnLeader serves a watch here when this server leads (or the watch
// is stale), and otherwise proxies it to the leader.
func watchOnLeader[Resp any](fw forwarder, stream grpc.ServerStreamingServer[Resp], stale bool,
	open func(conn *grpc.ClientConn, ctx context.Context) (grpc.ServerStreamingClient[Resp], error),
	serve func() error) error {
	ctx := stream.Context()
	if stale {
		return serve()
	}
	conn, fctx, err := fw.readConn(ctx, false)
	if err != nil {
		return err
	}
	if conn == nil {
		return serve()
	}
	out, err := open(conn, fctx)
	if err != nil {
		return err
	}
	return proxyServerStream(stream, out)
}

// watchEvent is what a Watch sends for ev: the LeaseEvent, encoded once
// for all the streams that send it (a token's few hundred watches of its
// own tenant would otherwise each encode every event). The broker has one
// codec (proto) and no compressor, so one encoding serves every stream;
// if it cannot be encoded, each stream sends the message itself.
func watchEvent(stream grpc.ServerStream, ev fsm.Event) any {
	return ev.Shared(func() any {
		m := &gpupoolv1.LeaseEvent{Type: ev.Type, Lease: ev.Lease, Index: ev.Index, Message: ev.Text(), DeadlineMs: ev.DeadlineMs, Actor: fsm.EventActor(ev)}
		var p grpc.PreparedMsg
		if err := p.Encode(stream, m); err != nil {
			return m
		}
		return &p
	})
}

// leaderStream is what a stream served on the leader needs: the way to
// the leader, the leader's memory, and the change feed.
type leaderStream struct {
	membership forwarder
	leadership leaderMemory
	fsm        *fsm.FSM
}

// serveOnLeader runs a bidi stream whose work needs the leader's memory.
// On a follower it proxies the stream to the leader through open. On the
// leader it calls onRecv for every request and onEvent for every applied
// change, one at a time, until the caller leaves or leadership ends
// (Unavailable, so clients reconnect to the new leader).
func serveOnLeader[Req, Resp any](s leaderStream, stream grpc.BidiStreamingServer[Req, Resp],
	open func(*grpc.ClientConn, context.Context) (grpc.BidiStreamingClient[Req, Resp], error),
	onRecv func(*leaderState, *Req) error, onEvent func(fsm.Event) error,
) error {
	return serveOnLeaderWith(s, stream, open, onRecv, onEvent, eventBatching{})
}

// eventBatching lets a stream on the leader skip events and answer a run
// of them at once.
type eventBatching struct {
	// keep filters the events as they are published (see
	// fsm.SubscribeFunc); nil keeps all of them.
	keep func(fsm.Event) bool
	// flush, if set, runs after onEvent has seen every event that was
	// waiting: a stream whose answer is the current state, not the event,
	// sends it once for the run.
	flush func() error
}

// serveOnLeaderWith is serveOnLeader with events filtered and batched.
func serveOnLeaderWith[Req, Resp any](s leaderStream, stream grpc.BidiStreamingServer[Req, Resp],
	open func(*grpc.ClientConn, context.Context) (grpc.BidiStreamingClient[Req, Resp], error),
	onRecv func(*leaderState, *Req) error, onEvent func(fsm.Event) error, b eventBatching,
) error {
	ctx := stream.Context()
	if conn, fctx, err := s.membership.leaderConn(ctx); err != nil {
		return err
	} else if conn != nil {
		out, err := open(conn, fctx)
		if err != nil {
			return err
		}
		return proxyBidi(stream, out)
	}
	ls := s.leadership.currentLeader()
	if ls == nil {
		return refuse(ErrUnavailable, "leader is still starting; retry")
	}
	events, cancel := s.fsm.SubscribeFunc(b.keep)
	defer cancel()
	reqs := recvAll(stream)
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-ls.stopCh:
			return refuse(ErrUnavailable, ErrLeadershipLost.Error())
		case r, ok := <-reqs:
			if !ok {
				return nil
			}
			if r.err != nil {
				return r.err
			}
			if err := onRecv(ls, r.msg); err != nil {
				return err
			}
		case ev, ok := <-events:
			if !ok {
				return refuse(ErrUnavailable, "stream fell behind the leader's changes; reconnect")
			}
			if err := onEvent(ev); err != nil {
				return err
			}
			if b.flush == nil {
				continue
			}
			for waiting := true; waiting; {
				select {
				case ev, ok := <-events:
					if !ok {
						return refuse(ErrUnavailable, "stream fell behind the leader's changes; reconnect")
					}
					if err := onEvent(ev); err != nil {
						return err
					}
				default:
					waiting = false
				}
			}
			if err := b.flush(); err != nil {
				return err
			}
		}
	}
}

type recvResult[T any] struct {
	msg *T
	err error
}

// recvAll reads a stream in the background; the channel closes at EOF.
func recvAll[Req, Resp any](stream grpc.BidiStreamingServer[Req, Resp]) <-chan recvResult[Req] {
	ch := make(chan recvResult[Req])
	go func() {
		defer close(ch)
		for {
			m, err := stream.Recv()
			if errors.Is(err, io.EOF) {
				return
			}
			select {
			case ch <- recvResult[Req]{msg: m, err: err}:
			case <-stream.Context().Done():
				return
			}
			if err != nil {
				return
			}
		}
	}()
	return ch
}
