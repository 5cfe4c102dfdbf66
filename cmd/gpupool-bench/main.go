// Command gpupool-bench runs gpupool's benchmarks. It is a binary of its
// own so that the product binary, gpupool, links none of them (nor the
// etcd client the lease benchmark compares against).
package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"

	consolebench "github.com/gpupool/gpupool/bench/console"
	cudabench "github.com/gpupool/gpupool/bench/cuda"
	dataplanebench "github.com/gpupool/gpupool/bench/dataplane"
	failoverbench "github.com/gpupool/gpupool/bench/failover"
	floodbench "github.com/gpupool/gpupool/bench/flood"
	leasebench "github.com/gpupool/gpupool/bench/lease"
	placementbench "github.com/gpupool/gpupool/bench/placement"
	scalebench "github.com/gpupool/gpupool/bench/scale"
)

// benchmark is one of the harness's benchmarks: its package's Run, which
// parses its own flags and returns an exit code.
type benchmark struct {
	name, short string
	run         func(ctx context.Context, args []string, stdout, stderr io.Writer) int
}

// benchmarks lists the benchmarks in the order 'make bench' runs them.
var benchmarks = []benchmark{
	{"placement", "the placement engine replays the four Alibaba openb traces beside a reference of the FGD paper's experiment: unallocated GPU share per policy, a mix-shift replay, placements/s from 1k to 100k hosts", placementbench.Run},
	{"lease", "acquire+release of a fractional slice on 3 gpupool brokers against an allocator on a 3-member etcd cluster, 1-256 clients", leasebench.Run},
	{"failover", "kill -9 the leader under steady acquire load, 10 times: time to the next acquire, acknowledged leases lost", failoverbench.Run},
	{"scale", "one broker with 10k hosts, 80k GPUs and 100k leases: memory, snapshot size and time, restart-to-ready", scalebench.Run},
	{"churn", "one broker's memory at 0, 10k and 100k leases and under acquire/release churn (up to 1M cycles): is the state bounded?", scalebench.RunChurn},
	{"dataplane", "the QUIC data plane against TCP+TLS on loopback: bulk throughput and exec latency", dataplanebench.Run},
	{"cuda", "remote CUDA through the shim, proxy and QUIC data plane against raw TCP and the data plane's own get/put: null call, pipelined launches, copies, release to failure", cudabench.Run},
	{"console", "the web console's pool page on 10k hosts: server render, browser to first full render (goal 2 s), live update", consolebench.Run},
	{"slowdisk", "one broker's Raft log writes slowed by 10ms, 100ms, 1s (a follower's, then the leader's) under acquire load: grants/s, p99, leadership handover", failoverbench.RunSlowDisk},
	{"flood", "one token floods acquires and streams while another acquires: its p99 with and without the flood; 8,000 waiting acquires of one tenant opened and cancelled", floodbench.Run},
}

func benchmarkNames() string {
	var names []string
	for _, b := range benchmarks {
		names = append(names, b.name)
	}
	return strings.Join(names, ", ")
}

func usage() string {
	var b strings.Builder
	b.WriteString(`Usage: gpupool-bench NAME [flags]

Runs one of gpupool's benchmarks, each a side-by-side comparison with the
baseline a user would pick instead, in one run. Each prints progress to
stderr and writes JSON, a markdown table and, where a curve says more, a PNG
to bench/results (most take --out). Runs are seeded and repeatable.
Benchmarks never run in 'make test'; 'make bench' runs all of them.

Benchmarks:
`)
	for _, bm := range benchmarks {
		fmt.Fprintf(&b, "  %-10s %s\n", bm.name, bm.short)
	}
	b.WriteString(`
'gpupool-bench NAME --help' shows a benchmark's flags.

Examples:
  gpupool-bench placement --policy all --seeds 10
  gpupool-bench lease --clients 1,16 --duration 5s
  gpupool-bench dataplane --size 256MiB
`)
	return b.String()
}

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

// run runs the benchmark args name and returns the exit code: the
// benchmark's own, or 2 for a missing or unknown name.
func run(args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprintf(stderr, "error: name a benchmark: %s\n\n%s", benchmarkNames(), usage())
		return 2
	}
	switch args[0] {
	case "-h", "--help", "help":
		fmt.Fprint(stdout, usage())
		return 0
	}
	for _, b := range benchmarks {
		if b.name == args[0] {
			ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			return b.run(ctx, args[1:], stdout, stderr)
		}
	}
	fmt.Fprintf(stderr, "error: unknown benchmark %q: must be one of %s\n", args[0], benchmarkNames())
	return 2
}
