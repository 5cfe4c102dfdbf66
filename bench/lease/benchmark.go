package leasebench

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"strings"
	"syscall"
	"time"

	"github.com/gpupool/gpupool/bench/report"
	"github.com/gpupool/gpupool/internal/proc"
)

// The simulated pool both systems serve, and the workload's slice. The
// pool holds hosts*gpusPerHost*min(gpuMemoryMiB/sliceMemoryMiB,
// 100/sliceComputePercent) = 32*80 = 2560 slices, ten times the largest
// default level: it never fills, even with gpupool's released slices
// waiting for their agent's teardown.
const (
	hosts               = 4
	gpusPerHost         = 8
	gpuModel            = "A100-80GB"
	gpuMemoryMiB        = 80 << 10
	sliceMemoryMiB      = 1 << 10
	sliceComputePercent = 1
	leaseTTL            = 60 * time.Second
)

// poolSlices is how many slices the pool holds at once.
func poolSlices() int {
	return hosts * gpusPerHost * min(gpuMemoryMiB/sliceMemoryMiB, 100/sliceComputePercent)
}

// simulatedPool is the etcd allocator's pool: the devices gpupool's
// simulated agents report.
func simulatedPool() []device {
	var devs []device
	for h := range hosts {
		for i := range gpusPerHost {
			devs = append(devs, newDevice(fmt.Sprintf("host-%d", h+1), i, gpuMemoryMiB, 100))
		}
	}
	return devs
}

// results is what a run measured; it is written as JSON as is.
type results struct {
	Benchmark string       `json:"benchmark"`
	Date      string       `json:"date"`
	Config    config       `json:"config"`
	Machine   machine      `json:"machine"`
	Systems   []systemInfo `json:"systems"`
	Levels    []level      `json:"levels"`
	// Burst is what other clients saw during one client's burst; nil
	// when skipped.
	Burst *burstFigures `json:"burst,omitempty"`
	// ElapsedSeconds is how long the whole run took, setup included.
	ElapsedSeconds float64 `json:"elapsed_seconds"`
	// LoadAvg is /proc/loadavg at the start and at the end of the run:
	// other work on the machine competes with both clusters for the CPUs.
	LoadAvg []string `json:"loadavg"`
}

type config struct {
	Clients             []int   `json:"clients"`
	DurationSeconds     float64 `json:"duration_seconds"`
	WarmupSeconds       float64 `json:"warmup_seconds"`
	Pool                string  `json:"pool"`
	PoolSlices          int     `json:"pool_slices"`
	SliceMemoryMiB      int64   `json:"slice_memory_mib"`
	SliceComputePercent int     `json:"slice_compute_percent"`
	TTLSeconds          float64 `json:"ttl_seconds"`
	GpupoolBinary       string  `json:"gpupool_binary"`
	EtcdBinary          string  `json:"etcd_binary"`
	EtcdVersion         string  `json:"etcd_version"`
	EtcdClient          string  `json:"etcd_client"`
	DataDirFS           string  `json:"data_dir_fs"`
}

type machine struct {
	Hostname  string `json:"hostname"`
	CPUModel  string `json:"cpu_model"`
	CPUs      int    `json:"cpus"`
	OS        string `json:"os"`
	Arch      string `json:"arch"`
	GoVersion string `json:"go_version"`
}

type systemInfo struct {
	Name string `json:"name"`
	Does string `json:"does"`
}

// level is both systems' figures at one number of clients.
type level struct {
	Clients int `json:"clients"`
	// Fsync is the data dirs' disk, measured just before the level.
	Fsync   fsyncFigures `json:"fsync"`
	Gpupool figures      `json:"gpupool"`
	Etcd    figures      `json:"etcd"`
	Ratio   ratio        `json:"ratio_gpupool_over_etcd"`
}

// side is one system's figures at a level.
type side struct {
	name string
	f    figures
}

// sides are the level's figures, gpupool's first.
func (l level) sides() []side { return []side{{"gpupool", l.Gpupool}, {"etcd", l.Etcd}} }

// ratio is gpupool's figure over etcd's: above 1 favours gpupool for the
// throughput, etcd for the latencies. 0 when etcd's figure is 0.
type ratio struct {
	CyclesPerSec float64 `json:"cycles_per_sec"`
	AcquireP50   float64 `json:"acquire_p50"`
	AcquireP99   float64 `json:"acquire_p99"`
	CycleP50     float64 `json:"cycle_p50"`
	CycleP99     float64 `json:"cycle_p99"`
}

func ratios(g, e figures) ratio {
	div := over
	return ratio{
		CyclesPerSec: div(g.CyclesPerSec, e.CyclesPerSec),
		AcquireP50:   div(g.Acquire.P50, e.Acquire.P50),
		AcquireP99:   div(g.Acquire.P99, e.Acquire.P99),
		CycleP50:     div(g.Cycle.P50, e.Cycle.P50),
		CycleP99:     div(g.Cycle.P99, e.Cycle.P99),
	}
}

var systemsInfo = []systemInfo{
	{"gpupool", "3 brokers (Raft, bbolt log with fsync) and 4 simulated agents, separate processes; " +
		"acquire = one Acquire RPC (placement on the leader, one Raft entry, tokens signed); " +
		"release = one Release RPC, returning once the lease is RELEASING (one Raft entry): the agent tears the slice down " +
		"and a further entry frees the capacity after the call, outside the timed cycle"},
	{"etcd", "3 etcd members (default fsync), our first-fit allocator over one key per device; " +
		"acquire = Grant an etcd lease (one Raft entry) while reading every device (a linearizable range), " +
		"then a transaction comparing the chosen device's mod revision that puts the device and a lease record attached to the etcd lease " +
		"(one Raft entry; a failed compare reads again); release = read the device, a transaction deleting the allocation and the record " +
		"(one Raft entry, retried likewise), then Revoke (one Raft entry); the capacity is free when release returns"},
}

// fsyncProbe is how long the disk's fsync limit is measured before each
// level.
const fsyncProbe = time.Second

// benchmark starts both clusters, runs every level on each, and stops
// them.
func benchmark(ctx context.Context, opts options, p *report.Progress) (_ *results, err error) {
	began := time.Now()
	res := &results{
		Benchmark: "lease",
		Date:      began.UTC().Format(time.RFC3339),
		Machine:   thisMachine(),
		Systems:   systemsInfo,
		LoadAvg:   []string{loadAvg()},
		Config: config{
			Clients: opts.clients, DurationSeconds: opts.duration.Seconds(), WarmupSeconds: opts.warmup.Seconds(),
			Pool:       fmt.Sprintf("%d hosts x %d %s", hosts, gpusPerHost, gpuModel),
			PoolSlices: poolSlices(), SliceMemoryMiB: sliceMemoryMiB, SliceComputePercent: sliceComputePercent,
			TTLSeconds: leaseTTL.Seconds(), GpupoolBinary: opts.gpupool, EtcdBinary: opts.etcd,
			EtcdClient: "go.etcd.io/etcd/client/v3 " + moduleVersion("go.etcd.io/etcd/client/v3"),
		},
	}
	if res.Config.EtcdVersion, err = etcdVersion(ctx, opts.etcd); err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp(opts.tmp, "gpupool-bench-lease-")
	if err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			p.Logf("kept %s for the servers' logs", dir)
			return
		}
		os.RemoveAll(dir)
	}()
	res.Config.DataDirFS = filesystem(dir)
	if opts.profile != "" {
		if err := os.MkdirAll(opts.profile, 0o755); err != nil {
			return nil, err
		}
	}
	if res.Config.DataDirFS == "tmpfs" {
		p.Logf("warning: %s is on tmpfs, where fsync costs nothing; pass --tmpdir on a disk", dir)
	}
	if opts.gpupool == "" {
		p.Logf("building gpupool")
		if opts.gpupool, err = report.BuildGpupool(ctx, dir); err != nil {
			return nil, err
		}
		res.Config.GpupoolBinary = "built from this tree"
	}

	p.Logf("starting 3 etcd %s members (data in %s, %s)", res.Config.EtcdVersion, dir, res.Config.DataDirFS)
	ec, err := startEtcd(ctx, dir, opts.etcd)
	if err != nil {
		return nil, err
	}
	defer ec.stop()
	alloc := &etcdAllocator{cli: ec.cli, ttl: int64(leaseTTL / time.Second)}
	if err := seedPool(ctx, ec.cli, simulatedPool()); err != nil {
		return nil, fmt.Errorf("etcd: write the device records: %w", err)
	}
	sl := slice{MemoryMiB: sliceMemoryMiB, ComputePercent: sliceComputePercent}
	etcdSys := &etcdSystem{alloc: alloc, slice: sl}
	for _, n := range opts.clients {
		lv := level{Clients: n}
		if lv.Fsync, err = measureFsync(dir, fsyncProbe); err != nil {
			return nil, err
		}
		// A fresh gpupool cluster per level: hosts that went down in one
		// level (see figures.IdleError) do not shrink the next one's pool.
		gdir := filepath.Join(dir, fmt.Sprintf("gpupool-%d", n))
		if err := os.Mkdir(gdir, 0o755); err != nil {
			return nil, err
		}
		p.Logf("starting 3 gpupool brokers and %d simulated agents", hosts)
		gc, err := startGpupool(ctx, gdir, opts.gpupool, hosts, opts.profile != "")
		if err != nil {
			return nil, fmt.Errorf("gpupool did not come up: %w", err)
		}
		var profiled func() error
		if opts.profile != "" {
			pr := &profiler{dir: opts.profile, addrs: gc.pprof, metrics: gc.metrics, logf: p.Logf}
			profiled = pr.start(ctx, time.Now().Add(opts.warmup), opts.duration, n)
		}
		lv.Gpupool, err = measure(ctx, p, opts, "gpupool", n, &gpupoolSystem{cl: gc, slice: sl, ttl: leaseTTL, hosts: hosts}, gc.children)
		if profiled != nil {
			if perr := profiled(); perr != nil && err == nil {
				err = perr
			}
		}
		gc.stop()
		if err != nil {
			return nil, err
		}
		if lv.Etcd, err = measure(ctx, p, opts, "etcd", n, etcdSys, ec.children); err != nil {
			return nil, err
		}
		lv.Ratio = ratios(lv.Gpupool, lv.Etcd)
		res.Levels = append(res.Levels, lv)
	}
	if opts.burst > 0 {
		if res.Burst, err = runBurst(ctx, p, opts, dir, sl); err != nil {
			return nil, err
		}
	}
	p.Logf("stopping the clusters")
	res.ElapsedSeconds = time.Since(began).Seconds()
	res.LoadAvg = append(res.LoadAvg, loadAvg())
	return res, nil
}

// measure runs one level of clients on sys, waits for it to be idle
// again, and checks that none of its servers died.
func measure(ctx context.Context, p *report.Progress, opts options, name string, clients int, sys system, servers []*proc.Proc) (figures, error) {
	p.Logf("%s, %d clients: %s warm-up, then %s timed", name, clients, opts.warmup, opts.duration)
	f := runLevel(ctx, sys, clients, opts.warmup, opts.duration)
	if ctx.Err() != nil {
		return f, fmt.Errorf("%w: %v", errStopped, ctx.Err())
	}
	idleFrom := time.Now()
	if err := sys.idle(ctx); err != nil {
		f.IdleError = err.Error()
		p.Logf("warning: %s, after %d clients: not back to idle: %v", name, clients, err)
	}
	f.IdleSeconds = time.Since(idleFrom).Seconds()
	if err := diedError(servers); err != nil {
		return f, err
	}
	p.Logf("%s, %d clients: %.0f cycles/s; acquire p50 %.2f ms, p99 %.2f ms; cycle p50 %.2f ms, p99 %.2f ms; "+
		"%d errors, %d retries; waited %.2fs for idle",
		name, clients, f.CyclesPerSec, f.Acquire.P50, f.Acquire.P99, f.Cycle.P50, f.Cycle.P99,
		f.errors(), f.Retries, f.IdleSeconds)
	if f.FirstAcquireError != "" || f.FirstReleaseError != "" {
		p.Logf("%s, %d clients: first errors: acquire %q, release %q", name, clients, f.FirstAcquireError, f.FirstReleaseError)
	}
	return f, nil
}

// moduleVersion is the version of module path this binary was built
// with, or "unknown".
func moduleVersion(path string) string {
	if bi, ok := debug.ReadBuildInfo(); ok {
		for _, m := range bi.Deps {
			if m.Path == path {
				return m.Version
			}
		}
	}
	return "unknown"
}

// filesystem names the file system dir is on, for the common ones.
func filesystem(dir string) string {
	var st syscall.Statfs_t
	if err := syscall.Statfs(dir, &st); err != nil {
		return "unknown"
	}
	switch st.Type {
	case 0xef53:
		return "ext4"
	case 0x58465342:
		return "xfs"
	case 0x9123683e:
		return "btrfs"
	case 0x01021994:
		return "tmpfs"
	case 0x794c7630:
		return "overlayfs"
	}
	return fmt.Sprintf("0x%x", st.Type)
}

func thisMachine() machine {
	m := machine{CPUs: runtime.NumCPU(), OS: runtime.GOOS, Arch: runtime.GOARCH, GoVersion: runtime.Version()}
	m.Hostname, _ = os.Hostname()
	if f, err := os.Open("/proc/cpuinfo"); err == nil {
		defer f.Close()
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			if k, v, ok := strings.Cut(sc.Text(), ":"); ok && strings.TrimSpace(k) == "model name" {
				m.CPUModel = strings.TrimSpace(v)
				break
			}
		}
	}
	return m
}

// loadAvg is /proc/loadavg, trimmed; "" where there is none.
func loadAvg() string {
	b, _ := os.ReadFile("/proc/loadavg")
	return strings.TrimSpace(string(b))
}

// runBurst starts a fresh gpupool cluster and measures one client's burst
// beside opts.others clients on it.
func runBurst(ctx context.Context, p *report.Progress, opts options, dir string, sl slice) (*burstFigures, error) {
	gdir := filepath.Join(dir, "gpupool-burst")
	if err := os.Mkdir(gdir, 0o755); err != nil {
		return nil, err
	}
	p.Logf("starting 3 gpupool brokers and %d simulated agents for the burst", hosts)
	gc, err := startGpupool(ctx, gdir, opts.gpupool, hosts, false)
	if err != nil {
		return nil, fmt.Errorf("gpupool did not come up: %w", err)
	}
	defer gc.stop()
	sys := &gpupoolSystem{cl: gc, slice: sl, ttl: leaseTTL, hosts: hosts}
	burster, closeBurster, err := sys.burstClient()
	if err != nil {
		return nil, err
	}
	defer closeBurster()
	p.Logf("gpupool: %d clients for %s, then one more client sends %d acquires at once", opts.others, quietWindow, opts.burst)
	f := measureBurst(ctx, sys, burster, opts.others, opts.burst)
	if ctx.Err() != nil {
		return nil, fmt.Errorf("%w: %v", errStopped, ctx.Err())
	}
	if err := diedError(gc.children); err != nil {
		return nil, err
	}
	p.Logf("gpupool burst: the others' cycle p99 %.2f ms quiet, %.2f ms during the burst (%.1fs; %d granted, %d refused)",
		f.Quiet.P99, f.During.P99, f.BurstSeconds, f.BurstOK, f.BurstErrors)
	return &f, nil
}
