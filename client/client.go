// Package client is the Go SDK for gpupool brokers.
//
// Any broker server accepts any call: followers forward writes and
// consistent reads to the leader. The client therefore spreads calls over
// every address it is given and retries calls that fail with Unavailable
// (a server down, or an election in progress) until the call's deadline.
package client

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"time"

	"github.com/google/uuid"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/resolver"
	"google.golang.org/grpc/resolver/manual"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// DefaultAddrs are the broker addresses `gpupool dev` listens on.
var DefaultAddrs = []string{"127.0.0.1:7641", "127.0.0.1:7643", "127.0.0.1:7645"}

// ErrNoAddrs is returned by Dial when it is given no broker address.
var ErrNoAddrs = errors.New("client: no broker address given")

// Client holds one connection spread over all broker servers.
type Client struct {
	conn *grpc.ClientConn

	Lease    gpupoolv1.LeaseServiceClient
	Pool     gpupoolv1.PoolServiceClient
	Agent    gpupoolv1.AgentServiceClient
	Operator gpupoolv1.OperatorServiceClient
}

// ParseAddrs splits a comma-separated address list, dropping blanks.
func ParseAddrs(s string) []string {
	var out []string
	for _, a := range strings.Split(s, ",") {
		if a = strings.TrimSpace(a); a != "" {
			out = append(out, a)
		}
	}
	return out
}

// Reconnect makes a connection try a server again within a second of it
// coming back: gRPC's default backoff grows to two minutes, and a broker
// that was down for a while may be the next leader.
var Reconnect = grpc.WithConnectParams(grpc.ConnectParams{
	Backoff:           backoff.Config{BaseDelay: 100 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: time.Second},
	MinConnectTimeout: 5 * time.Second,
})

// Dial connects to the brokers at addrs. It does not wait for any of them
// to answer: the first call does.
func Dial(addrs []string, opts ...grpc.DialOption) (*Client, error) {
	if len(addrs) == 0 {
		return nil, ErrNoAddrs
	}
	r := manual.NewBuilderWithScheme("gpupool")
	state := resolver.State{}
	for _, a := range addrs {
		state.Addresses = append(state.Addresses, resolver.Address{Addr: a})
	}
	r.InitialState(state)
	base := []grpc.DialOption{
		grpc.WithResolvers(r),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultServiceConfig(`{"loadBalancingConfig":[{"round_robin":{}}]}`),
		grpc.WithChainUnaryInterceptor(ensureRequestID, RetryUnavailable),
		Reconnect,
	}
	conn, err := grpc.NewClient(r.Scheme()+":///brokers", append(base, opts...)...)
	if err != nil {
		return nil, fmt.Errorf("client: dial %s: %w", strings.Join(addrs, ","), err)
	}
	return &Client{
		conn:     conn,
		Lease:    gpupoolv1.NewLeaseServiceClient(conn),
		Pool:     gpupoolv1.NewPoolServiceClient(conn),
		Agent:    gpupoolv1.NewAgentServiceClient(conn),
		Operator: gpupoolv1.NewOperatorServiceClient(conn),
	}, nil
}

// Conn is the underlying connection, for services the Client does not wrap.
func (c *Client) Conn() *grpc.ClientConn { return c.conn }

// Close closes the connection.
func (c *Client) Close() error { return c.conn.Close() }

// ensureRequestID gives an Acquire without a request id a random one
// before its first attempt, so that retries after an ambiguous failure
// (the grant committed, the answer was lost) return the same lease
// instead of granting a second one.
func ensureRequestID(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	if a, ok := req.(*gpupoolv1.AcquireRequest); ok && a.GetRequest() != nil && a.GetRequest().GetRequestId() == "" {
		a = proto.Clone(a).(*gpupoolv1.AcquireRequest)
		a.Request.RequestId = uuid.NewString()
		req = a
	}
	return invoker(ctx, method, req, reply, cc, opts...)
}

// maxRetryBackoff bounds the wait between retries of an Unavailable call.
// A leader election takes 1-3 s; a longer wait would mostly add to it.
const maxRetryBackoff = 250 * time.Millisecond

// RetryUnavailable retries a unary call that failed with Unavailable, with
// jittered backoff from 25 ms to maxRetryBackoff, until the call's context
// ends. Callers that need a bound set a deadline. Every other outcome is
// returned as is.
func RetryUnavailable(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	backoff := 25 * time.Millisecond
	for {
		err := invoker(ctx, method, req, reply, cc, opts...)
		if status.Code(err) != codes.Unavailable {
			return err
		}
		// Up to half again as long, so that clients a failover stopped
		// together do not come back in step.
		t := time.NewTimer(backoff + rand.N(backoff/2+1))
		select {
		case <-ctx.Done():
			t.Stop()
			return err
		case <-t.C:
		}
		backoff = min(2*backoff, maxRetryBackoff)
	}
}
