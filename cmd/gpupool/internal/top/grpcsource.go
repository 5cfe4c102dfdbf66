package top

import (
	"context"
	"errors"
	"io"
	"sync"
	"time"

	"github.com/gpupool/gpupool/internal/clock"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// Clients are the broker services GRPCSource reads; *client.Client has
// them all.
type Clients struct {
	Lease    gpupoolv1.LeaseServiceClient
	Pool     gpupoolv1.PoolServiceClient
	Operator gpupoolv1.OperatorServiceClient
}

// GRPCSource follows LeaseService.Watch and OperatorService.AuditLog, and
// polls ListHosts, Status and the pending leases every Interval. The
// polls are consistent reads (through the leader), since live readings
// and why-pending exist only there.
type GRPCSource struct {
	Clients
	// Interval between polls; 2s when 0.
	Interval time.Duration
	// Timeout bounds one poll; 10s when 0.
	Timeout time.Duration
	// AuditBacklog is how many past audit entries to show at start.
	AuditBacklog uint32
}

// Run implements Source.
func (s *GRPCSource) Run(ctx context.Context, out chan<- Update) {
	var wg sync.WaitGroup
	for _, f := range []func(context.Context, chan<- Update){s.poll, s.watchLeases, s.followAudit} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			f(ctx, out)
		}()
	}
	wg.Wait()
}

func send(ctx context.Context, out chan<- Update, u Update) bool {
	select {
	case out <- u:
		return true
	case <-ctx.Done():
		return false
	}
}

func (s *GRPCSource) poll(ctx context.Context, out chan<- Update) {
	interval := s.Interval
	if interval <= 0 {
		interval = 2 * time.Second
	}
	timeout := s.Timeout
	if timeout <= 0 {
		timeout = 10 * time.Second
	}
	report := map[string]error{}
	result := func(what string, err error) bool {
		if prev, seen := report[what]; seen && (prev == nil) == (err == nil) && (err == nil || prev.Error() == err.Error()) {
			return true // nothing new to say
		}
		report[what] = err
		return send(ctx, out, ErrorUpdate{What: what, Err: err})
	}
	for {
		cctx, cancel := context.WithTimeout(ctx, timeout)
		hosts, err := s.Pool.ListHosts(cctx, &gpupoolv1.ListHostsRequest{})
		if err == nil && !send(ctx, out, HostsUpdate{Hosts: hosts.Hosts}) {
			cancel()
			return
		}
		ok := result("hosts", err)
		st, err := s.Pool.Status(cctx, &gpupoolv1.StatusRequest{})
		if err == nil && !send(ctx, out, StatusUpdate{Status: st}) {
			cancel()
			return
		}
		ok = ok && result("status", err)
		q, err := s.Lease.List(cctx, &gpupoolv1.ListLeasesRequest{States: []gpupoolv1.LeaseState{gpupoolv1.LeaseState_LEASE_STATE_PENDING}})
		cancel()
		if err == nil && !send(ctx, out, QueueUpdate{Pending: q.Leases}) {
			return
		}
		if !(ok && result("queue", err)) || !clock.Sleep(ctx, clock.Real, interval) {
			return
		}
	}
}

// backoff grows a retry pause from 500ms to 10s.
type backoff struct{ d time.Duration }

func (b *backoff) next() time.Duration {
	b.d = min(max(b.d*2, 500*time.Millisecond), 10*time.Second)
	return b.d
}

func (s *GRPCSource) watchLeases(ctx context.Context, out chan<- Update) {
	resubscribe(ctx, out, "lease watch", "the broker ended the watch", func(ctx context.Context, b *backoff) error {
		stream, err := s.Lease.Watch(ctx, &gpupoolv1.WatchLeasesRequest{})
		if err != nil {
			return err
		}
		first := true
		for {
			ev, err := stream.Recv()
			if err != nil {
				return err
			}
			if first {
				// Only now is the stream known to work: reset what the
				// last one left, and say it works.
				first = false
				*b = backoff{}
				if !send(ctx, out, LeasesReset{}) || !send(ctx, out, ErrorUpdate{What: "lease watch"}) {
					return ctx.Err()
				}
			}
			if !send(ctx, out, LeaseUpdate{Event: ev}) {
				return ctx.Err()
			}
		}
	})
}

func (s *GRPCSource) followAudit(ctx context.Context, out chan<- Update) {
	var since uint64
	backlog := s.AuditBacklog
	resubscribe(ctx, out, "audit log", "the broker ended the audit follow", func(ctx context.Context, b *backoff) error {
		req := &gpupoolv1.AuditLogRequest{Follow: true, SinceIndex: since}
		if since == 0 {
			req.Limit = max(backlog, 1)
		}
		stream, err := s.Operator.AuditLog(ctx, req)
		if err != nil {
			return err
		}
		if !send(ctx, out, ErrorUpdate{What: "audit log"}) {
			return ctx.Err()
		}
		for {
			a, err := stream.Recv()
			if err != nil {
				return err
			}
			*b = backoff{}
			since = max(since, a.Index)
			if !send(ctx, out, AuditUpdate{Entry: a}) {
				return ctx.Err()
			}
		}
	})
}

// resubscribe runs follow until ctx ends, and again after each failure,
// with a pause b grows (follow resets b once its stream works). It reports
// each failure as an ErrorUpdate about what, and a stream the broker ended
// as the error ended. The ctx follow is given ends when follow returns.
func resubscribe(ctx context.Context, out chan<- Update, what, ended string, follow func(ctx context.Context, b *backoff) error) {
	var b backoff
	for ctx.Err() == nil {
		err := func() error {
			cctx, cancel := context.WithCancel(ctx)
			defer cancel()
			return follow(cctx, &b)
		}()
		if ctx.Err() != nil {
			return
		}
		if errors.Is(err, io.EOF) {
			err = errors.New(ended)
		}
		if !send(ctx, out, ErrorUpdate{What: what, Err: err}) || !clock.Sleep(ctx, clock.Real, b.next()) {
			return
		}
	}
}
