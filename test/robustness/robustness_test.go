package robustness

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"
)

var binary string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "gpupool-robustness-")
	if err != nil {
		panic(err)
	}
	binary, err = BuildGpupool(dir)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// seed is GPUPOOL_ROBUSTNESS_SEED, else one from the clock; the test
// prints it so that a failing run can be repeated.
func seed(t *testing.T) uint64 {
	t.Helper()
	s := uint64(time.Now().UnixNano() % 1_000_000_000)
	if v := os.Getenv("GPUPOOL_ROBUSTNESS_SEED"); v != "" {
		n, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			t.Fatalf("GPUPOOL_ROBUSTNESS_SEED=%q: want an unsigned integer", v)
		}
		s = n
	}
	t.Logf("seed %d (repeat with GPUPOOL_ROBUSTNESS_SEED=%d)", s, s)
	return s
}

// envDuration is the duration in env var name, else def.
func envDuration(t *testing.T, name string, def time.Duration) time.Duration {
	t.Helper()
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	d, err := time.ParseDuration(v)
	if err != nil || d <= 0 {
		t.Fatalf("%s=%q: want a positive Go duration such as 90s or 10m", name, v)
	}
	return d
}

// outDir is where a run keeps its logs and visualizations:
// GPUPOOL_ROBUSTNESS_OUT, else the test's temporary directory.
func outDir(t *testing.T) string {
	if d := os.Getenv("GPUPOOL_ROBUSTNESS_OUT"); d != "" {
		d = filepath.Join(d, t.Name())
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
		return d
	}
	return t.TempDir()
}

// needsCluster skips tests that start clusters unless
// GPUPOOL_ROBUSTNESS=1 (make test-robustness and make soak set it): they
// take minutes, and make test runs every package under test/.
func needsCluster(t *testing.T) {
	t.Helper()
	if testing.Short() || os.Getenv("GPUPOOL_ROBUSTNESS") != "1" {
		t.Skip("starts clusters under faults for minutes; run make test-robustness (or set GPUPOOL_ROBUSTNESS=1)")
	}
}

// runScenario runs cfg and fails t on errors and violations; it returns
// the run's report.
func runScenario(t *testing.T, cfg Config) *Report {
	t.Helper()
	cfg.Seed = seed(t)
	cfg.Bin, cfg.Dir, cfg.Timing = binary, outDir(t), DefaultTiming
	cfg.ForceProxy = os.Getenv("GPUPOOL_ROBUSTNESS_NET") == "proxy"
	cfg.Logf = t.Logf
	ctx, cancel := context.WithTimeout(context.Background(), cfg.Duration+10*time.Minute)
	defer cancel()
	rep, err := Run(ctx, cfg)
	if err != nil {
		t.Logf("what the run saw before it failed:\n%s", rep.Table())
		t.Fatalf("seed %d: %v", cfg.Seed, err)
	}
	table := rep.Table()
	if p, err := rep.WriteTable(cfg.Dir); err == nil {
		t.Logf("summary written to %s", p)
	}
	t.Logf("summary:\n%s", table)
	fmt.Println(table) // also without -v: the summary is the point of the run
	if rep.FaultErr != nil {
		t.Errorf("seed %d: %v", cfg.Seed, rep.FaultErr)
	}
	if n := rep.Violations(); n > 0 {
		t.Errorf("seed %d: %d violations (see the summary above)", cfg.Seed, n)
	}
	if rep.Ops[OpAcquire].OK == 0 || rep.Ops[OpRelease].OK == 0 || rep.Ops[OpKeepAlive].OK == 0 || rep.Ops[OpGet].OK == 0 {
		t.Errorf("seed %d: some kind of operation never succeeded: %+v", cfg.Seed, rep.Ops)
	}
	if rep.Check.Operations == 0 {
		t.Errorf("seed %d: no operation was checked", cfg.Seed)
	}
	return rep
}

// TestRobustness is the short run CI does: 3 brokers, 3 agents, 6
// clients, faults for GPUPOOL_ROBUSTNESS_DURATION (default 60s), the
// first of them a flood, a slow leader's disk and a full disk.
func TestRobustness(t *testing.T) {
	needsCluster(t)
	runScenario(t, Config{Duration: envDuration(t, "GPUPOOL_ROBUSTNESS_DURATION", 60*time.Second), MaxOps: 50_000,
		Brokers: 3, Agents: 3, Workers: 6, Faults: true, FirstFaults: []string{FaultFlood, FaultSlowDiskLeader, FaultFullDisk}})
}

// TestSoak is `make soak DURATION=10m`: 5 brokers, 4 agents, 8 clients,
// random faults for GPUPOOL_SOAK_DURATION. It skips without it.
// GPUPOOL_SOAK_FAULTS=none (make soak FAULTS=none) injects no fault: the
// run then also fails on any leader change, since no election may start
// without a real fault, however busy the CPUs are.
func TestSoak(t *testing.T) {
	needsCluster(t)
	d := envDuration(t, "GPUPOOL_SOAK_DURATION", 0)
	if d == 0 {
		t.Skip("set GPUPOOL_SOAK_DURATION (make soak DURATION=10m)")
	}
	faults := true
	switch f := os.Getenv("GPUPOOL_SOAK_FAULTS"); f {
	case "", "random":
	case "none":
		faults = false
	default:
		t.Fatalf("GPUPOOL_SOAK_FAULTS=%q: must be random (the default) or none", f)
	}
	rep := runScenario(t, Config{Duration: d, MaxOps: 10_000_000, Brokers: 5, Agents: 4, Workers: 8, Faults: faults})
	if !faults && rep.LeaderChanges > 0 {
		t.Errorf("%d leader changes without any fault: want 0", rep.LeaderChanges)
	}
}
