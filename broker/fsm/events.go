package fsm

import (
	"sync"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// Event is one change the FSM applied, published after the change commits.
type Event struct {
	Index uint64
	// Exactly one of Lease, Host and Audit is set, unless Reset is.
	Lease *gpupoolv1.Lease
	Type  gpupoolv1.LeaseEventType
	Host  *gpupoolv1.Host
	// Audit is an entry the change wrote to the audit log; its events
	// follow the change's others.
	Audit *gpupoolv1.AuditEntry
	// Message says what happened to the lease, when its reason does not:
	// a violation, a device turning unhealthy.
	Message string
	// DeadlineMs is, for a DRAIN_NOTICE, when the lease is revoked (Unix
	// ms; 0 for no deadline).
	DeadlineMs int64
	// Actor is who caused the event when the lease does not say (a
	// drain's notice); see EventActor.
	Actor *gpupoolv1.Actor
	// Reset means the whole state was replaced (snapshot restore):
	// subscribers must re-read everything.
	Reset bool

	// shared is what the subscribers of this one published event share
	// (see Shared); nil for an event not published.
	shared *shared
}

// shared is the value Shared made once for every subscriber of an event.
type shared struct {
	once sync.Once
	v    any
}

// Shared returns what make returns, made once for all the subscribers of
// this event: the first to ask makes it, the others get the same value.
// A subscriber that serves many watchers encodes an event once this way
// rather than once per watcher. make must not depend on who asks, and
// every caller must pass the same kind of make: there is one value per
// event. An event that was not published has none shared: make runs at
// each call.
func (e Event) Shared(make func() any) any {
	if e.shared == nil {
		return make()
	}
	e.shared.once.Do(func() { e.shared.v = make() })
	return e.shared.v
}

// Text is what to tell a watcher about the event: its message, else the
// lease's reason.
func (e Event) Text() string {
	if e.Message != "" || e.Lease == nil {
		return e.Message
	}
	return e.Lease.Reason
}

// EventActor is who caused the event, for the audit trail: the event's own
// actor, else the lease's granted_by for a grant and ended_by for an end.
// Nil when the record does not say (records older than the audit fields).
func EventActor(e Event) *gpupoolv1.Actor {
	if e.Actor != nil || e.Lease == nil {
		return e.Actor
	}
	switch e.Type {
	case gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_GRANTED, gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_GROWN,
		gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_SNAPSHOT:
		return e.Lease.GrantedBy
	case gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_RELEASING, gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_ENDED,
		gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_LOST:
		return e.Lease.EndedBy
	case gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_PREEMPT_NOTICE:
		return BrokerActor()
	}
	return nil
}

// subscriberBuffer is how many events a subscriber may lag before it is
// dropped. A dropped subscriber sees its channel closed and must re-read.
const subscriberBuffer = 4096

type publisher struct {
	mu sync.Mutex
	// subs are the subscribers' channels and what each keeps (nil:
	// every event). Guarded by mu.
	subs map[chan Event]func(Event) bool
}

// Subscribe returns a channel of events applied from now on and a cancel
// function. The channel is closed when the subscriber falls more than a few
// thousand events behind, or on cancel.
func (f *FSM) Subscribe() (<-chan Event, func()) {
	return f.SubscribeFunc(nil)
}

// SubscribeFunc is Subscribe for the events keep returns true for, and
// every Reset: the others never reach the channel, nor count towards how
// far behind it is. A watcher of one tenant is then not woken for each
// event of every other. keep runs as each event is published, on the
// goroutine that applies the log and under the publisher's lock: it must
// be quick, and must neither block nor call the FSM. A nil keep keeps
// every event.
func (f *FSM) SubscribeFunc(keep func(Event) bool) (<-chan Event, func()) {
	p := &f.pub
	ch := make(chan Event, subscriberBuffer)
	p.mu.Lock()
	if p.subs == nil {
		p.subs = map[chan Event]func(Event) bool{}
	}
	p.subs[ch] = keep
	p.mu.Unlock()
	return ch, func() {
		p.mu.Lock()
		defer p.mu.Unlock()
		if _, ok := p.subs[ch]; ok {
			delete(p.subs, ch)
			close(ch)
		}
	}
}

func (p *publisher) publish(evs []Event) {
	if len(evs) == 0 {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.subs) == 0 {
		return
	}
	for i := range evs {
		evs[i].shared = &shared{}
	}
	for ch, keep := range p.subs {
		for _, e := range evs {
			if keep != nil && !e.Reset && !keep(e) {
				continue
			}
			select {
			case ch <- e:
			default:
				delete(p.subs, ch)
				close(ch)
			}
			if _, ok := p.subs[ch]; !ok {
				break
			}
		}
	}
}
