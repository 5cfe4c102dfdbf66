package client

import (
	"context"
	"slices"
	"sync"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/gpupool/gpupool/protocol"
)

// LeaderHeader is the response header in which every broker names the
// gRPC address of the leader it knows (protocol.LeaderHeader).
const LeaderHeader = protocol.LeaderHeader

// leaderRouter sends unary calls straight to the leader when the client
// knows it, instead of to any broker (which forwards writes and
// consistent reads to the leader, one more hop each). It learns the
// leader from LeaderHeader, and only ever uses an address the client was
// given: a broker's advertised address may not be reachable from here.
type leaderRouter struct {
	addrs []string
	dial  func(addr string) (*grpc.ClientConn, error)

	mu     sync.Mutex
	leader string                      // guarded by mu; "" while unknown
	conns  map[string]*grpc.ClientConn // by address; guarded by mu
	closed bool                        // guarded by mu
}

func newLeaderRouter(addrs []string, dial func(addr string) (*grpc.ClientConn, error)) *leaderRouter {
	return &leaderRouter{addrs: addrs, dial: dial, conns: map[string]*grpc.ClientConn{}}
}

// leaderConn returns the connection to the leader, or nil while unknown.
func (r *leaderRouter) leaderConn() *grpc.ClientConn {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.leader == "" || r.closed {
		return nil
	}
	if c := r.conns[r.leader]; c != nil {
		return c
	}
	c, err := r.dial(r.leader)
	if err != nil {
		r.leader = ""
		return nil
	}
	r.conns[r.leader] = c
	return c
}

// learn takes the leader from a response's header.
func (r *leaderRouter) learn(md metadata.MD) {
	vs := md.Get(LeaderHeader)
	if len(vs) == 0 {
		return
	}
	leader := vs[0]
	if !slices.Contains(r.addrs, leader) {
		leader = "" // not an address this client may use
	}
	r.mu.Lock()
	r.leader = leader
	r.mu.Unlock()
}

// forget drops the leader after a call to it failed for want of it.
func (r *leaderRouter) forget() {
	r.mu.Lock()
	r.leader = ""
	r.mu.Unlock()
}

// intercept is the unary interceptor: the leader first when known, any
// broker otherwise or when the leader is gone.
func (r *leaderRouter) intercept(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	var md metadata.MD
	opts = append(opts, grpc.Header(&md))
	if lc := r.leaderConn(); lc != nil {
		err := lc.Invoke(ctx, method, req, reply, opts...)
		if status.Code(err) != codes.Unavailable || IsTLSError(err) {
			r.learn(md)
			return err
		}
		r.forget()
		md = nil
	}
	err := invoker(ctx, method, req, reply, cc, opts...)
	r.learn(md)
	return err
}

// close closes the connections to leaders.
func (r *leaderRouter) close() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.closed = true
	for _, c := range r.conns {
		c.Close()
	}
	r.conns = nil
}
