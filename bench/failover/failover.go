// Package failover benchmarks leader failover of a three-broker gpupool
// cluster: real broker processes with their Raft logs in bbolt (fsync on)
// and two simulated agents. Under steady Acquire load it SIGKILLs the
// leader, measures the time from the kill to the next successful Acquire,
// restarts the killed broker on its data dir, and checks that no lease
// whose Acquire returned OK is gone. Run calls it from a command line.
package failover

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

const usageHead = `Usage: failover [flags]

Benchmarks leader failover of a three-broker gpupool cluster (real broker
processes on 127.0.0.2-4, Raft log in bbolt with fsync, two simulated agents
with 8xA100-80GB each). Each round:

  1. --clients clients acquire 1 GiB / 1 % slices with fresh request ids,
     each releasing a random lease of its own once it holds more than --hold;
  2. after --settle, the leader is killed with SIGKILL;
  3. the round measures the time from the kill to the first Acquire that was
     sent after the kill and returned OK, and keeps the load on for --settle;
  4. the load stops, the killed broker restarts on its data dir, and the
     round waits until it has caught up with the leader;
  5. every lease whose Acquire ever returned OK, and that its client did not
     release, must still be granted (consistent List from the leader, and a
     local List on the restarted broker).

Progress goes to stderr; failover.json, failover.md and failover.png go to
--out. Exit code 1 when the benchmark fails or loses an acknowledged lease
(their ids are printed), 2 for a usage error.

Examples (the flags as given to Run):
  --rounds 3 --clients 4
  --gpupool ./bin/gpupool --out /tmp/results
  --restart-agents --timeout 20s

Flags:
`

// options is a validated command line.
type options struct {
	rounds  int
	clients int
	hold    int           // leases each client holds before releasing one
	settle  time.Duration // load before the kill and after the first acquire
	timeout time.Duration // bound on each wait in a round
	ttl     time.Duration // the leases' TTL; they are never renewed
	seed    uint64
	out     string // results directory
	gpupool string // prebuilt binary; "" builds one
	tmp     string // parent of the run's directory
	// restartAgents restarts the agents after each kill, before the
	// check: a workaround for agents whose heartbeat stream hangs.
	restartAgents bool
}

// Bounds of the flags: small enough to end, large enough to mean something.
const (
	maxRounds  = 1000
	maxClients = 256
	maxHold    = 1000
)

// Run runs the benchmark for the command-line arguments args and returns
// the exit code: 0, 1 when the benchmark failed or lost a lease, 2 for a
// usage error. --help prints the usage to stdout and returns 0. Cancelling
// ctx stops the run and every process it started.
func Run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	opts, err := parseFlags(args, stdout)
	if err != nil {
		return report.UsageExit(stderr, "failover", err)
	}
	p := report.NewProgress(stderr)
	res, err := benchmark(ctx, opts, p)
	if res != nil {
		if werr := writeResults(opts.out, res, stdout); werr != nil {
			return report.Fail(stderr, "failover", werr)
		}
		p.Logf("results written to %s", filepath.Join(opts.out, "failover.{json,md,png}"))
	}
	if err != nil {
		return report.Fail(stderr, "failover", err)
	}
	if len(res.Summary.LostLeaseIDs) > 0 {
		fmt.Fprintf(stderr, "bench/failover: %d acknowledged leases lost:\n", len(res.Summary.LostLeaseIDs))
		for _, l := range res.Summary.LostLeaseIDs {
			fmt.Fprintf(stderr, "  %s\n", l)
		}
		return 1
	}
	return 0
}

// parseFlags parses and validates args. On --help it writes the usage to
// help and returns flag.ErrHelp.
func parseFlags(args []string, help io.Writer) (options, error) {
	fs := report.NewFlags("failover")
	var o options
	fs.IntVar(&o.rounds, "rounds", 10, "`number` of leader kills")
	fs.IntVar(&o.clients, "clients", 8, "`number` of concurrent acquiring clients")
	fs.IntVar(&o.hold, "hold", 16, "`number` of leases each client holds before it releases a random one of them")
	fs.DurationVar(&o.settle, "settle", 2*time.Second, "how long the load runs before the kill, and again after the first acquire after it")
	fs.DurationVar(&o.timeout, "timeout", 60*time.Second, "bound on each wait of a round: for an acquire after the kill, for the restarted broker to catch up")
	fs.DurationVar(&o.ttl, "ttl", 30*time.Minute, "TTL of the leases, never renewed: must outlast the run")
	fs.Uint64Var(&o.seed, "seed", 1, "seed of the clients' choice of which lease to release")
	fs.StringVar(&o.out, "out", "bench/results", "`dir`ectory for failover.json, failover.md and failover.png; created if missing")
	fs.StringVar(&o.gpupool, "gpupool", "", "`path` of a built gpupool binary (default: go build ./cmd/gpupool into the run's directory)")
	fs.BoolVar(&o.restartAgents, "restart-agents", false, "restart both agents after each kill, once the load stops and before the killed broker restarts: "+
		"works around agents whose heartbeat stream hangs when the leader dies (their hosts then go down after --heartbeat-ttl, 10s, and their leases are lost)")
	fs.StringVar(&o.tmp, "tmpdir", "", "`dir`ectory for the run's data dirs and logs (default $TMPDIR or /tmp)")
	if err := report.ParseFlags(fs, args, usageHead, help); err != nil {
		return options{}, err
	}
	if err := o.validate(); err != nil {
		return options{}, err
	}
	return o, nil
}

func (o options) validate() error {
	switch {
	case o.rounds < 1 || o.rounds > maxRounds:
		return fmt.Errorf("--rounds %d: must be between 1 and %d", o.rounds, maxRounds)
	case o.clients < 1 || o.clients > maxClients:
		return fmt.Errorf("--clients %d: must be between 1 and %d", o.clients, maxClients)
	case o.hold < 1 || o.hold > maxHold:
		return fmt.Errorf("--hold %d: must be between 1 and %d", o.hold, maxHold)
	case o.clients*(o.hold+1) > poolSlices:
		return fmt.Errorf("--clients %d × (--hold %d + 1): must stay within the pool's %d slices of 1 GiB", o.clients, o.hold, poolSlices)
	case o.settle < 100*time.Millisecond:
		return fmt.Errorf("--settle %s: must be at least 100ms", o.settle)
	case o.timeout < time.Second:
		return fmt.Errorf("--timeout %s: must be at least 1s", o.timeout)
	case o.ttl < time.Minute:
		return fmt.Errorf("--ttl %s: must be at least 1m, and outlast the run", o.ttl)
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
