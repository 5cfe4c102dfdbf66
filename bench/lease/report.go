package leasebench

import (
	"bytes"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/gpupool/gpupool/bench/plot"
	"github.com/gpupool/gpupool/bench/report"
)

// writeTable writes res as markdown: both systems per level, the ratios,
// then the run's setup and what each side does per cycle.
func writeTable(w io.Writer, res *results) {
	fmt.Fprintln(w, "| clients | system | cycles/s | samples | acquire p50 (ms) | acquire p99 (ms) | release p50 (ms) | cycle p50 (ms) | cycle p99 (ms) | errors | CAS retries |")
	fmt.Fprintln(w, "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
	for _, l := range res.Levels {
		for _, s := range l.sides() {
			fmt.Fprintf(w, "| %d | %s | %.0f | %d | %.2f | %.2f | %.2f | %.2f | %.2f | %d | %d |\n",
				l.Clients, s.name, s.f.CyclesPerSec, s.f.Samples, s.f.Acquire.P50, s.f.Acquire.P99, s.f.Release.P50,
				s.f.Cycle.P50, s.f.Cycle.P99, s.f.errors(), s.f.Retries)
		}
	}
	fmt.Fprintln(w, "\nRatio gpupool/etcd (throughput: above 1 favours gpupool; latencies: below 1 favours gpupool):")
	fmt.Fprintln(w, "\n| clients | cycles/s | acquire p50 | acquire p99 | cycle p50 | cycle p99 |")
	fmt.Fprintln(w, "|---:|---:|---:|---:|---:|---:|")
	for _, l := range res.Levels {
		r := l.Ratio
		fmt.Fprintf(w, "| %d | %.2f | %.2f | %.2f | %.2f | %.2f |\n", l.Clients, r.CyclesPerSec, r.AcquireP50, r.AcquireP99, r.CycleP50, r.CycleP99)
	}
	fmt.Fprintln(w, "\nAgainst the disk's limit, a loop of 4 KiB write + fsync on the data dirs' disk just before each level "+
		"(cycles per fsync: cycles/s over fsyncs/s, above 1 only with group commit; cycle p50 in fsyncs: one cycle commits twice, so at least 2 without batching):")
	fmt.Fprintln(w, "\n| clients | fsyncs/s | fsync p50 (ms) | fsync p99 (ms) | gpupool cycles per fsync | etcd cycles per fsync | gpupool cycle p50 in fsyncs | etcd cycle p50 in fsyncs |")
	fmt.Fprintln(w, "|---:|---:|---:|---:|---:|---:|---:|---:|")
	for _, l := range res.Levels {
		d := l.Fsync
		fmt.Fprintf(w, "| %d | %.0f | %.2f | %.2f | %.2f | %.2f | %.1f | %.1f |\n", l.Clients, d.PerSec, d.P50, d.P99,
			over(l.Gpupool.CyclesPerSec, d.PerSec), over(l.Etcd.CyclesPerSec, d.PerSec), over(l.Gpupool.Cycle.P50, d.P50), over(l.Etcd.Cycle.P50, d.P50))
	}
	if b := res.Burst; b != nil {
		fmt.Fprintf(w, "\nFairness: %d other clients loop acquire + release on gpupool; then one more client (a connection of its own, no quota) sends %d acquires at once, each released once granted. "+
			"The others' cycle latency, alone and while the burst lasted (%.1f s; %d of its acquires granted, %d refused):\n", b.Clients, b.Burst, b.BurstSeconds, b.BurstOK, b.BurstErrors)
		fmt.Fprintln(w, "\n| other clients | cycle p50 (ms) | cycle p99 (ms) | cycle max (ms) | errors |")
		fmt.Fprintln(w, "|---|---:|---:|---:|---:|")
		fmt.Fprintf(w, "| alone | %.2f | %.2f | %.2f | 0 |\n", b.Quiet.P50, b.Quiet.P99, b.Quiet.Max)
		fmt.Fprintf(w, "| during the burst | %.2f | %.2f | %.2f | %d |\n", b.During.P50, b.During.P99, b.During.Max, b.OtherErrors)
	}
	c, m := res.Config, res.Machine
	fmt.Fprintf(w, "\nEach client loops: acquire a slice of %d MiB and %d%% compute (TTL %s) on a pool of %s (%d such slices at once), then release it. "+
		"Each level ran %s untimed, then %s timed, on gpupool (a fresh cluster per level) then on etcd (one cluster throughout); cycles/s counts the cycles that started and ended in the timed window, the latencies every cycle that started in it. "+
		"On loopback (127.0.0.x), data dirs on %s; etcd %s (client %s). "+
		"%s, %d CPUs, %s; load average %v (start, end); the run took %s.\n",
		c.SliceMemoryMiB, c.SliceComputePercent, time.Duration(c.TTLSeconds*float64(time.Second)), c.Pool, c.PoolSlices,
		time.Duration(c.WarmupSeconds*float64(time.Second)), time.Duration(c.DurationSeconds*float64(time.Second)),
		c.DataDirFS, c.EtcdVersion, c.EtcdClient, m.CPUModel, m.CPUs, m.GoVersion, strings.Join(res.LoadAvg, " / "),
		time.Duration(res.ElapsedSeconds*float64(time.Second)).Round(time.Second))
	for _, l := range res.Levels {
		for _, s := range l.sides() {
			if s.f.FirstAcquireError != "" {
				fmt.Fprintf(w, "\n%s, %d clients: %d acquires failed, the first with: %s\n", s.name, l.Clients, s.f.AcquireErrors, s.f.FirstAcquireError)
			}
			if s.f.IdleError != "" {
				fmt.Fprintf(w, "\n%s, after %d clients: not idle again within a minute after it (%s)\n", s.name, l.Clients, s.f.IdleError)
			}
			if s.f.FirstReleaseError != "" {
				fmt.Fprintf(w, "\n%s, %d clients: %d releases failed, the first with: %s\n", s.name, l.Clients, s.f.ReleaseErrors, s.f.FirstReleaseError)
			}
		}
	}
	for _, s := range res.Systems {
		fmt.Fprintf(w, "\n- **%s**: %s.\n", s.Name, s.Does)
	}
}

// writeResults writes res to dir as lease.json, lease.md and lease.png,
// creating dir.
func writeResults(dir string, res *results) error {
	var md bytes.Buffer
	fmt.Fprintf(&md, "# gpupool vs an allocator on etcd: acquire + release a fractional slice\n\n%s, on %s.\n\n", res.Date, res.Machine.Hostname)
	writeTable(&md, res)
	var x, g, e []float64
	for _, l := range res.Levels {
		x = append(x, float64(l.Clients))
		g = append(g, l.Gpupool.CyclesPerSec)
		e = append(e, l.Etcd.CyclesPerSec)
	}
	chart := plot.Chart{
		Title:  "Acquire + release cycles per second",
		XLabel: "concurrent clients",
		YLabel: "cycles/s",
		ZeroY:  true,
		Series: []plot.Series{{Name: "gpupool (3 brokers)", X: x, Y: g}, {Name: "etcd allocator (3 members)", X: x, Y: e}},
	}
	_, err := report.Write(report.Results{Dir: dir, Name: "lease", JSON: res, Markdown: md.String(), Charts: []report.Chart{{Name: "lease", Chart: chart}}})
	return err
}

// over is a/b, or 0 when b is 0.
func over(a, b float64) float64 {
	if b == 0 {
		return 0
	}
	return a / b
}
