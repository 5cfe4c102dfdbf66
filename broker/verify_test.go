package broker

import (
	"context"
	"errors"
	"sync"
	"testing"
)

// TestOneVerificationServesEveryRenewalWaitingOnIt holds a first round
// of verification in flight while two more renewals arrive: they must
// not be served by the round they arrived after, and one next round must
// serve both.
func TestOneVerificationServesEveryRenewalWaitingOnIt(t *testing.T) {
	started := make(chan int, 4)
	release := make(chan error, 4)
	var mu sync.Mutex
	rounds := 0
	v := newLeadVerifier(func() error {
		mu.Lock()
		rounds++
		n := rounds
		mu.Unlock()
		started <- n
		return <-release
	}, func(f func()) { go f() })
	ctx := context.Background()
	first := make(chan error, 1)
	go func() { first <- v.Confirm(ctx) }()
	if n := <-started; n != 1 {
		t.Fatalf("got round %d, want round 1", n)
	}
	later := make(chan error, 2)
	for range 2 {
		go func() { later <- v.Confirm(ctx) }()
	}
	waitFor(t, "both renewals wait on the next round", func() bool {
		v.mu.Lock()
		defer v.mu.Unlock()
		return v.next != nil && v.next.waiters == 2
	})
	release <- nil
	if err := <-first; err != nil {
		t.Fatalf("first renewal: got %v, want nil", err)
	}
	select {
	case err := <-later:
		t.Fatalf("a renewal that arrived during round 1 was answered by it (%v)", err)
	case n := <-started:
		if n != 2 {
			t.Fatalf("got round %d, want round 2", n)
		}
	}
	lost := errors.New("leadership lost")
	release <- lost
	for range 2 {
		if err := <-later; !errors.Is(err, lost) {
			t.Fatalf("later renewal: got %v, want %v", err, lost)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if rounds != 2 {
		t.Fatalf("got %d rounds, want 2", rounds)
	}
}

func TestARenewalStopsWaitingWhenItsCallEnds(t *testing.T) {
	block := make(chan struct{})
	t.Cleanup(func() { close(block) })
	v := newLeadVerifier(func() error { <-block; return nil }, func(f func()) { go f() })
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := v.Confirm(ctx); !errors.Is(err, context.Canceled) {
		t.Fatalf("got %v, want %v", err, context.Canceled)
	}
}
