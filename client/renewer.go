package client

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/gpupool/gpupool/internal/clock"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
	"github.com/gpupool/gpupool/protocol"
)

// Pacing of Renew.
const (
	// MinRenewInterval is the smallest fixed RenewOptions.Interval.
	MinRenewInterval = 100 * time.Millisecond
	// minRenewEvery bounds how often a lease is renewed when paced at a
	// third of its TTL.
	minRenewEvery = 500 * time.Millisecond
	// maxReconnectWait caps the wait between reconnect attempts.
	maxReconnectWait = 2 * time.Second
)

// RenewOptions configure Renew.
type RenewOptions struct {
	// Interval renews every lease this often; 0 renews each at a third of
	// its TTL, but no more often than every 500ms.
	Interval time.Duration
	// Once renews every lease given once, and Renew returns when each is
	// answered (an error naming those that failed). Extras are not taken on.
	Once bool
	// OnAnswer, if set, is called with every answer and event on the
	// stream, in order, from the goroutine that reads them; an error ends
	// Renew. A GROWN event that announces again an extra already being
	// renewed (as the brokers do on every new stream) is not passed on.
	OnAnswer func(*gpupoolv1.KeepAliveResponse) error
	// OnBroken, if set, is told once per outage why the stream broke,
	// before Renew reconnects.
	OnBroken func(why string)
	// Stream opens the stream to renew over; nil opens the Client's
	// LeaseService.KeepAlive.
	Stream func(context.Context) (KeepAliveStream, error)
}

// Renew renews the leases ids over one KeepAlive stream, and the extras an
// elastic one among them grows, until ctx ends (nil) or none is left to
// renew (an error naming the leases that could not be renewed; nil if
// none failed). A broken stream is reopened, to any broker, with backoff;
// an error that another broker would repeat (InvalidArgument,
// Unimplemented, PermissionDenied, Unauthenticated) is returned as is.
// Renewals are sent from their own goroutine, never from the one that
// reads answers.
func (c *Client) Renew(ctx context.Context, ids []string, o RenewOptions) error {
	open := o.Stream
	if open == nil {
		open = c.keepAliveStream
	}
	k := &renewer{sched: newRenewSchedule(ids, o.Interval, o.Once), open: open, onAnswer: o.OnAnswer, onBroken: o.OnBroken, clk: clock.Real}
	return k.run(ctx)
}

// sendQueue hands the ids to renew from the loop that schedules them to
// the goroutine that sends them, in order and without repeats; put never
// blocks.
type sendQueue struct {
	mu   sync.Mutex
	ids  []string // guarded by mu
	kick chan struct{}
}

func newSendQueue() *sendQueue { return &sendQueue{kick: make(chan struct{}, 1)} }

func (q *sendQueue) put(ids []string) {
	if len(ids) == 0 {
		return
	}
	q.mu.Lock()
	for _, id := range ids {
		if !slices.Contains(q.ids, id) {
			q.ids = append(q.ids, id)
		}
	}
	q.mu.Unlock()
	select {
	case q.kick <- struct{}{}:
	default:
	}
}

// take waits for ids to send; false once ctx ends.
func (q *sendQueue) take(ctx context.Context) ([]string, bool) {
	for {
		q.mu.Lock()
		ids := q.ids
		q.ids = nil
		q.mu.Unlock()
		if len(ids) > 0 {
			return ids, true
		}
		select {
		case <-ctx.Done():
			return nil, false
		case <-q.kick:
		}
	}
}

// RenewalFailure says why a renewal answer is not a successful renewal, or
// "" when it is one.
func RenewalFailure(r *gpupoolv1.KeepAliveResponse) string {
	switch {
	case r.GetError() != "":
		return r.GetError()
	case r.GetState() != gpupoolv1.LeaseState_LEASE_STATE_GRANTED:
		return fmt.Sprintf("lease is %s, not granted", protocol.EnumLabel(r.GetState()))
	}
	return ""
}

// renewSchedule is the schedule of a Renew: which leases are still
// being renewed, when each is due next, and which could not be renewed.
// The extras of an elastic lease join the schedule when the lease grows,
// are renewed with it, and leave it quietly when they end. A lease whose
// TTL is known (expireAfter) is given up once no renewal has succeeded for
// a whole TTL: it has expired at the brokers. It does no I/O and reads no
// clock, so it is tested with plain times.
type renewSchedule struct {
	ids      []string      // the leases, in the order given, without repeats
	interval time.Duration // fixed pace; 0 paces each lease at a third of its TTL
	once     bool          // renew each lease once, then drop it

	extras   []string                 // extras of those leases, in the order they grew
	parentOf map[string]string        // extra → the lease it belongs to
	active   map[string]bool          // leases and extras still to renew
	next     map[string]time.Time     // when an active lease is due; zero while waiting for an answer
	failed   map[string]string        // lease → why it could not be renewed
	ttl      map[string]time.Duration // lease → its TTL, for those given up after it
	expires  map[string]time.Time     // lease → when it expires unless renewed before
}

func newRenewSchedule(ids []string, interval time.Duration, once bool) *renewSchedule {
	r := &renewSchedule{interval: interval, once: once, parentOf: map[string]string{},
		active: map[string]bool{}, next: map[string]time.Time{}, failed: map[string]string{},
		ttl: map[string]time.Duration{}, expires: map[string]time.Time{}}
	for _, id := range ids {
		if !r.active[id] {
			r.ids = append(r.ids, id)
			r.active[id] = true
		}
	}
	return r
}

// expireAfter gives up lease id, one of those given, unless a renewal
// succeeds within ttl of now and of every successful renewal after; each
// answer's TTL replaces ttl. A zero ttl does nothing.
func (r *renewSchedule) expireAfter(id string, ttl time.Duration, now time.Time) {
	if ttl <= 0 || !r.active[id] {
		return
	}
	r.ttl[id] = ttl
	r.expires[id] = now.Add(ttl)
}

// due lists the active leases to renew at now, in the order given, then
// their extras; all lists every active lease, as on a new stream. An
// extra not waiting for an answer is renewed with its lease, in the same
// round.
func (r *renewSchedule) due(now time.Time, all bool) []string {
	var out []string
	for _, id := range slices.Concat(r.ids, r.extras) {
		if !r.active[id] {
			continue
		}
		at := r.next[id]
		withParent := !at.IsZero() && r.parentOf[id] != "" && slices.Contains(out, r.parentOf[id])
		if all || withParent || !at.IsZero() && !at.After(now) {
			out = append(out, id)
		}
	}
	return out
}

// expire gives up the leases whose TTL ran out at now with no renewal,
// and returns them.
func (r *renewSchedule) expire(now time.Time) []string {
	var out []string
	for _, id := range r.ids {
		if at, ok := r.expires[id]; ok && r.active[id] && !at.After(now) {
			out = append(out, id)
			r.drop(id, fmt.Sprintf("could not renew it before it expired: no renewal answered within its TTL of %s", r.ttl[id]))
		}
	}
	return out
}

// sent records that a renewal of id went out at now.
func (r *renewSchedule) sent(id string, now time.Time) {
	if r.interval > 0 && !r.once {
		r.next[id] = now.Add(r.interval)
	} else {
		r.next[id] = time.Time{} // due again once answered
	}
}

// answer records an answer received at now. Answers about leases not
// being renewed are ignored. A GROWN event adds the new extra of a lease
// being renewed, due at once (but not with Once, which renews the
// leases given only).
func (r *renewSchedule) answer(resp *gpupoolv1.KeepAliveResponse, now time.Time) {
	if ev := resp.GetEvent(); ev != nil {
		id := resp.GetLeaseId()
		if id == "" {
			id = ev.GetLease().GetId()
		}
		switch ev.GetType() {
		case gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_GROWN:
			if x := ev.GetLease(); r.active[x.GetParent()] && !r.active[x.GetId()] && x.GetId() != "" && !r.once {
				r.grow(x.GetId(), x.GetParent(), now)
			}
		case gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_RELEASING:
			if r.active[id] && r.parentOf[id] != "" {
				r.drop(id, "") // an extra taken back cannot be renewed
			}
		case gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_ENDED:
			if r.active[id] {
				r.drop(id, "lease ended: "+cmp.Or(ev.GetMessage(), "-"))
			}
		}
		return
	}
	id := resp.GetLeaseId()
	if !r.active[id] {
		return
	}
	if why := RenewalFailure(resp); why != "" {
		r.drop(id, why)
		return
	}
	ttl := time.Duration(resp.GetTtlMs()) * time.Millisecond
	if _, ok := r.expires[id]; ok {
		if ttl > 0 {
			r.ttl[id] = ttl
		}
		r.expires[id] = now.Add(r.ttl[id])
	}
	switch {
	case r.once:
		r.drop(id, "")
	case r.interval == 0:
		r.next[id] = now.Add(max(ttl/3, minRenewEvery))
	}
}

// repeated reports whether resp announces an extra already being
// renewed, as the brokers do again on every new stream.
func (r *renewSchedule) repeated(resp *gpupoolv1.KeepAliveResponse) bool {
	ev := resp.GetEvent()
	return ev.GetType() == gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_GROWN && r.active[ev.GetLease().GetId()]
}

// grow adds extra, an extra of parent, to the schedule, due at now.
func (r *renewSchedule) grow(extra, parent string, now time.Time) {
	if _, known := r.parentOf[extra]; !known {
		r.extras = append(r.extras, extra)
		r.parentOf[extra] = parent
	}
	r.active[extra] = true
	r.next[extra] = now
}

// drop stops renewing id and, for a lease given, its extras. A non-empty
// why records a failure of a lease given; an extra that ends or cannot be
// renewed is not one.
func (r *renewSchedule) drop(id, why string) {
	delete(r.active, id)
	delete(r.next, id)
	delete(r.expires, id)
	if r.parentOf[id] != "" {
		return
	}
	if why != "" {
		r.failed[id] = why
	}
	for _, x := range r.extras {
		if r.parentOf[x] == id {
			r.drop(x, "")
		}
	}
}

// wake is the earliest time a lease is due or expires, if any is
// scheduled.
func (r *renewSchedule) wake() (time.Time, bool) {
	var first time.Time
	for id := range r.active {
		for _, at := range []time.Time{r.next[id], r.expires[id]} {
			if !at.IsZero() && (first.IsZero() || at.Before(first)) {
				first = at
			}
		}
	}
	return first, !first.IsZero()
}

// done reports whether no lease is left to renew.
func (r *renewSchedule) done() bool { return len(r.active) == 0 }

// err summarises the failures, in the order the leases were given; nil
// when every renewal succeeded.
func (r *renewSchedule) err() error {
	var msgs []string
	for _, id := range r.ids {
		if why, ok := r.failed[id]; ok {
			msgs = append(msgs, id+": "+why)
		}
	}
	if len(msgs) == 0 {
		return nil
	}
	return fmt.Errorf("%d of %d leases not renewed: %s", len(msgs), len(r.ids), strings.Join(msgs, "; "))
}

// pending lists the leases still active, in the order given.
func (r *renewSchedule) pending() []string {
	var out []string
	for _, id := range r.ids {
		if r.active[id] {
			out = append(out, id)
		}
	}
	return out
}

// KeepAliveStream is the client side of LeaseService.KeepAlive.
type KeepAliveStream interface {
	Send(*gpupoolv1.KeepAliveRequest) error
	Recv() (*gpupoolv1.KeepAliveResponse, error)
	CloseSend() error
}

// renewer drives a renewSchedule over KeepAlive streams and opens a new
// stream whenever one breaks, until ctx ends or no lease is left to renew.
type renewer struct {
	sched    *renewSchedule
	open     func(context.Context) (KeepAliveStream, error)
	onAnswer func(*gpupoolv1.KeepAliveResponse) error
	onBroken func(why string)

	// clk paces renewals and reconnects (nil: the wall clock).
	clk clock.Clock
	// firstWait is the first pause before reconnecting; it doubles up to
	// maxReconnectWait. Zero means 50ms.
	firstWait time.Duration
}

// run renews until ctx ends (nil: the caller stopped it, unless Once was
// still waiting for answers) or no lease is left (the renewal failures, if
// any). A stream error that retrying cannot fix is returned as is.
func (k *renewer) run(ctx context.Context) error {
	if k.clk == nil {
		k.clk = clock.Real
	}
	first := k.firstWait
	if first == 0 {
		first = 50 * time.Millisecond
	}
	pause := first
	lastLogged := ""
	for {
		answered, err := k.session(ctx)
		switch {
		case ctx.Err() != nil && k.sched.once && !k.sched.done():
			return fmt.Errorf("no answer for %s before the deadline: %v", strings.Join(k.sched.pending(), ", "), ctx.Err())
		case ctx.Err() != nil:
			return nil
		case err == nil:
			return k.sched.err()
		case !retryableStreamError(err):
			return err
		}
		if answered {
			pause, lastLogged = first, ""
		}
		// A lease whose TTL ran out while no stream could renew it has
		// expired at the brokers.
		if k.sched.expire(k.clk.Now()); k.sched.done() {
			return k.sched.err()
		}
		// Say it once per outage, not once per attempt.
		if msg := brokenStreamText(err); msg != lastLogged {
			if k.onBroken != nil {
				k.onBroken(msg)
			}
			lastLogged = msg
		}
		if waitFor(ctx, k.clk, pause) != nil {
			continue // the top of the loop sorts out why ctx ended
		}
		pause = min(2*pause, maxReconnectWait)
	}
}

// session runs one stream. It returns nil once no lease is left to renew,
// or the error that ended the stream; answered tells whether the stream
// carried any answer.
func (k *renewer) session(ctx context.Context) (answered bool, err error) {
	r := k.sched
	if r.done() {
		return false, nil
	}
	if err := ctx.Err(); err != nil {
		return false, err
	}
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	st, err := k.open(sctx)
	if err != nil {
		return false, err
	}
	recv := make(chan received)
	go func() {
		for {
			resp, err := st.Recv()
			select {
			case recv <- received{resp, err}:
			case <-sctx.Done():
				return
			}
			if err != nil {
				return
			}
		}
	}()
	// Renewals are sent from their own goroutine, so the loop below keeps
	// taking answers while a send waits on flow control: sending from the
	// loop that reads can deadlock with a broker that pushes many events
	// (a blocked send stops the loop, which stops Recv, which blocks the
	// broker's sends and with it its reads of this stream).
	out := newSendQueue()
	sendErr := make(chan error, 1)
	senderDone := make(chan struct{})
	defer func() { cancel(); <-senderDone }() // no send outlives the session
	go func() {
		defer close(senderDone)
		for {
			ids, ok := out.take(sctx)
			if !ok {
				return
			}
			for _, id := range ids {
				if err := st.Send(&gpupoolv1.KeepAliveRequest{LeaseId: id}); err != nil {
					sendErr <- streamError(err)
					return
				}
			}
		}
	}()
	send := func(ids []string) {
		now := k.clk.Now()
		for _, id := range ids {
			r.sent(id, now)
		}
		out.put(ids)
	}
	send(r.due(k.clk.Now(), true))
	for !r.done() {
		if err := k.step(ctx, recv, sendErr, send, &answered); err != nil {
			return answered, err
		}
	}
	st.CloseSend()
	return answered, nil
}

// received is one result of Recv on a keepalive stream.
type received struct {
	resp *gpupoolv1.KeepAliveResponse
	err  error
}

// step waits for the next answer or the next due renewal and handles it.
func (k *renewer) step(ctx context.Context, recv <-chan received, sendErr <-chan error, send func([]string), answered *bool) error {
	r := k.sched
	var timer <-chan struct{}
	if at, ok := r.wake(); ok {
		fired := make(chan struct{})
		if d := at.Sub(k.clk.Now()); d > 0 {
			t := k.clk.AfterFunc(d, func() { close(fired) })
			defer t.Stop()
		} else {
			close(fired) // due already
		}
		timer = fired
	}
	select {
	case <-ctx.Done():
		return ctx.Err()
	case err := <-sendErr:
		return err
	case m := <-recv:
		if m.err != nil {
			return streamError(m.err)
		}
		*answered = true
		if !r.repeated(m.resp) && k.onAnswer != nil {
			if err := k.onAnswer(m.resp); err != nil {
				return err
			}
		}
		r.answer(m.resp, k.clk.Now())
		return nil
	case <-timer:
		now := k.clk.Now()
		if expired := r.expire(now); len(expired) > 0 && !r.done() {
			// No answer for a whole TTL: the stream may be half-open.
			// The others are renewed on a new one.
			return fmt.Errorf("%w: no renewal of %s answered within its TTL", errHalfOpen, strings.Join(expired, ", "))
		}
		send(r.due(now, false))
		return nil
	}
}

// errHalfOpen ends a stream on which renewals go unanswered.
var errHalfOpen = errors.New("the stream looks half-open")

// streamError names a stream's clean end, which io.EOF does not.
func streamError(err error) error {
	if err == io.EOF {
		return errors.New("the broker closed the stream")
	}
	return err
}

// retryableStreamError reports whether a new stream may succeed where err
// ended the last one: anything but a refusal that another broker would
// repeat.
func retryableStreamError(err error) bool {
	switch status.Code(err) {
	case codes.InvalidArgument, codes.Unimplemented, codes.PermissionDenied, codes.Unauthenticated:
		return false
	}
	return true
}

// brokenStreamText describes why a stream broke: the broker's own words
// and the gRPC code.
func brokenStreamText(err error) string {
	if st, ok := status.FromError(err); ok {
		return fmt.Sprintf("%s (%s)", st.Message(), st.Code())
	}
	return err.Error()
}

// waitFor waits for d on clk or until ctx ends.
func waitFor(ctx context.Context, clk clock.Clock, d time.Duration) error {
	fired := make(chan struct{})
	t := clk.AfterFunc(d, func() { close(fired) })
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-fired:
		return nil
	}
}
