package limits

import (
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
