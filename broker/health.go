package broker

import (
	"errors"
	"time"

	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
)

// ErrNotClustered is Ready's answer before the server has formed or joined
// a cluster.
var ErrNotClustered = errors.New("not part of a cluster yet (waiting for --bootstrap-expect servers or a --join server)")

// Ready returns nil when the server can serve calls: it is part of a
// cluster and knows the leader. Otherwise it says why not.
func (s *Server) Ready() error {
	if !s.membership.clustered() {
		return ErrNotClustered
	}
	if _, id := s.raft.LeaderWithID(); id == "" {
		return ErrNoLeader
	}
	return nil
}

// registerHealth serves the standard gRPC health service
// (grpc.health.v1.Health). The overall service "" is SERVING while Ready
// holds and NOT_SERVING otherwise; it needs no ACL token.
func (s *Server) registerHealth() {
	h := health.NewServer()
	healthpb.RegisterHealthServer(s.grpc, h)
	s.goFunc(func() {
		t := time.NewTicker(500 * time.Millisecond)
		defer t.Stop()
		for {
			st := healthpb.HealthCheckResponse_SERVING
			if s.Ready() != nil {
				st = healthpb.HealthCheckResponse_NOT_SERVING
			}
			h.SetServingStatus("", st)
			select {
			case <-s.ctx.Done():
				h.Shutdown()
				return
			case <-t.C:
			}
		}
	})
}
