package dataplane

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

func TestExec(t *testing.T) {
	t.Setenv("DATAPLANE_TEST_AGENT_SECRET", "agent-only")
	a := newTestAgent(t)
	c := a.dial(t)
	if err := os.Mkdir(filepath.Join(a.dir, "sub"), 0o755); err != nil {
		t.Fatal(err)
	}
	bigStdin := make([]byte, 3<<20)
	rand.Read(bigStdin)
	tests := []struct {
		name       string
		req        *gpupoolv1.ExecStart
		stdin      []byte
		wantStdout string
		wantStderr string
		want       ExitStatus
	}{{
		name:       "stdout, stderr and the exit code come back",
		req:        &gpupoolv1.ExecStart{Argv: []string{"sh", "-c", "echo $FOO; echo err >&2; exit 3"}, Env: []string{"FOO=bar"}},
		wantStdout: "bar\n",
		wantStderr: "err\n",
		want:       ExitStatus{Code: 3},
	}, {
		name:       "the lease's environment is set",
		req:        &gpupoolv1.ExecStart{Argv: []string{"sh", "-c", "echo $GPUPOOL_LEASE_ID $CUDA_VISIBLE_DEVICES"}},
		wantStdout: testLease + " " + testGPU + "\n",
	}, {
		name:       "the agent's environment is not",
		req:        &gpupoolv1.ExecStart{Argv: []string{"sh", "-c", "echo ${DATAPLANE_TEST_AGENT_SECRET:-unset}"}},
		wantStdout: "unset\n",
	}, {
		name:       "the process runs in the lease directory, which is HOME",
		req:        &gpupoolv1.ExecStart{Argv: []string{"sh", "-c", `[ "$HOME" = "$PWD" ] && pwd`}},
		wantStdout: "%DIR%\n",
	}, {
		name:       "cwd is relative to the lease directory",
		req:        &gpupoolv1.ExecStart{Argv: []string{"pwd"}, Cwd: "sub"},
		wantStdout: "%DIR%/sub\n",
	}, {
		name:       "stdin reaches the process and its end closes it",
		req:        &gpupoolv1.ExecStart{Argv: []string{"cat"}},
		stdin:      []byte("hello\nworld"),
		wantStdout: "hello\nworld",
	}, {
		name:       "several MiB of stdin stream through while the output streams back",
		req:        &gpupoolv1.ExecStart{Argv: []string{"cat"}},
		stdin:      bigStdin,
		wantStdout: string(bigStdin),
	}, {
		name: "a process killed by a signal reports it",
		req:  &gpupoolv1.ExecStart{Argv: []string{"sh", "-c", "kill -KILL $$"}},
		want: ExitStatus{Code: 128 + 9, Signal: "SIGKILL"},
	}, {
		name:       "output of a descendant that holds the pipes after the exit is relayed, then the exec ends",
		req:        &gpupoolv1.ExecStart{Argv: []string{"sh", "-c", "echo parent; (sleep 0.05; echo child) & exit 0"}},
		wantStdout: "parent\nchild\n",
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			stdio := ExecIO{Stdout: &stdout, Stderr: &stderr}
			if tt.stdin != nil {
				stdio.Stdin = bytes.NewReader(tt.stdin)
			}
			got, err := c.Exec(t.Context(), testToken, tt.req, stdio)
			if err != nil {
				t.Fatal(err)
			}
			pid := <-a.leases.started
			if got != tt.want {
				t.Errorf("got %+v, want %+v", got, tt.want)
			}
			wantStdout := strings.ReplaceAll(tt.wantStdout, "%DIR%", a.dir)
			if stdout.String() != wantStdout {
				t.Errorf("got stdout %.100q, want %.100q", stdout.String(), wantStdout)
			}
			if stderr.String() != tt.wantStderr {
				t.Errorf("got stderr %q, want %q", stderr.String(), tt.wantStderr)
			}
			if pid <= 0 {
				t.Errorf("Started got pid %d", pid)
			}
		})
	}
}

func TestExecRefusals(t *testing.T) {
	a := newTestAgent(t)
	c := a.dial(t)
	if err := os.Symlink(t.TempDir(), filepath.Join(a.dir, "out")); err != nil {
		t.Fatal(err)
	}
	const (
		invalid    = gpupoolv1.AcceptCode_ACCEPT_CODE_INVALID_ARGUMENT
		notFound   = gpupoolv1.AcceptCode_ACCEPT_CODE_NOT_FOUND
		denied     = gpupoolv1.AcceptCode_ACCEPT_CODE_PERMISSION_DENIED
		unauthed   = gpupoolv1.AcceptCode_ACCEPT_CODE_UNAUTHENTICATED
		validToken = testToken
	)
	tests := []struct {
		name  string
		token string
		req   *gpupoolv1.ExecStart
		code  gpupoolv1.AcceptCode
		msg   string
	}{
		{"an expired token, with the authorizer's reason", "expired", &gpupoolv1.ExecStart{Argv: []string{"true"}}, unauthed, "token expired at 2026-01-02T03:04:05Z"},
		{"an unknown token", "forged", &gpupoolv1.ExecStart{Argv: []string{"true"}}, unauthed, "not signed by a known broker key"},
		{"no argv", validToken, &gpupoolv1.ExecStart{}, invalid, "argv: must name a program"},
		{"a tty", validToken, &gpupoolv1.ExecStart{Argv: []string{"true"}, Tty: true}, invalid, "tty: not supported"},
		{"an env entry without =", validToken, &gpupoolv1.ExecStart{Argv: []string{"true"}, Env: []string{"FOO"}}, invalid, `env[0] "FOO": must be KEY=VALUE`},
		{"an env entry overriding the lease's", validToken, &gpupoolv1.ExecStart{Argv: []string{"true"}, Env: []string{"CUDA_VISIBLE_DEVICES=0,1"}}, invalid, "env[0] CUDA_VISIBLE_DEVICES: set by the lease"},
		{"a cwd out of the lease directory", validToken, &gpupoolv1.ExecStart{Argv: []string{"true"}, Cwd: "../x"}, invalid, "must be relative to the lease directory"},
		{"a cwd through a symlink out of it", validToken, &gpupoolv1.ExecStart{Argv: []string{"true"}, Cwd: "out"}, denied, "escapes the lease directory"},
		{"a cwd that does not exist", validToken, &gpupoolv1.ExecStart{Argv: []string{"true"}, Cwd: "nope"}, notFound, `cwd "nope"`},
		{"a program not in PATH", validToken, &gpupoolv1.ExecStart{Argv: []string{"no-such-program-gpupool"}}, notFound, "no executable in PATH"},
		{"a program path that does not exist", validToken, &gpupoolv1.ExecStart{Argv: []string{"./nope"}}, notFound, `argv[0] "./nope"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := c.Exec(t.Context(), tt.token, tt.req, ExecIO{})
			wantRefused(t, err, tt.code, tt.msg)
		})
	}
}

func TestRefusedErrorReadsLikeTheCodeThenTheReason(t *testing.T) {
	a := newTestAgent(t)
	c := a.dial(t)
	_, err := c.Exec(t.Context(), "expired", &gpupoolv1.ExecStart{Argv: []string{"true"}}, ExecIO{})
	if want := "unauthenticated: token expired at 2026-01-02T03:04:05Z"; err == nil || err.Error() != want {
		t.Fatalf("got %v, want %q", err, want)
	}
}

func TestExecForwardsSignalsToTheProcessGroup(t *testing.T) {
	a := newTestAgent(t)
	c := a.dial(t)
	stdout := newWatchWriter("ready")
	signals := make(chan os.Signal, 1)
	type result struct {
		status ExitStatus
		err    error
	}
	done := make(chan result, 1)
	go func() {
		// The loop's sleep is in the same process group: SIGINT ends it,
		// then the shell runs its trap.
		status, err := c.Exec(t.Context(), testToken, &gpupoolv1.ExecStart{
			Argv: []string{"sh", "-c", `trap "exit 7" INT; echo ready; while :; do sleep 1; done`},
		}, ExecIO{Stdout: stdout, Signals: signals})
		done <- result{status, err}
	}()
	pid := <-a.leases.started
	if pgid, err := syscall.Getpgid(pid); err != nil || pgid != pid {
		t.Errorf("got process group %d (%v), want the process's own, %d", pgid, err, pid)
	}
	<-stdout.seen
	signals <- syscall.SIGINT
	res := <-done
	if res.err != nil {
		t.Fatal(res.err)
	}
	if res.status != (ExitStatus{Code: 7}) {
		t.Fatalf("got %+v, want exit code 7 from the trap", res.status)
	}
}

// stallWriter accepts one write, then blocks every write until released.
type stallWriter struct {
	stalled chan struct{} // closed at the first write
	release chan struct{}
	once    sync.Once
}

func (w *stallWriter) Write(p []byte) (int, error) {
	w.once.Do(func() { close(w.stalled) })
	<-w.release
	return len(p), nil
}

// procState reads a process's state letter and the number of the system
// call it is blocked in (-1 when running), from /proc.
func procState(pid int) (state byte, syscallNr int, err error) {
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, 0, err
	}
	// The state follows the command name, which is in parentheses.
	i := bytes.LastIndexByte(stat, ')')
	if i < 0 || i+2 >= len(stat) {
		return 0, 0, fmt.Errorf("malformed /proc/%d/stat", pid)
	}
	sc, err := os.ReadFile(fmt.Sprintf("/proc/%d/syscall", pid))
	if err != nil {
		return 0, 0, err
	}
	nr, err := strconv.Atoi(strings.Fields(string(sc))[0])
	if err != nil {
		nr = -1 // "running"
	}
	return stat[i+2], nr, nil
}

// procWritten is how many bytes a process has written, from /proc.
func procWritten(t *testing.T, pid int) int64 {
	t.Helper()
	io, err := os.ReadFile(fmt.Sprintf("/proc/%d/io", pid))
	if err != nil {
		t.Fatal(err)
	}
	for line := range strings.Lines(string(io)) {
		if v, ok := strings.CutPrefix(line, "wchar: "); ok {
			n, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
			if err != nil {
				t.Fatal(err)
			}
			return n
		}
	}
	t.Fatalf("no wchar in /proc/%d/io", pid)
	return 0
}

func TestExecStalledClientBlocksTheProcessInsteadOfBuffering(t *testing.T) {
	a := newTestAgent(t)
	c := a.dial(t)
	const total = 100 << 20
	// QUIC's flow-control windows (6 MiB per stream by default, on the
	// client), a pipe and one chunk: anything beyond is buffering.
	const bound = 16 << 20
	// How long the process must stay blocked to count as blocked for good.
	const quiet = 200 * time.Millisecond
	stdout := &stallWriter{stalled: make(chan struct{}), release: make(chan struct{})}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() {
		_, err := c.Exec(ctx, testToken, &gpupoolv1.ExecStart{
			Argv: []string{"head", "-c", strconv.Itoa(total), "/dev/zero"},
		}, ExecIO{Stdout: stdout})
		done <- err
	}()
	pid := <-a.leases.started
	<-stdout.stalled
	// Blocked: asleep in write(2) on its full stdout pipe, and for good:
	// no byte more written for a while. A server that buffered would let
	// it go on writing until it exits.
	var (
		lastWritten int64 = -1
		since       time.Time
	)
	waitFor(t, "the process to stay blocked writing its output", func() bool {
		state, nr, err := procState(pid)
		if err != nil {
			t.Fatalf("the process is gone: %v", err)
		}
		written := procWritten(t, pid)
		if state != 'S' || nr != unix.SYS_WRITE || written != lastWritten {
			lastWritten, since = written, time.Now()
			return false
		}
		return time.Since(since) >= quiet
	})
	written := procWritten(t, pid)
	t.Logf("blocked after writing %d KiB", written>>10)
	if written > bound {
		t.Errorf("the process wrote %d MiB to a client that read one chunk, want at most %d MiB", written>>20, bound>>20)
	}
	// Canceling the Exec stops the process.
	cancel()
	close(stdout.release)
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("got %v, want context.Canceled", err)
	}
	waitFor(t, "the process to be stopped", func() bool {
		return errors.Is(syscall.Kill(pid, 0), syscall.ESRCH)
	})
}

func TestRevokeEndsARunningExecThatIgnoresSIGTERM(t *testing.T) {
	a := newTestAgent(t)
	c := a.dial(t)
	stdout := newWatchWriter("ready")
	done := make(chan error, 1)
	go func() {
		// Ignoring SIGTERM, it lasts until SIGKILL.
		_, err := c.Exec(t.Context(), testToken, &gpupoolv1.ExecStart{
			Argv: []string{"sh", "-c", `trap "" TERM; echo ready; exec sleep 1000`},
		}, ExecIO{Stdout: stdout})
		done <- err
	}()
	pid := <-a.leases.started
	<-stdout.seen

	a.leases.end(testLease)
	a.srv.Revoke(testLease)
	// Revoke returns once the process is reaped.
	if err := syscall.Kill(pid, 0); !errors.Is(err, syscall.ESRCH) {
		t.Errorf("process %d still exists after Revoke (kill: %v)", pid, err)
	}
	select {
	case err := <-done:
		if !errors.Is(err, ErrLeaseEnded) {
			t.Fatalf("got %v, want ErrLeaseEnded", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("Exec still running 20 s after Revoke")
	}

	_, err := c.Exec(t.Context(), testToken, &gpupoolv1.ExecStart{Argv: []string{"true"}}, ExecIO{})
	wantRefused(t, err, gpupoolv1.AcceptCode_ACCEPT_CODE_PERMISSION_DENIED, "not enforced on this host")
}

func TestServerShutdownEndsExecsAndStopsTheirProcesses(t *testing.T) {
	a := newTestAgent(t)
	c := a.dial(t)
	stdout := newWatchWriter("ready")
	done := make(chan error, 1)
	go func() {
		_, err := c.Exec(t.Context(), testToken, &gpupoolv1.ExecStart{
			Argv: []string{"sh", "-c", `echo ready; exec sleep 1000`},
		}, ExecIO{Stdout: stdout})
		done <- err
	}()
	pid := <-a.leases.started
	<-stdout.seen

	a.stop(t)
	if err := <-done; !errors.Is(err, ErrAgentShutdown) {
		t.Fatalf("got %v, want ErrAgentShutdown", err)
	}
	if err := syscall.Kill(pid, 0); !errors.Is(err, syscall.ESRCH) {
		t.Errorf("process %d still exists after Serve returned (kill: %v)", pid, err)
	}
}
