package clock

import (
	"context"
	"runtime"
	"testing"
	"time"
)

var epoch = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

// received returns what ch holds now, without waiting.
func received(ch <-chan time.Time) (time.Time, bool) {
	select {
	case v := <-ch:
		return v, true
	default:
		return time.Time{}, false
	}
}

func TestATimerFiresOnceItsDurationPassedAndNotBefore(t *testing.T) {
	c := NewFake(epoch)
	tm := NewTimer(c, time.Second)
	c.Advance(999 * time.Millisecond)
	if v, ok := received(tm.C); ok {
		t.Fatalf("fired at %v, before its second passed", v)
	}
	c.Advance(time.Millisecond)
	v, ok := received(tm.C)
	if !ok || !v.Equal(epoch.Add(time.Second)) {
		t.Fatalf("got %v (sent %v), want %v", v, ok, epoch.Add(time.Second))
	}
	c.Advance(time.Hour)
	if v, ok := received(tm.C); ok {
		t.Fatalf("fired again at %v; a timer fires once", v)
	}
}

func TestAStoppedTimerNeverFiresAndStopSaysWhetherItPreventedIt(t *testing.T) {
	c := NewFake(epoch)
	tm := NewTimer(c, time.Second)
	if !tm.Stop() {
		t.Fatal("Stop of a pending timer: got false, want true")
	}
	c.Advance(time.Hour)
	if v, ok := received(tm.C); ok {
		t.Fatalf("a stopped timer fired at %v", v)
	}
	tm.Reset(time.Second)
	c.Advance(time.Second)
	if tm.Stop() {
		t.Fatal("Stop of a timer that fired: got true, want false")
	}
	if v, ok := received(tm.C); ok {
		t.Fatalf("Stop left the stale value %v to read", v)
	}
}

func TestResetDropsAnUnreadValueAndArmsFromNow(t *testing.T) {
	c := NewFake(epoch)
	tm := NewTimer(c, time.Second)
	c.Advance(time.Second) // fired, not read
	tm.Reset(time.Minute)
	if v, ok := received(tm.C); ok {
		t.Fatalf("read %v after Reset, want nothing until the new deadline", v)
	}
	c.Advance(time.Minute)
	if v, ok := received(tm.C); !ok || !v.Equal(epoch.Add(time.Second+time.Minute)) {
		t.Fatalf("got %v (sent %v), want %v", v, ok, epoch.Add(time.Second+time.Minute))
	}
}

func TestATickerTicksEveryPeriodAndDropsTicksNobodyReads(t *testing.T) {
	c := NewFake(epoch)
	tk := NewTicker(c, time.Second)
	for i := 1; i <= 3; i++ {
		c.Advance(time.Second)
		v, ok := received(tk.C)
		if want := epoch.Add(time.Duration(i) * time.Second); !ok || !v.Equal(want) {
			t.Fatalf("tick %d: got %v (sent %v), want %v", i, v, ok, want)
		}
	}
	c.Advance(10 * time.Second) // ten ticks due, one kept
	if _, ok := received(tk.C); !ok {
		t.Fatal("no tick after ten periods")
	}
	if v, ok := received(tk.C); ok {
		t.Fatalf("a second tick %v was kept for a slow reader, want it dropped", v)
	}
	c.Advance(time.Second) // the schedule did not drift
	if v, ok := received(tk.C); !ok || !v.Equal(epoch.Add(14*time.Second)) {
		t.Fatalf("got %v (sent %v), want %v", v, ok, epoch.Add(14*time.Second))
	}
}

func TestAResetTickerTicksAtItsNewPeriodAndAStoppedOneNever(t *testing.T) {
	c := NewFake(epoch)
	tk := NewTicker(c, time.Second)
	c.Advance(500 * time.Millisecond)
	tk.Reset(time.Minute)
	c.Advance(59 * time.Second)
	if v, ok := received(tk.C); ok {
		t.Fatalf("ticked at %v at the old period", v)
	}
	c.Advance(time.Second)
	if v, ok := received(tk.C); !ok || !v.Equal(epoch.Add(60500*time.Millisecond)) {
		t.Fatalf("got %v (sent %v), want %v", v, ok, epoch.Add(60500*time.Millisecond))
	}
	tk.Stop()
	c.Advance(time.Hour)
	if v, ok := received(tk.C); ok {
		t.Fatalf("a stopped ticker ticked at %v", v)
	}
	if n := c.Pending(); n != 0 {
		t.Fatalf("%d functions still armed after Stop, want 0", n)
	}
}

func TestSleepReturnsTrueOnceItsDurationPassedAndFalseWhenCanceled(t *testing.T) {
	c := NewFake(epoch)
	done := make(chan bool, 1)
	go func() { done <- Sleep(context.Background(), c, time.Second) }()
	waitPending(t, c, 1)
	c.Advance(time.Second)
	if slept := <-done; !slept {
		t.Fatal("Sleep: got false once its second passed, want true")
	}

	ctx, cancel := context.WithCancel(context.Background())
	go func() { done <- Sleep(ctx, c, time.Second) }()
	waitPending(t, c, 1)
	cancel()
	if slept := <-done; slept {
		t.Fatal("Sleep: got true when canceled, want false")
	}
}

// waitPending waits until n functions are armed on c.
func waitPending(t *testing.T, c *Fake, n int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for c.Pending() < n {
		if time.Now().After(deadline) {
			t.Fatalf("%d functions armed after 10s, want %d", c.Pending(), n)
		}
		runtime.Gosched()
	}
}

func TestRealTimersAndTickersFire(t *testing.T) {
	tm := NewTimer(Real, time.Millisecond)
	tk := NewTicker(Real, time.Millisecond)
	defer tk.Stop()
	for _, ch := range []<-chan time.Time{tm.C, tk.C, tk.C} {
		select {
		case <-ch:
		case <-time.After(10 * time.Second):
			t.Fatal("a real timer or ticker did not fire in 10s")
		}
	}
}
