package failover

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/gpupool/gpupool/bench/report"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// The slow-disk benchmark: 3 brokers built with -tags faultinject, whose
// data dir's fault-fsync-delay file slows their Raft log writes, under
// steady acquire+release load. Each case slows one broker's disk: a
// follower's, then the leader's, by 10 ms, 100 ms and 1 s.

// faultFsyncDelayFile is broker.FaultFsyncDelayFile.
const faultFsyncDelayFile = "fault-fsync-delay"

type slowDiskCase struct {
	Name   string        `json:"name"`
	Target string        `json:"target"` // "", "follower" or "leader"
	Delay  time.Duration `json:"delay_ns"`
	// Results.
	Grants        int     `json:"grants"`
	Errors        int     `json:"errors"`
	GrantsPerSec  float64 `json:"grants_per_sec"`
	P50Ms         float64 `json:"acquire_p50_ms"`
	P99Ms         float64 `json:"acquire_p99_ms"`
	LeaderMovedMs float64 `json:"leader_moved_after_ms,omitempty"` // 0: it did not move
	Slowed        string  `json:"slowed,omitempty"`                // the broker slowed
	LeaderAfter   string  `json:"leader_after,omitempty"`
}

type slowDiskResults struct {
	Benchmark string         `json:"benchmark"`
	Date      string         `json:"date"`
	Clients   int            `json:"clients"`
	CaseSecs  float64        `json:"case_seconds"`
	Cases     []slowDiskCase `json:"cases"`
	LoadStart string         `json:"load_average_start"`
	LoadEnd   string         `json:"load_average_end"`
	Env       environment    `json:"env"`
}

const slowDiskUsageHead = `Usage: gpupool-bench slowdisk [flags]

Slows one broker's Raft log writes (fsync) by 10ms, 100ms and 1s, a follower's
then the leader's, under acquire+release load on 3 brokers: grants/s and acquire
p99 per case beside the unslowed baseline, and whether leadership moved.

Flags:
`

// RunSlowDisk is 'gpupool-bench slowdisk'.
func RunSlowDisk(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := report.NewFlags("slowdisk")
	out := fs.String("out", "bench/results", "directory for slowdisk.{json,md}")
	tmp := fs.String("tmp", "", "directory for the brokers' data dirs (default: the system's)")
	dur := fs.Duration("duration", 8*time.Second, "load per case, timed (each case also settles for 2s first)")
	clients := fs.Int("clients", 8, "concurrent clients, each looping acquire + release")
	gpupool := fs.String("gpupool", "", "a gpupool binary built with -tags faultinject (default: build one)")
	if err := report.ParseFlags(fs, args, slowDiskUsageHead, stdout); err != nil {
		return report.UsageExit(stderr, "slowdisk", err)
	}
	switch {
	case *dur < time.Second:
		return report.UsageExit(stderr, "slowdisk", fmt.Errorf("--duration %s: must be at least 1s", *dur))
	case *clients < 1 || *clients > 256:
		return report.UsageExit(stderr, "slowdisk", fmt.Errorf("--clients %d: must be between 1 and 256", *clients))
	}
	p := report.NewProgress(stderr)
	res, err := slowDisk(ctx, *tmp, *gpupool, *dur, *clients, p)
	if res != nil {
		if werr := writeSlowDisk(*out, res, stdout); werr != nil {
			return report.Fail(stderr, "slowdisk", werr)
		}
	}
	if err != nil {
		return report.Fail(stderr, "slowdisk", err)
	}
	return 0
}

func slowDisk(ctx context.Context, tmp, bin string, dur time.Duration, clients int, p *report.Progress) (*slowDiskResults, error) {
	dir, err := os.MkdirTemp(tmp, "gpupool-slowdisk-bench-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	if bin == "" {
		p.Logf("building gpupool with -tags faultinject")
		if bin, err = report.BuildGpupool(ctx, dir, "faultinject"); err != nil {
			return nil, err
		}
	}
	cl, err := startCluster(ctx, bin, dir, p)
	if err != nil {
		return nil, err
	}
	defer cl.stop()
	res := &slowDiskResults{Benchmark: "slowdisk", Date: time.Now().UTC().Format(time.RFC3339), Clients: clients, CaseSecs: dur.Seconds(),
		LoadStart: loadAvg(), Env: environment{GoVersion: runtime.Version(), OS: runtime.GOOS, Arch: runtime.GOARCH, CPUs: runtime.NumCPU()}}
	cases := []slowDiskCase{{Name: "baseline"}}
	for _, target := range []string{"follower", "leader"} {
		for _, d := range []time.Duration{10 * time.Millisecond, 100 * time.Millisecond, time.Second} {
			cases = append(cases, slowDiskCase{Name: fmt.Sprintf("%s +%s", target, d), Target: target, Delay: d})
		}
	}
	for _, c := range cases {
		leader, err := cl.leader(ctx, 30*time.Second)
		if err != nil {
			return res, err
		}
		file := ""
		if c.Target != "" {
			i := leader
			if c.Target == "follower" {
				i = (leader + 1) % brokers
			}
			c.Slowed = brokerID(i)
			file = filepath.Join(dir, brokerID(i), faultFsyncDelayFile)
			if err := os.WriteFile(file, []byte(c.Delay.String()), 0o600); err != nil {
				return res, err
			}
		}
		runSlowDiskCase(ctx, cl, &c, leader, dur, clients)
		if file != "" {
			os.Remove(file)
		}
		p.Logf("%-16s %6.1f grants/s, acquire p50 %.1f ms, p99 %.1f ms, %d errors; leader %s -> %s",
			c.Name, c.GrantsPerSec, c.P50Ms, c.P99Ms, c.Errors, brokerID(leader), c.LeaderAfter)
		res.Cases = append(res.Cases, c)
	}
	res.LoadEnd = loadAvg()
	return res, nil
}

// runSlowDiskCase settles for 2s, then loops acquire+release on clients
// goroutines for dur, and watches the leader.
func runSlowDiskCase(ctx context.Context, cl *cluster, c *slowDiskCase, leader int, dur time.Duration, clients int) {
	start := time.Now()
	timed := start.Add(2 * time.Second)
	end := timed.Add(dur)
	var mu sync.Mutex
	var lat []float64
	var wg sync.WaitGroup
	for range clients {
		wg.Go(func() {
			for time.Now().Before(end) && ctx.Err() == nil {
				sent := time.Now()
				cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
				r, err := cl.c.Lease.Acquire(cctx, &gpupoolv1.AcquireRequest{Request: &gpupoolv1.LeaseRequest{
					Count: 1, MemoryMib: sliceMiB, ComputePercent: slicePercent, TtlMs: 60_000}})
				took := time.Since(sent)
				if err == nil {
					_, _ = cl.c.Lease.Release(cctx, &gpupoolv1.ReleaseRequest{LeaseId: r.Lease.Id})
				}
				cancel()
				if sent.Before(timed) {
					continue
				}
				mu.Lock()
				if err != nil {
					c.Errors++
				} else {
					c.Grants++
					lat = append(lat, millis(took))
				}
				mu.Unlock()
			}
		})
	}
	// Watch for the leader to move while the load runs.
	wg.Go(func() {
		for time.Now().Before(end) && ctx.Err() == nil {
			if i, err := cl.agreedLeader(ctx); err == nil && i != leader && c.LeaderMovedMs == 0 {
				c.LeaderMovedMs = millis(time.Since(start))
			}
			time.Sleep(100 * time.Millisecond)
		}
	})
	wg.Wait()
	if i, err := cl.agreedLeader(ctx); err == nil {
		c.LeaderAfter = brokerID(i)
	}
	slices.Sort(lat)
	c.GrantsPerSec = float64(c.Grants) / dur.Seconds()
	if len(lat) > 0 {
		c.P50Ms, c.P99Ms = percentile(lat, 50), percentile(lat, 99)
	}
}

func writeSlowDisk(dir string, res *slowDiskResults, stdout io.Writer) error {
	var md strings.Builder
	fmt.Fprintf(&md, "# Slow disks: one broker's Raft log writes slowed, under acquire+release load\n\n%s, %d clients, %.0fs timed per case after 2s of settling.\n\n", res.Date, res.Clients, res.CaseSecs)
	md.WriteString("| case | slowed | grants/s | vs baseline | acquire p50 (ms) | acquire p99 (ms) | p99 vs baseline | errors | leadership moved after (s) | leader after |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---|\n")
	var base slowDiskCase
	for i, c := range res.Cases {
		if i == 0 {
			base = c
		}
		moved := "no"
		if c.LeaderMovedMs > 0 {
			moved = fmt.Sprintf("%.1f", c.LeaderMovedMs/1000)
		}
		fmt.Fprintf(&md, "| %s | %s | %.1f | %.2f | %.1f | %.1f | %.2f | %d | %s | %s |\n", c.Name, c.Slowed, c.GrantsPerSec, ratio(c.GrantsPerSec, base.GrantsPerSec),
			c.P50Ms, c.P99Ms, ratio(c.P99Ms, base.P99Ms), c.Errors, moved, c.LeaderAfter)
	}
	fmt.Fprintf(&md, "\nEach broker's data dir has a fault-fsync-delay file (a build with -tags faultinject) that makes every Raft log write sleep first, as a slow fsync would. A leader whose median log write over 5 s exceeds --slow-disk-threshold (default 200ms) hands leadership to a follower, at most once in 30 s; a slow follower is outvoted by the other. The leadership column counts from the start of the case (2 s of settling included). Load average %s (start) / %s (end); %s, %d CPUs.\n",
		res.LoadStart, res.LoadEnd, res.Env.GoVersion, res.Env.CPUs)
	_, err := report.Write(report.Results{Dir: dir, Name: "slowdisk", JSON: res, Markdown: md.String(), Echo: stdout})
	return err
}

func ratio(a, b float64) float64 {
	if b == 0 {
		return 0
	}
	return a / b
}
