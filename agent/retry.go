package agent

import (
	"math/rand/v2"
	"time"
)

// retryDelay is an exponential backoff between attempts to reach the
// brokers. Delays are jittered downwards by up to 20 % so that agents
// that lost the same broker do not come back in lockstep; no delay
// exceeds the cap.
type retryDelay struct {
	min, max, cur time.Duration
}

func newRetryDelay(min, max time.Duration) *retryDelay {
	return &retryDelay{min: min, max: max, cur: min}
}

// peek is the delay the next call to next is about (before jitter).
func (r *retryDelay) peek() time.Duration { return r.cur }

// next returns the delay to wait now and doubles the following one.
func (r *retryDelay) next() time.Duration {
	d := r.cur
	r.cur = min(2*r.cur, r.max)
	return d - rand.N(d/5+1)
}

// reset starts over from the shortest delay, after a success.
func (r *retryDelay) reset() { r.cur = r.min }
