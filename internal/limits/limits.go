// Package limits is the one mechanism that bounds what a single caller may
// make a broker or an agent do: requests per second per token, new
// connections per second per client address, streams open at once per
// token, and acquires waiting at once per tenant.
//
// A Set holds the limiters of one server and counts their refusals for
// /metrics (gpupool_limit_refusals_total{limit}). A limiter refuses with an
// *Error that names the limit, the flag that sets it and who hit it; the
// broker answers it with gRPC ResourceExhausted, the data plane with
// ACCEPT_CODE_RESOURCE_EXHAUSTED or a connection closed with its message.
//
// Limiters are safe for concurrent use. A limit of 0 is no limit.
package limits

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

// ErrLimited is what every refusal of this package wraps.
var ErrLimited = errors.New("limit reached")

// Error is a refusal: who hit which limit.
type Error struct {
	// Limit is the limit's name, the label of its refusals in /metrics.
	Limit string
	// Flag is the command-line flag that sets it.
	Flag string
	// Who is the caller that hit it, e.g. `token 1f2e... ("ci")`.
	Who string
	// Max says what the limit allows, e.g. "100 requests/s (bursts of 200)".
	Max string
}

func (e *Error) Error() string {
	return fmt.Sprintf("limit %s reached by %s: at most %s (--%s); slow down and retry", e.Limit, e.Who, e.Max, e.Flag)
}

func (e *Error) Unwrap() error { return ErrLimited }

// Set is the limiters of one server and the count of their refusals.
type Set struct {
	now      func() time.Time
	refusals *prometheus.CounterVec
	gauges   []prometheus.Collector // the fair shares' seats and queues
}

// NewSet returns an empty set whose rate limiters read the time from now
// (time.Now when nil).
func NewSet(now func() time.Time) *Set {
	if now == nil {
		now = time.Now
	}
	return &Set{now: now, refusals: prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "gpupool_limit_refusals_total",
		Help: "Requests, streams and connections refused because a caller hit a limit, by limit.",
	}, []string{"limit"})}
}

// Collector is the refusal counter and the fair shares' gauges, for a
// Prometheus registry.
func (s *Set) Collector() prometheus.Collector {
	return collectors(append([]prometheus.Collector{s.refusals}, s.gauges...))
}

// collectors is several collectors as one.
type collectors []prometheus.Collector

func (cs collectors) Describe(ch chan<- *prometheus.Desc) {
	for _, c := range cs {
		c.Describe(ch)
	}
}

func (cs collectors) Collect(ch chan<- prometheus.Metric) {
	for _, c := range cs {
		c.Collect(ch)
	}
}

// Refusals returns how many refusals limit name has made so far.
func (s *Set) Refusals(name string) float64 {
	var m dto.Metric
	_ = s.refusals.WithLabelValues(name).Write(&m)
	return m.GetCounter().GetValue()
}

func (s *Set) refuse(e *Error) error {
	s.refusals.WithLabelValues(e.Limit).Inc()
	return e
}

// Rate is a rate limit: PerSecond on average, in bursts of at most Burst.
// PerSecond 0 is no limit.
type Rate struct {
	PerSecond float64
	Burst     int
}

func (r Rate) String() string {
	return fmt.Sprintf("%g/s (bursts of %d)", r.PerSecond, r.Burst)
}

// Validate checks a rate given by flag and its burst by burstFlag.
func (r Rate) Validate(flag, burstFlag string) error {
	if r.PerSecond < 0 || math.IsNaN(r.PerSecond) || math.IsInf(r.PerSecond, 0) {
		return fmt.Errorf("--%s %g: must be 0 (no limit) or a positive number per second", flag, r.PerSecond)
	}
	if r.PerSecond > 0 && r.Burst < 1 {
		return fmt.Errorf("--%s %d: must be 1 or more while --%s is not 0", burstFlag, r.Burst, flag)
	}
	return nil
}

// RateLimiter allows each key a Rate: a token bucket per key. Buckets that
// have refilled are forgotten, so idle keys cost nothing.
type RateLimiter struct {
	set  *Set
	name string
	flag string
	rate Rate

	mu      sync.Mutex
	buckets map[string]*bucket // guarded by mu
	swept   time.Time          // guarded by mu
}

type bucket struct {
	tokens float64
	at     time.Time
}

// Rate returns a rate limiter named name, set by --flag.
func (s *Set) Rate(name, flag string, r Rate) *RateLimiter {
	s.refusals.WithLabelValues(name)
	return &RateLimiter{set: s, name: name, flag: flag, rate: r, buckets: map[string]*bucket{}}
}

// Limit is the limiter's rate.
func (l *RateLimiter) Limit() Rate { return l.rate }

// Allow takes one from key's bucket, or returns an *Error naming who when
// the bucket is empty.
func (l *RateLimiter) Allow(key, who string) error {
	if l == nil || l.rate.PerSecond == 0 {
		return nil
	}
	now := l.set.now()
	l.mu.Lock()
	l.sweepLocked(now)
	b := l.buckets[key]
	if b == nil {
		b = &bucket{tokens: float64(l.rate.Burst), at: now}
		l.buckets[key] = b
	}
	b.refill(now, l.rate)
	ok := b.tokens >= 1
	if ok {
		b.tokens--
	}
	l.mu.Unlock()
	if ok {
		return nil
	}
	return l.set.refuse(&Error{Limit: l.name, Flag: l.flag, Who: who, Max: l.rate.String()})
}

func (b *bucket) refill(now time.Time, r Rate) {
	if d := now.Sub(b.at); d > 0 {
		b.tokens = math.Min(float64(r.Burst), b.tokens+d.Seconds()*r.PerSecond)
		b.at = now
	}
}

// sweepLocked forgets, at most once a second, the buckets that are full
// again: a new bucket starts full, so forgetting them changes nothing.
func (l *RateLimiter) sweepLocked(now time.Time) {
	if now.Sub(l.swept) < time.Second {
		return
	}
	l.swept = now
	for k, b := range l.buckets {
		b.refill(now, l.rate)
		if b.tokens >= float64(l.rate.Burst) {
			delete(l.buckets, k)
		}
	}
}

// Concurrency allows each key at most Max things at once (streams,
// connections, waiting acquires). Max 0 is no limit.
type Concurrency struct {
	set  *Set
	name string
	flag string
	max  int
	what string

	mu   sync.Mutex
	open map[string]int // guarded by mu; keys holding none are absent
}

// Concurrency returns a limiter named name, set by --flag, of max things
// (what, e.g. "streams open at once") per key.
func (s *Set) Concurrency(name, flag string, max int, what string) *Concurrency {
	s.refusals.WithLabelValues(name)
	return &Concurrency{set: s, name: name, flag: flag, max: max, what: what, open: map[string]int{}}
}

// Max is the limiter's limit.
func (c *Concurrency) Max() int { return c.max }

// Acquire takes one of key's slots, or returns an *Error naming who when
// key holds them all. Call release, once, when the thing ends.
func (c *Concurrency) Acquire(key, who string) (release func(), err error) {
	if c == nil || c.max == 0 {
		return func() {}, nil
	}
	c.mu.Lock()
	if c.open[key] >= c.max {
		c.mu.Unlock()
		return nil, c.set.refuse(&Error{Limit: c.name, Flag: c.flag, Who: who, Max: fmt.Sprintf("%d %s", c.max, c.what)})
	}
	c.open[key]++
	c.mu.Unlock()
	var once sync.Once
	return func() {
		once.Do(func() {
			c.mu.Lock()
			defer c.mu.Unlock()
			if c.open[key]--; c.open[key] <= 0 {
				delete(c.open, key)
			}
		})
	}, nil
}

// Open returns how many things key holds now.
func (c *Concurrency) Open(key string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.open[key]
}

// ValidateMax checks a concurrency limit given by flag.
func ValidateMax(flag string, max int) error {
	if max < 0 {
		return fmt.Errorf("--%s %d: must be 0 (no limit) or more", flag, max)
	}
	return nil
}

// Fair shares a server's seats for work in flight (its writes) fairly
// between keys (tokens): a key holds at most Share seats at once, all keys
// together at most Seats, and a call that finds no seat free waits in its
// key's queue of at most Queue calls. A seat that frees goes to the
// waiting key that holds the fewest seats, the least recently served
// first among equals, so a key that asks for much (a flood) gets no more
// than the others while they ask too, and all of what they leave.
//
// A key whose queue is full is refused with an *Error. Seats or Share 0
// is no limit of that kind; Queue 0 is no waiting (refused at once when
// no seat is free).
type Fair struct {
	set   *Set
	name  string
	flag  string
	limit FairLimit

	mu      sync.Mutex
	busy    int              // guarded by mu; seats held
	flows   map[string]*flow // guarded by mu; keys holding or waiting for a seat
	waiting int              // guarded by mu; calls waiting, all keys
	served  uint64           // guarded by mu; the count of seats handed out
}

// FairLimit is the size of a Fair: see Fair.
type FairLimit struct {
	Seats int
	Share int
	Queue int
}

// Validate checks the limit, set by the three flags.
func (f FairLimit) Validate(seatsFlag, shareFlag, queueFlag string) error {
	for _, c := range []struct {
		flag, zero string
		v          int
	}{{seatsFlag, "no limit", f.Seats}, {shareFlag, "no limit", f.Share}, {queueFlag, "none wait", f.Queue}} {
		if c.v < 0 {
			return fmt.Errorf("--%s %d: must be 0 (%s) or more", c.flag, c.v, c.zero)
		}
	}
	if f.Seats > 0 && f.Share > f.Seats {
		return fmt.Errorf("--%s %d: must be at most --%s (%d), or --%s 0 (no limit)", shareFlag, f.Share, seatsFlag, f.Seats, seatsFlag)
	}
	return nil
}

type flow struct {
	held    int
	queue   []*fairWaiter
	lastAt  uint64 // Fair.served when it last got a seat
	waiting bool
}

type fairWaiter struct {
	ready    chan struct{}
	admitted bool // guarded by Fair.mu
}

// Fair returns a fair share named name; a refusal names flag (the
// queue's).
func (s *Set) Fair(name, flag string, l FairLimit) *Fair {
	s.refusals.WithLabelValues(name)
	f := &Fair{set: s, name: name, flag: flag, limit: l, flows: map[string]*flow{}}
	s.gauges = append(s.gauges,
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "gpupool_limit_seats_held", ConstLabels: prometheus.Labels{"limit": name},
			Help: "Seats of a fair share held now (writes in flight), all tokens."}, func() float64 { h, _ := f.InFlight(); return float64(h) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "gpupool_limit_seats_waiting", ConstLabels: prometheus.Labels{"limit": name},
			Help: "Calls waiting for a seat of a fair share now, all tokens."}, func() float64 { _, w := f.InFlight(); return float64(w) }))
	return f
}

// Limit is the share's size.
func (f *Fair) Limit() FairLimit { return f.limit }

// Acquire takes a seat for key, waiting in key's queue until one is free
// or ctx ends (its error). It returns an *Error naming who when key's
// queue is full. Call release, once, when the work ends.
func (f *Fair) Acquire(ctx context.Context, key, who string) (release func(), err error) {
	if f == nil || (f.limit.Seats == 0 && f.limit.Share == 0) {
		return func() {}, nil
	}
	f.mu.Lock()
	fl := f.flows[key]
	if fl == nil {
		fl = &flow{}
		f.flows[key] = fl
	}
	if len(fl.queue) == 0 && f.freeLocked(fl) {
		f.admitLocked(fl)
		f.mu.Unlock()
		return f.releaser(key), nil
	}
	if len(fl.queue) >= f.limit.Queue {
		held := fl.held
		f.forgetLocked(key, fl)
		f.mu.Unlock()
		return nil, f.set.refuse(&Error{Limit: f.name, Flag: f.flag, Who: who,
			Max: fmt.Sprintf("%d writes waiting behind its %d in flight", f.limit.Queue, held)})
	}
	w := &fairWaiter{ready: make(chan struct{})}
	fl.queue = append(fl.queue, w)
	f.waiting++
	f.mu.Unlock()
	select {
	case <-w.ready:
		return f.releaser(key), nil
	case <-ctx.Done():
	}
	f.mu.Lock()
	if w.admitted {
		f.mu.Unlock()
		f.releaser(key)()
		return nil, ctx.Err()
	}
	if i := slices.Index(fl.queue, w); i >= 0 {
		fl.queue = slices.Delete(fl.queue, i, i+1)
		f.waiting--
	}
	f.forgetLocked(key, fl)
	f.mu.Unlock()
	return nil, ctx.Err()
}

// freeLocked says whether fl may take a seat now.
func (f *Fair) freeLocked(fl *flow) bool {
	return (f.limit.Seats == 0 || f.busy < f.limit.Seats) && (f.limit.Share == 0 || fl.held < f.limit.Share)
}

func (f *Fair) admitLocked(fl *flow) {
	fl.held++
	f.busy++
	f.served++
	fl.lastAt = f.served
}

// forgetLocked drops key's flow once it holds and waits for nothing.
func (f *Fair) forgetLocked(key string, fl *flow) {
	if fl.held == 0 && len(fl.queue) == 0 {
		delete(f.flows, key)
	}
}

func (f *Fair) releaser(key string) func() {
	var once sync.Once
	return func() {
		once.Do(func() {
			f.mu.Lock()
			defer f.mu.Unlock()
			fl := f.flows[key]
			fl.held--
			f.busy--
			f.dispatchLocked()
			f.forgetLocked(key, fl)
		})
	}
}

// dispatchLocked hands the free seats to the waiting keys, fewest held
// first, then least recently served.
func (f *Fair) dispatchLocked() {
	for f.waiting > 0 && (f.limit.Seats == 0 || f.busy < f.limit.Seats) {
		var next *flow
		for _, fl := range f.flows {
			if len(fl.queue) == 0 || !f.freeLocked(fl) {
				continue
			}
			if next == nil || fl.held < next.held || (fl.held == next.held && fl.lastAt < next.lastAt) {
				next = fl
			}
		}
		if next == nil {
			return
		}
		w := next.queue[0]
		next.queue = slices.Delete(next.queue, 0, 1)
		f.waiting--
		w.admitted = true
		f.admitLocked(next)
		close(w.ready)
	}
}

// InFlight returns the seats held and the calls waiting, all keys.
func (f *Fair) InFlight() (held, waiting int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.busy, f.waiting
}
