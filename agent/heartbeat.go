package agent

import (
	"context"
	"errors"
	"io"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/gpupool/gpupool/internal/clock"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// follow carries out what a heartbeat response asks: new leases are
// prepared (or refused), ended ones torn down in the background (under
// the agent's context, not the stream's: a broken stream must not abandon
// a teardown), and moved deadlines saved.
func (a *Agent) follow(ctx context.Context, resp *gpupoolv1.HeartbeatResponse, now time.Time) {
	a.keys.setKeys(resp.GetKeys())
	a.keys.sawResponse(resp)
	p := a.leases.reconcile(resp, now)
	for _, rec := range p.save {
		if err := a.files.put(rec); err != nil {
			a.log.Error("saving a lease's deadline failed", "lease", rec.Assignment.LeaseId, "err", err)
		}
	}
	for _, o := range p.teardown {
		a.teardown(o)
	}
	for _, as := range p.prepare {
		a.prepare(ctx, as, now)
	}
}

// heartbeat runs one heartbeat stream until it fails or ctx ends. It sends
// a heartbeat at once, then every interval, and at once again whenever
// the agent has news: a teardown finished, a violation, a refusal, a
// device turned unhealthy. progressed reports whether the broker answered
// at least once. The interval and the silence are timed on the agent's
// clock.
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
		req := &gpupoolv1.HeartbeatRequest{HostId: a.cfg.HostID, Devices: a.deviceReports()}
		a.leases.report(req)
		err := stream.Send(req)
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
	// Later sends run on their own goroutine, so this loop keeps taking
	// the broker's responses while a send waits on flow control. Sending
	// from the loop would deadlock under load: a blocked send stops the
	// loop, which stops Recv, which fills the broker's window, which
	// blocks the broker's sends and with them its reads of this stream.
	sendKick := make(chan struct{}, 1)
	sendErr := make(chan error, 1)
	go func() {
		for {
			select {
			case <-ctx.Done():
				return
			case <-sendKick:
			}
			if err := send(); err != nil {
				sendErr <- err
				return
			}
		}
	}()
	kick := func() {
		select {
		case sendKick <- struct{}{}:
		default: // a send is due already; it carries the news too
		}
	}
	tick := clock.NewTicker(a.clock, interval)
	defer tick.Stop()
	quiet := clock.NewTimer(a.clock, silence())
	defer quiet.Stop()
	for {
		select {
		case <-ctx.Done():
			return progressed, ctx.Err()
		case err := <-recvErr:
			return progressed, err
		case <-quiet.C:
			return progressed, status.Errorf(codes.Unavailable, "no heartbeat response for %s", silence())
		case err := <-sendErr:
			return progressed, err
		case <-tick.C:
			kick()
		case <-a.kickCh:
			kick()
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
			if a.leases.ack(resp.GetAckedEventSeq()) {
				a.saveMemory()
			}
			if ids := resp.GetClearHealth(); len(ids) > 0 {
				a.clearHealth(ids)
			}
			a.follow(ctx, resp, a.clock.Now())
		}
	}
}
