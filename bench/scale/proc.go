package scale

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"time"
)

// proc is one gpupool child process; its output goes to a log file.
type proc struct {
	name string
	bin  string
	args []string
	log  string // path of the log file, appended to across restarts

	cmd  *exec.Cmd
	done chan struct{} // closed once cmd has exited
}

// start starts the process. It dies with the benchmark (SIGKILL on the
// parent's death) so that an interrupted run leaves nothing behind.
func (p *proc) start() error {
	f, err := os.OpenFile(p.log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	cmd := exec.Command(p.bin, p.args...)
	cmd.Stdout, cmd.Stderr = f, f
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL, Setpgid: true}
	if err := cmd.Start(); err != nil {
		f.Close()
		return fmt.Errorf("start %s: %w", p.name, err)
	}
	p.cmd, p.done = cmd, make(chan struct{})
	go func(done chan struct{}) {
		cmd.Wait()
		f.Close()
		close(done)
	}(p.done)
	return nil
}

// kill sends SIGKILL and waits for the process to be gone.
func (p *proc) kill() {
	if !p.running() {
		return
	}
	p.cmd.Process.Signal(syscall.SIGKILL)
	<-p.done
}

func (p *proc) running() bool {
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

// logTail returns the last n bytes of the process's log.
func (p *proc) logTail(n int) string {
	b, err := os.ReadFile(p.log)
	if err != nil {
		return fmt.Sprintf("(no log: %v)", err)
	}
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return string(b)
}

// buildGpupool builds cmd/gpupool into dir. It must run inside the module.
func buildGpupool(ctx context.Context, dir string) (string, error) {
	bin := filepath.Join(dir, "gpupool")
	out, err := exec.CommandContext(ctx, "go", "build", "-o", bin, "github.com/gpupool/gpupool/cmd/gpupool").CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("go build ./cmd/gpupool (run from the repository, or pass --gpupool PATH): %v\n%s", err, out)
	}
	return bin, nil
}

// freeAddr asks the kernel for a free TCP port on ip. Another process may
// take it before the broker binds it; the broker then fails to start and
// says so in its log.
func freeAddr(ip string) (string, error) {
	l, err := net.Listen("tcp", net.JoinHostPort(ip, "0"))
	if err != nil {
		return "", err
	}
	defer l.Close()
	return l.Addr().String(), nil
}

// backoffStop makes poll give up at once.
type backoffStop struct{ err error }

func (b backoffStop) Error() string { return b.err.Error() }

// poll calls f, each call bounded by 5s, every 20ms until it returns nil,
// returns backoffStop, or timeout passes; it returns f's last error.
func poll(ctx context.Context, timeout time.Duration, f func(context.Context) error) error {
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
		if stop, ok := errors.AsType[backoffStop](err); ok {
			return stop.err
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
