package dataplanebench

import (
	"context"
	"crypto/tls"
	"encoding/binary"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"time"

	"github.com/gpupool/gpupool/bench/report"
	"github.com/gpupool/gpupool/dataplane"
	"github.com/gpupool/gpupool/internal/quantity"
)

// side is one of the two stacks compared: its server running on loopback
// with a directory of its own, and one client connection to it. Its
// methods are called one at a time.
type side interface {
	// name is how the output calls the side.
	name() string
	// does says what the side does for each operation, for the output.
	does() string
	// put sends the size bytes r holds to the file name in the server's
	// directory. When put returns without error the file is there, whole
	// and synced to disk. It returns the SHA-256 (hex) the server checked.
	put(ctx context.Context, r io.Reader, size int64, name string) (string, error)
	// get copies the file name in the server's directory to w and returns
	// its SHA-256 (hex), checked against the one the server computed.
	get(ctx context.Context, name string, w io.Writer) (string, error)
	// exec runs argv on the server and returns its exit code once it has
	// exited.
	exec(ctx context.Context, argv []string) (int, error)
	// close closes the client connection and stops the server.
	close() error
}

const (
	// warmupExecs untimed runs per side precede the timed ones.
	warmupExecs = 3
	// bulkFile is the file each side puts and then gets.
	bulkFile = "bulk.bin"
)

// execArgv is the command the exec benchmark runs.
var execArgv = []string{"true"}

// benchmark runs the whole comparison in a temporary directory under
// opts.tmp, which it removes.
func benchmark(ctx context.Context, opts options, p *report.Progress) (*results, error) {
	start := time.Now()
	dir, err := os.MkdirTemp(opts.tmp, "gpupool-dataplane-bench-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	p.Logf("working in %s", dir)

	cert, fp, err := dataplane.LoadOrCreateCert(filepath.Join(dir, "cert"))
	if err != nil {
		return nil, err
	}
	sides, err := startSides(ctx, cert, fp, dir)
	if err != nil {
		return nil, err
	}
	defer func() {
		for _, s := range sides {
			if err := s.close(); err != nil {
				p.Logf("stopping %s: %v", s.name(), err)
			}
		}
	}()

	res := &results{
		Benchmark: "dataplane",
		Config: config{
			SizeBytes:   opts.size,
			Seed:        opts.seed,
			Execs:       opts.execs,
			WarmupExecs: warmupExecs,
			ExecArgv:    execArgv,
		},
		Env: environment{GoVersion: runtime.Version(), OS: runtime.GOOS, Arch: runtime.GOARCH, CPUs: runtime.NumCPU()},
	}
	for _, s := range sides {
		res.Sides = append(res.Sides, sideInfo{Name: s.name(), Does: s.does()})
	}

	// Both puts come before both gets, so that each get finds its file in
	// the page cache alike.
	var puts, gets [2]bulkResult
	for i, s := range sides {
		if puts[i], err = measurePut(ctx, s, opts.size, opts.seed, p); err != nil {
			return nil, err
		}
	}
	for i, s := range sides {
		if gets[i], err = measureGet(ctx, s, opts.size, p); err != nil {
			return nil, err
		}
	}
	sum := puts[0].SHA256
	for i, r := range append(puts[:], gets[:]...) {
		if r.SHA256 != sum {
			return nil, fmt.Errorf("transfer %d of 4 moved data with sha256 %s, the first %s: the sides did not move the same bytes", i+1, r.SHA256, sum)
		}
	}
	res.DataSHA256 = sum

	lat, err := measureExecs(ctx, sides, opts.execs, p)
	if err != nil {
		return nil, err
	}

	res.Metrics = []metric{
		higher("put_throughput", "put throughput, client→server", "MiB/s", puts[0].MiBps, puts[1].MiBps),
		higher("get_throughput", "get throughput, server→client", "MiB/s", gets[0].MiBps, gets[1].MiBps),
	}
	ours, base := summarize(lat[0]), summarize(lat[1])
	res.Metrics = append(res.Metrics,
		lower("exec_p50", "exec latency p50", "ms", millis(ours.p50), millis(base.p50)),
		lower("exec_p90", "exec latency p90", "ms", millis(ours.p90), millis(base.p90)),
		lower("exec_p99", "exec latency p99", "ms", millis(ours.p99), millis(base.p99)),
		lower("exec_mean", "exec latency mean", "ms", millis(ours.mean), millis(base.mean)),
	)
	res.ElapsedSeconds = time.Since(start).Seconds()
	return res, nil
}

// startSides starts both sides, ours first, each in a directory of its
// own under dir. On error it stops what it started.
func startSides(ctx context.Context, cert tls.Certificate, certSHA256, dir string) ([]side, error) {
	ours, err := startQUIC(ctx, cert, certSHA256, filepath.Join(dir, "quic"))
	if err != nil {
		return nil, fmt.Errorf("starting the data plane: %w", err)
	}
	baseline, err := startTCPTLS(ctx, cert, certSHA256, filepath.Join(dir, "tcp-tls"))
	if err != nil {
		ours.close()
		return nil, fmt.Errorf("starting the TCP+TLS baseline: %w", err)
	}
	return []side{ours, baseline}, nil
}

// bulkResult is one timed transfer.
type bulkResult struct {
	Seconds float64
	MiBps   float64
	SHA256  string
}

func newBulkResult(size int64, elapsed time.Duration, sum string) bulkResult {
	return bulkResult{
		Seconds: elapsed.Seconds(),
		MiBps:   float64(size) / (1 << 20) / elapsed.Seconds(),
		SHA256:  sum,
	}
}

// measurePut times putting size bytes of the data seeded by seed through s,
// generating them on the way.
func measurePut(ctx context.Context, s side, size int64, seed uint64, p *report.Progress) (bulkResult, error) {
	what := fmt.Sprintf("put %s over %s", formatBytes(size), s.name())
	r := &meteredReader{r: newData(seed, size), m: newMeter(p, what, size)}
	start := time.Now()
	sum, err := s.put(ctx, r, size, bulkFile)
	elapsed := time.Since(start)
	if err != nil {
		return bulkResult{}, fmt.Errorf("%s: %w", what, err)
	}
	res := newBulkResult(size, elapsed, sum)
	p.Logf("%s: %.2fs, %.1f MiB/s", what, res.Seconds, res.MiBps)
	return res, nil
}

// measureGet times getting back the file measurePut put through s.
func measureGet(ctx context.Context, s side, size int64, p *report.Progress) (bulkResult, error) {
	what := fmt.Sprintf("get %s over %s", formatBytes(size), s.name())
	w := &meteredWriter{w: io.Discard, m: newMeter(p, what, size)}
	start := time.Now()
	sum, err := s.get(ctx, bulkFile, w)
	elapsed := time.Since(start)
	if err != nil {
		return bulkResult{}, fmt.Errorf("%s: %w", what, err)
	}
	if w.n != size {
		return bulkResult{}, fmt.Errorf("%s: received %d bytes, want %d", what, w.n, size)
	}
	res := newBulkResult(size, elapsed, sum)
	p.Logf("%s: %.2fs, %.1f MiB/s", what, res.Seconds, res.MiBps)
	return res, nil
}

// newData returns a reader of size bytes generated from seed: the same
// seed always gives the same bytes.
func newData(seed uint64, size int64) io.Reader {
	var key [32]byte
	binary.LittleEndian.PutUint64(key[:], seed)
	return io.LimitReader(rand.NewChaCha8(key), size)
}

// measureExecs times n runs of execArgv on each side, after warmupExecs
// untimed runs each. The sides alternate run by run, so that the machine's
// load drifting during the benchmark weighs on both alike. It returns the
// latencies of each side, in the order of sides.
func measureExecs(ctx context.Context, sides []side, n int, p *report.Progress) ([][]time.Duration, error) {
	lat := make([][]time.Duration, len(sides))
	p.Logf("exec %q: %d warm-up and %d timed runs per side, alternating", execArgv, warmupExecs, n)
	for i := range warmupExecs + n {
		for j, s := range sides {
			start := time.Now()
			code, err := s.exec(ctx, execArgv)
			elapsed := time.Since(start)
			if err != nil {
				return nil, fmt.Errorf("exec %q over %s: %w", execArgv, s.name(), err)
			}
			if code != 0 {
				return nil, fmt.Errorf("exec %q over %s: exit code %d, want 0", execArgv, s.name(), code)
			}
			if i >= warmupExecs {
				lat[j] = append(lat[j], elapsed)
			}
		}
		if done := i + 1 - warmupExecs; done > 0 && done%max(n/4, 1) == 0 && done < n {
			p.Logf("exec: %d/%d timed runs per side", done, n)
		}
	}
	for j, s := range sides {
		st := summarize(lat[j])
		p.Logf("exec over %s: p50 %s, p90 %s, p99 %s, mean %s", s.name(), st.p50, st.p90, st.p99, st.mean)
	}
	return lat, nil
}

// latencyStats summarizes latencies.
type latencyStats struct {
	p50, p90, p99, mean time.Duration
}

// summarize returns the percentiles (nearest rank) and mean of d, which
// must not be empty.
func summarize(d []time.Duration) latencyStats {
	sorted := slices.Sorted(slices.Values(d))
	var sum time.Duration
	for _, x := range sorted {
		sum += x
	}
	return latencyStats{
		p50:  percentile(sorted, 50),
		p90:  percentile(sorted, 90),
		p99:  percentile(sorted, 99),
		mean: sum / time.Duration(len(sorted)),
	}
}

// percentile is the nearest-rank q-th percentile of sorted, which must not
// be empty: the smallest value that at least q% of the values do not
// exceed.
func percentile(sorted []time.Duration, q int) time.Duration {
	rank := int(math.Ceil(float64(q) / 100 * float64(len(sorted))))
	return sorted[max(rank, 1)-1]
}

func millis(d time.Duration) float64 {
	return float64(d) / float64(time.Millisecond)
}

// formatBytes formats a size for progress lines: "1 GiB", "8 MiB", or
// bytes when it is not a whole number of MiB.
func formatBytes(n int64) string {
	if n%(1<<20) == 0 {
		return quantity.FormatMiB(n >> 20)
	}
	return fmt.Sprintf("%d bytes", n)
}
