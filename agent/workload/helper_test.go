package workload

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// helperEnv, when set in a test binary's environment, makes it run as a
// child process for the tests instead of running them.
const helperEnv = "WORKLOAD_TEST_HELPER"

func TestMain(m *testing.M) {
	if os.Getenv(helperEnv) == "report-term" {
		reportTerm()
		return
	}
	os.Exit(m.Run())
}

// reportTerm is a process that survives SIGTERM: it prints "ready" once
// it catches SIGTERM, then "TERM" for each one, and runs until killed.
func reportTerm() {
	c := make(chan os.Signal, 1)
	signal.Notify(c, syscall.SIGTERM)
	fmt.Println("ready")
	for range c {
		fmt.Println("TERM")
	}
}

// child is a process started by a test.
type child struct {
	cmd  *exec.Cmd
	proc Proc
	// lines reads what the child prints.
	lines *bufio.Scanner

	reapOnce sync.Once
	exited   chan struct{} // closed once the child has been reaped
}

// startChild starts argv with leaseID in its environment (none if
// empty). The child is killed and reaped when the test ends.
func startChild(t *testing.T, leaseID string, argv ...string) *child {
	t.Helper()
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Env = childEnv(leaseID)
	return start(t, cmd)
}

// startTermReporter starts a child that prints "TERM" for each SIGTERM
// instead of exiting, and returns once it catches SIGTERM.
func startTermReporter(t *testing.T) *child {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(childEnv(""), helperEnv+"=report-term")
	c := start(t, cmd)
	if line := c.readLine(t); line != "ready" {
		t.Fatalf("helper printed %q, want %q", line, "ready")
	}
	return c
}

func childEnv(leaseID string) []string {
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, EnvLeaseID+"=") && !strings.HasPrefix(kv, helperEnv+"=") {
			env = append(env, kv)
		}
	}
	if leaseID != "" {
		env = append(env, EnvLeaseID+"="+leaseID)
	}
	return env
}

func start(t *testing.T, cmd *exec.Cmd) *child {
	t.Helper()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	// The test owns the read end, so output stays readable after the
	// child has been reaped.
	cmd.Stdout = w
	cmd.Stderr = os.Stderr
	// Die with the test binary if it is killed before its cleanups run.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	err = cmd.Start()
	w.Close()
	if err != nil {
		r.Close()
		t.Fatalf("start %v: %v", cmd.Args, err)
	}
	c := &child{cmd: cmd, lines: bufio.NewScanner(r), exited: make(chan struct{})}
	t.Cleanup(func() {
		cmd.Process.Kill()
		c.reap()
		<-c.exited
		r.Close()
	})
	p, err := NewTable("/proc").Lookup(cmd.Process.Pid)
	if err != nil {
		t.Fatalf("look up child: %v", err)
	}
	c.proc = p
	return c
}

// reap collects the child's exit status in the background once it
// exits, so that it does not linger as a zombie.
func (c *child) reap() {
	c.reapOnce.Do(func() {
		go func() {
			c.cmd.Wait()
			close(c.exited)
		}()
	})
}

// signalled returns the signal that ended the child, waiting for it to
// exit.
func (c *child) signalled(t *testing.T) syscall.Signal {
	t.Helper()
	c.reap()
	<-c.exited
	ws := c.cmd.ProcessState.Sys().(syscall.WaitStatus)
	if !ws.Signaled() {
		t.Fatalf("child %v ended with %v, want it ended by a signal", c.proc, c.cmd.ProcessState)
	}
	return ws.Signal()
}

// readLine returns the next line the child prints.
func (c *child) readLine(t *testing.T) string {
	t.Helper()
	if !c.lines.Scan() {
		t.Fatalf("child %v printed no line: %v", c.proc, c.lines.Err())
	}
	return c.lines.Text()
}

// killToZombie kills the child without reaping it and returns once it is
// a zombie.
func (c *child) killToZombie(t *testing.T) {
	t.Helper()
	if err := c.cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "child to become a zombie", func() bool {
		st, err := readStat("/proc", c.proc.PID)
		return err == nil && st.state == 'Z'
	})
}

// testContext ends when the test does, or after a minute, so that a Stop
// that never returns fails the test instead of hanging it.
func testContext(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	t.Cleanup(cancel)
	return ctx
}

// waitFor polls cond until it holds, failing the test after 10 s.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.NewTimer(10 * time.Second)
	defer deadline.Stop()
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	for !cond() {
		select {
		case <-tick.C:
		case <-deadline.C:
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}
