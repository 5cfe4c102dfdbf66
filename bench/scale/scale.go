// Package scale benchmarks one gpupool broker holding a large pool: it
// registers --hosts hosts of --gpus-per-host GPUs through the agent API,
// grants --leases fractional leases with many concurrent clients, and
// reports the load rates, the broker's resident memory, the state
// snapshot's size and time, and how long the broker takes from a restart
// on its data dir until it serves again. Run calls it from a command line.
package scale

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"time"

	"github.com/gpupool/gpupool/bench/report"
)

const usageHead = `Usage: scale [flags]

Benchmarks one gpupool broker process (Raft log in bbolt, fsync on) holding a
large pool:

  1. registers --hosts hosts of --gpus-per-host simulated A100-80GB GPUs
     through the agent API (Register RPC, no agent processes: the broker runs
     with --heartbeat-ttl 1h so the hosts stay ready without heartbeats);
  2. grants --leases fractional leases (seeded random slices of 2-16 GiB and
     5-25 % compute, TTL 24h) with --clients concurrent clients, sending no
     new Acquire once --grant-budget is spent (the report then says how many
     were granted and how long the rest would take at the measured rate);
  3. reads the broker's resident memory (VmRSS, VmHWM from /proc);
  4. saves a snapshot through the operator API (SnapshotSave) and reports its
     size and time, and the newest Raft snapshot in the data dir;
  5. SIGKILLs the broker, restarts it on its data dir and times it until a
     consistent read answers and until an Acquire is granted.

Progress goes to stderr; scale.json and scale.md go to --out. Exit code 1
when the benchmark fails, 2 for a usage error.

Examples (the flags as given to Run):
  --hosts 1000 --leases 10000 --clients 16
  --grant-budget 0                      (grant every lease, however long)
  --gpupool ./bin/gpupool --out /tmp/results

Flags:
`

// options is a validated command line.
type options struct {
	hosts        int
	brokers      int
	gpusPerHost  int
	leases       int
	clients      int
	seed         uint64
	grantBudget  time.Duration // no new Acquire after this long; 0: none
	snapshotWait time.Duration // how long to wait for a Raft snapshot taken after the load
	out          string
	gpupool      string
	tmp          string
}

// Bounds of the flags.
const (
	maxHosts       = 1_000_000
	maxGPUsPerHost = 64 // what the agent's simulator allows per model
	maxLeases      = 10_000_000
	maxClients     = 1024
	// slicesPerGPU is how many of the largest slice (16 GiB) fit an 80 GiB GPU.
	slicesPerGPU = 5
)

// Run runs the benchmark for the command-line arguments args and returns
// the exit code: 0, 1 when the benchmark failed, 2 for a usage error.
// --help prints the usage to stdout and returns 0. Cancelling ctx stops the
// run and the broker it started.
func Run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	opts, err := parseFlags(args, stdout)
	if err != nil {
		return report.UsageExit(stderr, "scale", err)
	}
	p := report.NewProgress(stderr)
	res, err := benchmark(ctx, opts, p)
	if err != nil {
		return report.Fail(stderr, "scale", err)
	}
	if err := writeResults(opts.out, res, stdout); err != nil {
		return report.Fail(stderr, "scale", err)
	}
	p.Logf("results written to %s", filepath.Join(opts.out, resultsName(opts.brokers)+".{json,md}"))
	return 0
}

// parseFlags parses and validates args. On --help it writes the usage to
// help and returns flag.ErrHelp.
func parseFlags(args []string, help io.Writer) (options, error) {
	fs := report.NewFlags("scale")
	var o options
	fs.IntVar(&o.hosts, "hosts", 10000, "`number` of hosts to register")
	fs.IntVar(&o.brokers, "brokers", 1, "`number` of brokers: 1, or a cluster of 3 or 5 (the restart is measured on 1 only); results go to scale.{json,md} for 1 broker and scale-Nbrokers.{json,md} for N")
	fs.IntVar(&o.gpusPerHost, "gpus-per-host", 8, "`number` of GPUs per host")
	fs.IntVar(&o.leases, "leases", 100000, "`number` of leases to grant")
	fs.IntVar(&o.clients, "clients", 32, "`number` of concurrent clients registering and acquiring")
	fs.Uint64Var(&o.seed, "seed", 1, "seed of the lease sizes")
	fs.DurationVar(&o.grantBudget, "grant-budget", 10*time.Minute, "stop sending Acquires after this long and go on with the leases granted so far (0: grant them all however long it takes)")
	fs.DurationVar(&o.snapshotWait, "snapshot-wait", 0, "how long to wait after the load for Raft's own snapshot to cover it (the broker's Raft takes one within 2-4 s once 2048 entries are new; 0 reports the newest there is)")
	fs.StringVar(&o.out, "out", "bench/results", "`dir`ectory for scale.json and scale.md; created if missing")
	fs.StringVar(&o.gpupool, "gpupool", "", "`path` of a built gpupool binary (default: go build ./cmd/gpupool into the run's directory)")
	fs.StringVar(&o.tmp, "tmpdir", "", "`dir`ectory for the run's data dir and log (default $TMPDIR or /tmp)")
	if err := report.ParseFlags(fs, args, usageHead, help); err != nil {
		return options{}, err
	}
	return o, o.validate()
}

func (o options) validate() error {
	switch {
	case o.hosts < 1 || o.hosts > maxHosts:
		return fmt.Errorf("--hosts %d: must be between 1 and %d", o.hosts, maxHosts)
	case o.brokers != 1 && o.brokers != 3 && o.brokers != 5:
		return fmt.Errorf("--brokers %d: must be 1, 3 or 5", o.brokers)
	case o.gpusPerHost < 1 || o.gpusPerHost > maxGPUsPerHost:
		return fmt.Errorf("--gpus-per-host %d: must be between 1 and %d", o.gpusPerHost, maxGPUsPerHost)
	case o.leases < 1 || o.leases > maxLeases:
		return fmt.Errorf("--leases %d: must be between 1 and %d", o.leases, maxLeases)
	case o.leases > o.hosts*o.gpusPerHost*slicesPerGPU:
		return fmt.Errorf("--leases %d: must be at most %d (%d GPUs × %d slices of up to 16 GiB): add hosts", o.leases, o.hosts*o.gpusPerHost*slicesPerGPU, o.hosts*o.gpusPerHost, slicesPerGPU)
	case o.clients < 1 || o.clients > maxClients:
		return fmt.Errorf("--clients %d: must be between 1 and %d", o.clients, maxClients)
	case o.grantBudget < 0:
		return fmt.Errorf("--grant-budget %s: must be 0 (no budget) or more", o.grantBudget)
	case o.snapshotWait < 0:
		return fmt.Errorf("--snapshot-wait %s: must be 0 or more", o.snapshotWait)
	case o.out == "":
		return errors.New("--out: must name a directory, e.g. bench/results")
	}
	if o.gpupool != "" {
		if st, err := os.Stat(o.gpupool); err != nil || st.IsDir() {
			return fmt.Errorf("--gpupool %s: not a file; build one with go build -o PATH ./cmd/gpupool", o.gpupool)
		}
	}
	return nil
}
