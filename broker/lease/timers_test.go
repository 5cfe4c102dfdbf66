package lease

import (
	"sync"
	"testing"
	"time"

	"github.com/gpupool/gpupool/internal/clock"
)

type fired struct {
	mu   sync.Mutex
	keys []string
}

func (f *fired) add(k string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.keys = append(f.keys, k)
}

func (f *fired) got() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.keys...)
}

func TestTimers(t *testing.T) {
	tests := []struct {
		name string
		run  func(ts *Timers, c *clock.Fake)
		want []string
	}{
		{"a deadline fires once when it passes", func(ts *Timers, c *clock.Fake) {
			ts.Reset("a", 10*time.Second)
			c.Advance(10 * time.Second)
			c.Advance(10 * time.Second)
		}, []string{"a"}},
		{"a deadline does not fire early", func(ts *Timers, c *clock.Fake) {
			ts.Reset("a", 10*time.Second)
			c.Advance(9 * time.Second)
		}, nil},
		{"a reset pushes the deadline out", func(ts *Timers, c *clock.Fake) {
			ts.Reset("a", 10*time.Second)
			c.Advance(8 * time.Second)
			ts.Reset("a", 10*time.Second)
			c.Advance(8 * time.Second)
		}, nil},
		{"a stopped deadline never fires", func(ts *Timers, c *clock.Fake) {
			ts.Reset("a", time.Second)
			ts.Stop("a")
			c.Advance(time.Hour)
		}, nil},
		{"StopAll stops every deadline", func(ts *Timers, c *clock.Fake) {
			ts.Reset("a", time.Second)
			ts.Reset("b", 2*time.Second)
			ts.StopAll()
			c.Advance(time.Hour)
		}, nil},
		{"deadlines fire in order", func(ts *Timers, c *clock.Fake) {
			ts.Reset("late", 3*time.Second)
			ts.Reset("early", time.Second)
			c.Advance(5 * time.Second)
		}, []string{"early", "late"}},
		{"equal deadlines fire in the order they were set", func(ts *Timers, c *clock.Fake) {
			for _, k := range []string{"c", "a", "b"} {
				ts.Reset(k, time.Second)
			}
			c.Advance(time.Second)
		}, []string{"c", "a", "b"}},
		{"a reset to an earlier deadline fires then", func(ts *Timers, c *clock.Fake) {
			ts.Reset("a", time.Hour)
			ts.Reset("b", 2*time.Hour)
			ts.Reset("b", time.Second)
			c.Advance(time.Minute)
		}, []string{"b"}},
		{"stopping the earliest leaves the next to fire", func(ts *Timers, c *clock.Fake) {
			ts.Reset("a", time.Second)
			ts.Reset("b", 2*time.Second)
			ts.Stop("a")
			c.Advance(3 * time.Second)
		}, []string{"b"}},
		{"a key set again after it fired fires again", func(ts *Timers, c *clock.Fake) {
			ts.Reset("a", time.Second)
			c.Advance(time.Second)
			ts.Reset("a", time.Second)
			ts.Reset("b", 0)
			c.Advance(time.Second)
		}, []string{"a", "b", "a"}},
		{"after StopAll new deadlines fire", func(ts *Timers, c *clock.Fake) {
			ts.Reset("a", time.Second)
			ts.StopAll()
			ts.Reset("b", 2*time.Second)
			c.Advance(3 * time.Second)
		}, []string{"b"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := clock.NewFake(time.Unix(0, 0))
			var f fired
			ts := NewTimers(c, f.add)
			tt.run(ts, c)
			got := f.got()
			if len(got) != len(tt.want) {
				t.Fatalf("fired %v, want %v", got, tt.want)
			}
			for i := range got {
				if got[i] != tt.want[i] {
					t.Fatalf("fired %v, want %v", got, tt.want)
				}
			}
		})
	}
}

func TestTimersDeadlineAndLen(t *testing.T) {
	c := clock.NewFake(time.Unix(100, 0))
	ts := NewTimers(c, func(string) {})
	want := ts.Reset("a", 5*time.Second)
	if got, ok := ts.Deadline("a"); !ok || !got.Equal(want) || !got.Equal(time.Unix(105, 0)) {
		t.Fatalf("Deadline: got %v %t, want %v", got, ok, want)
	}
	if ts.Len() != 1 {
		t.Fatalf("Len: got %d, want 1", ts.Len())
	}
	c.Advance(5 * time.Second)
	if _, ok := ts.Deadline("a"); ok || ts.Len() != 0 {
		t.Fatal("a fired deadline is still listed")
	}
}

func TestTimersFireEveryKeyWithARealClock(t *testing.T) {
	const n = 200
	done := make(chan string, n)
	ts := NewTimers(clock.Real, func(k string) { done <- k })
	for i := range n {
		ts.Reset(string(rune('a'+i%26))+string(rune('0'+i/26)), time.Duration(i%5)*time.Millisecond)
	}
	seen := map[string]bool{}
	deadline := time.After(time.Minute)
	for len(seen) < n {
		select {
		case k := <-done:
			if seen[k] {
				t.Fatalf("%s fired twice", k)
			}
			seen[k] = true
		case <-deadline:
			t.Fatalf("%d of %d keys fired", len(seen), n)
		}
	}
	if ts.Len() != 0 {
		t.Fatalf("Len after every key fired: %d", ts.Len())
	}
}
