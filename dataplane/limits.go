package dataplane

import (
	"fmt"
	"net"

	"github.com/quic-go/quic-go"

	"github.com/gpupool/gpupool/internal/limits"
)

// Limits bounds what one client may make the data plane do (see
// internal/limits). A field of 0 is no limit.
type Limits struct {
	// ClientConnRate is the new connections one client address may open
	// per second; a connection over it is closed with the reason.
	ClientConnRate limits.Rate
	// ClientConns is the connections one client address may hold open at
	// once. With MaxStreamsPerConn it bounds the streams a client can
	// open before it shows a lease token.
	ClientConns int
	// LeaseStreams is the streams one lease token may hold open at once
	// on this host.
	LeaseStreams int
}

// DefaultLimits are well above what the benchmarks and the SDK need.
func DefaultLimits() Limits {
	return Limits{
		ClientConnRate: limits.Rate{PerSecond: 50, Burst: 100},
		ClientConns:    32,
		LeaseStreams:   256,
	}
}

// The names of the data plane's limits, as in /metrics, and the agent's
// flags that set them.
const (
	LimitClientConnRate = "dataplane-client-connection-rate"
	LimitClientConns    = "dataplane-client-connections"
	LimitLeaseStreams   = "dataplane-lease-streams"

	FlagClientConnRate  = "limit-client-conn-rate"
	FlagClientConnBurst = "limit-client-conn-burst"
	FlagClientConns     = "limit-client-conns"
	FlagLeaseStreams    = "limit-lease-streams"
)

// Validate checks every limit, naming the flag of a wrong one.
func (l Limits) Validate() error {
	for _, err := range []error{
		l.ClientConnRate.Validate(FlagClientConnRate, FlagClientConnBurst),
		limits.ValidateMax(FlagClientConns, l.ClientConns),
		limits.ValidateMax(FlagLeaseStreams, l.LeaseStreams),
	} {
		if err != nil {
			return fmt.Errorf("dataplane: %w", err)
		}
	}
	return nil
}

// admit applies the client's connection limits to a new connection; the
// caller calls release when the connection ends.
func (s *Server) admit(conn *quic.Conn) (release func(), err error) {
	host := conn.RemoteAddr().String()
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	}
	who := "client " + host
	if err := s.connRate.Allow(host, who); err != nil {
		return nil, err
	}
	return s.clientConns.Acquire(host, who)
}
