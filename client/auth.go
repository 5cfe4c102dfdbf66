package client

import (
	"context"

	"google.golang.org/grpc"
)

// Options are what a client needs besides the broker addresses. Turn them
// into dial options with DialOptions:
//
//	c, err := client.Dial(addrs, client.Options{Token: secret}.DialOptions()...)
type Options struct {
	// Token is the ACL token's secret, sent on every call (unary and
	// streaming) as "authorization: Bearer <secret>". Empty sends none,
	// which only brokers without ACL (--insecure, gpupool dev) accept.
	Token string
}

// DialOptions returns the grpc dial options for o.
func (o Options) DialOptions() []grpc.DialOption {
	var opts []grpc.DialOption
	if o.Token != "" {
		opts = append(opts, WithToken(o.Token))
	}
	return opts
}

// WithToken makes every call on the connection carry the ACL token secret.
func WithToken(secret string) grpc.DialOption {
	return grpc.WithPerRPCCredentials(bearer(secret))
}

// bearer is an ACL token as per-call credentials.
type bearer string

func (b bearer) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	return map[string]string{"authorization": "Bearer " + string(b)}, nil
}

// RequireTransportSecurity is false so that tokens also work over plain
// connections (brokers without TLS); with TLS they travel encrypted.
func (bearer) RequireTransportSecurity() bool { return false }
