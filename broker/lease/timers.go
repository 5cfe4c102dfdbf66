package lease

import (
	"container/heap"
	"sync"
	"time"

	"github.com/gpupool/gpupool/internal/clock"
)

// Timers is a set of keyed deadlines, such as lease TTLs or host
// heartbeats. When a deadline passes, fire is called with its key, in its
// own goroutine. The leader owns one Timers per kind; they live in leader
// memory only and are never replicated.
//
// A set holds its deadlines in a heap and arms one clock timer, for the
// earliest: a leader keeps a deadline per lease, and a runtime timer and
// its closure per lease cost about four times the memory of a heap entry.
// When the timer fires it takes the earliest deadline that passed, arms
// the timer for the next one (at once if it passed too, so that each key
// still fires in its own goroutine), and then calls fire.
type Timers struct {
	clock clock.Clock
	fire  func(key string)

	mu      sync.Mutex
	entries map[string]*entry // guarded by mu
	queue   deadlines         // guarded by mu; the entries, earliest first
	timer   clock.Timer       // guarded by mu; armed for queue[0], or nil
	armedAt time.Time         // guarded by mu; the deadline timer is armed for
	gen     uint64            // guarded by mu; counts armings, to ignore a stale one
	seq     uint64            // guarded by mu; counts Resets, to order equal deadlines
}

type entry struct {
	key      string
	deadline time.Time
	seq      uint64 // equal deadlines fire in the order they were set
	pos      int    // in queue
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
	deadline := t.clock.Now().Add(d)
	t.seq++
	if e, ok := t.entries[key]; ok {
		e.deadline, e.seq = deadline, t.seq
		heap.Fix(&t.queue, e.pos)
	} else {
		e := &entry{key: key, deadline: deadline, seq: t.seq}
		t.entries[key] = e
		heap.Push(&t.queue, e)
	}
	t.arm()
	return deadline
}

// arm makes the clock timer fire at the earliest deadline, re-arming it
// only when that changed.
func (t *Timers) arm() {
	if len(t.queue) == 0 {
		t.disarm()
		return
	}
	next := t.queue[0].deadline
	if t.timer != nil && t.armedAt.Equal(next) {
		return
	}
	t.disarm()
	t.gen++
	gen := t.gen
	t.armedAt = next
	t.timer = t.clock.AfterFunc(next.Sub(t.clock.Now()), func() { t.expire(gen) })
}

func (t *Timers) disarm() {
	if t.timer != nil {
		t.timer.Stop()
		t.timer = nil
	}
}

// expire fires the earliest deadline if it passed, unless the timer was
// re-armed meanwhile.
func (t *Timers) expire(gen uint64) {
	t.mu.Lock()
	if gen != t.gen {
		t.mu.Unlock()
		return
	}
	t.timer = nil
	if len(t.queue) == 0 || t.queue[0].deadline.After(t.clock.Now()) {
		t.arm()
		t.mu.Unlock()
		return
	}
	e := heap.Pop(&t.queue).(*entry)
	delete(t.entries, e.key)
	t.arm()
	t.mu.Unlock()
	t.fire(e.key)
}

// Stop removes key's deadline, if any.
func (t *Timers) Stop(key string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if e, ok := t.entries[key]; ok {
		heap.Remove(&t.queue, e.pos)
		delete(t.entries, key)
		t.arm()
	}
}

// StopAll removes every deadline.
func (t *Timers) StopAll() {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.disarm()
	clear(t.entries)
	t.queue = nil
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

// deadlines is a min-heap of entries by deadline (container/heap).
type deadlines []*entry

func (q deadlines) Len() int { return len(q) }

func (q deadlines) Less(i, j int) bool {
	if !q[i].deadline.Equal(q[j].deadline) {
		return q[i].deadline.Before(q[j].deadline)
	}
	return q[i].seq < q[j].seq
}

func (q deadlines) Swap(i, j int) {
	q[i], q[j] = q[j], q[i]
	q[i].pos, q[j].pos = i, j
}

func (q *deadlines) Push(x any) {
	e := x.(*entry)
	e.pos = len(*q)
	*q = append(*q, e)
}

func (q *deadlines) Pop() any {
	old := *q
	e := old[len(old)-1]
	old[len(old)-1] = nil
	*q = old[:len(old)-1]
	return e
}
