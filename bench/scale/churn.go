package scale

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/gpupool/gpupool/bench/report"
	"github.com/gpupool/gpupool/internal/proc"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

const churnUsageHead = `Usage: churn [flags]

Measures one gpupool broker's memory as its state grows and under churn:

  1. registers --hosts hosts of --gpus-per-host GPUs (as 'scale' does) and
     reads the broker's resident memory (VmRSS) with 0 leases;
  2. grants leases up to each of --steps (default 10000 and 100000; 24 h
     TTL, never released) and reads the memory at each step;
  3. registers --churn-clients more hosts, one per churn client, and runs
     acquire/release cycles on them (each client acquires a small slice on
     its own host, releases it and confirms the teardown as its agent
     would) until --cycles cycles are done or --churn-budget is spent,
     reading the memory and the number of ended leases the state keeps
     every --sample;
  4. reports the memory after the churn, and, when the budget ended the
     churn early, the RSS growth per 100k cycles over the second half of
     the churn, so that the reader can extrapolate to --cycles.

The broker runs with its default --ended-lease-retention and
--ended-leases-max unless --broker-flags says otherwise. Progress goes to
stderr; churn.json and churn.md go to --out. Exit code 1 when the benchmark
fails, 2 for a usage error.

Examples (the flags as given to Run):
  --steps 10000 --cycles 100000 --churn-budget 5m
  --broker-flags "--ended-leases-max=1000"

Flags:
`

type churnOptions struct {
	hosts, gpusPerHost  int
	steps               []int
	clients             int
	churnClients        int
	cycles              int
	churnBudget         time.Duration
	loadBudget          time.Duration
	sample              time.Duration
	seed                uint64
	out, gpupool, tmp   string
	brokerFlags         []string
	stepsText, flagText string
}

// RunChurn runs the churn benchmark for the command-line arguments args
// and returns the exit code, as Run does.
func RunChurn(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	o, err := parseChurnFlags(args, stdout)
	if err != nil {
		return report.UsageExit(stderr, "churn", err)
	}
	p := report.NewProgress(stderr)
	res, err := churn(ctx, o, p)
	if err != nil {
		return report.Fail(stderr, "churn", err)
	}
	if err := writeChurnResults(o.out, res, stdout); err != nil {
		return report.Fail(stderr, "churn", err)
	}
	p.Logf("results written to %s", filepath.Join(o.out, "churn.{json,md}"))
	return 0
}

func parseChurnFlags(args []string, help io.Writer) (churnOptions, error) {
	fs := report.NewFlags("churn")
	var o churnOptions
	fs.IntVar(&o.hosts, "hosts", 10000, "`number` of hosts to register")
	fs.IntVar(&o.gpusPerHost, "gpus-per-host", 8, "`number` of GPUs per host")
	fs.StringVar(&o.stepsText, "steps", "10000,100000", "comma-separated lease `counts` at which to read the memory, increasing")
	fs.IntVar(&o.clients, "clients", 32, "`number` of concurrent clients granting the leases of the steps")
	fs.DurationVar(&o.loadBudget, "load-budget", 15*time.Minute, "stop granting the leases of the steps after this long and go on with those granted")
	fs.IntVar(&o.churnClients, "churn-clients", 64, "`number` of churn clients, each on a host of its own")
	fs.IntVar(&o.cycles, "cycles", 1_000_000, "`number` of acquire/release cycles of the churn")
	fs.DurationVar(&o.churnBudget, "churn-budget", 90*time.Minute, "stop the churn after this long (the report then extrapolates to --cycles); 1M cycles took 46 minutes on 2 cores")
	fs.DurationVar(&o.sample, "sample", 15*time.Second, "how often to read the memory during the churn")
	fs.Uint64Var(&o.seed, "seed", 1, "seed of the lease sizes")
	fs.StringVar(&o.flagText, "broker-flags", "", "extra flags for the broker, space-separated (e.g. \"--ended-leases-max=1000\")")
	fs.StringVar(&o.out, "out", "bench/results", "`dir`ectory for churn.json and churn.md; created if missing")
	fs.StringVar(&o.gpupool, "gpupool", "", "`path` of a built gpupool binary (default: go build ./cmd/gpupool into the run's directory)")
	fs.StringVar(&o.tmp, "tmpdir", "", "`dir`ectory for the run's data dir and log (default $TMPDIR or /tmp)")
	if err := report.ParseFlags(fs, args, churnUsageHead, help); err != nil {
		return o, err
	}
	o.brokerFlags = strings.Fields(o.flagText)
	for _, s := range strings.Split(o.stepsText, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil || n < 1 || n > maxLeases || (len(o.steps) > 0 && n <= o.steps[len(o.steps)-1]) {
			return o, fmt.Errorf("--steps %q: must be increasing lease counts between 1 and %d, e.g. 10000,100000", o.stepsText, maxLeases)
		}
		o.steps = append(o.steps, n)
	}
	switch {
	case o.hosts < 1 || o.hosts > maxHosts:
		return o, fmt.Errorf("--hosts %d: must be between 1 and %d", o.hosts, maxHosts)
	case o.gpusPerHost < 1 || o.gpusPerHost > maxGPUsPerHost:
		return o, fmt.Errorf("--gpus-per-host %d: must be between 1 and %d", o.gpusPerHost, maxGPUsPerHost)
	case o.steps[len(o.steps)-1] > o.hosts*o.gpusPerHost*slicesPerGPU:
		return o, fmt.Errorf("--steps %d: must be at most %d (%d GPUs × %d slices of up to 16 GiB): add hosts", o.steps[len(o.steps)-1], o.hosts*o.gpusPerHost*slicesPerGPU, o.hosts*o.gpusPerHost, slicesPerGPU)
	case o.clients < 1 || o.clients > maxClients:
		return o, fmt.Errorf("--clients %d: must be between 1 and %d", o.clients, maxClients)
	case o.churnClients < 1 || o.churnClients > maxClients:
		return o, fmt.Errorf("--churn-clients %d: must be between 1 and %d", o.churnClients, maxClients)
	case o.cycles < 1 || o.cycles > 100_000_000:
		return o, fmt.Errorf("--cycles %d: must be between 1 and 100000000", o.cycles)
	case o.churnBudget <= 0 || o.loadBudget <= 0:
		return o, fmt.Errorf("--churn-budget %s, --load-budget %s: must be more than 0", o.churnBudget, o.loadBudget)
	case o.sample < time.Second:
		return o, fmt.Errorf("--sample %s: must be at least 1s", o.sample)
	case o.out == "":
		return o, errors.New("--out: must name a directory, e.g. bench/results")
	}
	if o.gpupool != "" {
		if st, err := os.Stat(o.gpupool); err != nil || st.IsDir() {
			return o, fmt.Errorf("--gpupool %s: not a file; build one with go build -o PATH ./cmd/gpupool", o.gpupool)
		}
	}
	return o, nil
}

// churnResults is what a churn run measured.
type churnResults struct {
	Benchmark string `json:"benchmark"`
	Config    struct {
		Hosts        int      `json:"hosts"`
		GPUsPerHost  int      `json:"gpus_per_host"`
		Steps        []int    `json:"steps"`
		ChurnClients int      `json:"churn_clients"`
		Cycles       int      `json:"cycles"`
		ChurnBudget  string   `json:"churn_budget"`
		BrokerFlags  []string `json:"broker_flags"`
		Seed         uint64   `json:"seed"`
	} `json:"config"`
	Env environment `json:"env"`
	// Points are the memory readings: empty, with the pool, at each step,
	// and during and after the churn.
	Points []churnPoint `json:"points"`
	// CyclesDone and CyclesPerSecond are the churn's; a cycle is an
	// acquire, a release and the agent's teardown confirmation.
	CyclesDone      int     `json:"cycles_done"`
	CyclesPerSecond float64 `json:"cycles_per_second"`
	CycleP50Ms      float64 `json:"cycle_p50_ms"`
	CycleP99Ms      float64 `json:"cycle_p99_ms"`
	// RSSGrowthMiBPer100k is the least-squares slope of RSS against the
	// cycles done over the second half of the churn, per 100k cycles.
	RSSGrowthMiBPer100k float64 `json:"rss_growth_mib_per_100k_cycles"`
	// ExtrapolatedRSSMiB is the RSS after --cycles at that slope, when the
	// churn stopped early; 0 otherwise.
	ExtrapolatedRSSMiB float64 `json:"extrapolated_rss_mib"`
	LoadAverage        string  `json:"load_average"`
	ElapsedSeconds     float64 `json:"elapsed_seconds"`
}

type churnPoint struct {
	Label  string  `json:"label"`
	Leases int     `json:"leases_granted"`
	Cycles int     `json:"cycles"`
	Ended  int     `json:"ended_leases_in_state"`
	RSSMiB float64 `json:"rss_mib"`
	// HeapMiB is the broker's go_memstats_heap_inuse_bytes.
	HeapMiB float64 `json:"heap_inuse_mib"`
	AtS     float64 `json:"at_seconds"`
}

func churn(ctx context.Context, o churnOptions, p *report.Progress) (*churnResults, error) {
	start := time.Now()
	dir, err := os.MkdirTemp(o.tmp, "gpupool-churn-bench-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	bin := o.gpupool
	if bin == "" {
		p.Logf("building gpupool")
		if bin, err = report.BuildGpupool(ctx, dir); err != nil {
			return nil, err
		}
	}
	metricsAddr, err := proc.FreeAddr("127.0.0.1")
	if err != nil {
		return nil, err
	}
	b, err := startBroker(ctx, bin, dir, 1, append([]string{"--metrics-bind", metricsAddr}, o.brokerFlags...)...)
	if err != nil {
		return nil, err
	}
	defer func() { b.stop() }()
	if _, err := b.waitLeader(ctx); err != nil {
		return nil, fmt.Errorf("the broker did not start: %w", err)
	}
	fail := func(what string, err error) (*churnResults, error) {
		return nil, fmt.Errorf("%s: %w\n---- %s, last 2 KiB ----\n%s", what, err, b.proc.Log, b.proc.LogTail(2048))
	}
	res := &churnResults{Benchmark: "churn", Env: environment{GoVersion: runtime.Version(), OS: runtime.GOOS, Arch: runtime.GOARCH, CPUs: runtime.NumCPU()}}
	res.Config.Hosts, res.Config.GPUsPerHost, res.Config.Steps = o.hosts, o.gpusPerHost, o.steps
	res.Config.ChurnClients, res.Config.Cycles, res.Config.ChurnBudget = o.churnClients, o.cycles, o.churnBudget.String()
	res.Config.BrokerFlags, res.Config.Seed = o.brokerFlags, o.seed
	var granted, cycles atomic.Int64
	point := func(label string) (churnPoint, error) {
		mem, err := readMemory(b.proc.Pid())
		if err != nil {
			return churnPoint{}, err
		}
		pt := churnPoint{Label: label, Leases: int(granted.Load()), Cycles: int(cycles.Load()), RSSMiB: mem.RSSMiB, AtS: time.Since(start).Seconds()}
		if v := scrapeGauge(ctx, metricsAddr, "go_memstats_heap_inuse_bytes"); !math.IsNaN(v) {
			pt.HeapMiB = v / (1 << 20) // 0 when the scrape failed (JSON has no NaN)
		}
		if st, err := b.c.Pool.Status(ctx, &gpupoolv1.StatusRequest{}); err == nil {
			for _, s := range []string{"released", "expired", "revoked"} {
				pt.Ended += int(st.LeasesByState[s])
			}
		}
		res.Points = append(res.Points, pt)
		p.Logf("%s: %d leases, %d cycles, %d ended leases kept: VmRSS %.0f MiB, heap in use %.0f MiB", label, pt.Leases, pt.Cycles, pt.Ended, pt.RSSMiB, pt.HeapMiB)
		return pt, nil
	}
	if _, err := point("empty broker"); err != nil {
		return fail("read the memory", err)
	}
	if _, _, _, err := parallel(ctx, o.hosts, o.clients, 0, p, "registered hosts", func(ctx context.Context, i int) error {
		_, err := b.c.Agent.Register(ctx, &gpupoolv1.RegisterRequest{Host: host(i, o.gpusPerHost)})
		return err
	}); err != nil {
		return fail("register hosts", err)
	}
	if _, err := point("0 leases"); err != nil {
		return fail("read the memory", err)
	}
	loadStart := time.Now()
	for _, step := range o.steps {
		from := int(granted.Load())
		left := o.loadBudget - time.Since(loadStart)
		if left <= 0 {
			p.Logf("--load-budget %s spent at %d leases", o.loadBudget, from)
			break
		}
		_, made, _, err := parallel(ctx, step-from, o.clients, left, p, fmt.Sprintf("granted leases (step %d)", step), func(ctx context.Context, i int) error {
			_, err := b.c.Lease.Acquire(ctx, &gpupoolv1.AcquireRequest{Request: leaseRequest(o.seed, from+i)})
			if err == nil {
				granted.Add(1)
			}
			return err
		})
		if err != nil {
			return fail("grant leases", err)
		}
		if _, err := point(fmt.Sprintf("%d leases", from+made)); err != nil {
			return fail("read the memory", err)
		}
		if from+made < step {
			break
		}
	}

	// Churn.
	hosts := make([]string, o.churnClients)
	for k := range hosts {
		h := host(o.hosts+k, 1)
		h.Id = fmt.Sprintf("churn-%03d", k)
		h.Devices[0].Uuid, h.Devices[0].HostId = "GPU-"+h.Id, h.Id
		if _, err := b.c.Agent.Register(ctx, &gpupoolv1.RegisterRequest{Host: h}); err != nil {
			return fail("register a churn host", err)
		}
		hosts[k] = h.Id
	}
	p.Logf("churn: %d clients, up to %d cycles or %s", o.churnClients, o.cycles, o.churnBudget)
	cctx, cancel := context.WithTimeout(ctx, o.churnBudget)
	defer cancel()
	var (
		wg       sync.WaitGroup
		mu       sync.Mutex
		firstErr error
		lat      []float64
	)
	churnStart := time.Now()
	for k := range o.churnClients {
		wg.Go(func() {
			l, err := churnClient(cctx, b, hosts[k], o, &cycles)
			mu.Lock()
			defer mu.Unlock()
			lat = append(lat, l...)
			if err != nil && firstErr == nil && cctx.Err() == nil {
				firstErr = err
				cancel()
			}
		})
	}
	// The clients end when the cycles are done: the churn ends then, not
	// when the budget is spent.
	clientsDone := make(chan struct{})
	go func() {
		wg.Wait()
		close(clientsDone)
	}()
	var samples []churnPoint
	tick := time.NewTicker(o.sample)
	for done := false; !done; {
		select {
		case <-cctx.Done():
			done = true
		case <-clientsDone:
			done = true
		case <-tick.C:
			if pt, err := point("churn"); err == nil {
				samples = append(samples, pt)
			}
		}
	}
	tick.Stop()
	<-clientsDone
	d := time.Since(churnStart)
	if firstErr != nil {
		return fail("churn", firstErr)
	}
	if ctx.Err() != nil {
		return nil, ctx.Err()
	}
	res.CyclesDone = int(cycles.Load())
	res.CyclesPerSecond = float64(res.CyclesDone) / d.Seconds()
	slices.Sort(lat)
	res.CycleP50Ms, res.CycleP99Ms = percentile(lat, 50), percentile(lat, 99)
	after, err := point(fmt.Sprintf("after %d cycles", res.CyclesDone))
	if err != nil {
		return fail("read the memory", err)
	}
	samples = append(samples, after)
	res.RSSGrowthMiBPer100k = rssSlope(samples[len(samples)/2:]) * 100_000
	if res.CyclesDone < o.cycles {
		res.ExtrapolatedRSSMiB = after.RSSMiB + max(res.RSSGrowthMiBPer100k, 0)*float64(o.cycles-res.CyclesDone)/100_000
	}
	res.LoadAverage = loadAverage()
	res.ElapsedSeconds = time.Since(start).Seconds()
	return res, nil
}

// churnClient runs acquire/release cycles on host until ctx ends or the
// cycles are done, confirming each teardown as the host's agent would, and
// returns each cycle's latency in ms.
func churnClient(ctx context.Context, b *broker, host string, o churnOptions, cycles *atomic.Int64) ([]float64, error) {
	hb, err := b.c.Agent.Heartbeat(ctx)
	if err != nil {
		return nil, err
	}
	go func() {
		for {
			if _, err := hb.Recv(); err != nil {
				return
			}
		}
	}()
	var lat []float64
	for i := 0; ctx.Err() == nil; i++ {
		if cycles.Add(1) > int64(o.cycles) {
			cycles.Add(-1)
			return lat, nil
		}
		t := time.Now()
		r := &gpupoolv1.LeaseRequest{Count: 1, MemoryMib: 1024, ComputePercent: 1, TtlMs: time.Minute.Milliseconds(),
			Holder: "bench-churn", RequestId: fmt.Sprintf("churn-%s-%d", host, i), Constraints: &gpupoolv1.Constraints{Host: host}}
		a, err := b.c.Lease.Acquire(ctx, &gpupoolv1.AcquireRequest{Request: r})
		if status.Code(err) == codes.ResourceExhausted {
			cycles.Add(-1) // the teardowns confirmed have not freed the host yet
			continue
		}
		if err != nil {
			cycles.Add(-1)
			return lat, fmt.Errorf("churn acquire on %s: %w", host, err)
		}
		if _, err := b.c.Lease.Release(ctx, &gpupoolv1.ReleaseRequest{LeaseId: a.Lease.Id}); err != nil {
			cycles.Add(-1)
			return lat, fmt.Errorf("churn release of %s: %w", a.Lease.Id, err)
		}
		if err := hb.Send(&gpupoolv1.HeartbeatRequest{HostId: host, TornDown: []string{a.Lease.Id}}); err != nil {
			cycles.Add(-1)
			return lat, fmt.Errorf("churn teardown of %s: %w", a.Lease.Id, err)
		}
		lat = append(lat, float64(time.Since(t).Microseconds())/1000)
	}
	cycles.Add(-1) // the cycle begun when ctx ended
	return lat, nil
}

// rssSlope is the least-squares slope of RSS (MiB) against cycles.
func rssSlope(pts []churnPoint) float64 {
	if len(pts) < 2 {
		return 0
	}
	var sx, sy, sxx, sxy float64
	for _, p := range pts {
		x, y := float64(p.Cycles), p.RSSMiB
		sx, sy, sxx, sxy = sx+x, sy+y, sxx+x*x, sxy+x*y
	}
	n := float64(len(pts))
	den := n*sxx - sx*sx
	if den == 0 {
		return 0
	}
	return (n*sxy - sx*sy) / den
}

// scrapeGauge reads one unlabelled gauge from a Prometheus text page; NaN
// when it cannot.
func scrapeGauge(ctx context.Context, addr, name string) float64 {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+"/metrics", nil)
	if err != nil {
		return math.NaN()
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return math.NaN()
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), name+" "); ok {
			f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
			if err == nil {
				return f
			}
		}
	}
	return math.NaN()
}

func writeChurnResults(dir string, res *churnResults, stdout io.Writer) error {
	_, err := report.Write(report.Results{Dir: dir, Name: "churn", JSON: res, Markdown: churnMarkdown(res), Echo: stdout})
	return err
}

func churnMarkdown(res *churnResults) string {
	var s strings.Builder
	fmt.Fprintf(&s, "# Broker memory under growth and churn\n\n")
	fmt.Fprintf(&s, "%d hosts × %d GPUs, one broker process; %d churn clients, each cycling acquire → release → teardown confirmed on a host of its own.\n\n",
		res.Config.Hosts, res.Config.GPUsPerHost, res.Config.ChurnClients)
	fmt.Fprintf(&s, "| point | leases granted (held) | churn cycles | ended leases in the state | VmRSS | Go heap in use |\n|---|---:|---:|---:|---:|---:|\n")
	for _, p := range res.Points {
		if p.Label == "churn" {
			continue
		}
		fmt.Fprintf(&s, "| %s | %d | %d | %d | %.0f MiB | %.0f MiB |\n", p.Label, p.Leases, p.Cycles, p.Ended, p.RSSMiB, p.HeapMiB)
	}
	fmt.Fprintf(&s, "\nChurn: %d cycles in %s budget, %.1f cycles/s (cycle p50 %.1f ms, p99 %.1f ms). RSS growth over the second half of the churn: %+.1f MiB per 100k cycles.",
		res.CyclesDone, res.Config.ChurnBudget, res.CyclesPerSecond, res.CycleP50Ms, res.CycleP99Ms, res.RSSGrowthMiBPer100k)
	if res.ExtrapolatedRSSMiB > 0 {
		fmt.Fprintf(&s, " The budget ended the churn before %d cycles; at that slope the RSS after %d cycles would be %.0f MiB (an extrapolation, not a measurement).",
			res.Config.Cycles, res.Config.Cycles, res.ExtrapolatedRSSMiB)
	}
	fmt.Fprintf(&s, "\n\nRSS during the churn (every sample):\n\n| at | cycles | ended leases kept | VmRSS | heap in use |\n|---:|---:|---:|---:|---:|\n")
	for _, p := range res.Points {
		if p.Label == "churn" {
			fmt.Fprintf(&s, "| %.0f s | %d | %d | %.0f MiB | %.0f MiB |\n", p.AtS, p.Cycles, p.Ended, p.RSSMiB, p.HeapMiB)
		}
	}
	fmt.Fprintf(&s, "\nSetup: broker flags %q (empty: the defaults, --ended-lease-retention 1h, --ended-leases-max 10000), --heartbeat-ttl 1h, Raft log in bbolt with fsync; %s %s/%s, %d CPUs, load average %s at the end; the run took %s.\n",
		strings.Join(res.Config.BrokerFlags, " "), res.Env.GoVersion, res.Env.OS, res.Env.Arch, res.Env.CPUs, res.LoadAverage, (time.Duration(res.ElapsedSeconds) * time.Second).String())
	return s.String()
}
