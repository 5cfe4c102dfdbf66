// Package benchproc runs the gpupool processes a benchmark needs: start,
// kill and restart them with their output in a log file, build the
// binary, find free ports and poll until a condition holds; and print
// their progress.
package benchproc

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

// Proc is one gpupool child process; its output goes to a log file.
type Proc struct {
	Name string
	Bin  string
	Args []string
	Log  string // path of the log file, appended to across restarts

	Cmd  *exec.Cmd
	done chan struct{} // closed once Cmd has exited
}

// Start starts the process. It dies with the benchmark (SIGKILL on the
// parent's death) so that an interrupted run leaves nothing behind.
func (p *Proc) Start() error {
	f, err := os.OpenFile(p.Log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	cmd := exec.Command(p.Bin, p.Args...)
	cmd.Stdout, cmd.Stderr = f, f
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL, Setpgid: true}
	if err := cmd.Start(); err != nil {
		f.Close()
		return fmt.Errorf("start %s: %w", p.Name, err)
	}
	p.Cmd, p.done = cmd, make(chan struct{})
	go func(done chan struct{}) {
		cmd.Wait()
		f.Close()
		close(done)
	}(p.done)
	return nil
}

// Kill sends SIGKILL and waits for the process to be gone.
func (p *Proc) Kill() {
	if !p.Running() {
		return
	}
	p.Cmd.Process.Signal(syscall.SIGKILL)
	<-p.done
}

// Started reports whether Start ever succeeded.
func (p *Proc) Started() bool { return p.done != nil }

// Running reports whether the process was started and has not exited.
func (p *Proc) Running() bool {
	if p.done == nil {
		return false
	}
	select {
	case <-p.done:
		return false
	default:
		return true
	}
}

// LogTail returns the last n bytes of the process's log.
func (p *Proc) LogTail(n int) string {
	b, err := os.ReadFile(p.Log)
	if err != nil {
		return fmt.Sprintf("(no log: %v)", err)
	}
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return string(b)
}

// BuildGpupool builds cmd/gpupool into dir, with the build tags given
// (e.g. faultinject). It must run inside the module.
func BuildGpupool(ctx context.Context, dir string, tags ...string) (string, error) {
	bin := filepath.Join(dir, "gpupool")
	args := []string{"build", "-o", bin}
	if len(tags) > 0 {
		args = append(args, "-tags", strings.Join(tags, ","))
	}
	out, err := exec.CommandContext(ctx, "go", append(args, "github.com/gpupool/gpupool/cmd/gpupool")...).CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("go build ./cmd/gpupool (run from the repository, or pass --gpupool PATH): %v\n%s", err, out)
	}
	return bin, nil
}

// FreeAddr asks the kernel for a free TCP port on ip. Another process may
// take it before the broker binds it; the broker then fails to start and
// says so in its log.
func FreeAddr(ip string) (string, error) {
	l, err := net.Listen("tcp", net.JoinHostPort(ip, "0"))
	if err != nil {
		return "", err
	}
	defer l.Close()
	return l.Addr().String(), nil
}

// Stop, returned by Poll's function, makes Poll give up at once with Err.
type Stop struct{ Err error }

func (b Stop) Error() string { return b.Err.Error() }

// Poll calls f, each call bounded by 5s, every 20ms until it returns nil,
// returns Stop, or timeout passes; it returns f's last error.
func Poll(ctx context.Context, timeout time.Duration, f func(context.Context) error) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	var last error
	for {
		cctx, ccancel := context.WithTimeout(ctx, 5*time.Second)
		err := f(cctx)
		ccancel()
		if err == nil {
			return nil
		}
		if stop, ok := errors.AsType[Stop](err); ok {
			return stop.Err
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
		case <-time.After(20 * time.Millisecond):
		}
	}
}
