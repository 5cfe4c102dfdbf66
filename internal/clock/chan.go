package clock

import (
	"context"
	"sync"
	"time"
)

// ChanTimer is a time.Timer on a Clock: it sends the clock's time on C
// once d passed. As with time.Timer since Go 1.23, Stop and Reset drop a
// value sent but not yet received, so no stale value is read after them.
type ChanTimer struct {
	C <-chan time.Time

	c       Clock
	ch      chan time.Time
	mu      sync.Mutex
	t       Timer  // guarded by mu; the pending AfterFunc
	gen     uint64 // guarded by mu; bumped by Stop and Reset, so that an older AfterFunc sends nothing
	pending bool   // guarded by mu; armed and not yet sent
}

// NewTimer returns a timer of c that fires after d.
func NewTimer(c Clock, d time.Duration) *ChanTimer {
	ch := make(chan time.Time, 1)
	t := &ChanTimer{C: ch, c: c, ch: ch}
	t.mu.Lock()
	t.armLocked(d)
	t.mu.Unlock()
	return t
}

func (t *ChanTimer) armLocked(d time.Duration) {
	t.gen++
	gen := t.gen
	t.pending = true
	t.t = t.c.AfterFunc(d, func() {
		t.mu.Lock()
		defer t.mu.Unlock()
		if t.gen != gen {
			return
		}
		t.pending = false
		select {
		case t.ch <- t.c.Now():
		default:
		}
	})
}

// stopLocked cancels the pending send and drops an unread value; it
// reports whether a send was pending.
func (t *ChanTimer) stopLocked() bool {
	t.gen++
	t.t.Stop()
	was := t.pending
	t.pending = false
	select {
	case <-t.ch:
	default:
	}
	return was
}

// Stop prevents the timer from firing; it reports whether it did (false:
// it had fired or was stopped).
func (t *ChanTimer) Stop() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.stopLocked()
}

// Reset makes the timer fire d from now, whether or not it had fired.
func (t *ChanTimer) Reset(d time.Duration) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.stopLocked()
	t.armLocked(d)
}

// Ticker is a time.Ticker on a Clock: it sends the clock's time on C every
// d, dropping ticks a slow receiver misses. Ticks are due at whole periods
// from the start (or the last Reset), so they do not drift.
type Ticker struct {
	C <-chan time.Time

	c  Clock
	ch chan time.Time
	mu sync.Mutex
	t  Timer         // guarded by mu; the next tick's AfterFunc
	d  time.Duration // guarded by mu
	// next is when the next tick is due; gen is bumped by Stop and
	// Reset, so that an older AfterFunc neither sends nor re-arms.
	next time.Time // guarded by mu
	gen  uint64    // guarded by mu
}

// NewTicker returns a ticker of c with period d, which must be positive.
func NewTicker(c Clock, d time.Duration) *Ticker {
	if d <= 0 {
		panic("clock: non-positive interval for NewTicker")
	}
	ch := make(chan time.Time, 1)
	t := &Ticker{C: ch, c: c, ch: ch}
	t.mu.Lock()
	t.startLocked(d)
	t.mu.Unlock()
	return t
}

func (t *Ticker) startLocked(d time.Duration) {
	t.gen++
	t.d = d
	t.next = t.c.Now().Add(d)
	t.armLocked(t.gen, d)
}

func (t *Ticker) armLocked(gen uint64, in time.Duration) {
	t.t = t.c.AfterFunc(in, func() {
		t.mu.Lock()
		defer t.mu.Unlock()
		if t.gen != gen {
			return
		}
		now := t.c.Now()
		select {
		case t.ch <- now:
		default:
		}
		for !t.next.After(now) {
			t.next = t.next.Add(t.d)
		}
		t.armLocked(gen, t.next.Sub(now))
	})
}

// Stop ends the ticks; a tick sent but not received stays readable.
func (t *Ticker) Stop() {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.gen++
	t.t.Stop()
}

// Reset stops the ticker and starts it again with period d from now.
func (t *Ticker) Reset(d time.Duration) {
	if d <= 0 {
		panic("clock: non-positive interval for Ticker.Reset")
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	t.gen++
	t.t.Stop()
	t.startLocked(d)
}

// Sleep waits until d passed on c or ctx ended; it reports whether d
// passed.
func Sleep(ctx context.Context, c Clock, d time.Duration) bool {
	t := NewTimer(c, d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}
