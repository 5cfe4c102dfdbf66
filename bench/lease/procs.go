package leasebench

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"time"
)

// stopTimeout is how long a child has to exit on SIGTERM before SIGKILL.
const stopTimeout = 10 * time.Second

// child is one server process of a cluster under test. Its stdout and
// stderr go to a log file in the run's directory.
type child struct {
	name string
	log  string
	cmd  *exec.Cmd
	done chan struct{} // closed once the process has exited
	err  error         // Wait's error; read after done is closed
}

// startChild starts bin with args, logging to dir/name.log. The child is
// killed if this process dies first.
func startChild(dir, name, bin string, args ...string) (*child, error) {
	logPath := filepath.Join(dir, name+".log")
	f, err := os.Create(logPath)
	if err != nil {
		return nil, err
	}
	defer f.Close() // the child holds its own descriptor
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = f, f
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s (%s): %w", name, bin, err)
	}
	c := &child{name: name, log: logPath, cmd: cmd, done: make(chan struct{})}
	go func() {
		c.err = cmd.Wait()
		close(c.done)
	}()
	return c, nil
}

// exited reports whether the child has exited, and why.
func (c *child) exited() (bool, error) {
	select {
	case <-c.done:
		return true, c.err
	default:
		return false, nil
	}
}

// stop sends SIGTERM and waits for the child to exit, killing it after
// stopTimeout.
func (c *child) stop() {
	if ok, _ := c.exited(); ok {
		return
	}
	c.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-c.done:
	case <-time.After(stopTimeout):
		c.cmd.Process.Kill()
		<-c.done
	}
}

// logTail is the last n bytes of the child's log, for error messages.
func (c *child) logTail(n int) string {
	b, err := os.ReadFile(c.log)
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

// diedError reports the first of children that has exited, with the tail
// of its log; nil when all are running.
func diedError(children []*child) error {
	for _, c := range children {
		if ok, err := c.exited(); ok {
			return fmt.Errorf("%s exited (%v); the end of %s:\n%s", c.name, err, c.log, c.logTail(2048))
		}
	}
	return nil
}

// freeAddr asks the kernel for a free TCP port on ip. The port is free
// when asked; a child binds it shortly after.
func freeAddr(ip string) (string, error) {
	l, err := net.Listen("tcp", net.JoinHostPort(ip, "0"))
	if err != nil {
		return "", fmt.Errorf("find a free port on %s: %w", ip, err)
	}
	defer l.Close()
	return l.Addr().String(), nil
}

// freeAddrs returns n free addresses, one on each of 127.0.0.(first),
// 127.0.0.(first+1), ...
func freeAddrs(first, n int) ([]string, error) {
	var addrs []string
	for i := range n {
		a, err := freeAddr(fmt.Sprintf("127.0.0.%d", first+i))
		if err != nil {
			return nil, err
		}
		addrs = append(addrs, a)
	}
	return addrs, nil
}

// errStopped is returned when the run's context ends while waiting.
var errStopped = errors.New("stopped")
