// Package dataplanebench benchmarks the data plane (package dataplane: framed
// protobuf over QUIC) against a baseline of the same operations over plain
// TCP + TLS 1.3, side by side on loopback in one process: bulk throughput
// both ways, and exec round-trip latency.
//
// The data is generated from a seeded PRNG while it is sent and is never
// held in memory, so runs with the same --seed and --size move the same
// bytes; only the timings differ from run to run.
package dataplanebench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"

	"github.com/gpupool/gpupool/bench/report"
	"github.com/gpupool/gpupool/internal/quantity"
)

const usageHead = `Usage: gpupool-bench dataplane [flags]

Benchmarks the data plane (QUIC, package dataplane) against the same
operations over plain TCP + TLS 1.3, side by side on loopback:

  - bulk throughput: --size bytes of seeded pseudo-random data put from the
    client to a file on the server (hashed, written, fsynced, renamed), then
    got back (read, hashed, streamed);
  - exec latency: --execs runs of ` + "`true`" + ` on the server, from request to
    exit status, on one established connection per side.

Progress goes to stderr, a markdown table to stdout, and the results as JSON
to --out. Exit code 1 when the benchmark fails, 2 for a usage error.

Examples:
  gpupool-bench dataplane
  gpupool-bench dataplane --size 256MiB --execs 1000
  gpupool-bench dataplane --seed 7 --out /tmp/dataplane.json --tmpdir /var/tmp

Flags:
`

// maxExecs bounds --execs: enough for stable tails, small enough to end.
const maxExecs = 1_000_000

// options is a validated command line.
type options struct {
	size  int64  // bytes moved each way
	execs int    // timed exec runs per side
	seed  uint64 // seeds the data's PRNG
	out   string // the JSON results file
	tmp   string // parent of the run's directory; "" means os.TempDir()
}

// Run runs the benchmark for the command-line arguments args and returns
// the exit code: 0, 1 when the benchmark failed, 2 for a usage error.
// 'gpupool-bench dataplane' calls it.
func Run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	return run(ctx, args, stdout, stderr)
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	opts, err := parseFlags(args, stdout)
	if err != nil {
		return report.UsageExit(stderr, "dataplane", err)
	}
	res, err := benchmark(ctx, opts, report.NewProgress(stderr))
	if err != nil {
		return report.Fail(stderr, "dataplane", err)
	}
	writeTable(stdout, res)
	if err := writeJSON(opts.out, res); err != nil {
		return report.Fail(stderr, "dataplane", err)
	}
	fmt.Fprintf(stderr, "results written to %s\n", opts.out)
	return 0
}

// parseFlags parses and validates args. On --help it writes the usage to
// help and returns flag.ErrHelp.
func parseFlags(args []string, help io.Writer) (options, error) {
	fs := report.NewFlags("dataplane")
	size := sizeFlag(1 << 10)
	fs.Var(&size, "size", "the `size` of the data moved each way, a whole number of MiB: 1GiB, 256MiB, 8MiB (a plain number is MiB)")
	execs := fs.Int("execs", 200, fmt.Sprintf("the `number` of timed runs of true per side, after %d untimed warm-up runs each", warmupExecs))
	seed := fs.Uint64("seed", 1, "seed of the PRNG that generates the data: the same seed and size move the same bytes")
	out := fs.String("out", "bench/results/dataplane.json", "file to write the results to as JSON; its directory is created")
	tmp := fs.String("tmpdir", "", "`dir`ectory for the run's certificate and received files, the same for both sides (default $TMPDIR or /tmp)")

	if err := report.ParseFlags(fs, args, usageHead, help); err != nil {
		return options{}, err
	}
	switch {
	case size == 0:
		return options{}, errors.New("--size 0: must be at least 1MiB")
	case *execs < 1 || *execs > maxExecs:
		return options{}, fmt.Errorf("--execs %d: must be between 1 and %d", *execs, maxExecs)
	case !strings.HasSuffix(*out, ".json") || *out == ".json":
		return options{}, fmt.Errorf("--out %q: must name a .json file, e.g. bench/results/dataplane.json", *out)
	}
	return options{size: int64(size) << 20, execs: *execs, seed: *seed, out: *out, tmp: *tmp}, nil
}

// sizeFlag is a size in MiB, parsed as the rest of gpupool parses memory
// sizes.
type sizeFlag int64

func (s *sizeFlag) String() string { return quantity.FormatMiB(int64(*s)) }

func (s *sizeFlag) Set(v string) error {
	mib, err := quantity.ParseMemoryMiB(v)
	if err != nil {
		var qe *quantity.Error
		if errors.As(err, &qe) {
			return errors.New(qe.Reason)
		}
		return err
	}
	*s = sizeFlag(mib)
	return nil
}
