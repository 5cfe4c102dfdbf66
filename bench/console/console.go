// Package console measures the web console's pool page on a large pool:
// one broker (in this process, no agents: hosts are registered through the
// agent API and kept ready with a long heartbeat TTL) with 10k hosts of 8
// GPUs and some leases, its console, and Debian's headless Chromium.
//
// It reports the server's render (the whole HTML of the page, over HTTP),
// the browser's first full render (navigation to the last host's row laid
// out and painted), and how long a lease takes to show on the open page
// (the live stream's round trip), against the goal of 2 s to first full
// render. It writes bench/results/console.{json,md}.
package console

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/chromedp/chromedp"
	"google.golang.org/grpc"

	"github.com/gpupool/gpupool/bench/report"
	"github.com/gpupool/gpupool/broker"
	"github.com/gpupool/gpupool/client"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// Goal is the pool page's first full render the console issue asks for.
const Goal = 2 * time.Second

type options struct {
	hosts, gpus, leases, runs int
	out, chromium             string
}

// Result is what the benchmark writes as JSON.
type Result struct {
	Hosts, GPUs, Leases int
	Runs                int
	PageBytes           int
	// Server: the whole page over HTTP (ms), per run.
	ServerMs []float64
	// ListHostsMs: the consistent ListHosts the page reads first (ms).
	ListHostsMs []float64
	// Browser: navigation start to the last row laid out and painted (ms).
	BrowserMs []float64
	// FirstPaintMs: the browser's first contentful paint (ms).
	FirstPaintMs []float64
	// UpdateMs: a lease acquired to its GPU marked on the open page (ms).
	UpdateMs []float64
	// Medians.
	ServerP50, ListHostsP50, BrowserP50, FirstPaintP50, UpdateP50 float64
	GoalMs                                                        float64
	// GoalRatio is the browser's median over the goal (below 1 meets it).
	GoalRatio float64
	Chromium  string
	Date      string
}

const usageHead = `Usage: gpupool-bench console [flags]

The web console's pool page on simulated hosts: its server render, a headless
Chromium's first full render (goal 2 s) and a live update.

Flags:
`

// Run is the benchmark's entry point: 'gpupool-bench console [flags]'.
func Run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := report.NewFlags("console")
	var o options
	fs.IntVar(&o.hosts, "hosts", 10000, "simulated hosts (1-100000)")
	fs.IntVar(&o.gpus, "gpus", 8, "GPUs per host (1-16)")
	fs.IntVar(&o.leases, "leases", 2000, "fractional leases granted before measuring (0-1000000)")
	fs.IntVar(&o.runs, "runs", 5, "page loads to measure (1-100)")
	fs.StringVar(&o.out, "out", filepath.Join("bench", "results"), "directory for console.json and console.md")
	fs.StringVar(&o.chromium, "chromium", "", "Chromium binary (default: chromium on PATH; 'make bench-console' installs Debian's)")
	if err := report.ParseFlags(fs, args, usageHead, stdout); err != nil {
		return report.UsageExit(stderr, "console", err)
	}
	for _, c := range []struct {
		name     string
		v, lo, h int
	}{{"hosts", o.hosts, 1, 100000}, {"gpus", o.gpus, 1, 16}, {"leases", o.leases, 0, 1000000}, {"runs", o.runs, 1, 100}} {
		if c.v < c.lo || c.v > c.h {
			return report.UsageExit(stderr, "console", fmt.Errorf("--%s %d: must be between %d and %d", c.name, c.v, c.lo, c.h))
		}
	}
	if o.chromium == "" {
		p, err := exec.LookPath("chromium")
		if err != nil {
			return report.Fail(stderr, "console", errors.New("chromium is not on PATH: install Debian's chromium ('make bench-console' does) or pass --chromium"))
		}
		o.chromium = p
	}
	res, err := run(ctx, o, stderr)
	if err != nil {
		return report.Fail(stderr, "console", err)
	}
	if err := write(o.out, res, stdout); err != nil {
		return report.Fail(stderr, "console", err)
	}
	return 0
}

func run(ctx context.Context, o options, log io.Writer) (*Result, error) {
	dir, err := os.MkdirTemp("", "gpupool-bench-console-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	b, err := broker.New(broker.Config{DataDir: dir, BindAddr: "127.0.0.1:0", RaftBindAddr: "127.0.0.1:0", BootstrapExpect: 1,
		HeartbeatTTL: 24 * time.Hour, PlacementWindow: 1024, UI: broker.UIConfig{Bind: "127.0.0.1:0"}})
	if err != nil {
		return nil, err
	}
	defer b.Shutdown()
	c, err := client.Dial([]string{b.Addr()})
	if err != nil {
		return nil, err
	}
	defer c.Close()
	start := time.Now()
	fmt.Fprintf(log, "registering %d hosts with %d GPUs each ...\n", o.hosts, o.gpus)
	if err := parallel(ctx, o.hosts, func(ctx context.Context, i int) error {
		h := &gpupoolv1.Host{Id: fmt.Sprintf("host-%05d", i), Address: "127.0.0.1:1", CpuMillicores: 128000, MemoryMib: 1 << 20,
			Labels: map[string]string{"zone": fmt.Sprintf("z%d", i%4)}}
		for g := range o.gpus {
			h.Devices = append(h.Devices, &gpupoolv1.Device{Uuid: fmt.Sprintf("GPU-%05d-%02d", i, g), Index: int32(g), Model: "A100-SXM4-80GB", MemoryMib: 81920})
		}
		_, err := c.Agent.Register(ctx, &gpupoolv1.RegisterRequest{Host: h})
		return err
	}); err != nil {
		return nil, fmt.Errorf("register: %w", err)
	}
	fmt.Fprintf(log, "registered in %s; granting %d leases ...\n", time.Since(start).Round(time.Millisecond), o.leases)
	if err := parallel(ctx, o.leases, func(ctx context.Context, i int) error {
		_, err := c.Lease.Acquire(ctx, &gpupoolv1.AcquireRequest{Request: &gpupoolv1.LeaseRequest{Count: 1, MemoryMib: int64(4096 * (1 + i%8)), ComputePercent: int32(10 + i%40), TtlMs: 24 * 3600 * 1000, Tenant: fmt.Sprintf("t%d", i%5)}})
		return err
	}); err != nil {
		return nil, fmt.Errorf("acquire: %w", err)
	}
	url := b.UIURL()
	last := fmt.Sprintf("row-host-%05d", o.hosts-1)
	res := &Result{Hosts: o.hosts, GPUs: o.hosts * o.gpus, Leases: o.leases, Runs: o.runs, GoalMs: ms(Goal), Chromium: o.chromium, Date: time.Now().UTC().Format(time.RFC3339)}

	// The read under the page: every host through the leader.
	for i := range o.runs {
		t0 := time.Now()
		if _, err := c.Pool.ListHosts(ctx, &gpupoolv1.ListHostsRequest{}, grpc.MaxCallRecvMsgSize(512<<20)); err != nil {
			return nil, err
		}
		res.ListHostsMs = append(res.ListHostsMs, ms(time.Since(t0)))
		fmt.Fprintf(log, "ListHosts %d: %.0f ms\n", i+1, res.ListHostsMs[i])
	}

	// The server's render: the whole page over HTTP.
	for i := range o.runs {
		t0 := time.Now()
		resp, err := http.Get(url)
		if err != nil {
			return nil, err
		}
		n, err := io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if err != nil || resp.StatusCode != 200 {
			return nil, fmt.Errorf("GET %s: %d %v", url, resp.StatusCode, err)
		}
		res.ServerMs = append(res.ServerMs, ms(time.Since(t0)))
		res.PageBytes = int(n)
		fmt.Fprintf(log, "server render %d: %.0f ms, %d bytes\n", i+1, res.ServerMs[i], n)
	}

	// The browser: navigation to the last row painted.
	actx, cancel := chromedp.NewExecAllocator(ctx, chromedp.ExecPath(o.chromium), chromedp.Headless, chromedp.NoSandbox, chromedp.DisableGPU,
		chromedp.NoFirstRun, chromedp.Flag("disable-quic", true), chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-component-update", true), chromedp.Flag("disable-sync", true), chromedp.Flag("disable-dev-shm-usage", true),
		chromedp.UserDataDir(filepath.Join(dir, "chromium")), chromedp.WindowSize(1400, 900))
	defer cancel()
	bctx, cancel := chromedp.NewContext(actx)
	defer cancel()
	if err := chromedp.Do(bctx); err != nil {
		return nil, fmt.Errorf("start chromium: %w", err)
	}
	for i := range o.runs {
		rctx, cancel := context.WithTimeout(bctx, 2*time.Minute)
		err := chromedp.Do(rctx, chromedp.Navigate("about:blank"), chromedp.Navigate(url), chromedp.WaitVisible(chromedp.ID(last)))
		if err != nil {
			cancel()
			return nil, fmt.Errorf("load the pool page: %w", err)
		}
		// Two animation frames after the last row exists: it is painted.
		t, err := chromedp.Run(rctx, chromedp.Evaluate[[]float64](`new Promise(r => requestAnimationFrame(() => requestAnimationFrame(() => {
			const fcp = performance.getEntriesByName("first-contentful-paint")[0];
			r([performance.now(), fcp ? fcp.startTime : -1]);
		})))`, chromedp.EvalAwaitPromise))
		cancel()
		if err != nil || len(t) != 2 {
			return nil, fmt.Errorf("read the page's timing: %v", err)
		}
		res.BrowserMs = append(res.BrowserMs, t[0])
		res.FirstPaintMs = append(res.FirstPaintMs, t[1])
		fmt.Fprintf(log, "browser render %d: %.0f ms (first paint %.0f ms)\n", i+1, t[0], t[1])
	}

	// Responsiveness: a lease granted while the page is open.
	for i := range o.runs {
		host := fmt.Sprintf("host-%05d", (i*7919)%o.hosts)
		before, err := chromedp.Run(bctx, chromedp.Evaluate[int](fmt.Sprintf(`[...document.querySelectorAll("#row-%s [data-leases]")].reduce((n, e) => n + Number(e.dataset.leases), 0)`, host)))
		if err != nil {
			return nil, err
		}
		t0 := time.Now()
		if _, err := c.Lease.Acquire(ctx, &gpupoolv1.AcquireRequest{Request: &gpupoolv1.LeaseRequest{Count: 1, MemoryMib: 1024, ComputePercent: 5, TtlMs: 3600_000, Tenant: "probe",
			Constraints: &gpupoolv1.Constraints{Host: host}}}); err != nil {
			return nil, err
		}
		deadline := time.Now().Add(time.Minute)
		for {
			n, err := chromedp.Run(bctx, chromedp.Evaluate[int](fmt.Sprintf(`[...document.querySelectorAll("#row-%s [data-leases]")].reduce((n, e) => n + Number(e.dataset.leases), 0)`, host)))
			if err != nil {
				return nil, err
			}
			if n > before {
				break
			}
			if time.Now().After(deadline) {
				return nil, errors.New("a new lease did not show on the open pool page within a minute")
			}
			time.Sleep(10 * time.Millisecond)
		}
		res.UpdateMs = append(res.UpdateMs, ms(time.Since(t0)))
		fmt.Fprintf(log, "live update %d: %.0f ms\n", i+1, res.UpdateMs[i])
	}
	res.ServerP50, res.ListHostsP50, res.BrowserP50, res.FirstPaintP50, res.UpdateP50 = median(res.ServerMs), median(res.ListHostsMs), median(res.BrowserMs), median(res.FirstPaintMs), median(res.UpdateMs)
	res.GoalRatio = res.BrowserP50 / res.GoalMs
	return res, nil
}

// parallel runs f for 0..n-1 on 16 workers, stopping at the first error.
func parallel(ctx context.Context, n int, f func(context.Context, int) error) error {
	var next atomic.Int64
	var wg sync.WaitGroup
	var once sync.Once
	var first error
	var failed atomic.Bool
	for range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := int(next.Add(1)) - 1
				if i >= n || failed.Load() {
					return
				}
				cctx, cancel := context.WithTimeout(ctx, time.Minute)
				err := f(cctx, i)
				cancel()
				if err != nil {
					once.Do(func() { first = err; failed.Store(true) })
					return
				}
			}
		}()
	}
	wg.Wait()
	return first
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

func median(v []float64) float64 {
	if len(v) == 0 {
		return 0
	}
	s := slices.Clone(v)
	slices.Sort(s)
	return s[len(s)/2]
}

func write(dir string, r *Result, stdout io.Writer) error {
	_, err := report.Write(report.Results{Dir: dir, Name: "console", JSON: r, Markdown: markdown(r), Echo: stdout})
	return err
}

func markdown(r *Result) string {
	verdict := "meets"
	if r.GoalRatio >= 1 {
		verdict = "misses"
	}
	return fmt.Sprintf(`# Console: the pool page on %d hosts

%d hosts × %d GPUs (%d GPUs), %d leases; one broker in process, its console, headless Chromium (%s); median of %d runs, %s.

| measure | median (ms) | runs (ms) |
|---|---:|---|
| server: ListHosts of the whole pool (the read under the page) | %.0f | %v |
| server render (whole page over HTTP, %d KiB) | %.0f | %v |
| browser: first contentful paint | %.0f | %v |
| browser: navigation to the last row painted | %.0f | %v |
| live update: lease acquired → its GPU marked on the open page | %.0f | %v |

First full render against the goal of %.0f ms: **%.2f×** (%s it).
`, r.Hosts, r.Hosts, r.GPUs/max(r.Hosts, 1), r.GPUs, r.Leases, r.Chromium, r.Runs, r.Date,
		r.ListHostsP50, rounded(r.ListHostsMs), r.PageBytes/1024, r.ServerP50, rounded(r.ServerMs), r.FirstPaintP50, rounded(r.FirstPaintMs), r.BrowserP50, rounded(r.BrowserMs),
		r.UpdateP50, rounded(r.UpdateMs), r.GoalMs, r.GoalRatio, verdict)
}

func rounded(v []float64) []int {
	out := make([]int, len(v))
	for i, x := range v {
		out[i] = int(x + 0.5)
	}
	return out
}
