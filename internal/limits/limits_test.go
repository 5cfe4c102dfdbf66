package limits

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"
)

func TestRateAllowsBurstsThenTheRate(t *testing.T) {
	now := time.Unix(1_700_000_000, 0)
	set := NewSet(func() time.Time { return now })
	l := set.Rate("test-rate", "test-rate", Rate{PerSecond: 2, Burst: 3})
	steps := []struct {
		name    string
		advance time.Duration
		key     string
		wantOK  bool
	}{
		{"the first of a burst", 0, "a", true},
		{"the second of a burst", 0, "a", true},
		{"the last of a burst", 0, "a", true},
		{"one over the burst", 0, "a", false},
		{"another key has its own bucket", 0, "b", true},
		{"half a second refills one", 500 * time.Millisecond, "a", true},
		{"but only one", 0, "a", false},
		{"a long pause refills the burst, no more", time.Hour, "a", true},
	}
	refused := 0
	for _, s := range steps {
		now = now.Add(s.advance)
		err := l.Allow(s.key, "caller "+s.key)
		if (err == nil) != s.wantOK {
			t.Fatalf("%s: got %v, want allowed %v", s.name, err, s.wantOK)
		}
		if err != nil {
			refused++
			var le *Error
			if !errors.As(err, &le) || !errors.Is(err, ErrLimited) || le.Limit != "test-rate" {
				t.Errorf("%s: got %#v, want an *Error of test-rate", s.name, err)
			}
			if want := "limit test-rate reached by caller a: at most 2/s (bursts of 3) (--test-rate)"; !strings.Contains(err.Error(), want) {
				t.Errorf("%s: got %q, want it to contain %q", s.name, err, want)
			}
		}
	}
	if got := set.Refusals("test-rate"); got != float64(refused) {
		t.Errorf("got %v refusals counted, want %d", got, refused)
	}
	l.mu.Lock()
	n := len(l.buckets)
	l.mu.Unlock()
	if n > 1 {
		t.Errorf("got %d buckets kept after an hour, want the full ones forgotten", n)
	}
}

func TestZeroIsNoLimit(t *testing.T) {
	set := NewSet(nil)
	r := set.Rate("r", "r", Rate{})
	c := set.Concurrency("c", "c", 0, "things")
	for range 1000 {
		if err := r.Allow("k", "k"); err != nil {
			t.Fatal(err)
		}
		if _, err := c.Acquire("k", "k"); err != nil {
			t.Fatal(err)
		}
	}
}

func TestConcurrencyHoldsMaxPerKey(t *testing.T) {
	set := NewSet(nil)
	c := set.Concurrency("streams", "limit-streams", 2, "streams open at once")
	r1, err := c.Acquire("a", "token a")
	if err != nil {
		t.Fatal(err)
	}
	r2, err := c.Acquire("a", "token a")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Acquire("b", "token b"); err != nil {
		t.Fatalf("another key: %v", err)
	}
	_, err = c.Acquire("a", "token a")
	if want := "limit streams reached by token a: at most 2 streams open at once (--limit-streams)"; err == nil || !strings.Contains(err.Error(), want) {
		t.Fatalf("got %v, want %q", err, want)
	}
	r1()
	r1() // a second release gives nothing back
	if got := c.Open("a"); got != 1 {
		t.Errorf("got %d open after one release, want 1", got)
	}
	if _, err := c.Acquire("a", "token a"); err != nil {
		t.Errorf("after a release: %v", err)
	}
	r2()
}

func TestValidateNamesTheFlag(t *testing.T) {
	tests := []struct {
		name string
		err  error
		want string
	}{
		{"a negative rate", Rate{PerSecond: -1, Burst: 1}.Validate("x-rate", "x-burst"), "--x-rate -1: must be 0 (no limit)"},
		{"no burst", Rate{PerSecond: 1}.Validate("x-rate", "x-burst"), "--x-burst 0: must be 1 or more while --x-rate is not 0"},
		{"a negative cap", ValidateMax("x-max", -1), "--x-max -1: must be 0 (no limit) or more"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if tt.err == nil || !strings.Contains(tt.err.Error(), tt.want) {
				t.Errorf("got %v, want %q", tt.err, tt.want)
			}
		})
	}
	if err := (Rate{}).Validate("x", "y"); err != nil {
		t.Errorf("no limit: %v", err)
	}
}

func TestFairHandsFreedSeatsToTheTokenHoldingFewest(t *testing.T) {
	set := NewSet(nil)
	f := set.Fair("test-writes", "test-queue", FairLimit{Seats: 4, Share: 3, Queue: 2})
	ctx := t.Context()
	take := func(key string) func() {
		t.Helper()
		release, err := f.Acquire(ctx, key, "token "+key)
		if err != nil {
			t.Fatalf("%s: %v", key, err)
		}
		return release
	}
	// wait starts a call of key that waits for a seat; its channel gets
	// the release once it has one.
	wait := func(key string) chan func() {
		got := make(chan func(), 1)
		go func() {
			release, err := f.Acquire(ctx, key, "token "+key)
			if err != nil {
				t.Errorf("%s: %v", key, err)
			}
			got <- release
		}()
		return got
	}
	waitingIs := func(n int) {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for {
			if _, w := f.InFlight(); w == n {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("want %d waiting", n)
			}
			time.Sleep(time.Millisecond)
		}
	}
	a1, a2, a3 := take("a"), take("a"), take("a") // a's share
	aWaits := wait("a")                           // over its share
	waitingIs(1)
	b1 := take("b") // the last seat
	bWaits := wait("b")
	waitingIs(2)
	aMore := wait("a")
	waitingIs(3)
	if _, err := f.Acquire(ctx, "a", "token a"); !errors.Is(err, ErrLimited) || !strings.Contains(err.Error(), "limit test-writes reached by token a") {
		t.Fatalf("a third waiting call of a: got %v, want its queue full", err)
	}
	if got := set.Refusals("test-writes"); got != 1 {
		t.Errorf("got %v refusals, want 1", got)
	}
	// a frees a seat: b holds fewer, so b has it, although a waited first.
	a1()
	b2 := <-bWaits
	select {
	case <-aWaits:
		t.Fatal("a got the seat that b, holding fewer, waited for")
	default:
	}
	// Each frees one: the seats go to a's queue in order.
	a2()
	(<-aWaits)()
	a3()
	(<-aMore)()
	b1()
	b2()
	if held, waiting := f.InFlight(); held != 0 || waiting != 0 {
		t.Errorf("got %d held, %d waiting at the end, want none", held, waiting)
	}
	f.mu.Lock()
	n := len(f.flows)
	f.mu.Unlock()
	if n != 0 {
		t.Errorf("got %d flows kept, want none", n)
	}
}

func TestFairCallThatGivesUpLeavesTheQueue(t *testing.T) {
	f := NewSet(nil).Fair("w", "q", FairLimit{Seats: 1, Queue: 5})
	release, err := f.Acquire(t.Context(), "a", "a")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() {
		_, err := f.Acquire(ctx, "b", "b")
		done <- err
	}()
	deadline := time.Now().Add(10 * time.Second)
	for _, w := f.InFlight(); w != 1; _, w = f.InFlight() {
		if time.Now().After(deadline) {
			t.Fatalf("got %d waiting after 10s, want the second call waiting", w)
		}
		time.Sleep(time.Millisecond)
	}
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("got %v, want context.Canceled", err)
	}
	release()
	release() // once only
	if held, waiting := f.InFlight(); held != 0 || waiting != 0 {
		t.Errorf("got %d held, %d waiting, want none", held, waiting)
	}
}

func TestFairLimitValidate(t *testing.T) {
	for _, c := range []struct {
		name string
		l    FairLimit
		want string
	}{
		{"defaults", FairLimit{Seats: 8, Share: 8, Queue: 512}, ""},
		{"none", FairLimit{}, ""},
		{"negative seats", FairLimit{Seats: -1}, "--seats -1: must be 0 (no limit) or more"},
		{"negative queue", FairLimit{Queue: -2}, "--queue -2: must be 0 (none wait) or more"},
		{"a share over the seats", FairLimit{Seats: 4, Share: 5}, "--share 5: must be at most --seats (4)"},
		{"a share with no seat limit", FairLimit{Share: 5}, ""},
	} {
		err := c.l.Validate("seats", "share", "queue")
		if (err == nil) != (c.want == "") || (err != nil && !strings.Contains(err.Error(), c.want)) {
			t.Errorf("%s: got %v, want %q", c.name, err, c.want)
		}
	}
}
