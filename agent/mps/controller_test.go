package mps

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// writeScript writes an executable Binary with body into a new directory
// and returns its path.
func writeScript(t *testing.T, body string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), Binary)
	if err := os.WriteFile(path, []byte("#!/bin/sh\n"+body), 0o755); err != nil {
		t.Fatal(err)
	}
	return path
}

func TestStopWritesQuitAndANewline(t *testing.T) {
	// Saves the stdin of every call but -d next to itself.
	bin := writeScript(t, `[ "$1" = -d ] && exit 0
cat > "$(dirname "$0")/stdin"
`)
	c := New(bin, t.TempDir(), nil)
	ctx := testContext(t)
	if err := c.Start(ctx, gpu); err != nil {
		t.Fatalf("Start: %v", err)
	}
	if err := c.Stop(ctx, gpu); err != nil {
		t.Fatalf("Stop: %v", err)
	}
	got, err := os.ReadFile(filepath.Join(filepath.Dir(bin), "stdin"))
	if err != nil {
		t.Fatal(err)
	}
	if string(got) != "quit\n" {
		t.Errorf("stdin = %q, want %q", got, "quit\n")
	}
}

func TestStartServesTheSharedClientUser(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("handing the pipe directory to another user needs root; CI runs the tests as root")
	}
	// Logs every call (arguments, then stdin unless -d) next to itself.
	bin := writeScript(t, `log="$(dirname "$0")/calls"
echo "args: $*" >> "$log"
[ "$1" = -d ] && exit 0
cat >> "$log"
`)
	dir := t.TempDir()
	c := New(bin, dir, nil)
	c.SetClientUser(200000)
	ctx := testContext(t)
	if err := c.Start(ctx, gpu); err != nil {
		t.Fatalf("Start: %v", err)
	}
	if err := c.Stop(ctx, gpu); err != nil {
		t.Fatalf("Stop: %v", err)
	}
	got, err := os.ReadFile(filepath.Join(filepath.Dir(bin), "calls"))
	if err != nil {
		t.Fatal(err)
	}
	want := "args: -d\nargs: \nstart_server -uid 200000\nargs: \nquit\n"
	if string(got) != want {
		t.Errorf("calls = %q, want %q", got, want)
	}
	for _, d := range []string{c.pipeDir(gpu), c.logDir(gpu)} {
		fi, err := os.Stat(d)
		if err != nil {
			t.Fatal(err)
		}
		if uid := fi.Sys().(*syscall.Stat_t).Uid; uid != 200000 {
			t.Errorf("%s is owned by %d, want the client user 200000", d, uid)
		}
	}
}

func TestCommandErrors(t *testing.T) {
	tests := []struct {
		name    string
		mode    string
		timeout time.Duration
		// check inspects the CommandError's Err.
		check func(t *testing.T, err error)
		want  []string // in the message
	}{{
		name:    "a binary that fails reports its exit status and output",
		mode:    "fail",
		timeout: commandTimeout,
		check: func(t *testing.T, err error) {
			var exit *exec.ExitError
			if !errors.As(err, &exit) || exit.ExitCode() != 1 {
				t.Errorf("Err = %v, want exit status 1", err)
			}
		},
		want: []string{"mps: start daemon: ", " -d for " + gpu + ": exit status 1: cannot open /dev/nvidiactl"},
	}, {
		name:    "a binary that hangs times out",
		mode:    "hang",
		timeout: 50 * time.Millisecond,
		check: func(t *testing.T, err error) {
			if !errors.Is(err, context.DeadlineExceeded) {
				t.Errorf("Err = %v, want %v", err, context.DeadlineExceeded)
			}
		},
		want: []string{" -d for " + gpu + ": timed out after 50ms"},
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, _, _ := setup(t)
			c.timeout = tt.timeout
			t.Setenv("FAKE_MODE", tt.mode)
			err := c.Start(testContext(t), gpu)
			var cerr *CommandError
			if !errors.As(err, &cerr) {
				t.Fatalf("Start error = %v, want a *CommandError", err)
			}
			if want := c.binary + " -d"; cerr.Command != want || cerr.GPU != gpu {
				t.Errorf("CommandError for %q on %s, want %q on %s", cerr.Command, cerr.GPU, want, gpu)
			}
			tt.check(t, cerr.Err)
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q lacks %q", err, w)
				}
			}
		})
	}
}

func TestAFailedStopLeavesTheDaemonRunning(t *testing.T) {
	c, calls, _ := setup(t)
	ctx := testContext(t)
	if err := c.Start(ctx, gpu); err != nil {
		t.Fatalf("Start: %v", err)
	}
	t.Setenv("FAKE_MODE", "fail")
	err := c.Stop(ctx, gpu)
	if err == nil || !strings.Contains(err.Error(), `(stdin "quit\n") for `+gpu+": exit status 1") {
		t.Fatalf("Stop error = %v, want the quit command's exit status", err)
	}
	if got := c.Running(); !slices.Equal(got, []string{gpu}) {
		t.Errorf("Running after a failed stop = %v, want [%s]", got, gpu)
	}

	t.Setenv("FAKE_MODE", "")
	if err := c.Stop(ctx, gpu); err != nil {
		t.Fatalf("Stop again: %v", err)
	}
	if got := c.Running(); len(got) != 0 {
		t.Errorf("Running = %v, want none", got)
	}
	if got := calls(); len(got) != 2 || !strings.HasPrefix(got[1], "stdin=quit ") {
		t.Errorf("calls %q: want -d, quit", got)
	}
}

func TestStopOfAGPUNeverStartedDoesNothing(t *testing.T) {
	c, calls, _ := setup(t)
	if err := c.Stop(testContext(t), gpu); err != nil {
		t.Fatalf("Stop: %v", err)
	}
	if got := calls(); len(got) != 0 {
		t.Errorf("calls = %q, want none", got)
	}
}

func TestConcurrentStartsRunOneCommandPerGPU(t *testing.T) {
	c, calls, _ := setup(t)
	ctx := testContext(t)
	const other = "MIG-5bc6c19e-5a8b-5d7c-9e2b-1d3a0c7f4e21"
	var wg sync.WaitGroup
	for i := range 16 {
		uuid := []string{gpu, other}[i%2]
		wg.Go(func() {
			if err := c.Start(ctx, uuid); err != nil {
				t.Errorf("Start(%s): %v", uuid, err)
			}
			c.Running()
		})
	}
	wg.Wait()
	starts := map[string]int{}
	for _, line := range calls() {
		for _, uuid := range []string{gpu, other} {
			if strings.HasPrefix(line, "-d CUDA_VISIBLE_DEVICES="+uuid+" ") {
				starts[uuid]++
			}
		}
	}
	if starts[gpu] != 1 || starts[other] != 1 {
		t.Errorf("-d ran %v times per GPU, want once each", starts)
	}
	if got, want := c.Running(), []string{gpu, other}; !slices.Equal(got, want) {
		t.Errorf("Running = %v, want %v", got, want)
	}
}

func TestStartGivesUpWaitingWhenTheContextEnds(t *testing.T) {
	c, calls, _ := setup(t)
	// Another command for the GPU is under way.
	d := c.addDaemon(gpu)
	if err := d.wait(testContext(t)); err != nil {
		t.Fatal(err)
	}
	defer d.done()
	ctx, cancel := context.WithCancel(testContext(t))
	cancel()
	if err := c.Start(ctx, gpu); !errors.Is(err, context.Canceled) {
		t.Errorf("Start error = %v, want %v", err, context.Canceled)
	}
	if got := calls(); len(got) != 0 {
		t.Errorf("calls = %q, want none", got)
	}
}

func TestADaemonHoldingTheOutputOpenDoesNotHoldUpStart(t *testing.T) {
	// Leaves a child behind that inherits stdout and stderr, as a
	// daemon that does not close them would.
	bin := writeScript(t, `sleep 60 &
echo $! > "$(dirname "$0")/child"
`)
	t.Cleanup(func() {
		b, err := os.ReadFile(filepath.Join(filepath.Dir(bin), "child"))
		if pid, perr := strconv.Atoi(strings.TrimSpace(string(b))); err == nil && perr == nil {
			syscall.Kill(pid, syscall.SIGKILL)
		}
	})
	c := New(bin, t.TempDir(), nil)
	c.waitDelay = 10 * time.Millisecond
	if err := c.Start(testContext(t), gpu); err != nil {
		t.Fatalf("Start: %v", err)
	}
	if got := c.Running(); !slices.Equal(got, []string{gpu}) {
		t.Errorf("Running = %v, want [%s]", got, gpu)
	}
}

func TestBadUUIDsAreRefusedByName(t *testing.T) {
	for _, uuid := range []string{
		"",
		"GPU-",
		"gpu-3c63abec",
		"3c63abec-03c1-58d0-abe9-3c1015f46294",
		"GPU-../../etc",
		"GPU-3c63abec/../x",
		"MIG-GPU-3c63abec-03c1-58d0-abe9-3c1015f46294/1/0",
		"GPU-3c63abec 03c1",
		"GPU-" + strings.Repeat("a", 101),
	} {
		t.Run(strconv.Quote(uuid), func(t *testing.T) {
			c, calls, dir := setup(t)
			ctx := testContext(t)
			want := "GPU uuid " + strconv.Quote(uuid) + ": want GPU-... or MIG-..."
			for name, op := range map[string]func(context.Context, string) error{"Start": c.Start, "Stop": c.Stop} {
				if err := op(ctx, uuid); err == nil || !strings.Contains(err.Error(), want) {
					t.Errorf("%s error = %v, want it to contain %q", name, err, want)
				}
			}
			if got := calls(); len(got) != 0 {
				t.Errorf("calls = %q, want none", got)
			}
			if entries, _ := os.ReadDir(dir); len(entries) != 0 {
				t.Errorf("%s holds %d entries, want none", dir, len(entries))
			}
		})
	}
}

func TestGoodUUIDsAreAccepted(t *testing.T) {
	for _, uuid := range []string{gpu, "MIG-5bc6c19e-5a8b-5d7c-9e2b-1d3a0c7f4e21", "GPU-" + strings.Repeat("a", 100)} {
		if err := checkUUID(uuid); err != nil {
			t.Errorf("checkUUID(%q) = %v, want nil", uuid, err)
		}
	}
}

func TestNewMakesDirAbsolute(t *testing.T) {
	wd, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	c := New(Binary, "state/mps", nil)
	want := "CUDA_MPS_PIPE_DIRECTORY=" + filepath.Join(wd, "state/mps", gpu, "pipe")
	if got := c.ClientEnv(gpu, 1024, 50)[0]; got != want {
		t.Errorf("ClientEnv()[0] = %q, want %q", got, want)
	}
}

// testContext ends with the test, or after a minute.
func testContext(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	t.Cleanup(cancel)
	return ctx
}
