package cudabench

import (
	"context"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"syscall"
	"time"

	"github.com/quic-go/quic-go"

	"github.com/gpupool/gpupool/dataplane"
)

// The floor of a null call: the same request and answer sizes over each
// transport the call crosses, on its own, between two goroutines of this
// process. The protocol, on a stream, is requests of 16 bytes: an op
// byte, 7 bytes of padding and a u64 size. 'p' is echoed (a ping-pong of
// 16 bytes each way, as a null call's frames are), 'u' is followed by
// size bytes and answered by one byte, 'd' is answered by size bytes.

const reqSize = 16

// pipe is the client's end of one baseline connection and its server.
type pipe struct {
	name string
	rw   io.ReadWriter
	stop func()
}

func (p *pipe) request(op byte, n int64) error {
	var req [reqSize]byte
	req[0] = op
	binary.LittleEndian.PutUint64(req[8:], uint64(n))
	_, err := p.rw.Write(req[:])
	return err
}

// echo serves the protocol on rw until it ends.
func echo(rw io.ReadWriter) {
	buf := make([]byte, 1<<20)
	var req [reqSize]byte
	for {
		if _, err := io.ReadFull(rw, req[:]); err != nil {
			return
		}
		n := int64(binary.LittleEndian.Uint64(req[8:]))
		switch req[0] {
		case 'p':
			if _, err := rw.Write(req[:]); err != nil {
				return
			}
		case 'u':
			if err := drain(rw, n, buf); err != nil {
				return
			}
			if _, err := rw.Write(req[:1]); err != nil {
				return
			}
		case 'd':
			for n > 0 {
				k := min(n, int64(len(buf)))
				if _, err := rw.Write(buf[:k]); err != nil {
					return
				}
				n -= k
			}
		}
	}
}

func (p *pipe) pingPong(n int) (latency, error) {
	var ans [reqSize]byte
	for range 200 { // as the program warms up
		if err := p.request('p', 0); err != nil {
			return latency{}, err
		}
		if _, err := io.ReadFull(p.rw, ans[:]); err != nil {
			return latency{}, err
		}
	}
	d := make([]time.Duration, n)
	var sum time.Duration
	for i := range n {
		s := time.Now()
		if err := p.request('p', 0); err != nil {
			return latency{}, fmt.Errorf("%s ping-pong: %w", p.name, err)
		}
		if _, err := io.ReadFull(p.rw, ans[:]); err != nil {
			return latency{}, fmt.Errorf("%s ping-pong: %w", p.name, err)
		}
		d[i] = time.Since(s)
		sum += d[i]
	}
	slices.Sort(d)
	return latency{P50us: us(int64(d[n/2])), P99us: us(int64(d[n*99/100])), MeanUs: us(int64(sum) / int64(n))}, nil
}

// bulk writes size bytes reps times, each answered by one byte, then
// reads size bytes reps times, in writes and reads of at most 1 MiB.
func (p *pipe) bulk(size int64, reps int) (pair, error) {
	buf := make([]byte, min(size, 1<<20))
	var ack [1]byte
	start := time.Now()
	for range reps {
		if err := p.request('u', size); err != nil {
			return pair{}, err
		}
		for n := size; n > 0; {
			k := min(n, int64(len(buf)))
			if _, err := p.rw.Write(buf[:k]); err != nil {
				return pair{}, fmt.Errorf("%s bulk: %w", p.name, err)
			}
			n -= k
		}
		if _, err := io.ReadFull(p.rw, ack[:]); err != nil {
			return pair{}, fmt.Errorf("%s bulk: %w", p.name, err)
		}
	}
	up := time.Since(start)
	start = time.Now()
	for range reps {
		if err := p.request('d', size); err != nil {
			return pair{}, err
		}
		if err := drain(p.rw, size, buf); err != nil {
			return pair{}, fmt.Errorf("%s bulk: %w", p.name, err)
		}
	}
	return pair{HtoD: gibps(size, reps, up), DtoH: gibps(size, reps, time.Since(start))}, nil
}

func (p *pipe) close() { p.stop() }

// streamPipe connects to l and serves the protocol on the accepted end.
func streamPipe(name string, l net.Listener, dial func() (net.Conn, error)) (*pipe, error) {
	done := make(chan struct{})
	go func() {
		defer close(done)
		c, err := l.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		echo(c)
	}()
	c, err := dial()
	if err != nil {
		l.Close()
		<-done
		return nil, err
	}
	return &pipe{name: name, rw: c, stop: func() { c.Close(); l.Close(); <-done }}, nil
}

// startTCP is the loopback's TCP baseline.
func startTCP() (*pipe, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	return streamPipe("TCP", l, func() (net.Conn, error) { return net.Dial("tcp", l.Addr().String()) })
}

// startUnix is a unix socket's baseline: one of the null call's hops (the
// shim's socket, the agent's socket to the lease's server).
func startUnix(dir string) (*pipe, error) {
	path := filepath.Join(dir, "pingpong.sock")
	l, err := net.Listen("unix", path)
	if err != nil {
		return nil, err
	}
	return streamPipe("unix", l, func() (net.Conn, error) { return net.Dial("unix", path) })
}

// startQUIC is QUIC's own baseline: one stream of a connection on the
// loopback, both ends with TLS 1.3 and config (the data plane's
// quic.Config, or quic-go's defaults), and nothing of the data plane's
// protocol.
func startQUIC(ctx context.Context, dir string, config func() *quic.Config) (*pipe, error) {
	cert, _, err := dataplane.LoadOrCreateCert(filepath.Join(dir, "cert"))
	if err != nil {
		return nil, err
	}
	// The client's configuration accepts no streams; the agent's does.
	srv := config()
	srv.MaxIncomingStreams = 1
	ln, err := quic.ListenAddr("127.0.0.1:0", &tls.Config{
		Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS13, NextProtos: []string{dataplane.ALPN},
	}, srv)
	if err != nil {
		return nil, err
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		c, err := ln.Accept(ctx)
		if err != nil {
			return
		}
		defer c.CloseWithError(0, "")
		s, err := c.AcceptStream(ctx)
		if err != nil {
			return
		}
		echo(s)
	}()
	c, err := quic.DialAddr(ctx, ln.Addr().String(), &tls.Config{
		InsecureSkipVerify: true, MinVersion: tls.VersionTLS13, NextProtos: []string{dataplane.ALPN},
	}, config())
	if err != nil {
		ln.Close()
		<-done
		return nil, err
	}
	s, err := c.OpenStreamSync(ctx)
	if err != nil {
		c.CloseWithError(0, "")
		ln.Close()
		<-done
		return nil, err
	}
	return &pipe{name: "QUIC", rw: s, stop: func() { c.CloseWithError(0, ""); ln.Close(); <-done }}, nil
}

// defaultQUICConfig is quic-go's defaults, with the data plane's
// settings that are not about performance: what the data plane used
// before its windows were tuned.
func defaultQUICConfig() *quic.Config {
	return &quic.Config{MaxIncomingStreams: -1, MaxIncomingUniStreams: -1, KeepAlivePeriod: 10 * time.Second}
}

// directServer is the lease's CUDA server started as the agent starts it
// (its stdin a listening unix socket) with no data plane in front: the
// program's shim connects to it directly, which measures the shim and the
// server alone.
type directServer struct {
	path string
	ln   *net.UnixListener // closing it removes the socket
	cmd  *exec.Cmd
}

func startDirect(gpupool, arg, dir string) (*directServer, error) {
	path := filepath.Join(dir, "direct.sock")
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, err
	}
	f, err := ln.File()
	if err != nil {
		ln.Close()
		return nil, err
	}
	defer f.Close() // the child has its copy once started
	cmd := exec.Command(gpupool, "agent", "cuda-server", "--lease", arg)
	cmd.Stdin = f
	cmd.Stderr = io.Discard
	if err := cmd.Start(); err != nil {
		ln.Close()
		return nil, fmt.Errorf("the direct CUDA server: %w", err)
	}
	return &directServer{path: path, ln: ln, cmd: cmd}, nil
}

func (d *directServer) close() {
	if err := d.cmd.Process.Signal(syscall.SIGTERM); err != nil && !errors.Is(err, os.ErrProcessDone) {
		_ = d.cmd.Process.Kill()
	}
	_ = d.cmd.Wait()
	d.ln.Close()
}
