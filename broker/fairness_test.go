package broker

import (
	"context"
	"errors"
	"testing"
)

func TestACallerGateHoldsBackOnlyTheCallerWhoseSlotsAreTaken(t *testing.T) {
	g := newCallerGate()
	var leaves []func()
	for range acquiresPerCaller {
		leave, err := g.enter(context.Background(), "a")
		if err != nil {
			t.Fatalf("enter a: %v", err)
		}
		leaves = append(leaves, leave)
	}
	done, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := g.enter(done, "a"); !errors.Is(err, context.Canceled) {
		t.Fatalf("enter a with every slot taken: got %v, want it to wait until its context ends", err)
	}
	leaveB, err := g.enter(context.Background(), "b")
	if err != nil {
		t.Fatalf("enter b while a is full: %v", err)
	}
	leaveB()
	leaves[0]()
	leave, err := g.enter(context.Background(), "a")
	if err != nil {
		t.Fatalf("enter a after one of its calls left: %v", err)
	}
	leaves[0] = leave
	for _, leave := range leaves {
		leave()
	}
	if n := len(g.slots); n != 0 {
		t.Fatalf("callers tracked after every call left: got %d, want 0", n)
	}
}
