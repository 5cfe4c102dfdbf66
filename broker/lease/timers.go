package lease

import (
	"sync"
	"time"

	"github.com/gpupool/gpupool/internal/clock"
)

// Timers is a set of keyed deadlines, such as lease TTLs or host
// heartbeats. When a deadline passes, fire is called with its key, in its
// own goroutine. The leader owns one Timers per kind; they live in leader
// memory only and are never replicated.
type Timers struct {
	clock clock.Clock
	fire  func(key string)

	mu      sync.Mutex
	entries map[string]*entry // guarded by mu
}

type entry struct {
	deadline time.Time
	timer    clock.Timer
}

// NewTimers returns an empty set that calls fire when a deadline passes.
func NewTimers(c clock.Clock, fire func(key string)) *Timers {
	return &Timers{clock: c, fire: fire, entries: map[string]*entry{}}
}

// Reset sets key's deadline to now+d, replacing any earlier one. It
// returns the new deadline.
func (t *Timers) Reset(key string, d time.Duration) time.Time {
	t.mu.Lock()
	defer t.mu.Unlock()
	if e, ok := t.entries[key]; ok {
		e.timer.Stop()
	}
	e := &entry{deadline: t.clock.Now().Add(d)}
	e.timer = t.clock.AfterFunc(d, func() { t.expire(key, e) })
	t.entries[key] = e
	return e.deadline
}

// expire fires key unless its entry was replaced or stopped meanwhile.
func (t *Timers) expire(key string, e *entry) {
	t.mu.Lock()
	cur, ok := t.entries[key]
	if !ok || cur != e {
		t.mu.Unlock()
		return
	}
	delete(t.entries, key)
	t.mu.Unlock()
	t.fire(key)
}

// Stop removes key's deadline, if any.
func (t *Timers) Stop(key string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if e, ok := t.entries[key]; ok {
		e.timer.Stop()
		delete(t.entries, key)
	}
}

// StopAll removes every deadline.
func (t *Timers) StopAll() {
	t.mu.Lock()
	defer t.mu.Unlock()
	for k, e := range t.entries {
		e.timer.Stop()
		delete(t.entries, k)
	}
}

// Deadline returns key's deadline and whether it has one.
func (t *Timers) Deadline(key string) (time.Time, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	e, ok := t.entries[key]
	if !ok {
		return time.Time{}, false
	}
	return e.deadline, true
}

// Len returns how many deadlines are set.
func (t *Timers) Len() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.entries)
}
