// Package cudabench benchmarks remote CUDA ('gpupool-bench cuda', make
// bench-cuda): a C program on gpupool's shim (libcuda.so.1), through the
// local proxy and the QUIC data plane, to the lease's CUDA server started
// as the agent starts it ('gpupool agent cuda-server', simulated backend),
// side by side in one run with the baselines on the same loopback: a raw
// TCP ping-pong and bulk copy, and the data plane's own QUIC get and put.
package cudabench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"

	"github.com/gpupool/gpupool/bench/report"
)

const usageHead = `Usage: gpupool-bench cuda [flags]

Benchmarks remote CUDA on loopback: a C program on gpupool's libcuda.so.1,
through the local proxy and a real QUIC data plane, to the lease's CUDA
server run as the agent runs it ('gpupool agent cuda-server', simulated
GPU), side by side in one run with:

  - a raw TCP ping-pong (the loopback's round trip) for the null call;
  - a raw TCP bulk copy and the data plane's own QUIC get and put for the
    copies, at 4 KiB, 1 MiB and 256 MiB.

It measures a null synchronising call (p50, p99), pipelined launches per
second, copies each way in GiB/s, and the delay from the lease's release
on the agent to the program's first failed call. Progress goes to stderr,
a markdown table to stdout and to OUT/cuda.md, the results as JSON to
OUT/cuda.json. Exit code 1 when the benchmark fails, 2 for a usage error.
Needs gcc (the C program) and the gpupool binary (make build).

Examples:
  gpupool-bench cuda --gpupool bin/gpupool
  gpupool-bench cuda --gpupool bin/gpupool --calls 2000 --launches 20000 --out /tmp/cuda
  gpupool-bench cuda --gpupool bin/gpupool --backend real --out bench/results/gpu
  gpupool-bench cuda --gpupool bin/gpupool --cpuprofile /tmp/null.pprof --out /tmp/cuda

Flags:
`

type options struct {
	gpupool  string // the gpupool binary: its 'agent cuda-server'
	calls    int    // timed null calls, and TCP ping-pongs
	launches int    // timed pipelined launches
	out      string // the results' directory
	backend  string // the lease server's backend: simulated or real
	profile  string // a file for the CPU profile of the null calls, or ""
}

// Run runs the benchmark for args and returns the exit code: 0, 1 when the
// benchmark failed, 2 for a usage error.
func Run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	opts, err := parseFlags(args, stdout)
	if err != nil {
		return report.UsageExit(stderr, "cuda", err)
	}
	res, err := benchmark(ctx, opts, report.NewProgress(stderr))
	if err != nil {
		return report.Fail(stderr, "cuda", err)
	}
	if err := write(opts.out, res, stdout); err != nil {
		return report.Fail(stderr, "cuda", err)
	}
	fmt.Fprintf(stderr, "results written to %s/cuda.json and %s/cuda.md\n", opts.out, opts.out)
	return 0
}

func parseFlags(args []string, help io.Writer) (options, error) {
	fs := report.NewFlags("cuda")
	gpupool := fs.String("gpupool", "bin/gpupool", "the gpupool `binary` whose 'agent cuda-server' serves the lease (make build)")
	calls := fs.Int("calls", 20000, "the `number` of timed null calls, and of TCP ping-pongs: 100 to 10000000")
	launches := fs.Int("launches", 200000, "the `number` of timed pipelined launches: 1000 to 100000000")
	out := fs.String("out", "bench/results", "the `directory` cuda.json and cuda.md go to; created")
	profile := fs.String("cpuprofile", "", "write a CPU profile of this process (the proxy, the data plane and the agent's splice) while the program makes its null calls through them to `file` (go tool pprof reads it)")
	backend := fs.String("backend", "simulated", "the lease server's `backend`: simulated, or real (this machine's GPU 0 through its libcuda.so.1; make test-gpu)")
	if err := report.ParseFlags(fs, args, usageHead, help); err != nil {
		return options{}, err
	}
	switch {
	case *calls < 100 || *calls > 10_000_000:
		return options{}, fmt.Errorf("--calls %d: must be between 100 and 10000000", *calls)
	case *launches < 1000 || *launches > 100_000_000:
		return options{}, fmt.Errorf("--launches %d: must be between 1000 and 100000000", *launches)
	case *backend != "simulated" && *backend != "real":
		return options{}, fmt.Errorf("--backend %q: must be simulated or real", *backend)
	case *out == "":
		return options{}, errors.New("--out: must name a directory, e.g. bench/results")
	}
	if st, err := os.Stat(*gpupool); err != nil || st.IsDir() {
		return options{}, fmt.Errorf("--gpupool %s: not a file (make build writes bin/gpupool)", *gpupool)
	}
	return options{gpupool: *gpupool, calls: *calls, launches: *launches, out: *out, backend: *backend, profile: *profile}, nil
}
