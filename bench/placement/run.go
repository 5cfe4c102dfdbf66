// Package placement is the placement benchmark: the broker's placement engine
// replays the Alibaba openb GPU-sharing trace the way the FGD paper (Weng et al., USENIX
// ATC '23) does, for each policy and seed, and reports the unallocated GPU share as the
// arrived GPU request grows, next to the paper's published figures. It also measures how
// many placements per second the engine makes on a large synthetic pool.
//
// The traces ship in bench/traces/openb (CC BY 4.0, see the README there); the replay
// protocol is in bench/README.md.
package placement

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	benchreport "github.com/gpupool/gpupool/bench/report"

	"github.com/gpupool/gpupool/broker/placement"
)

// tracesDir is where the openb traces are, relative to the repository's root: the default of
// --traces.
const tracesDir = "bench/traces/openb"

// Trace files in the traces directory: the node list and the pod lists replayed by default.
const nodesFile = "openb_node_list_gpu_node.csv"

var podsFiles = []string{"openb_pod_list_default.csv", "openb_pod_list_gpushare40.csv",
	"openb_pod_list_gpuspec10.csv", "openb_pod_list_multigpu20.csv"}

// defaultTraces is tracesDir under the repository that holds the working directory: the first
// directory upwards with a go.mod naming this module. It returns tracesDir itself (relative)
// when there is none, so the error names the path tried.
func defaultTraces() string {
	dir, err := os.Getwd()
	if err != nil {
		return tracesDir
	}
	for {
		if b, err := os.ReadFile(filepath.Join(dir, "go.mod")); err == nil && bytes.Contains(b, []byte("module "+modulePath+"\n")) {
			return filepath.Join(dir, tracesDir)
		}
		up := filepath.Dir(dir)
		if up == dir {
			return tracesDir
		}
		dir = up
	}
}

// modulePath is the repository's Go module.
const modulePath = "github.com/gpupool/gpupool"

const usage = `usage: placement [flags]

Replays the openb GPU traces (bench/traces/openb) through the broker's placement engine for
each policy and seed, as the FGD paper's experiment does, beside a reference of that
experiment; then a replay whose mix shifts halfway (the first two traces), and the default
policy's placement rate on synthetic pools (--synthetic-hosts, --scale-hosts). Writes
placement.json, placement.md, placement-TRACE.png and placement-scale.png to --out.

Examples:
  placement                                   # every policy, seeds 42..51, the four traces
  placement --policy fgd,fgd-oracle --seeds 2
  placement --pods bench/traces/openb/openb_pod_list_gpushare40.csv --out /tmp/r
  placement --traces /data/openb --scale-hosts ""
  placement --reuse bench/results/placement.json --reuse-policies random,best-fit   # replay the others only

Flags:
`

type config struct {
	Traces         string   `json:"-"`
	Nodes          string   `json:"nodes"`
	Pods           []string `json:"pods"`
	Seeds          []int64  `json:"seeds"`
	Inflate        float64  `json:"inflate"`
	Policies       []string `json:"policies"`
	Out            string   `json:"-"`
	SyntheticHosts int      `json:"synthetic_hosts"`
	SyntheticTasks int      `json:"synthetic_tasks"`
	ScaleHosts     []int    `json:"scale_hosts"`
	Workers        int      `json:"workers"`
	// Reuse and ReusePolicies: outcomes read from an earlier report rather than replayed.
	Reuse         string   `json:"reuse,omitempty"`
	ReusePolicies []string `json:"reuse_policies,omitempty"`
}

// Run runs the benchmark with command-line args (without the program name), writes progress
// to stderr and a summary to stdout. It returns 0 on success, 1 on failure and 2 on a usage
// error.
func Run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	cfg, err := parseFlags(args, stdout)
	if err != nil {
		return benchreport.UsageExit(stderr, "placement", err)
	}
	if err := run(ctx, cfg, stdout, stderr); err != nil {
		return benchreport.Fail(stderr, "placement", err)
	}
	return 0
}

func parseFlags(args []string, help io.Writer) (*config, error) {
	fs := benchreport.NewFlags("placement")
	cfg := &config{}
	var seeds int
	var policy string
	fs.StringVar(&cfg.Traces, "traces", "", "directory of the openb traces (default "+tracesDir+" in the repository holding the working directory)")
	fs.StringVar(&cfg.Nodes, "nodes", "", "node list CSV (default "+nodesFile+" in --traces)")
	var pods string
	fs.StringVar(&pods, "pods", "", "pod list CSVs, comma-separated (default the four openb pod lists in --traces)")
	fs.IntVar(&seeds, "seeds", 10, "number of seeds, from 42")
	fs.Float64Var(&cfg.Inflate, "inflate", 1.3, "offer tasks until they ask for this multiple of the GPU capacity")
	fs.StringVar(&policy, "policy", "all", "policy, comma-separated policies, or all: "+strings.Join(benchPolicies, ", "))
	fs.StringVar(&cfg.Out, "out", "bench/results", "directory for placement.json, placement.md and the PNG charts")
	fs.IntVar(&cfg.SyntheticHosts, "synthetic-hosts", 10000, "hosts (8 GPUs each) of the pool for placements/s; 0 skips it")
	fs.IntVar(&cfg.SyntheticTasks, "synthetic-tasks", 2000, "placements per policy for placements/s")
	fs.IntVar(&cfg.Workers, "workers", runtime.NumCPU(), "replays run at once")
	fs.StringVar(&cfg.Reuse, "reuse", "", "an earlier placement.json of the same --seeds and --inflate: read the outcomes of --reuse-policies from it rather than replay them")
	reuse := fs.String("reuse-policies", "", "with --reuse: comma-separated policies whose outcomes are read from --reuse (those whose placements have not changed since)")
	scale := fs.String("scale-hosts", "1000,3000,10000,30000,100000", "pool sizes (hosts × 8 GPUs) of the scale curve of the default policy, comma-separated; empty skips it")
	if err := benchreport.ParseFlags(fs, args, usage, help); err != nil {
		return nil, err
	}
	switch {
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
	for f := range strings.SplitSeq(*scale, ",") {
		if f = strings.TrimSpace(f); f == "" {
			continue
		}
		n, err := strconv.Atoi(f)
		if err != nil || n < 1 || n > 1_000_000 {
			return nil, fmt.Errorf("--scale-hosts %q: %q: want whole numbers of hosts between 1 and 1000000", *scale, f)
		}
		cfg.ScaleHosts = append(cfg.ScaleHosts, n)
	}
	var err error
	if cfg.Policies, err = parsePolicies(policy); err != nil {
		return nil, err
	}
	switch {
	case *reuse != "" && cfg.Reuse == "":
		return nil, fmt.Errorf("--reuse-policies %q: needs --reuse FILE", *reuse)
	case cfg.Reuse != "" && *reuse == "":
		return nil, fmt.Errorf("--reuse %s: needs --reuse-policies naming the policies to read from it", cfg.Reuse)
	case *reuse != "":
		if cfg.ReusePolicies, err = parsePolicies(*reuse); err != nil {
			return nil, fmt.Errorf("--reuse-policies: %w", err)
		}
		for _, p := range cfg.ReusePolicies {
			if !slices.Contains(cfg.Policies, p) {
				return nil, fmt.Errorf("--reuse-policies %q: %s is not in --policy", *reuse, p)
			}
		}
	}
	if cfg.Traces == "" {
		cfg.Traces = defaultTraces()
	}
	if cfg.Nodes == "" {
		cfg.Nodes = filepath.Join(cfg.Traces, nodesFile)
	}
	if pods == "" {
		for _, f := range podsFiles {
			cfg.Pods = append(cfg.Pods, filepath.Join(cfg.Traces, f))
		}
	} else {
		cfg.Pods = strings.Split(pods, ",")
	}
	files := []struct{ flag, path string }{{"nodes", cfg.Nodes}}
	for _, p := range cfg.Pods {
		files = append(files, struct{ flag, path string }{"pods", p})
	}
	for _, f := range files {
		if _, err := os.Stat(f.path); err != nil {
			return nil, fmt.Errorf("--%s %s: %v: run from inside the repository (the traces are in %s), or give --traces DIR or --%s FILE",
				f.flag, f.path, errors.Unwrap(err), tracesDir, f.flag)
		}
	}
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
	traces := make([][]task, len(cfg.Pods))
	for i, f := range cfg.Pods {
		if traces[i], err = loadTasks(f); err != nil {
			return err
		}
		if err := checkModels(f, traces[i], nodes); err != nil {
			return err
		}
	}
	if err := os.MkdirAll(cfg.Out, 0o755); err != nil {
		return err
	}
	var reuse *reused
	if cfg.Reuse != "" {
		if reuse, err = loadReused(cfg.Reuse, cfg.ReusePolicies, cfg); err != nil {
			return err
		}
	}
	rep := newReport(cfg)
	for i, f := range cfg.Pods {
		tasks := traces[i]
		arrivals := make([]*arrival, len(cfg.Seeds))
		for i, s := range cfg.Seeds {
			arrivals[i] = arrive(nodes, tasks, s, cfg.Inflate)
		}
		name := traceName(f)
		fmt.Fprintf(stderr, "placement: %s: %d nodes, %d tasks (%d offered per seed), %d policies × %d seeds on %d workers\n",
			name, len(nodes), len(tasks), len(arrivals[0].tasks), len(cfg.Policies), len(cfg.Seeds), cfg.Workers)
		outcomes, err := replayAll(ctx, cfg, nodes, tasks, arrivals, reuse, stderr)
		if err != nil {
			return err
		}
		for _, p := range cfg.Policies {
			if reuse.has(p) {
				if outcomes[p], err = reuse.outcomes(name, p, false, cfg.Seeds); err != nil {
					return err
				}
			}
		}
		bounds := make([]float64, len(arrivals))
		for i, a := range arrivals {
			bounds[i] = sliverBound(a)
		}
		rep.addTrace(name, outcomes, bounds)
	}
	if len(traces) >= 2 && slices.Contains(cfg.Policies, placement.FGD) && slices.Contains(cfg.Policies, FGDOracle) {
		shift, err := mixShift(ctx, cfg, nodes, traceName(cfg.Pods[0]), traces[0], traceName(cfg.Pods[1]), traces[1], reuse, stderr)
		if err != nil {
			return err
		}
		rep.MixShift = shift
	}
	rep.ReplaySeconds = time.Since(start).Seconds()
	if cfg.SyntheticHosts > 0 {
		arrival := arrive(nodes, traces[0], cfg.Seeds[0], cfg.Inflate)
		for _, p := range cfg.Policies {
			r, err := throughput(ctx, cfg, cfg.SyntheticHosts, nodes, traces[0], arrival, p)
			if err != nil {
				return err
			}
			fmt.Fprintf(stderr, "placement: %s: %.0f placements/s (%.0f per CPU second) on %d hosts\n", p, r.Wall, r.CPU, cfg.SyntheticHosts)
			rep.Rates[p] = r
		}
		for _, n := range cfg.ScaleHosts {
			r, err := throughput(ctx, cfg, n, nodes, traces[0], arrival, placement.FGD)
			if err != nil {
				return err
			}
			fmt.Fprintf(stderr, "placement: scale: %s: %.0f placements/s (%.0f per CPU second) on %d hosts\n", placement.FGD, r.Wall, r.CPU, n)
			pt := scalePoint{Hosts: n, PlacementsPerSec: r.Wall, PerCPUSecond: r.CPU}
			if r.CPU > 0 {
				pt.CPUMicrosPerPlacement = 1e6 / r.CPU
			}
			rep.Scale = append(rep.Scale, pt)
		}
	}
	rep.TotalSeconds = time.Since(start).Seconds()
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
// The policies reuse has are left for the caller to fill.
func replayAll(ctx context.Context, cfg *config, nodes []node, tasks []task, arrivals []*arrival, reuse *reused, stderr io.Writer) (map[string][]*outcome, error) {
	type job struct {
		policy string
		a      int
	}
	var jobs []job
	for _, p := range cfg.Policies {
		for i := range arrivals {
			if !reuse.has(p) {
				jobs = append(jobs, job{p, i})
			}
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
				o, err := replay(ctx, nodes, tasks, a, j.policy, progress)
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
