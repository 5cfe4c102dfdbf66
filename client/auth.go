package client

import (
	"context"

	"google.golang.org/grpc"
)

// WithToken makes every call on the connection carry the ACL token secret;
// DialWith adds it for Options.Token.
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

// WithTokenCall makes one call carry the ACL token secret, for a client
// dialed without one (or with another).
func WithTokenCall(secret string) grpc.CallOption {
	return grpc.PerRPCCredentials(bearer(secret))
}
