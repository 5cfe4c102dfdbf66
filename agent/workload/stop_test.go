package workload

import (
	"context"
	"errors"
	"slices"
	"syscall"
	"testing"
	"time"
)

// stopModes are the two ways a stopper watches processes exit.
var stopModes = []struct {
	name string
	s    stopper
}{
	{"pidfd", stopper{procRoot: "/proc"}},
	{"proc polling", stopper{procRoot: "/proc", noPidfd: true}},
}

// termGrace is the killAfter of the cases that check the child caught
// SIGTERM before SIGKILL came: long enough for a loaded machine to run
// the child's handler, which 20 ms was not.
const termGrace = 2 * time.Second

func TestStop(t *testing.T) {
	sleeper := func(t *testing.T) *child { return startChild(t, "", "sleep", "60") }
	tests := []struct {
		name  string
		start func(t *testing.T) *child
		// prepare runs before Stop and returns what Stop is given.
		prepare   func(t *testing.T, c *child) []Proc
		killAfter time.Duration
		want      StopResult
		// wantSignal ended the child: sent by Stop, or by the test after
		// Stop returned if Stop was to leave the child alone.
		wantSignal syscall.Signal
		// wantTerm says the child caught SIGTERM before it died.
		wantTerm bool
	}{{
		name:       "a process that exits on SIGTERM is terminated",
		start:      sleeper,
		prepare:    reaped,
		killAfter:  time.Hour,
		want:       StopResult{Terminated: 1},
		wantSignal: syscall.SIGTERM,
	}, {
		name:       "a process whose parent leaves it a zombie is terminated",
		start:      sleeper,
		prepare:    unreaped,
		killAfter:  time.Hour,
		want:       StopResult{Terminated: 1},
		wantSignal: syscall.SIGTERM,
	}, {
		name:       "a process that survives SIGTERM is killed after killAfter",
		start:      startTermReporter,
		prepare:    reaped,
		killAfter:  termGrace,
		want:       StopResult{Killed: 1},
		wantSignal: syscall.SIGKILL,
		wantTerm:   true,
	}, {
		name:       "a process that survives SIGTERM and is left a zombie is killed",
		start:      startTermReporter,
		prepare:    unreaped,
		killAfter:  termGrace,
		want:       StopResult{Killed: 1},
		wantSignal: syscall.SIGKILL,
		wantTerm:   true,
	}, {
		name:       "a process is killed at once when killAfter is zero",
		start:      startTermReporter,
		prepare:    reaped,
		killAfter:  0,
		want:       StopResult{Killed: 1},
		wantSignal: syscall.SIGKILL,
	}, {
		name:  "a reused pid is never signalled",
		start: sleeper,
		prepare: func(t *testing.T, c *child) []Proc {
			c.reap()
			return []Proc{{PID: c.proc.PID, Start: c.proc.Start - 1}}
		},
		killAfter:  0,
		want:       StopResult{Gone: 1},
		wantSignal: syscall.SIGKILL,
	}, {
		name:  "a zombie is gone and not signalled",
		start: sleeper,
		prepare: func(t *testing.T, c *child) []Proc {
			c.killToZombie(t)
			return []Proc{c.proc}
		},
		killAfter:  0,
		want:       StopResult{Gone: 1},
		wantSignal: syscall.SIGKILL,
	}, {
		name:  "a process listed twice is stopped once",
		start: sleeper,
		prepare: func(t *testing.T, c *child) []Proc {
			c.reap()
			return []Proc{c.proc, c.proc}
		},
		killAfter:  time.Hour,
		want:       StopResult{Terminated: 1},
		wantSignal: syscall.SIGTERM,
	}}
	for _, mode := range stopModes {
		for _, tt := range tests {
			t.Run(mode.name+"/"+tt.name, func(t *testing.T) {
				c := tt.start(t)
				procs := tt.prepare(t, c)
				got, err := mode.s.stop(testContext(t), procs, tt.killAfter)
				if err != nil {
					t.Fatalf("Stop: %v", err)
				}
				got.Took = 0
				if !equalResults(got, tt.want) {
					t.Errorf("Stop = %+v, want %+v", got, tt.want)
				}
				// Whatever Stop did has happened: end the child if it
				// was to be left alone, and learn what ended it.
				c.cmd.Process.Kill()
				if sig := c.signalled(t); sig != tt.wantSignal {
					t.Errorf("child ended by %v, want %v", sig, tt.wantSignal)
				}
				if tt.wantTerm {
					if line := c.readLine(t); line != "TERM" {
						t.Errorf("child printed %q, want %q", line, "TERM")
					}
				}
			})
		}
	}
}

// reaped has the child's exit collected as soon as it exits.
func reaped(t *testing.T, c *child) []Proc {
	c.reap()
	return []Proc{c.proc}
}

// unreaped leaves the child a zombie when it exits, until the test ends.
func unreaped(t *testing.T, c *child) []Proc {
	return []Proc{c.proc}
}

func equalResults(a, b StopResult) bool {
	return a.Terminated == b.Terminated && a.Killed == b.Killed && a.Gone == b.Gone &&
		slices.Equal(a.Remaining, b.Remaining) && a.Took == b.Took
}

func TestStopSeveralProcesses(t *testing.T) {
	for _, mode := range stopModes {
		t.Run(mode.name, func(t *testing.T) {
			term := startChild(t, "", "sleep", "60")
			survivor := startTermReporter(t)
			zombie := startChild(t, "", "sleep", "60")
			zombie.killToZombie(t)
			term.reap()
			survivor.reap()

			got, err := mode.s.stop(testContext(t), []Proc{term.proc, survivor.proc, zombie.proc}, 20*time.Millisecond)
			if err != nil {
				t.Fatalf("Stop: %v", err)
			}
			got.Took = 0
			if want := (StopResult{Terminated: 1, Killed: 1, Gone: 1}); !equalResults(got, want) {
				t.Errorf("Stop = %+v, want %+v", got, want)
			}
		})
	}
}

func TestStopReturnsWhenContextEnds(t *testing.T) {
	for _, mode := range stopModes {
		t.Run(mode.name, func(t *testing.T) {
			c := startTermReporter(t)
			c.reap()
			ctx, cancel := context.WithCancel(testContext(t))
			defer cancel()
			// Cancel once Stop has sent SIGTERM and is waiting.
			caught := make(chan string, 1)
			go func() {
				c.lines.Scan()
				caught <- c.lines.Text()
				cancel()
			}()

			got, err := mode.s.stop(ctx, []Proc{c.proc}, time.Hour)
			if !errors.Is(err, context.Canceled) {
				t.Errorf("Stop error = %v, want %v", err, context.Canceled)
			}
			got.Took = 0
			if want := (StopResult{Remaining: []Proc{c.proc}}); !equalResults(got, want) {
				t.Errorf("Stop = %+v, want %+v", got, want)
			}
			if line := <-caught; line != "TERM" {
				t.Errorf("child printed %q, want %q", line, "TERM")
			}
		})
	}
}

func TestStopNothing(t *testing.T) {
	got, err := Stop(testContext(t), nil, time.Second)
	if err != nil {
		t.Fatalf("Stop: %v", err)
	}
	got.Took = 0
	if !equalResults(got, StopResult{}) {
		t.Errorf("Stop = %+v, want %+v", got, StopResult{})
	}
}

func TestStopUsesRealProc(t *testing.T) {
	c := startChild(t, "", "sleep", "60")
	c.reap()
	got, err := Stop(testContext(t), []Proc{c.proc}, time.Hour)
	if err != nil {
		t.Fatalf("Stop: %v", err)
	}
	if got.Terminated != 1 {
		t.Errorf("Stop = %+v, want 1 terminated", got)
	}
}
