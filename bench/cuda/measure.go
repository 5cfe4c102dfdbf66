package cudabench

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpupool/gpupool/bench/report"
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

func benchmark(ctx context.Context, opts options, p *report.Progress) (*results, error) {
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
	rawQUIC, err := startQUIC(ctx, dir, dataplane.QUICConfig)
	if err != nil {
		return nil, err
	}
	defer rawQUIC.close()
	untunedQUIC, err := startQUIC(ctx, dir, defaultQUICConfig)
	if err != nil {
		return nil, err
	}
	defer untunedQUIC.close()
	unixp, err := startUnix(dir)
	if err != nil {
		return nil, err
	}
	defer unixp.close()
	var load [3]float64
	if b, err := os.ReadFile("/proc/loadavg"); err == nil {
		fmt.Sscanf(string(b), "%f %f %f", &load[0], &load[1], &load[2])
	}
	res := &results{
		Benchmark: "cuda",
		Env:       environment{GoVersion: runtime.Version(), OS: runtime.GOOS, Arch: runtime.GOARCH, CPUs: runtime.NumCPU(), LoadAverage: load[0]},
		Config:    config{Calls: opts.calls, Launches: opts.launches, Backend: opts.backend},
	}

	p.Logf("null calls: %d through the shim, and with the shim connected to the server directly; %d ping-pongs on TCP, QUIC and a unix socket", opts.calls, opts.calls)
	stopProfile, err := startProfile(opts.profile)
	if err != nil {
		return nil, err
	}
	res.Null, err = s.null(ctx, s.px.Path(), opts.calls)
	stopProfile()
	if err != nil {
		return nil, err
	}
	direct, err := startDirect(s.gpupool, s.arg, dir)
	if err != nil {
		return nil, err
	}
	res.DirectNull, err = s.null(ctx, direct.path, opts.calls)
	direct.close()
	if err != nil {
		return nil, err
	}
	if res.TCPPingPong, err = tcp.pingPong(opts.calls); err != nil {
		return nil, err
	}
	if res.QUICPingPong, err = rawQUIC.pingPong(opts.calls); err != nil {
		return nil, err
	}
	if res.UnixPingPong, err = unixp.pingPong(opts.calls); err != nil {
		return nil, err
	}

	p.Logf("pipelined launches: %d", opts.launches)
	out, err := s.run(ctx, "launch", s.ptx, strconv.Itoa(opts.launches))
	if err != nil {
		return nil, err
	}
	var k, ns int64
	if _, err := fmt.Sscanf(out, "launch %d %d", &k, &ns); err != nil {
		return nil, fmt.Errorf("the program's launch line %q: %v", out, err)
	}
	res.LaunchesPerSec = float64(k) / (float64(ns) / 1e9)

	for _, sz := range sizes {
		p.Logf("copies of %s: %d each way through the shim, raw TCP, raw QUIC (tuned and quic-go's defaults) and QUIC get/put", human(sz.bytes), sz.reps)
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
		if c.RawQUIC, err = rawQUIC.bulk(sz.bytes, sz.reps); err != nil {
			return nil, err
		}
		if c.UntunedQUIC, err = untunedQUIC.bulk(sz.bytes, sz.reps); err != nil {
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

// null runs the program's null calls with its shim connected to socket.
func (s *stack) null(ctx context.Context, socket string, n int) (latency, error) {
	cmd := s.command(ctx, "null", strconv.Itoa(n))
	cmd.Env = append(cmd.Env, "GPUPOOL_CUDA_SOCKET="+socket)
	b, err := cmd.Output()
	if err != nil {
		return latency{}, fmt.Errorf("cudabench null: %v", err)
	}
	out := strings.TrimSpace(string(b))
	var p50, p99, mean int64
	if _, err := fmt.Sscanf(out, "null %d %d %d", &p50, &p99, &mean); err != nil {
		return latency{}, fmt.Errorf("the program's null line %q: %v", out, err)
	}
	return latency{P50us: us(p50), P99us: us(p99), MeanUs: us(mean)}, nil
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

// startProfile starts a CPU profile to path, if one is asked for, and
// returns what stops it.
func startProfile(path string) (func(), error) {
	if path == "" {
		return func() {}, nil
	}
	f, err := os.Create(path)
	if err != nil {
		return nil, fmt.Errorf("--cpuprofile: %w", err)
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		f.Close()
		return nil, fmt.Errorf("--cpuprofile: %w", err)
	}
	return func() { pprof.StopCPUProfile(); f.Close() }, nil
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
