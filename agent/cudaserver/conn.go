package cudaserver

import (
	"io"
	"net"
	"os"
	"syscall"

	"golang.org/x/sys/unix"
)

// threadConn is a session's unix socket, read by blocking the session's
// own OS thread in the kernel rather than in Go's netpoller.
//
// A session's goroutine is locked to its thread (the driver's current
// context is per thread). Parked in the netpoller, every request would
// wake two threads: the netpoller's, which finds the goroutine ready, and
// the session's own, which only it may run on and which the first hands
// its processor to. Waiting in poll(2), the session's thread is the one
// the kernel wakes, once, as it would a C server's. Writes stay Go's: the
// socket stays non-blocking.
//
// A thread waiting in poll(2) keeps its processor until the runtime's
// monitor takes it back, which can be milliseconds: while the session's
// answers wait for the writer goroutine (idle reports false), Read waits
// in the netpoller instead, which lets the writer run at once.
type threadConn struct {
	*net.UnixConn
	rc   syscall.RawConn
	idle func() bool // set by the session's goroutine, the one reader; nil: always poll(2)
}

// newThreadConn wraps c, or returns c itself when its descriptor cannot
// be had.
func newThreadConn(c net.Conn) net.Conn {
	uc, ok := c.(*net.UnixConn)
	if !ok {
		return c
	}
	rc, err := uc.SyscallConn()
	if err != nil {
		return c
	}
	return &threadConn{UnixConn: uc, rc: rc}
}

// Read reads what is there, waiting on this thread for at least a byte.
func (c *threadConn) Read(b []byte) (int, error) {
	if len(b) == 0 {
		return 0, nil
	}
	var n int
	var err error
	rerr := c.rc.Read(func(fd uintptr) bool {
		pfd := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
		for {
			n, err = unix.Read(int(fd), b)
			switch err {
			case unix.EINTR:
				continue
			case unix.EAGAIN:
				if c.idle != nil && !c.idle() {
					return false // wait in the netpoller
				}
				if _, err = unix.Poll(pfd, -1); err != nil && err != unix.EINTR {
					return true
				}
				continue
			}
			return true
		}
	})
	switch {
	case rerr != nil:
		return 0, rerr
	case err != nil:
		return 0, &net.OpError{Op: "read", Net: "unix", Source: c.LocalAddr(), Addr: c.RemoteAddr(), Err: os.NewSyscallError("read", err)}
	case n == 0:
		return 0, io.EOF
	}
	return n, nil
}

// Close shuts the socket down first: that ends a Read waiting in poll(2),
// which Go's Close would otherwise wait for.
func (c *threadConn) Close() error {
	_ = c.rc.Control(func(fd uintptr) { _ = unix.Shutdown(int(fd), unix.SHUT_RDWR) })
	return c.UnixConn.Close()
}
