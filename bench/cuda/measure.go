package cudabench

import (
	"bufio"
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpupool/gpupool/dataplane"
)

// sizes are the copies' sizes, each with its repetitions: a few hundred
// MiB each way at the larger sizes, enough small copies for a stable rate.
var sizes = []struct {
	bytes int64
	reps  int
}{
	{4 << 10, 2000},
	{1 << 20, 256},
	{256 << 20, 2},
}

func benchmark(ctx context.Context, opts options, p *progress) (*results, error) {
	start := time.Now()
	dir, err := os.MkdirTemp("", "gpupool-cuda-bench-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	s, err := startStack(ctx, opts, dir)
	if err != nil {
		return nil, err
	}
	defer s.close()
	tcp, err := startTCP()
	if err != nil {
		return nil, err
	}
	defer tcp.close()
	var load [3]float64
	if b, err := os.ReadFile("/proc/loadavg"); err == nil {
		fmt.Sscanf(string(b), "%f %f %f", &load[0], &load[1], &load[2])
	}
	res := &results{
		Benchmark: "cuda",
		Env:       environment{GoVersion: runtime.Version(), OS: runtime.GOOS, Arch: runtime.GOARCH, CPUs: runtime.NumCPU(), LoadAverage: load[0]},
		Config:    config{Calls: opts.calls, Launches: opts.launches, Backend: opts.backend},
	}

	p.Logf("null calls: %d through the shim, %d TCP ping-pongs", opts.calls, opts.calls)
	out, err := s.run(ctx, "null", strconv.Itoa(opts.calls))
	if err != nil {
		return nil, err
	}
	var p50, p99, mean int64
	if _, err := fmt.Sscanf(out, "null %d %d %d", &p50, &p99, &mean); err != nil {
		return nil, fmt.Errorf("the program's null line %q: %v", out, err)
	}
	res.Null = latency{P50us: us(p50), P99us: us(p99), MeanUs: us(mean)}
	if res.TCPPingPong, err = tcp.pingPong(opts.calls); err != nil {
		return nil, err
	}

	p.Logf("pipelined launches: %d", opts.launches)
	if out, err = s.run(ctx, "launch", s.ptx, strconv.Itoa(opts.launches)); err != nil {
		return nil, err
	}
	var k, ns int64
	if _, err := fmt.Sscanf(out, "launch %d %d", &k, &ns); err != nil {
		return nil, fmt.Errorf("the program's launch line %q: %v", out, err)
	}
	res.LaunchesPerSec = float64(k) / (float64(ns) / 1e9)

	for _, sz := range sizes {
		p.Logf("copies of %s: %d each way through the shim, raw TCP and QUIC get/put", human(sz.bytes), sz.reps)
		c := copyResult{Bytes: sz.bytes, Reps: sz.reps}
		if out, err = s.run(ctx, "copy", strconv.FormatInt(sz.bytes, 10), strconv.Itoa(sz.reps)); err != nil {
			return nil, err
		}
		var size int64
		var reps int
		var up, down int64
		if _, err := fmt.Sscanf(out, "copy %d %d %d %d", &size, &reps, &up, &down); err != nil {
			return nil, fmt.Errorf("the program's copy line %q: %v", out, err)
		}
		c.CUDA = pair{HtoD: gibps(sz.bytes, sz.reps, time.Duration(up)), DtoH: gibps(sz.bytes, sz.reps, time.Duration(down))}
		if c.TCP, err = tcp.bulk(sz.bytes, sz.reps); err != nil {
			return nil, err
		}
		if c.QUIC, err = quicBulk(ctx, s.conn, s.dir, sz.bytes, sz.reps); err != nil {
			return nil, err
		}
		res.Copies = append(res.Copies, c)
	}

	p.Logf("release: the lease ends on the agent while the program calls")
	if res.ReleaseToFailureMs, err = s.release(ctx); err != nil {
		return nil, err
	}
	res.ElapsedSeconds = time.Since(start).Seconds()
	return res, nil
}

// run runs the program once and returns its line of numbers.
func (s *stack) run(ctx context.Context, args ...string) (string, error) {
	out, err := s.command(ctx, args...).Output()
	if err != nil {
		return "", fmt.Errorf("cudabench %s: %v", strings.Join(args, " "), err)
	}
	return strings.TrimSpace(string(out)), nil
}

// release starts the program calling, revokes the lease as the agent does
// when it ends, and returns the delay to the program's first failed call.
func (s *stack) release(ctx context.Context) (float64, error) {
	cmd := s.command(ctx, "release")
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return 0, err
	}
	if err := cmd.Start(); err != nil {
		return 0, err
	}
	defer cmd.Wait()
	r := bufio.NewReader(stdout)
	if line, err := r.ReadString('\n'); err != nil || line != "ready\n" {
		cmd.Process.Kill()
		return 0, fmt.Errorf("cudabench release: got %q (%v), want ready", line, err)
	}
	// Let it call for a moment, so the release meets a call in flight.
	time.Sleep(200 * time.Millisecond)
	released := monotonic()
	s.dp.Revoke(benchLease)
	line, err := r.ReadString('\n')
	var failed, result int64
	if _, serr := fmt.Sscanf(line, "failed %d %d", &failed, &result); err != nil || serr != nil {
		cmd.Process.Kill()
		return 0, fmt.Errorf("cudabench release: got %q (%v), want failed T RESULT", line, err)
	}
	return float64(failed-released) / 1e6, nil
}

func monotonic() int64 {
	var ts unix.Timespec
	_ = unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts)
	return ts.Nano()
}

func us(ns int64) float64 { return float64(ns) / 1e3 }

func gibps(size int64, reps int, d time.Duration) float64 {
	return float64(size) * float64(reps) / float64(1<<30) / d.Seconds()
}

func human(n int64) string {
	switch {
	case n >= 1<<20:
		return fmt.Sprintf("%d MiB", n>>20)
	default:
		return fmt.Sprintf("%d KiB", n>>10)
	}
}

// quicBulk puts a file of size bytes reps times through the data plane's
// own put, then gets it reps times.
func quicBulk(ctx context.Context, conn *dataplane.Conn, dir string, size int64, reps int) (pair, error) {
	name := fmt.Sprintf("bulk-%d", size)
	start := time.Now()
	for range reps {
		if _, err := conn.Put(ctx, benchToken, io.LimitReader(zeros{}, size), size, name, 0o644); err != nil {
			return pair{}, fmt.Errorf("QUIC put: %w", err)
		}
	}
	put := time.Since(start)
	start = time.Now()
	for range reps {
		if _, err := conn.Get(ctx, benchToken, name, io.Discard); err != nil {
			return pair{}, fmt.Errorf("QUIC get: %w", err)
		}
	}
	get := time.Since(start)
	_ = os.Remove(filepath.Join(dir, "lease", name))
	return pair{HtoD: gibps(size, reps, put), DtoH: gibps(size, reps, get)}, nil
}

type zeros struct{}

func (zeros) Read(p []byte) (int, error) {
	clear(p)
	return len(p), nil
}

// tcpServer is the loopback baseline: one TCP connection, requests of an
// op byte and a u64 size: 'p' answers one byte, 'u' reads size bytes and
// answers one byte, 'd' writes size bytes.
type tcpServer struct {
	l    net.Listener
	c    net.Conn
	done chan struct{}
}

func startTCP() (*tcpServer, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	t := &tcpServer{l: l, done: make(chan struct{})}
	go t.serve()
	if t.c, err = net.Dial("tcp", l.Addr().String()); err != nil {
		l.Close()
		return nil, err
	}
	return t, nil
}

func (t *tcpServer) serve() {
	defer close(t.done)
	c, err := t.l.Accept()
	if err != nil {
		return
	}
	defer c.Close()
	buf := make([]byte, 1<<20)
	var req [9]byte
	for {
		if _, err := io.ReadFull(c, req[:]); err != nil {
			return
		}
		n := int64(binary.LittleEndian.Uint64(req[1:]))
		switch req[0] {
		case 'u':
			if err := drain(c, n, buf); err != nil {
				return
			}
		case 'd':
			for n > 0 {
				k := min(n, int64(len(buf)))
				if _, err := c.Write(buf[:k]); err != nil {
					return
				}
				n -= k
			}
			continue
		}
		if _, err := c.Write(req[:1]); err != nil {
			return
		}
	}
}

func (t *tcpServer) request(op byte, n int64) error {
	var req [9]byte
	req[0] = op
	binary.LittleEndian.PutUint64(req[1:], uint64(n))
	_, err := t.c.Write(req[:])
	return err
}

func (t *tcpServer) pingPong(n int) (latency, error) {
	var ack [1]byte
	d := make([]time.Duration, n)
	var sum time.Duration
	for i := range n {
		s := time.Now()
		if err := t.request('p', 0); err != nil {
			return latency{}, err
		}
		if _, err := io.ReadFull(t.c, ack[:]); err != nil {
			return latency{}, err
		}
		d[i] = time.Since(s)
		sum += d[i]
	}
	slices.Sort(d)
	return latency{P50us: us(int64(d[n/2])), P99us: us(int64(d[n*99/100])), MeanUs: us(int64(sum) / int64(n))}, nil
}

func (t *tcpServer) bulk(size int64, reps int) (pair, error) {
	buf := make([]byte, min(size, 1<<20))
	var ack [1]byte
	start := time.Now()
	for range reps {
		if err := t.request('u', size); err != nil {
			return pair{}, err
		}
		for n := size; n > 0; {
			k := min(n, int64(len(buf)))
			if _, err := t.c.Write(buf[:k]); err != nil {
				return pair{}, err
			}
			n -= k
		}
		if _, err := io.ReadFull(t.c, ack[:]); err != nil {
			return pair{}, err
		}
	}
	up := time.Since(start)
	start = time.Now()
	for range reps {
		if err := t.request('d', size); err != nil {
			return pair{}, err
		}
		if err := drain(t.c, size, buf); err != nil {
			return pair{}, err
		}
	}
	return pair{HtoD: gibps(size, reps, up), DtoH: gibps(size, reps, time.Since(start))}, nil
}

// drain reads n bytes from r into buf, over and over.
func drain(r io.Reader, n int64, buf []byte) error {
	for n > 0 {
		k, err := r.Read(buf[:min(n, int64(len(buf)))])
		n -= int64(k)
		if err != nil && n > 0 {
			return err
		}
	}
	return nil
}

func (t *tcpServer) close() {
	t.c.Close()
	t.l.Close()
	<-t.done
}
