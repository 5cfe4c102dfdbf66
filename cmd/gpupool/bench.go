package main

import (
	"context"
	"io"
	"strings"

	"github.com/spf13/cobra"

	consolebench "github.com/gpupool/gpupool/bench/console"
	dataplanebench "github.com/gpupool/gpupool/bench/dataplane"
	failoverbench "github.com/gpupool/gpupool/bench/failover"
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
	{"placement", "the broker's placement engine replays the Alibaba openb trace: unallocated GPU share per policy, FGD included, and placements/s", placementbench.Run},
	{"lease", "acquire+release of a fractional slice on 3 gpupool brokers against an allocator on a 3-member etcd cluster, 1-256 clients", leasebench.Run},
	{"failover", "kill -9 the leader under steady acquire load, 10 times: time to the next acquire, acknowledged leases lost", failoverbench.Run},
	{"scale", "one broker with 10k hosts, 80k GPUs and 100k leases: memory, snapshot size and time, restart-to-ready", scalebench.Run},
	{"dataplane", "the QUIC data plane against TCP+TLS on loopback: bulk throughput and exec latency", dataplanebench.Run},
	{"console", "the web console's pool page on 10k hosts: server render, browser to first full render (goal 2 s), live update", consolebench.Run},
}

func benchmarkNames() string {
	var names []string
	for _, b := range benchmarks {
		names = append(names, b.name)
	}
	return strings.Join(names, ", ")
}

func newBenchCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "bench NAME [flags]",
		Short: "Run a benchmark; results go to bench/results/NAME.{json,md,png}",
		Long: `Bench runs one of gpupool's benchmarks, each a side-by-side comparison with
the baseline a user would pick instead, in one run. Each prints progress to
stderr and writes JSON, a markdown table and, where a curve says more, a PNG
to bench/results (most take --out). Runs are seeded and repeatable.
Benchmarks never run in 'make test'; 'make bench' runs all of them.

Benchmarks: ` + benchmarkNames() + `.
'gpupool bench NAME --help' shows a benchmark's flags.`,
		Example: `  gpupool bench placement --policy all --seeds 10
  gpupool bench lease --clients 1,16 --duration 5s
  gpupool bench dataplane --size 256MiB
  gpupool bench placement --help`,
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) == 0 {
				return usagef("name a benchmark: %s", benchmarkNames())
			}
			return usagef("unknown benchmark %q: must be one of %s", args[0], benchmarkNames())
		},
		RunE: func(*cobra.Command, []string) error { return nil },
	}
	for _, b := range benchmarks {
		cmd.AddCommand(&cobra.Command{
			Use:                b.name + " [flags]",
			Short:              b.short,
			DisableFlagParsing: true, // the benchmark parses its own
			RunE: func(cmd *cobra.Command, args []string) error {
				if code := b.run(cmd.Context(), args, cmd.OutOrStdout(), cmd.ErrOrStderr()); code != 0 {
					return &exitError{code: code} // it said why itself
				}
				return nil
			},
		})
	}
	return cmd
}
