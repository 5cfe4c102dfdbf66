// Package client is the Go SDK for gpupool brokers.
//
// Any broker server accepts any call: followers forward writes and
// consistent reads to the leader. The client therefore spreads calls over
// every address it is given and retries calls that fail with Unavailable
// (a server down, or an election in progress) until the call's deadline.
package client

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"slices"
	"strings"
	"time"

	"github.com/google/uuid"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/resolver"
	"google.golang.org/grpc/resolver/manual"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
	"github.com/gpupool/gpupool/protocol"
)

// DefaultAddrs are the broker addresses `gpupool dev` listens on.
var DefaultAddrs = []string{"127.0.0.1:7641", "127.0.0.1:7643", "127.0.0.1:7645"}

// Errors of Dial and DialWith.
var (
	ErrNoAddrs = errors.New("client: no broker address given")
	// ErrNoClientCert: brokers accept only clients with a certificate of
	// the cluster CA, so TLS without one cannot work.
	ErrNoClientCert = errors.New("client: TLS without a client certificate: the brokers require one (Options.TLS Certificates or GetClientCertificate; in the CLI --tls-cert and --tls-key)")
)

// Client holds one connection spread over all broker servers, and sends
// unary calls to the leader directly once a broker has named it (see
// LeaderHeader).
type Client struct {
	conn    *grpc.ClientConn
	router  *leaderRouter
	addrs   []string
	tls     bool
	dialOne func(addr string) (*grpc.ClientConn, error)

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
// coming back (protocol.Reconnect: the timings every component uses).
var Reconnect = protocol.Reconnect

// Options configure DialWith.
type Options struct {
	// TLS, when set, makes every connection to the brokers mutual TLS: it
	// must trust the cluster CA (RootCAs) and present a certificate the CA
	// issued (Certificates or GetClientCertificate). Each broker's
	// certificate must name the host of the address it is dialed at.
	// internal/pki's Source.ClientConfig builds one from files that are
	// reloaded when they change. Nil dials plaintext, which only brokers
	// started with --insecure (and 'gpupool dev') accept.
	TLS *tls.Config
	// Token is the ACL token's secret, sent on every call (unary and
	// streaming) as "authorization: Bearer <secret>". Empty sends none,
	// which only brokers without ACL (--insecure, gpupool dev) accept.
	Token string
	// ConnectTimeout is the connect budget: how long a unary call keeps
	// retrying while no broker answers or no leader is known (Unavailable),
	// separately from the call's own deadline. When it runs out, or after
	// half of it when every broker refuses the connection, the call fails with a
	// *ClusterError that says what happened to each broker (refused, TLS
	// failure, timeout, up but no leader) and names a lost quorum. Zero
	// retries until the call's deadline. Set it longer than an election
	// (a few seconds).
	ConnectTimeout time.Duration
	// DialOptions are applied after the client's own.
	DialOptions []grpc.DialOption
}

// Dial connects to the brokers at addrs in plaintext, without a token;
// see DialWith.
func Dial(addrs []string, opts ...grpc.DialOption) (*Client, error) {
	return DialWith(addrs, Options{DialOptions: opts})
}

// DialWith connects to the brokers at addrs. It does not wait for any of
// them to answer: the first call does.
func DialWith(addrs []string, o Options) (*Client, error) {
	if len(addrs) == 0 {
		return nil, ErrNoAddrs
	}
	creds := insecure.NewCredentials()
	if o.TLS != nil && len(o.TLS.Certificates) == 0 && o.TLS.GetClientCertificate == nil {
		return nil, ErrNoClientCert
	}
	if o.TLS != nil {
		creds = credentials.NewTLS(o.TLS)
	}
	r := manual.NewBuilderWithScheme("gpupool")
	state := resolver.State{}
	for _, a := range addrs {
		addr := resolver.Address{Addr: a}
		if o.TLS != nil && o.TLS.ServerName == "" {
			// Verify each broker by the host it is dialed at, not by
			// the target's made-up authority.
			if host, _, err := net.SplitHostPort(a); err == nil {
				addr.ServerName = host
			}
		}
		state.Addresses = append(state.Addresses, addr)
	}
	r.InitialState(state)
	dialOne := func(addr string) (*grpc.ClientConn, error) {
		creds := insecure.NewCredentials()
		if o.TLS != nil {
			tc := o.TLS.Clone()
			if host, _, err := net.SplitHostPort(addr); err == nil && tc.ServerName == "" {
				tc.ServerName = host
			}
			creds = credentials.NewTLS(tc)
		}
		opts := []grpc.DialOption{grpc.WithTransportCredentials(creds), Reconnect}
		if o.Token != "" {
			opts = append(opts, WithToken(o.Token))
		}
		return grpc.NewClient(addr, append(opts, o.DialOptions...)...)
	}
	router := newLeaderRouter(addrs, dialOne)
	c := &Client{router: router, addrs: slices.Clone(addrs), tls: o.TLS != nil, dialOne: dialOne}
	retry := RetryUnavailable
	if o.ConnectTimeout > 0 {
		retry = c.retryWithin(o.ConnectTimeout)
	}
	base := []grpc.DialOption{
		grpc.WithResolvers(r),
		grpc.WithTransportCredentials(creds),
		grpc.WithDefaultServiceConfig(`{"loadBalancingConfig":[{"round_robin":{}}]}`),
		grpc.WithChainUnaryInterceptor(ensureRequestID, retry, router.intercept),
		Reconnect,
	}
	if o.TLS == nil {
		base = append(base, grpc.WithChainUnaryInterceptor(hintTLSUnary), grpc.WithChainStreamInterceptor(hintTLSStream))
	}
	if o.Token != "" {
		base = append(base, WithToken(o.Token))
	}
	conn, err := grpc.NewClient(r.Scheme()+":///brokers", append(base, o.DialOptions...)...)
	if err != nil {
		return nil, fmt.Errorf("client: dial %s: %w", strings.Join(addrs, ","), err)
	}
	c.conn = conn
	c.Lease = gpupoolv1.NewLeaseServiceClient(conn)
	c.Pool = gpupoolv1.NewPoolServiceClient(conn)
	c.Agent = gpupoolv1.NewAgentServiceClient(conn)
	c.Operator = gpupoolv1.NewOperatorServiceClient(conn)
	return c, nil
}

// Conn is the underlying connection, for services the Client does not wrap.
func (c *Client) Conn() *grpc.ClientConn { return c.conn }

// Close closes the connections.
func (c *Client) Close() error {
	c.router.close()
	return c.conn.Close()
}

// ensureRequestID gives an Acquire without a request id a random one
// before its first attempt, so that retries after an ambiguous failure
// (the grant committed, the answer was lost) return the same lease
// instead of granting a second one.
func ensureRequestID(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	if a, ok := req.(*gpupoolv1.AcquireRequest); ok {
		req = withRequestID(a)
	}
	return invoker(ctx, method, req, reply, cc, opts...)
}

// withRequestID returns a, or, when its request has no request id, a copy
// of it with a random one: the one place a client fills it in, and the
// request's one copy on its way to the leader.
func withRequestID(a *gpupoolv1.AcquireRequest) *gpupoolv1.AcquireRequest {
	if a.GetRequest() == nil || a.GetRequest().GetRequestId() != "" {
		return a
	}
	a = proto.CloneOf(a)
	a.Request.RequestId = uuid.NewString()
	return a
}

// maxRetryBackoff bounds the wait between retries of an Unavailable call.
// A leader election takes 1-3 s; a longer wait would mostly add to it.
const maxRetryBackoff = 250 * time.Millisecond

// RetryUnavailable retries a unary call that failed with Unavailable, with
// jittered backoff from 25 ms to maxRetryBackoff, until the call's context
// ends. Callers that need a bound set a deadline. A TLS failure (a
// certificate the other side refused) does not heal by waiting and is
// returned at once, as is every other outcome. When the deadline passes
// during a retry, the error is the last Unavailable answer (a full disk,
// no leader), not the interrupted attempt's DeadlineExceeded: the caller
// hears why, whether the deadline fell during an attempt or between two.
func RetryUnavailable(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	backoff := 25 * time.Millisecond
	var last error // the last Unavailable answer
	for {
		err := invoker(ctx, method, req, reply, cc, opts...)
		if last != nil && interruptedByDeadline(ctx, err) {
			return last
		}
		if status.Code(err) != codes.Unavailable || IsTLSError(err) {
			return err
		}
		last = err
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

// interruptedByDeadline reports whether err is an attempt cut short by
// ctx's deadline rather than a broker's answer.
func interruptedByDeadline(ctx context.Context, err error) bool {
	return status.Code(err) == codes.DeadlineExceeded && errors.Is(ctx.Err(), context.DeadlineExceeded)
}

// IsTLSError reports whether err is a connection that failed in its TLS
// handshake: a certificate one side did not accept, TLS against a
// plaintext server, or a plaintext client a TLS broker dropped. gRPC
// reports these as Unavailable with the TLS error's text, so the text is
// all there is to go by.
func IsTLSError(err error) bool {
	st, ok := status.FromError(err)
	if !ok || st.Code() != codes.Unavailable {
		return false
	}
	m := st.Message()
	return strings.Contains(m, "tls: ") || strings.Contains(m, "x509: ") || strings.Contains(m, plaintextHint)
}

// plaintextHint explains the error a plaintext client gets from a TLS
// broker: the broker drops the connection before HTTP/2 starts.
const plaintextHint = "; this client dials without TLS: if the brokers serve TLS, give it the cluster CA and a client certificate"

// addTLSHint adds plaintextHint to an Unavailable error that looks like a
// TLS broker refusing a plaintext connection.
func addTLSHint(err error) error {
	st, ok := status.FromError(err)
	if !ok || st.Code() != codes.Unavailable || !strings.Contains(st.Message(), "error reading server preface") {
		return err
	}
	return status.Error(codes.Unavailable, st.Message()+plaintextHint)
}

func hintTLSUnary(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	return addTLSHint(invoker(ctx, method, req, reply, cc, opts...))
}

func hintTLSStream(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
	cs, err := streamer(ctx, desc, cc, method, opts...)
	if err != nil {
		return nil, addTLSHint(err)
	}
	return hintedStream{cs}, nil
}

// hintedStream adds plaintextHint to the errors of a stream's messages.
type hintedStream struct{ grpc.ClientStream }

func (s hintedStream) RecvMsg(m any) error { return addTLSHint(s.ClientStream.RecvMsg(m)) }
func (s hintedStream) SendMsg(m any) error { return addTLSHint(s.ClientStream.SendMsg(m)) }
