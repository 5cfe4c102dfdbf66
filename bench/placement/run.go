// Package placement is the placement benchmark (issue 7): the broker's placement engine
// replays the Alibaba openb GPU-sharing trace the way the FGD paper (Weng et al., USENIX
// ATC '23) does, for each policy and seed, and reports the unallocated GPU share as the
// arrived GPU request grows, next to the paper's published figures. It also measures how
// many placements per second the engine makes on a large synthetic pool.
//
// The replay protocol is described in bench/traces/openb/README.md (the traces and their
// README ship in the repository with the placement work); the deviations from it are listed
// in the report.
package placement

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"time"
)

// Default trace files, relative to the repository's root (where make runs
// the benchmark), used when they exist and the flags are not given.
const (
	defaultNodes = "bench/traces/openb/openb_node_list_gpu_node.csv"
	defaultPods  = "bench/traces/openb/openb_pod_list_default.csv"
)

const usage = `usage: placement [flags]

Replays the openb GPU trace through the broker's placement engine for each policy and seed,
and writes placement.json, placement.md and placement.png to --out.

Examples:
  placement                                   # every policy, seeds 42..51, the default trace
  placement --policy fgd,best-fit --seeds 2
  placement --pods openb_pod_list_gpushare40.csv --out /tmp/r

Flags:
`

type config struct {
	Nodes          string   `json:"nodes"`
	Pods           string   `json:"pods"`
	Trace          string   `json:"trace"`
	Seeds          []int64  `json:"seeds"`
	Inflate        float64  `json:"inflate"`
	Policies       []string `json:"policies"`
	Out            string   `json:"-"`
	SyntheticHosts int      `json:"synthetic_hosts"`
	SyntheticTasks int      `json:"synthetic_tasks"`
	Workers        int      `json:"workers"`
}

// Run runs the benchmark with command-line args (without the program name), writes progress
// to stderr and a summary to stdout. It returns 0 on success, 1 on failure and 2 on a usage
// error.
func Run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	cfg, err := parseFlags(args, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	if err != nil {
		fmt.Fprintf(stderr, "placement: %v\n", err)
		return 2
	}
	if err := run(ctx, cfg, stdout, stderr); err != nil {
		fmt.Fprintf(stderr, "placement: %v\n", err)
		return 1
	}
	return 0
}

func parseFlags(args []string, stderr io.Writer) (*config, error) {
	fs := flag.NewFlagSet("placement", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() { fmt.Fprint(stderr, usage); fs.PrintDefaults() }
	cfg := &config{}
	var seeds int
	var policy string
	fs.StringVar(&cfg.Nodes, "nodes", "", "node list CSV (default "+defaultNodes+" when it exists)")
	fs.StringVar(&cfg.Pods, "pods", "", "pod list CSV (default "+defaultPods+" when it exists)")
	fs.IntVar(&seeds, "seeds", 10, "number of seeds, from 42")
	fs.Float64Var(&cfg.Inflate, "inflate", 1.3, "offer tasks until they ask for this multiple of the GPU capacity")
	fs.StringVar(&policy, "policy", "all", "policy, comma-separated policies, or all: "+strings.Join(benchPolicies, ", "))
	fs.StringVar(&cfg.Out, "out", "bench/results", "directory for placement.json, .md and .png")
	fs.IntVar(&cfg.SyntheticHosts, "synthetic-hosts", 10000, "hosts (8 GPUs each) of the pool for placements/s; 0 skips it")
	fs.IntVar(&cfg.SyntheticTasks, "synthetic-tasks", 2000, "placements per policy for placements/s")
	fs.IntVar(&cfg.Workers, "workers", runtime.NumCPU(), "replays run at once")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	switch {
	case fs.NArg() > 0:
		return nil, fmt.Errorf("unexpected argument %q: placement takes flags only", fs.Arg(0))
	case seeds < 1:
		return nil, fmt.Errorf("--seeds %d: must be at least 1", seeds)
	case !(cfg.Inflate >= 0.75 && cfg.Inflate <= 10):
		return nil, fmt.Errorf("--inflate %v: must be between 0.75 and 10", cfg.Inflate)
	case cfg.SyntheticHosts < 0 || cfg.SyntheticTasks < 1:
		return nil, fmt.Errorf("--synthetic-hosts %d, --synthetic-tasks %d: must be at least 0 and 1", cfg.SyntheticHosts, cfg.SyntheticTasks)
	case cfg.Workers < 1:
		return nil, fmt.Errorf("--workers %d: must be at least 1", cfg.Workers)
	}
	for i := range seeds {
		cfg.Seeds = append(cfg.Seeds, int64(42+i))
	}
	var err error
	if cfg.Policies, err = parsePolicies(policy); err != nil {
		return nil, err
	}
	for _, f := range []struct {
		name string
		v    *string
		def  string
	}{{"nodes", &cfg.Nodes, defaultNodes}, {"pods", &cfg.Pods, defaultPods}} {
		if *f.v != "" {
			continue
		}
		if _, err := os.Stat(f.def); err != nil {
			return nil, fmt.Errorf("--%s: not given, and the default %s does not exist: name the openb CSV file", f.name, f.def)
		}
		*f.v = f.def
	}
	cfg.Trace = traceName(cfg.Pods)
	return cfg, nil
}

// parsePolicies reads --policy: "all" or comma-separated names.
func parsePolicies(s string) ([]string, error) {
	if s == "all" {
		return slices.Clone(benchPolicies), nil
	}
	var out []string
	for p := range strings.SplitSeq(s, ",") {
		p = strings.TrimSpace(p)
		if !slices.Contains(benchPolicies, p) {
			return nil, fmt.Errorf("--policy %q: unknown policy %q: must be all or one or more of %s",
				s, p, strings.Join(benchPolicies, ", "))
		}
		if !slices.Contains(out, p) {
			out = append(out, p)
		}
	}
	return out, nil
}

// traceName is the trace variant of an openb pod list: "default", "gpushare40", … or the
// file's base name without extension.
func traceName(pods string) string {
	base := strings.TrimSuffix(filepath.Base(pods), filepath.Ext(pods))
	return strings.TrimPrefix(base, "openb_pod_list_")
}

func run(ctx context.Context, cfg *config, stdout, stderr io.Writer) error {
	start := time.Now()
	nodes, err := loadNodes(cfg.Nodes)
	if err != nil {
		return err
	}
	tasks, err := loadTasks(cfg.Pods)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(cfg.Out, 0o755); err != nil {
		return err
	}
	arrivals := make([]*arrival, len(cfg.Seeds))
	for i, s := range cfg.Seeds {
		arrivals[i] = arrive(nodes, tasks, s, cfg.Inflate)
	}
	fmt.Fprintf(stderr, "placement: %s: %d nodes, %d tasks (%d offered per seed), %d policies × %d seeds on %d workers\n",
		cfg.Trace, len(nodes), len(tasks), len(arrivals[0].tasks), len(cfg.Policies), len(cfg.Seeds), cfg.Workers)

	outcomes, err := replayAll(ctx, cfg, nodes, arrivals, stderr)
	if err != nil {
		return err
	}
	replaySeconds := time.Since(start).Seconds()
	rates := map[string]float64{}
	if cfg.SyntheticHosts > 0 {
		for _, p := range cfg.Policies {
			r, err := throughput(ctx, cfg, nodes, arrivals[0], p)
			if err != nil {
				return err
			}
			fmt.Fprintf(stderr, "placement: %s: %.0f placements/s on %d hosts\n", p, r, cfg.SyntheticHosts)
			rates[p] = r
		}
	}
	rep := newReport(cfg, outcomes, rates, replaySeconds, time.Since(start).Seconds())
	paths, err := rep.write(cfg.Out)
	if err != nil {
		return err
	}
	fmt.Fprint(stdout, rep.markdown())
	fmt.Fprintf(stdout, "\nwrote %s\n", strings.Join(paths, ", "))
	return nil
}

// replayAll replays every policy on every seed, cfg.Workers at a time, and returns the
// outcomes by policy, in seed order.
func replayAll(ctx context.Context, cfg *config, nodes []node, arrivals []*arrival, stderr io.Writer) (map[string][]*outcome, error) {
	type job struct {
		policy string
		a      int
	}
	var jobs []job
	for _, p := range cfg.Policies {
		for i := range arrivals {
			jobs = append(jobs, job{p, i})
		}
	}
	out := make(map[string][]*outcome)
	for _, p := range cfg.Policies {
		out[p] = make([]*outcome, len(arrivals))
	}
	var (
		mu       sync.Mutex // guards out, done, firstErr and writes to stderr
		done     int
		firstErr error
		wg       sync.WaitGroup
	)
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	ch := make(chan job)
	for range cfg.Workers {
		wg.Go(func() {
			for j := range ch {
				a := arrivals[j.a]
				quarter := 0
				progress := func(f float64) {
					if q := int(f * 4); q > quarter {
						quarter = q
						mu.Lock()
						fmt.Fprintf(stderr, "placement: %s seed %d: %d%% done\n", j.policy, a.seed, 25*q)
						mu.Unlock()
					}
				}
				t0 := time.Now()
				o, err := replay(ctx, nodes, a, j.policy, progress)
				mu.Lock()
				if err != nil {
					if firstErr == nil {
						firstErr = err
					}
					cancel()
				} else {
					o.Seconds = time.Since(t0).Seconds()
					out[j.policy][j.a] = o
					done++
					fmt.Fprintf(stderr, "placement: [%d/%d] %s seed %d: unallocated %.2f%% at 100%% arrived, %.1fs\n",
						done, len(jobs), j.policy, a.seed, at(o.Unalloc, 100), o.Seconds)
				}
				mu.Unlock()
			}
		})
	}
	for _, j := range jobs {
		if ctx.Err() != nil {
			break
		}
		ch <- j
	}
	close(ch)
	wg.Wait()
	if firstErr != nil {
		return nil, firstErr
	}
	return out, ctx.Err()
}
