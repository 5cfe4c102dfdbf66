package client

import (
	"context"
	"math/rand/v2"
	"slices"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// finalProbe bounds the probe that describes the cluster when the connect
// budget has run out.
const finalProbe = time.Second

// retryWithin is RetryUnavailable with a connect budget: it retries a call
// that fails with Unavailable for at most budget from its first such
// failure, then fails with a *ClusterError. It probes every broker at the
// first failure, and fails after half the budget when none of them can
// answer for a reason waiting rarely fixes (refused, TLS failure): brokers
// that were just started get that long to listen.
func (c *Client) retryWithin(budget time.Duration) grpc.UnaryClientInterceptor {
	return func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		backoff := 25 * time.Millisecond
		var (
			start  time.Time
			end    time.Time
			probed chan []Member
			early  []Member // the first probe's result, once in
			at     time.Time
		)
		var last error // the last Unavailable answer
		for {
			err := invoker(ctx, method, req, reply, cc, opts...)
			if last != nil && interruptedByDeadline(ctx, err) {
				return c.clusterError(ctx, budget, last, early, at)
			}
			if status.Code(err) != codes.Unavailable || IsTLSError(err) {
				return err
			}
			last = err
			if probed == nil {
				start = time.Now()
				end = start.Add(budget)
				probed = make(chan []Member, 1)
				c.probeLater(ctx, probed, 0, end)
			}
			if !time.Now().Before(end) {
				return c.clusterError(ctx, budget, err, early, at)
			}
			wait := min(backoff+rand.N(backoff/2+1), time.Until(end))
			t := time.NewTimer(wait)
			select {
			case <-ctx.Done():
				t.Stop()
				if ctx.Err() == context.DeadlineExceeded {
					return c.clusterError(ctx, budget, err, early, at)
				}
				return err
			case ms := <-probed:
				t.Stop()
				early, at = ms, time.Now()
				if allHopeless(ms) {
					// Brokers that were just started may not listen yet:
					// give them half the budget before failing.
					if time.Since(start) >= budget/2 {
						return &ClusterError{Members: ms, Last: err}
					}
					c.probeLater(ctx, probed, 250*time.Millisecond, end)
				}
			case <-t.C:
			}
			backoff = min(2*backoff, maxRetryBackoff)
		}
	}
}

// probeLater probes every broker after delay, within end, and sends the
// result on ch (which has room for it).
func (c *Client) probeLater(ctx context.Context, ch chan<- []Member, delay time.Duration, end time.Time) {
	go func() {
		if delay > 0 {
			t := time.NewTimer(delay)
			defer t.Stop()
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
		}
		pctx, cancel := context.WithDeadline(ctx, end)
		defer cancel()
		ch <- c.probeAll(pctx)
	}()
}

// allHopeless reports whether no broker answered, each for a reason that
// waiting within a connect budget does not fix.
func allHopeless(ms []Member) bool {
	return len(ms) > 0 && !slices.ContainsFunc(ms, func(m Member) bool {
		return m.Outcome != OutcomeRefused && m.Outcome != OutcomeTLS
	})
}

// clusterError describes the cluster after the budget ran out: the early
// probe's picture when it is recent, else a fresh one.
func (c *Client) clusterError(ctx context.Context, budget time.Duration, last error, early []Member, at time.Time) *ClusterError {
	ms := early
	if ms == nil || time.Since(at) > finalProbe {
		pctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), finalProbe)
		ms = c.probeAll(pctx)
		cancel()
	}
	e := &ClusterError{Members: ms, Budget: budget, Last: last}
	for _, m := range ms {
		if m.Voter {
			e.Voters++
		}
	}
	return e
}
