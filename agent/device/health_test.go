package device

import (
	"context"
	"testing"
	"time"
)

// waitLimit bounds every wait for something another goroutine does.
const waitLimit = 10 * time.Second

// watcher is a WatchHealth running in the background.
type watcher struct {
	events chan HealthEvent
	done   chan error // receives what WatchHealth returned
	cancel context.CancelFunc
}

// watch starts b.WatchHealth; the test ends it with w.stop, or cleanup
// does.
func watch(t *testing.T, b Backend) *watcher {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	w := &watcher{events: make(chan HealthEvent, 64), done: make(chan error, 1), cancel: cancel}
	go func() { w.done <- b.WatchHealth(ctx, func(e HealthEvent) { w.events <- e }) }()
	t.Cleanup(cancel)
	return w
}

// next returns the next event.
func (w *watcher) next(t *testing.T) HealthEvent {
	t.Helper()
	select {
	case e := <-w.events:
		return e
	case err := <-w.done:
		t.Fatalf("WatchHealth returned %v while an event was expected", err)
	case <-time.After(waitLimit):
		t.Fatalf("no health event within %v", waitLimit)
	}
	return HealthEvent{}
}

// stop cancels WatchHealth's context and returns what it returned.
func (w *watcher) stop(t *testing.T) error {
	t.Helper()
	w.cancel()
	return w.returned(t)
}

// returned waits for WatchHealth to return.
func (w *watcher) returned(t *testing.T) error {
	t.Helper()
	select {
	case err := <-w.done:
		return err
	case <-time.After(waitLimit):
		t.Fatalf("WatchHealth did not return within %v", waitLimit)
		return nil
	}
}

func TestWatchHealthSimulated(t *testing.T) {
	b := newSim(t, "2xA100-80GB")
	ids := uuids(simDevices(t, "2xA100-80GB", "host-a"))
	w := watch(t, b)
	for _, tc := range []struct {
		name   string
		inject func(sim Simulator) error
		want   HealthEvent
	}{
		{"Xid 79 (fallen off the bus) is critical", func(s Simulator) error { return s.InjectXid(0, 79) },
			HealthEvent{UUID: ids[0], Kind: HealthXid, Xid: 79, Critical: true, Reason: "Xid 79"}},
		{"Xid 48 (double-bit ECC) is critical", func(s Simulator) error { return s.InjectXid(1, 48) },
			HealthEvent{UUID: ids[1], Kind: HealthXid, Xid: 48, Critical: true, Reason: "Xid 48"}},
		{"application Xid 13 is not critical", func(s Simulator) error { return s.InjectXid(1, 13) },
			HealthEvent{UUID: ids[1], Kind: HealthXid, Xid: 13, Reason: "Xid 13"}},
		{"application Xid 31 is not critical", func(s Simulator) error { return s.InjectXid(0, 31) },
			HealthEvent{UUID: ids[0], Kind: HealthXid, Xid: 31, Reason: "Xid 31"}},
		{"application Xid 43 is not critical", func(s Simulator) error { return s.InjectXid(0, 43) },
			HealthEvent{UUID: ids[0], Kind: HealthXid, Xid: 43, Reason: "Xid 43"}},
		{"application Xid 45 is not critical", func(s Simulator) error { return s.InjectXid(0, 45) },
			HealthEvent{UUID: ids[0], Kind: HealthXid, Xid: 45, Reason: "Xid 45"}},
		{"application Xid 68 is not critical", func(s Simulator) error { return s.InjectXid(0, 68) },
			HealthEvent{UUID: ids[0], Kind: HealthXid, Xid: 68, Reason: "Xid 68"}},
		{"application Xid 109 is not critical", func(s Simulator) error { return s.InjectXid(0, 109) },
			HealthEvent{UUID: ids[0], Kind: HealthXid, Xid: 109, Reason: "Xid 109"}},
		{"a double-bit ECC error is critical", func(s Simulator) error { return s.InjectECC(1, true) },
			HealthEvent{UUID: ids[1], Kind: HealthECC, Critical: true, Reason: "double-bit ECC error"}},
		{"a single-bit ECC error is not critical", func(s Simulator) error { return s.InjectECC(0, false) },
			HealthEvent{UUID: ids[0], Kind: HealthECC, Reason: "single-bit ECC error"}},
		{"lost GPUs are reported once, for every device", func(s Simulator) error { return s.LoseGPUs() },
			HealthEvent{Kind: HealthLost, Critical: true, Reason: "GPU is lost"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if err := tc.inject(b); err != nil {
				t.Fatalf("inject: %v", err)
			}
			if got := w.next(t); got != tc.want {
				t.Errorf("got %+v, want %+v", got, tc.want)
			}
		})
	}
	// After the loss WatchHealth reports nothing more and waits for its
	// context.
	if err := b.InjectXid(0, 79); err != nil {
		t.Fatal(err)
	}
	if err := w.stop(t); err != nil {
		t.Errorf("WatchHealth returned %v after its context ended, want nil", err)
	}
	select {
	case e := <-w.events:
		t.Errorf("event %+v after the loss, want none", e)
	default:
	}
}

func TestWatchHealthDeliversEventsInjectedBeforeItStarted(t *testing.T) {
	b := newSim(t, "2xA100-80GB")
	ids := uuids(simDevices(t, "2xA100-80GB", "host-a"))
	if err := firstErr(b.InjectXid(1, 94), b.InjectECC(0, true)); err != nil {
		t.Fatal(err)
	}
	w := watch(t, b)
	got := map[HealthEvent]bool{w.next(t): true, w.next(t): true}
	for _, want := range []HealthEvent{
		{UUID: ids[1], Kind: HealthXid, Xid: 94, Critical: true, Reason: "Xid 94"},
		{UUID: ids[0], Kind: HealthECC, Critical: true, Reason: "double-bit ECC error"},
	} {
		if !got[want] {
			t.Errorf("events %v lack %+v", got, want)
		}
	}
}

func TestWatchHealthStartedAfterLossReportsIt(t *testing.T) {
	b := newSim(t, "1xH100-80GB")
	if err := b.LoseGPUs(); err != nil {
		t.Fatal(err)
	}
	w := watch(t, b)
	if got, want := w.next(t), (HealthEvent{Kind: HealthLost, Critical: true, Reason: "GPU is lost"}); got != want {
		t.Errorf("got %+v, want %+v", got, want)
	}
	if err := w.stop(t); err != nil {
		t.Errorf("WatchHealth = %v, want nil", err)
	}
}

func TestCloseEndsWatchHealth(t *testing.T) {
	b, err := NewSimulated("1xA100-80GB", "host-a")
	if err != nil {
		t.Fatal(err)
	}
	w := watch(t, b)
	if err := b.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if err := w.returned(t); err != ErrClosed {
		t.Errorf("WatchHealth = %v after Close, want %v", err, ErrClosed)
	}
	if err := b.WatchHealth(context.Background(), func(HealthEvent) {}); err != ErrClosed {
		t.Errorf("WatchHealth after Close = %v, want %v", err, ErrClosed)
	}
}

func TestCriticalXid(t *testing.T) {
	for _, tc := range []struct {
		xid  uint64
		want bool
	}{
		{13, false}, {31, false}, {43, false}, {45, false}, {68, false}, {109, false},
		{48, true}, {63, true}, {64, true}, {74, true}, {79, true}, {94, true}, {95, true}, {1, true},
	} {
		if got := CriticalXid(tc.xid); got != tc.want {
			t.Errorf("CriticalXid(%d) = %v, want %v", tc.xid, got, tc.want)
		}
	}
}

func TestHealthKindString(t *testing.T) {
	for k, want := range map[HealthKind]string{HealthXid: "xid", HealthECC: "ecc", HealthLost: "lost", 0: "HealthKind(0)"} {
		if got := k.String(); got != want {
			t.Errorf("HealthKind(%d).String() = %q, want %q", int(k), got, want)
		}
	}
}
