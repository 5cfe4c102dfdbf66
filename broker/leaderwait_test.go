package broker

import (
	"context"
	"testing"
)

func TestALeaderObservationWakesEveryWaiterOnce(t *testing.T) {
	w := newLeaderWatch()
	a, b := w.next(), w.next()
	w.observed()
	for i, ch := range []<-chan struct{}{a, b} {
		select {
		case <-ch:
		default:
			t.Fatalf("waiter %d: not woken by the observation", i)
		}
	}
	select {
	case <-w.next():
		t.Fatal("a waiter that came after the observation was woken by it: want it to wait for the next one")
	default:
	}
}

func TestAwaitLeaderAnswersAtOnceWhenALeaderIsKnown(t *testing.T) {
	ts := startServer(t)
	if got, want := string(ts.s.membership.awaitLeader(context.Background())), ts.s.ID(); got != want {
		t.Fatalf("awaitLeader on a one-server cluster: got %q, want %q", got, want)
	}
	done, cancel := context.WithCancel(context.Background())
	cancel()
	if got := ts.s.membership.awaitLeader(done); got == "" {
		t.Fatal("awaitLeader with an ended context while a leader is known: got none, want the leader")
	}
}
