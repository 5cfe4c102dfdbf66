package fsm

import (
	"bytes"
	"io"
	"slices"
	"testing"

	"google.golang.org/protobuf/proto"
)

func TestSubscribersOfAnEventShareOneValue(t *testing.T) {
	f := New(nil)
	applyAll(t, f, []proto.Message{host("h1", 1)})
	var subs []<-chan Event
	for range 3 {
		events, cancel := f.Subscribe()
		t.Cleanup(cancel)
		subs = append(subs, events)
	}
	applyAll(t, f, []proto.Message{grant("l-1", "h1", 0, 1024, 10)})
	made := 0
	make := func() any { made++; return new(int) }
	var first any
	for i, events := range subs {
		var e Event
		select {
		case e = <-events:
		default:
			t.Fatalf("subscriber %d got no event", i)
		}
		if e.Lease.GetId() != "l-1" {
			t.Fatalf("subscriber %d got %+v, want l-1's grant", i, e)
		}
		v := e.Shared(make)
		if first == nil {
			first = v
		}
		if v != first {
			t.Errorf("subscriber %d got its own value %p, want the shared %p", i, v, first)
		}
	}
	if made != 1 {
		t.Errorf("made %d values for %d subscribers of one event, want 1", made, len(subs))
	}
	// An event not published shares nothing.
	made = 0
	var e Event
	e.Shared(make)
	e.Shared(make)
	if made != 2 {
		t.Errorf("made %d values for 2 calls on an event not published, want 2", made)
	}
}

func TestASubscriberGetsTheEventsItKeepsAndEveryReset(t *testing.T) {
	f := New(nil)
	applyAll(t, f, []proto.Message{host("h1", 2)})
	all, cancelAll := f.Subscribe()
	t.Cleanup(cancelAll)
	kept, cancelKept := f.SubscribeFunc(func(e Event) bool { return e.Lease.GetId() == "l-2" })
	t.Cleanup(cancelKept)
	applyAll(t, f, []proto.Message{grant("l-1", "h1", 0, 1024, 10), grant("l-2", "h1", 1, 1024, 10)})
	if err := f.Restore(io.NopCloser(bytes.NewReader(snapshotBytes(t, f)))); err != nil {
		t.Fatal(err)
	}
	drain := func(events <-chan Event) (got []string) {
		for {
			select {
			case e := <-events:
				switch {
				case e.Reset:
					got = append(got, "reset")
				case e.Lease != nil:
					got = append(got, e.Lease.Id)
				default:
					got = append(got, "other")
				}
			default:
				return got
			}
		}
	}
	if got, want := drain(kept), []string{"l-2", "reset"}; !slices.Equal(got, want) {
		t.Errorf("the subscriber that keeps l-2's events got %v, want %v", got, want)
	}
	if got := drain(all); !slices.Contains(got, "l-1") || !slices.Contains(got, "l-2") || got[len(got)-1] != "reset" {
		t.Errorf("the subscriber of every event got %v, want l-1's and l-2's, then the reset", got)
	}
}
