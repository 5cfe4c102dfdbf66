// Package proc runs the child processes of tests and benchmarks: each
// started with its output appended to a log file that outlives it (and is
// kept when a run fails, for whoever reads why), killed when its parent
// dies, stopped with a grace period, and waited for with Poll until it is
// ready. It knows nothing of what the processes are.
package proc

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

// Proc is one child process. Set its fields, then Start it; Start again
// after it has exited restarts it with the same command line and log.
// A Proc is used from one goroutine at a time.
type Proc struct {
	Name string // what messages call it
	Bin  string
	Args []string
	// Log is the file the process's stdout and stderr are appended to,
	// across restarts, each start marked by a "==== <time> start" line.
	// It is never removed.
	Log string
	// Wrap, if set, rewrites the command before it starts, e.g. to run it
	// in a network namespace. It must keep the command's Stdout, Stderr
	// and SysProcAttr.
	Wrap func(*exec.Cmd) *exec.Cmd
	// OwnGroup starts the process in a process group of its own, so that
	// a terminal's ^C reaches only the parent, which stops its children
	// in the order it wants.
	OwnGroup bool

	cmd  *exec.Cmd
	done chan struct{} // closed once cmd has exited
	err  error         // Wait's error; read only after done is closed
}

// Start starts the process. It dies with its parent (SIGKILL on the
// parent's death), so an interrupted run leaves nothing behind.
func (p *Proc) Start() error {
	f, err := os.OpenFile(p.Log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	fmt.Fprintf(f, "==== %s start %s %s\n", time.Now().Format(time.RFC3339Nano), p.Bin, strings.Join(p.Args, " "))
	cmd := exec.Command(p.Bin, p.Args...)
	cmd.Stdout, cmd.Stderr = f, f
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL, Setpgid: p.OwnGroup}
	if p.Wrap != nil {
		cmd = p.Wrap(cmd)
	}
	if err := cmd.Start(); err != nil {
		f.Close()
		return fmt.Errorf("start %s (%s): %w", p.Name, p.Bin, err)
	}
	done := make(chan struct{})
	p.cmd, p.done, p.err = cmd, done, nil
	go func() {
		err := cmd.Wait()
		f.Close()
		p.err = err
		close(done)
	}()
	return nil
}

// Started reports whether Start ever succeeded.
func (p *Proc) Started() bool { return p.done != nil }

// Running reports whether the process was started and has not exited.
func (p *Proc) Running() bool {
	exited, _ := p.Exited()
	return p.done != nil && !exited
}

// Exited reports whether the process, once started, has exited, and
// Wait's error if so.
func (p *Proc) Exited() (bool, error) {
	if p.done == nil {
		return false, nil
	}
	select {
	case <-p.done:
		return true, p.err
	default:
		return false, nil
	}
}

// Pid is the process id of the last start; 0 before the first.
func (p *Proc) Pid() int {
	if p.cmd == nil {
		return 0
	}
	return p.cmd.Process.Pid
}

// ProcessState is how the last start ended; nil while it runs.
func (p *Proc) ProcessState() *os.ProcessState {
	if exited, _ := p.Exited(); !exited {
		return nil
	}
	return p.cmd.ProcessState
}

// Signal sends sig to a running process and does not wait: for SIGSTOP,
// SIGCONT and the like. Kill and Stop end it.
func (p *Proc) Signal(sig os.Signal) error {
	if !p.Running() {
		return nil
	}
	return p.cmd.Process.Signal(sig)
}

// Kill sends SIGKILL and returns once the process is gone.
func (p *Proc) Kill() {
	if !p.Running() {
		return
	}
	p.cmd.Process.Signal(syscall.SIGKILL)
	<-p.done
}

// Stop sends SIGTERM and returns once the process is gone, killing it
// if it has not exited after grace.
func (p *Proc) Stop(grace time.Duration) {
	if !p.Running() {
		return
	}
	p.cmd.Process.Signal(syscall.SIGTERM)
	t := time.NewTimer(grace)
	defer t.Stop()
	select {
	case <-p.done:
	case <-t.C:
		p.Kill()
	}
}

// LogTail is the end of the process's log, at most n bytes from the
// first whole line, for error messages.
func (p *Proc) LogTail(n int) string {
	b, err := os.ReadFile(p.Log)
	if err != nil {
		return fmt.Sprintf("(no log: %v)", err)
	}
	if len(b) > n {
		b = b[len(b)-n:]
		if i := bytes.IndexByte(b, '\n'); i >= 0 {
			b = b[i+1:]
		}
	}
	return string(bytes.TrimSpace(b))
}

// GoBuild builds the main package pkg into dir, with the build tags
// given, and returns the binary's path (dir and the package's last
// element). It must run inside the module that has pkg.
func GoBuild(ctx context.Context, dir, pkg string, tags ...string) (string, error) {
	bin := filepath.Join(dir, path.Base(pkg))
	args := []string{"build", "-o", bin}
	if len(tags) > 0 {
		args = append(args, "-tags", strings.Join(tags, ","))
	}
	out, err := exec.CommandContext(ctx, "go", append(args, pkg)...).CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("go %s %s (run it inside the module, or give a built binary): %v\n%s", strings.Join(args[:len(args)-2], " "), pkg, err, out)
	}
	return bin, nil
}

// FreeAddr asks the kernel for a free TCP port on ip. Another process may
// take it before the child binds it; the child then fails to start and
// says so in its log.
func FreeAddr(ip string) (string, error) {
	l, err := net.Listen("tcp", net.JoinHostPort(ip, "0"))
	if err != nil {
		return "", fmt.Errorf("find a free port on %s: %w", ip, err)
	}
	defer l.Close()
	return l.Addr().String(), nil
}

// GiveUp, returned by Poll's function, makes Poll return Err at once.
type GiveUp struct{ Err error }

func (g GiveUp) Error() string { return g.Err.Error() }

// Poll calls f, each call bounded by 5s, every 20ms until it returns nil
// or GiveUp, or timeout passes; it then returns nil, GiveUp's Err, or f's
// last error ("after <timeout>: ..."). It returns ctx's error if ctx
// ends first.
func Poll(ctx context.Context, timeout time.Duration, f func(context.Context) error) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	var last error
	for {
		cctx, ccancel := context.WithTimeout(ctx, 5*time.Second)
		err := f(cctx)
		ccancel()
		if err == nil {
			return nil
		}
		if g, ok := errors.AsType[GiveUp](err); ok {
			return g.Err
		}
		if ctx.Err() == nil || last == nil {
			last = err
		}
		select {
		case <-ctx.Done():
			if errors.Is(ctx.Err(), context.DeadlineExceeded) {
				return fmt.Errorf("after %s: %w", timeout, last)
			}
			return ctx.Err()
		case <-tick.C:
		}
	}
}
