package agent

import (
	"context"
	"errors"
	"io"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// heartbeat runs one heartbeat stream until it fails or ctx ends. It sends
// a heartbeat at once, then every interval, and at once again whenever a
// response asks for a teardown not confirmed yet. progressed reports
// whether the broker answered at least once.
//
// The broker answers every heartbeat. A stream that stays silent for the
// heartbeat TTL (at least two intervals) is treated as dead, so that a
// broker that vanished without closing the connection is noticed.
func (a *Agent) heartbeat(ctx context.Context, ac gpupoolv1.AgentServiceClient, reg *gpupoolv1.RegisterResponse, conn *connState) (progressed bool, err error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := ac.Heartbeat(ctx)
	if err != nil {
		return false, err
	}
	responses := make(chan *gpupoolv1.HeartbeatResponse)
	recvErr := make(chan error, 1)
	go func() {
		for {
			resp, err := stream.Recv()
			if err != nil {
				recvErr <- err
				return
			}
			select {
			case responses <- resp:
			case <-ctx.Done():
				return
			}
		}
	}()

	send := func() error {
		err := stream.Send(&gpupoolv1.HeartbeatRequest{HostId: a.cfg.HostID, TornDown: a.leases.confirmations()})
		if errors.Is(err, io.EOF) {
			// The stream ended; Recv has the reason.
			select {
			case err = <-recvErr:
			case <-ctx.Done():
				err = ctx.Err()
			}
		}
		return err
	}

	interval := heartbeatInterval(reg.GetHeartbeatIntervalMs())
	silence := func() time.Duration {
		return max(time.Duration(reg.GetHeartbeatTtlMs())*time.Millisecond, 2*interval)
	}
	if err := send(); err != nil {
		return false, err
	}
	tick := time.NewTicker(interval)
	defer tick.Stop()
	quiet := time.NewTimer(silence())
	defer quiet.Stop()
	for {
		select {
		case <-ctx.Done():
			return progressed, ctx.Err()
		case err := <-recvErr:
			return progressed, err
		case <-quiet.C:
			return progressed, status.Errorf(codes.Unavailable, "no heartbeat response for %s", silence())
		case <-tick.C:
			if err := send(); err != nil {
				return progressed, err
			}
		case resp := <-responses:
			if !progressed {
				progressed = true
				conn.up(a.log)
			}
			if iv := heartbeatInterval(resp.GetHeartbeatIntervalMs()); resp.GetHeartbeatIntervalMs() > 0 && iv != interval {
				a.log.Info("heartbeat interval changed", "from", interval, "to", iv)
				interval = iv
				tick.Reset(interval)
			}
			quiet.Reset(silence())
			c := a.leases.apply(resp)
			if c.empty() {
				continue
			}
			a.log.Info("assignments changed", "added", c.added, "removed", c.removed,
				"torn_down", c.tornDown, "enforcing", c.enforcing)
			if len(c.tornDown) > 0 {
				if err := send(); err != nil {
					return progressed, err
				}
			}
		}
	}
}
