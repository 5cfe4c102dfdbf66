// Package lease benchmarks gpupool's lease path against the allocator a
// team would write on etcd: three gpupool brokers (Raft on bbolt, fsync on)
// with four simulated agents, and a three-member etcd cluster (fsync on)
// running our first-fit allocator, each as separate processes on loopback.
// Both serve the same workload, acquire a fractional slice and release it,
// from several numbers of concurrent clients for a fixed time each.
//
// Run is the whole command; 'gpupool-bench lease' calls it.
package leasebench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/gpupool/gpupool/bench/report"
)

const usageHead = `Usage: gpupool-bench lease [flags]

Benchmarks gpupool's lease path against an allocator written on etcd:

  - gpupool: three brokers (--bootstrap-expect 3, Raft on bbolt with fsync)
    and four simulated agents (8xA100-80GB each), as child processes;
  - etcd: three members of --etcd (3.4.x, default fsync) and our allocator
    (bench/lease/allocator.go): one key per device, first fit, a
    compare-and-swap transaction on the device's mod revision, and an etcd
    lease for the TTL.

Each client loops: acquire a slice of 1 GiB and 1 % compute, then release
it. Each level of --clients runs for --warmup untimed, then --duration
timed, on gpupool then on etcd. Before each level, a loop of 4 KiB write +
fsync measures the data dirs' disk, the limit both are compared with.
Then, on a fresh gpupool cluster, one client sends --burst acquires at
once while --burst-clients others loop: the others' p99 during the burst
shows whether one caller can starve the rest.

Progress goes to stderr, a markdown table to stdout; DIR/lease.json,
DIR/lease.md and DIR/lease.png are written. Exit code 1 when the benchmark
fails, 2 for a usage error.

Examples:
  gpupool-bench lease
  gpupool-bench lease --clients 1,16 --duration 3s --out /tmp/lease
  gpupool-bench lease --gpupool /tmp/gpupool --etcd /usr/local/bin/etcd --tmpdir /var/tmp

Flags:
`

// maxClients bounds one level of --clients: each client is a goroutine
// with a request in flight, and the pool holds 2560 slices.
const maxClients = 1024

// maxBurst bounds --burst: each of its acquires is a goroutine.
const maxBurst = 100_000

// options is a validated command line.
type options struct {
	clients  []int         // concurrency levels, in the order given
	duration time.Duration // timed length of each level, per system
	warmup   time.Duration // untimed start of each level, per system
	out      string        // directory of lease.{json,md,png}
	gpupool  string        // the gpupool binary; "" builds one
	etcd     string        // the etcd binary
	tmp      string        // parent of the run's data dirs; "" means os.TempDir()
	profile  string        // directory of the brokers' profiles; "" takes none
	burst    int           // acquires one client sends at once after the levels; 0 skips
	others   int           // clients running beside the burst
}

// Run runs the benchmark for the command-line arguments args and returns
// the exit code: 0, 1 when the benchmark failed, 2 for a usage error.
// --help prints the usage to stdout and returns 0. Progress goes to
// stderr, the results table to stdout.
func Run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	opts, err := parseFlags(args, stdout)
	if err != nil {
		return report.UsageExit(stderr, "lease", err)
	}
	res, err := benchmark(ctx, opts, report.NewProgress(stderr))
	if err != nil {
		return report.Fail(stderr, "lease", err)
	}
	writeTable(stdout, res)
	if err := writeResults(opts.out, res); err != nil {
		return report.Fail(stderr, "lease", err)
	}
	fmt.Fprintf(stderr, "results written to %s/lease.{json,md,png}\n", opts.out)
	return 0
}

// parseFlags parses and validates args. On --help it writes the usage to
// help and returns flag.ErrHelp.
func parseFlags(args []string, help io.Writer) (options, error) {
	fs := report.NewFlags("lease")
	clients := fs.String("clients", "1,16,64,256", "concurrency `levels`, comma-separated, each between 1 and "+strconv.Itoa(maxClients))
	duration := fs.Duration("duration", 10*time.Second, "how long each level is timed, per system")
	warmup := fs.Duration("warmup", 2*time.Second, "untimed run before each level's timed run, per system")
	out := fs.String("out", "bench/results", "`dir`ectory to write lease.json, lease.md and lease.png to; created if missing")
	gpupool := fs.String("gpupool", "", "the gpupool `binary` (default: build ./cmd/gpupool into the run's temp dir)")
	etcd := fs.String("etcd", "/usr/bin/etcd", "the etcd `binary`, 3.4 or newer (bench/lease/install-etcd.sh installs Debian's)")
	profile := fs.String("profile", "", "`dir`ectory to write the brokers' CPU, mutex and block profiles to, taken over each level's timed window (gpupool-CLIENTS-BROKER.KIND.pprof; read with 'go tool pprof'), and each broker's Raft log writes and entries applied over it, to tell how many entries one fsync carried (gpupool-CLIENTS-batching.txt); empty takes none")
	burst := fs.Int("burst", 10000, "after the levels, `n` acquires one client sends at once (on gpupool, without quota) while --burst-clients others loop; 0 skips the burst")
	others := fs.Int("burst-clients", 16, "how many other clients loop acquire + release during the burst, between 1 and "+strconv.Itoa(maxClients))
	tmp := fs.String("tmpdir", "", "`dir`ectory for both clusters' data dirs, on a disk that honours fsync, not tmpfs (default $TMPDIR or /tmp)")

	if err := report.ParseFlags(fs, args, usageHead, help); err != nil {
		return options{}, err
	}
	levels, err := parseLevels(*clients)
	if err != nil {
		return options{}, err
	}
	switch {
	case *duration < 100*time.Millisecond:
		return options{}, fmt.Errorf("--duration %s: must be at least 100ms", *duration)
	case *warmup < 0:
		return options{}, fmt.Errorf("--warmup %s: must not be negative", *warmup)
	case *out == "":
		return options{}, errors.New("--out: must name a directory, e.g. bench/results")
	case *burst < 0 || *burst > maxBurst:
		return options{}, fmt.Errorf("--burst %d: must be between 0 (no burst) and %d", *burst, maxBurst)
	case *others < 1 || *others > maxClients:
		return options{}, fmt.Errorf("--burst-clients %d: must be between 1 and %d", *others, maxClients)
	case *etcd == "":
		return options{}, errors.New("--etcd: must name the etcd binary, e.g. /usr/bin/etcd")
	}
	return options{clients: levels, duration: *duration, warmup: *warmup, out: *out, gpupool: *gpupool, etcd: *etcd, tmp: *tmp, profile: *profile, burst: *burst, others: *others}, nil
}

// parseLevels parses --clients: distinct whole numbers between 1 and
// maxClients, comma-separated.
func parseLevels(s string) ([]int, error) {
	var levels []int
	for f := range strings.SplitSeq(s, ",") {
		f = strings.TrimSpace(f)
		n, err := strconv.Atoi(f)
		switch {
		case f == "":
			return nil, fmt.Errorf("--clients %q: empty level: give numbers separated by commas, e.g. 1,16,64", s)
		case err != nil:
			return nil, fmt.Errorf("--clients %q: level %q is not a whole number", s, f)
		case n < 1 || n > maxClients:
			return nil, fmt.Errorf("--clients %q: level %d must be between 1 and %d", s, n, maxClients)
		case slices.Contains(levels, n):
			return nil, fmt.Errorf("--clients %q: level %d is given twice", s, n)
		}
		levels = append(levels, n)
	}
	return levels, nil
}
