package robustness

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/anishathalye/porcupine"
	"google.golang.org/grpc"

	"github.com/gpupool/gpupool/internal/clock"
	"github.com/gpupool/gpupool/internal/proc"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// Config is one seeded run.
type Config struct {
	Seed     uint64
	Duration time.Duration // how long the workload and the faults run
	MaxOps   int64         // the workload stops after this many operations
	Brokers  int           // 3 or 5
	Agents   int
	Workers  int
	Faults   bool
	// FirstFaults are injected first, in order (see Faults.First).
	FirstFaults []string
	ForceProxy  bool
	Bin         string // gpupool binary
	Dir         string // data dirs, logs, visualizations
	Timing      Timing
	Logf        func(format string, args ...any)
}

// Report is what a run saw.
type Report struct {
	Config        Config
	Network       string // kind: description (why)
	Elapsed       time.Duration
	Ops           map[OpKind]OpCounts
	Faults        map[string]FaultCount
	FaultErr      error // the cluster did not recover from a fault
	LeaderChanges int
	Probes        int      // invariant probes answered
	ProbeErrors   []string // over-commits the probes saw
	Check         CheckResult
	Unanswered    []string // the commonest errors of calls without an answer
	Refused       []string // the commonest errors of calls that failed
}

// leaseID matches a lease id, so that errors about different leases count
// as one.
var leaseID = regexp.MustCompile(`l-[0-9a-f]{16}`)

// commonErrors counts the errors of calls without an answer and of calls
// that failed, commonest first.
func commonErrors(records []Record) (unanswered, failed []string) {
	n, f := map[string]int{}, map[string]int{}
	for _, r := range records {
		if r.Err == "" {
			continue
		}
		e := leaseID.ReplaceAllString(r.Err, "l-…")
		if len(e) > 160 {
			e = e[:160] + "…"
		}
		if r.Unknown {
			n[r.Kind.String()+": "+e]++
		} else {
			f[r.Kind.String()+": "+e]++
		}
	}
	top := func(m map[string]int) []string {
		var out []string
		for e, c := range m {
			out = append(out, fmt.Sprintf("%6d × %s", c, e))
		}
		slices.Sort(out)
		slices.Reverse(out)
		return out[:min(len(out), 5)]
	}
	return top(n), top(f)
}

// Violations is every safety violation found.
func (r *Report) Violations() int { return len(r.Check.Violations) + len(r.ProbeErrors) }

// Run starts a cluster, runs the workload (and faults) for cfg.Duration
// or cfg.MaxOps operations, then stops the faults, lets the cluster
// recover, reads the final lease table and checks the history.
func Run(ctx context.Context, cfg Config) (*Report, error) {
	rep := &Report{Config: cfg}
	nw, why := NewNetwork(cfg.ForceProxy)
	defer nw.Close()
	rep.Network = fmt.Sprintf("%s: %s (%s)", nw.Kind(), nw.Describe(), why)
	cfg.Logf("seed %d; network %s", cfg.Seed, rep.Network)

	cl, err := StartCluster(ctx, ClusterOptions{Bin: cfg.Bin, Dir: cfg.Dir, Net: nw, Brokers: cfg.Brokers, Agents: cfg.Agents, Timing: cfg.Timing})
	defer cl.Stop()
	if err != nil {
		return rep, fmt.Errorf("start cluster: %w\n%s", err, cl.logTails())
	}
	devices, err := cl.Client.Pool.ListDevices(ctx, &gpupoolv1.ListDevicesRequest{})
	if err != nil {
		return rep, err
	}

	started := time.Now()
	runCtx, stop := context.WithTimeout(ctx, cfg.Duration)
	defer stop()
	hist := &History{}
	wl := &Workload{Client: cl.Client, History: hist, Seed: cfg.Seed, Workers: cfg.Workers, MaxOps: cfg.MaxOps}
	fl := &Faults{Cluster: cl, Net: nw, Seed: cfg.Seed, Logf: cfg.Logf, First: cfg.FirstFaults}
	var wg sync.WaitGroup
	var faultErr error
	if cfg.Faults {
		wg.Add(1)
		go func() {
			defer wg.Done()
			faultErr = fl.Run(runCtx)
			if faultErr != nil {
				stop()
			}
		}()
	}
	wg.Add(2)
	go func() { defer wg.Done(); rep.LeaderChanges = watchLeader(runCtx, cl) }()
	go func() { defer wg.Done(); rep.Probes, rep.ProbeErrors = probe(runCtx, cl) }()
	wl.Run(runCtx)
	stop()
	wg.Wait()
	rep.FaultErr = faultErr
	rep.Elapsed = time.Since(started)
	rep.Ops = wl.Counts()
	rep.Unanswered, rep.Refused = commonErrors(hist.Records())
	if cfg.Faults {
		rep.Faults = fl.Counts()
	}

	// Every fault lifted: wait for the cluster, then read the final table.
	nw.Heal()
	for _, p := range append(append([]*Proc(nil), cl.Brokers...), cl.Agents...) {
		if !p.Running() {
			p.Start()
		}
	}
	if _, err := cl.WaitLeader(ctx, 60*time.Second); err != nil {
		return rep, fmt.Errorf("no leader after the run: %w\n%s", err, cl.logTails())
	}
	final, err := finalLeases(ctx, cl)
	if err != nil {
		return rep, fmt.Errorf("final lease table: %w", err)
	}
	rep.Check = Check(hist.Records(), final, devices.Devices, cfg.Dir, time.Minute)
	if errs := overCommits(final, devices.Devices); len(errs) > 0 {
		rep.ProbeErrors = append(rep.ProbeErrors, errs...)
	}
	return rep, nil
}

// finalLeases reads every lease, ended ones too, host by host (a long
// run's table is tens of megabytes).
func finalLeases(ctx context.Context, cl *Cluster) ([]*gpupoolv1.Lease, error) {
	seen := map[string]bool{}
	var out []*gpupoolv1.Lease
	for _, a := range cl.Agents {
		err := proc.Poll(ctx, 3*time.Minute, func(context.Context) error {
			cctx, cancel := context.WithTimeout(ctx, time.Minute)
			defer cancel()
			resp, err := cl.Client.Lease.List(cctx, &gpupoolv1.ListLeasesRequest{Host: a.Node, IncludeEnded: true}, grpc.MaxCallRecvMsgSize(1<<30))
			if err != nil {
				return err
			}
			for _, l := range resp.Leases {
				if !seen[l.Id] {
					seen[l.Id] = true
					out = append(out, l)
				}
			}
			return nil
		})
		if err != nil {
			return nil, fmt.Errorf("leases of %s: %w", a.Node, err)
		}
	}
	return out, nil
}

// watchLeader counts leader changes until ctx ends.
func watchLeader(ctx context.Context, cl *Cluster) int {
	changes, last := 0, -1
	for clock.Sleep(ctx, clock.Real, 200*time.Millisecond) {
		i, err := cl.Leader(ctx)
		if err != nil {
			continue
		}
		if last >= 0 && i != last {
			changes++
		}
		last = i
	}
	return changes
}

// probe checks, every second until ctx ends, that no device holds more
// than it has: in the lease table, and in the devices' own records.
func probe(ctx context.Context, cl *Cluster) (int, []string) {
	n := 0
	var errs []string
	for clock.Sleep(ctx, clock.Real, time.Second) {
		cctx, cancel := context.WithTimeout(ctx, 3*time.Second)
		ls, err := cl.Client.Lease.List(cctx, &gpupoolv1.ListLeasesRequest{})
		var ds *gpupoolv1.ListDevicesResponse
		if err == nil {
			ds, err = cl.Client.Pool.ListDevices(cctx, &gpupoolv1.ListDevicesRequest{})
		}
		cancel()
		if err != nil {
			continue
		}
		n++
		errs = append(errs, overCommits(ls.Leases, ds.Devices)...)
		if len(errs) > 20 {
			errs = errs[:20] // enough to see it
		}
	}
	return n, errs
}

// overCommits lists the devices that the holding leases, or the
// devices' own allocation records, over-commit.
func overCommits(leases []*gpupoolv1.Lease, devices []*gpupoolv1.Device) []string {
	capacity := map[string]int64{}
	for _, d := range devices {
		capacity[d.Uuid] = d.MemoryMib
	}
	mem, comp := map[string]int64{}, map[string]int32{}
	for _, l := range leases {
		if l.State != gpupoolv1.LeaseState_LEASE_STATE_GRANTED && l.State != gpupoolv1.LeaseState_LEASE_STATE_RELEASING {
			continue
		}
		for _, s := range l.Slices {
			mem[s.Device] += s.MemoryMib
			comp[s.Device] += s.ComputePercent
		}
	}
	var errs []string
	for d := range mem {
		if c, ok := capacity[d]; ok && mem[d] > c || comp[d] > 100 {
			errs = append(errs, fmt.Sprintf("%s: leases hold %d MiB of %d MiB and %d%% compute", d, mem[d], capacity[d], comp[d]))
		}
	}
	for _, d := range devices {
		if d.AllocatedMemoryMib > d.MemoryMib || d.AllocatedComputePercent > 100 {
			errs = append(errs, fmt.Sprintf("%s: records %d/%d MiB and %d%% allocated", d.Uuid, d.AllocatedMemoryMib, d.MemoryMib, d.AllocatedComputePercent))
		}
	}
	slices.Sort(errs)
	return errs
}

func (cl *Cluster) logTails() string {
	var b strings.Builder
	for _, p := range append(append([]*Proc(nil), cl.Brokers...), cl.Agents...) {
		fmt.Fprintf(&b, "---- %s (last 3 KiB of %s) ----\n%s\n", p.Node, p.Log, p.LogTail(3072))
	}
	return b.String()
}

// Table is the run's summary: operations by kind, faults by kind, leader
// changes, the porcupine result and the violations.
func (r *Report) Table() string {
	var b strings.Builder
	c := r.Config
	fmt.Fprintf(&b, "seed %d · %d brokers, %d agents (8 simulated A100-80GB each), %d clients · ran %s (limit %s or %d operations)\n",
		c.Seed, c.Brokers, c.Agents, c.Workers, r.Elapsed.Round(time.Second), c.Duration, c.MaxOps)
	fmt.Fprintf(&b, "network: %s\n\n", r.Network)
	tw := tabwriter.NewWriter(&b, 0, 0, 2, ' ', tabwriter.AlignRight|tabwriter.Debug)
	fmt.Fprintln(tw, "operation\tok\tfailed/refused\tno answer\t")
	var tot OpCounts
	for _, k := range []OpKind{OpAcquire, OpRelease, OpKeepAlive, OpGet} {
		o := r.Ops[k]
		tot.OK, tot.Failed, tot.Unknown = tot.OK+o.OK, tot.Failed+o.Failed, tot.Unknown+o.Unknown
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t\n", k, o.OK, o.Failed, o.Unknown)
	}
	fmt.Fprintf(tw, "total\t%d\t%d\t%d\t\n", tot.OK, tot.Failed, tot.Unknown)
	tw.Flush()
	if r.Faults != nil {
		b.WriteString("\n")
		tw = tabwriter.NewWriter(&b, 0, 0, 2, ' ', tabwriter.Debug)
		fmt.Fprintln(tw, "fault\tinjected\tskipped\tnote\t")
		kinds := append(slices.Clone(FaultKinds), FaultPause)
		for _, k := range kinds {
			f, ok := r.Faults[k]
			if !ok {
				continue
			}
			note := f.Detail
			if f.Why != "" && f.Injected == 0 {
				note = f.Why
			}
			if k == FaultSlowLink || slices.Contains(MoreFaultKinds, k) || f.Injected == 0 {
				fmt.Fprintf(tw, "%s\t%d\t%d\t%s\t\n", k, f.Injected, f.Skipped, note)
			} else {
				fmt.Fprintf(tw, "%s\t%d\t%d\t\t\n", k, f.Injected, f.Skipped)
			}
		}
		tw.Flush()
	}
	for _, l := range []struct {
		title string
		errs  []string
	}{{"calls without an answer", r.Unanswered}, {"failed or refused calls", r.Refused}} {
		if len(l.errs) > 0 {
			fmt.Fprintf(&b, "\ncommonest errors of %s:\n", l.title)
			for _, e := range l.errs {
				fmt.Fprintf(&b, "  %s\n", e)
			}
		}
	}
	fmt.Fprintf(&b, "\nleader changes: %d\n", r.LeaderChanges)
	fmt.Fprintf(&b, "porcupine: %s (%d devices, %d operations checked, %d unanswered reads or ungranted acquires left out)\n",
		porcupineName(r.Check.Result), r.Check.Devices, r.Check.Operations, r.Check.Dropped)
	fmt.Fprintf(&b, "over-commit probes: %d answered, %d over-commits\n", r.Probes, len(r.ProbeErrors))
	fmt.Fprintf(&b, "violations: %d\n", r.Violations())
	if r.FaultErr != nil {
		fmt.Fprintf(&b, "the cluster did not recover: %v\n", r.FaultErr)
	}
	for _, v := range r.Check.Violations {
		fmt.Fprintf(&b, "\nVIOLATION on device %s (reproduce with GPUPOOL_ROBUSTNESS_SEED=%d; visualization: %s)\n%s", v.Device, c.Seed, v.File, v.Window)
	}
	for _, e := range r.ProbeErrors {
		fmt.Fprintf(&b, "\nVIOLATION (over-commit; reproduce with GPUPOOL_ROBUSTNESS_SEED=%d): %s\n", c.Seed, e)
	}
	return b.String()
}

func porcupineName(r porcupine.CheckResult) string {
	switch r {
	case porcupine.Ok:
		return "linearizable"
	case porcupine.Illegal:
		return "NOT linearizable"
	}
	return "unknown (the check timed out)"
}

// WriteTable writes the table to dir/summary.txt as well.
func (r *Report) WriteTable(dir string) (string, error) {
	p := filepath.Join(dir, "summary.txt")
	return p, os.WriteFile(p, []byte(r.Table()), 0o644)
}
