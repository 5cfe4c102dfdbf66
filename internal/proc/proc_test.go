package proc

import (
	"context"
	"errors"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestAStoppedProcessLeavesItsLogAcrossRestarts(t *testing.T) {
	p := &Proc{Name: "echo", Bin: "/bin/sh", Args: []string{"-c", "echo hello; exec sleep 60"}, Log: filepath.Join(t.TempDir(), "echo.log")}
	for i := range 2 {
		if err := p.Start(); err != nil {
			t.Fatal(err)
		}
		if err := Poll(context.Background(), 10*time.Second, func(context.Context) error {
			if n := strings.Count(p.LogTail(4096), "hello"); n <= i {
				return errors.New("no hello yet")
			}
			return nil
		}); err != nil {
			t.Fatal(err)
		}
		p.Stop(10 * time.Second)
		if p.Running() {
			t.Fatal("got running after Stop, want exited")
		}
	}
	if got := strings.Count(p.LogTail(4096), "==== "); got != 2 {
		t.Errorf("got %d start lines in the log, want 2:\n%s", got, p.LogTail(4096))
	}
}

func TestPollReturnsWhatItsFunctionGaveUpWith(t *testing.T) {
	errGone := errors.New("gone")
	err := Poll(context.Background(), time.Minute, func(context.Context) error { return GiveUp{Err: errGone} })
	if err != errGone {
		t.Errorf("got %v, want %v", err, errGone)
	}
}
