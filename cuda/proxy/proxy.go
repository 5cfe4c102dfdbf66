// Package proxy is the user's end of CUDA remoting: it accepts the shim's
// connections (libcuda.so.1, GPUPOOL_CUDA_SOCKET) on a unix socket and
// carries each one, byte for byte, to the lease's CUDA server on the pool
// host over one stream of the lease's data-plane connection.
//
// The proxy neither reads nor changes the CUDA protocol: the shim and the
// server check each other (cuda/wire). One client process is one
// connection, so its calls stay in order.
package proxy

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"sync"
	"syscall"
)

// Carrier carries one shim connection to the lease's server until either
// side ends it. It closes local. gpupool attach's carries it over the
// data plane's cuda operation (client.Host.Cuda).
type Carrier func(ctx context.Context, local net.Conn) error

// Proxy serves one unix socket.
type Proxy struct {
	path  string
	l     *net.UnixListener
	carry Carrier
	dev   uint64 // the socket file's device and inode: Close removes the
	ino   uint64 // path only while it is still this socket
	// OnError, when set before Serve, hears why a connection ended early
	// (a refused token, the lease ended).
	OnError func(error)

	wg sync.WaitGroup
}

// Listen creates the unix socket at path, readable and writable by this
// user only, and returns a proxy that carries its connections with carry.
func Listen(path string, carry Carrier) (*Proxy, error) {
	if carry == nil {
		return nil, errors.New("proxy: carry: required")
	}
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("proxy: listening on %s: %w", path, err)
	}
	// Another process (a newer instance of the same program) may take
	// the path over later; closing the listener must not remove its
	// socket, so Close removes the path itself, and only if it is ours.
	l.SetUnlinkOnClose(false)
	p := &Proxy{path: path, l: l, carry: carry}
	var st syscall.Stat_t
	if err := syscall.Lstat(path, &st); err != nil {
		l.Close()
		return nil, fmt.Errorf("proxy: %w", err)
	}
	p.dev, p.ino = uint64(st.Dev), st.Ino
	if err := os.Chmod(path, 0o600); err != nil {
		p.Close()
		return nil, fmt.Errorf("proxy: %w", err)
	}
	return p, nil
}

// Path is the socket's path: the value of GPUPOOL_CUDA_SOCKET.
func (p *Proxy) Path() string { return p.path }

// Serve accepts connections until ctx ends or Close is called, carrying
// each in its own goroutine, and waits for them to end when it returns.
func (p *Proxy) Serve(ctx context.Context) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stop := context.AfterFunc(ctx, func() { p.l.Close() })
	defer stop()
	defer p.wg.Wait()
	for {
		c, err := p.l.AcceptUnix()
		if err != nil {
			if ctx.Err() != nil || errors.Is(err, net.ErrClosed) {
				return nil
			}
			return err
		}
		p.wg.Go(func() {
			if err := p.carry(ctx, c); err != nil && ctx.Err() == nil && p.OnError != nil {
				p.OnError(err)
			}
		})
	}
}

// Close stops accepting and removes the socket, unless its path is
// another socket now (another process listened there since): it removes
// only what Listen created. Connections being carried end when Serve's
// context does.
func (p *Proxy) Close() error {
	err := p.l.Close()
	p.removeOwn()
	return err
}

// removeOwn removes the socket's path if it is still the socket Listen
// made, by device and inode.
func (p *Proxy) removeOwn() {
	var st syscall.Stat_t
	if syscall.Lstat(p.path, &st) != nil || uint64(st.Dev) != p.dev || st.Ino != p.ino {
		return
	}
	_ = os.Remove(p.path)
}
