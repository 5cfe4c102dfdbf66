// Command elastic-sim is a simulation job on an elastic gpupool lease: it
// is guaranteed --min slices, the brokers lend it more, up to --max, while
// the pool has room, and take the extras back, with notice, when waiting
// guaranteed work needs them. The job runs one worker per slice it holds
// and moves its work as the lease grows and shrinks.
//
// No GPU is used: a work unit is a small CPU computation (a Monte Carlo
// estimate of pi), and a slice's compute share sets how many units its
// worker is given per tick.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"google.golang.org/grpc/status"

	"github.com/gpupool/gpupool/client"
	"github.com/gpupool/gpupool/internal/quantity"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

const usageHead = `Usage: go run ./examples/elastic-sim [flags]

A simulation job on an elastic lease. It asks the brokers for --min
guaranteed slices of --memory and --compute each and lets them add extra
slices of the same size, up to --max in all, while the pool has room. It
runs one worker per slice it holds and spreads its work over them:

  - when the lease grows, a worker starts on the new slice at once;
  - on a shrink notice, the leaving slice gets no new work: its unstarted
    units go back to the queue and the unit it is running is saved when it
    finishes, well before the deadline;
  - when an extra ends, its worker goes.

Each tick prints the slices held, the units done and the rate; every
change prints a line as it happens (+ grew, - shrink notice, - shrank).
With --show-pool (the default) each tick also records the GPUs the pool's
other guaranteed leases hold, the load the lease shrinks and grows for.
The job ends after --work units, after --duration, or on Ctrl-C; it then
releases the lease and writes --csv and --plot.

No GPU is used: a work unit is a Monte Carlo estimate of pi on the CPU,
and a slice's compute share sets how many units its worker gets per tick
(--units-per-gpu for a whole GPU). Exit code 1 when the job fails or loses
its lease, 2 for a usage error.

Examples:
  gpupool dev                # in another terminal: a local pool
  go run ./examples/elastic-sim --min 2 --max 16 --memory 20GiB --compute 25 --plot elastic.png
  go run ./examples/elastic-sim --work 5000 --csv /tmp/sim.csv
  GPUPOOL_ADDR=10.0.0.5:7641 GPUPOOL_TOKEN=<client token> go run ./examples/elastic-sim --duration 10m

Flags:
`

// Bounds of the flags, checked before anything is asked of the brokers.
const (
	minTick      = 100 * time.Millisecond
	minTTL       = time.Second
	maxTTL       = 24 * time.Hour
	maxUnitsTick = 100_000
)

// options is a validated command line.
type options struct {
	brokers  []string
	min, max int32
	memory   int64 // MiB per slice
	compute  int32 // percent per slice
	tenant   string
	holder   string
	ttl      time.Duration
	wait     time.Duration // in the pending queue, for the guaranteed slices
	duration time.Duration // 0: until Ctrl-C or the work is done
	work     int64         // units in all; 0: endless
	perGPU   int           // units a whole GPU is given per tick
	tick     time.Duration
	csv      string
	plot     string
	showPool bool // record the GPUs other guaranteed leases hold
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	go func() {
		// After the first Ctrl-C the job winds down; a second one kills it.
		<-ctx.Done()
		stop()
	}()
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// run runs the job for the command-line arguments args and returns the
// exit code: 0, 1 when the job failed, 2 for a usage error. --help prints
// the usage to stdout and returns 0.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	o, err := parseFlags(args, stdout)
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	if err != nil {
		fmt.Fprintf(stderr, "elastic-sim: %v\nRun with --help for the usage.\n", err)
		return 2
	}
	if err := simulate(ctx, o, stdout); err != nil {
		fmt.Fprintf(stderr, "elastic-sim: %v\n", err)
		return 1
	}
	return 0
}

// defaultBrokers is what gpupool's own CLI talks to: $GPUPOOL_ADDR, or
// the cluster 'gpupool dev' runs.
func defaultBrokers() string {
	if a := os.Getenv("GPUPOOL_ADDR"); a != "" {
		return a
	}
	return strings.Join(client.DefaultAddrs, ",")
}

func defaultHolder() string {
	host, err := os.Hostname()
	if err != nil || host == "" {
		host = "localhost"
	}
	return fmt.Sprintf("elastic-sim@%s/%d", host, os.Getpid())
}

// parseFlags parses and validates args. On --help it writes the usage to
// help and returns flag.ErrHelp.
func parseFlags(args []string, help io.Writer) (options, error) {
	fs := flag.NewFlagSet("elastic-sim", flag.ContinueOnError)
	// Errors are returned, not printed: run prints them once.
	fs.SetOutput(io.Discard)
	brokers := fs.String("brokers", defaultBrokers(), "broker `addresses`, comma-separated (default $GPUPOOL_ADDR, else the cluster 'gpupool dev' runs)")
	minSlices := fs.Int("min", 1, "guaranteed slices: the job does not start without them and keeps them to the end")
	maxSlices := fs.Int("max", 8, "most slices in all, guaranteed and extra; extras come and go with the pool's free room")
	memory := fs.String("memory", "10GiB", "GPU memory per slice: 20GiB, 512MiB, or a plain number of MiB")
	compute := fs.String("compute", "25", "compute per slice in percent of one GPU, 1-100; it also scales the slice's units per tick")
	tenant := fs.String("tenant", "sim", "tenant whose quota the lease counts against")
	holder := fs.String("holder", defaultHolder(), "who holds the lease, as 'gpupool lease ls' shows it")
	ttl := fs.Duration("ttl", 30*time.Second, "lease TTL, 1s to 24h; the lease is renewed in the background, so this is how long it outlives a crash")
	wait := fs.Duration("wait", 2*time.Minute, "how long to wait in the brokers' queue for the guaranteed slices (0: fail at once if they do not fit)")
	duration := fs.Duration("duration", 0, "stop after this long from the grant (0: run until Ctrl-C or --work is done)")
	work := fs.Int64("work", 0, "work units in all: the job ends when they are done (0: endless)")
	perGPU := fs.Int("units-per-gpu", 100, fmt.Sprintf("work `units` a whole GPU is given per tick, 1-%d; a slice is given its compute share of them", maxUnitsTick))
	tick := fs.Duration("tick", time.Second, "how often to hand out work, print progress and record a CSV row (at least 100ms)")
	csvPath := fs.String("csv", "", "at exit, write one row a tick to this `file`: t_seconds,slices,leaving,units_done,other_guaranteed_gpus")
	plotPath := fs.String("plot", "", "at exit, draw the slices held over time as a step chart in this PNG `file`")
	showPool := fs.Bool("show-pool", true, "once a tick, list the pool's granted leases and record the GPUs other guaranteed leases hold, the load the lease shrinks for (a CSV column and a line on the chart; --show-pool=false to skip)")

	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			printUsage(help, fs)
		}
		return options{}, err
	}
	o := options{
		brokers: client.ParseAddrs(*brokers), min: int32(*minSlices), max: int32(*maxSlices),
		tenant: strings.TrimSpace(*tenant), holder: *holder, ttl: *ttl, wait: *wait, duration: *duration,
		work: *work, perGPU: *perGPU, tick: *tick, csv: *csvPath, plot: *plotPath, showPool: *showPool,
	}
	var err error
	if o.memory, err = quantity.ParseMemoryMiB(*memory); err != nil {
		return options{}, fmt.Errorf("--memory: %w", err)
	}
	if o.compute, err = quantity.ParsePercent(*compute); err != nil {
		return options{}, fmt.Errorf("--compute: %w", err)
	}
	switch {
	case fs.NArg() > 0:
		return options{}, fmt.Errorf("unexpected argument %q: this command takes only flags", fs.Arg(0))
	case len(o.brokers) == 0:
		return options{}, errors.New("--brokers is empty: give one or more broker addresses, e.g. 127.0.0.1:7641")
	case *minSlices < 1 || *minSlices > 1<<16:
		return options{}, fmt.Errorf("--min %d: must be between 1 and %d", *minSlices, 1<<16)
	case *maxSlices < *minSlices || *maxSlices > 1<<16:
		return options{}, fmt.Errorf("--max %d: must be between --min (%d) and %d", *maxSlices, *minSlices, 1<<16)
	case o.memory < 1:
		return options{}, fmt.Errorf("--memory %s: a slice needs at least 1MiB", *memory)
	case o.tenant == "":
		return options{}, errors.New("--tenant is empty: name the tenant whose quota the lease counts against, e.g. --tenant sim")
	case o.ttl < minTTL || o.ttl > maxTTL:
		return options{}, fmt.Errorf("--ttl %s: must be between %s and %s", o.ttl, minTTL, maxTTL)
	case o.wait < 0:
		return options{}, fmt.Errorf("--wait %s: must not be negative (0 fails at once when the slices do not fit)", o.wait)
	case o.duration < 0:
		return options{}, fmt.Errorf("--duration %s: must not be negative (0 runs until Ctrl-C)", o.duration)
	case o.work < 0:
		return options{}, fmt.Errorf("--work %d: must not be negative (0 is endless)", o.work)
	case o.perGPU < 1 || o.perGPU > maxUnitsTick:
		return options{}, fmt.Errorf("--units-per-gpu %d: must be between 1 and %d", o.perGPU, maxUnitsTick)
	case o.tick < minTick:
		return options{}, fmt.Errorf("--tick %s: must be at least %s", o.tick, minTick)
	case o.plot != "" && !strings.EqualFold(filepath.Ext(o.plot), ".png"):
		return options{}, fmt.Errorf("--plot %s: the chart is a PNG: name the file *.png", o.plot)
	}
	return o, nil
}

// printUsage writes the usage, spelling flags with two dashes as the
// examples do (one dash works too).
func printUsage(w io.Writer, fs *flag.FlagSet) {
	fmt.Fprint(w, usageHead)
	fs.VisitAll(func(f *flag.Flag) {
		arg, usage := flag.UnquoteUsage(f)
		def := ""
		if f.DefValue != "" && f.DefValue != "0" && f.DefValue != "0s" {
			def = fmt.Sprintf(" (default %s)", f.DefValue)
		}
		fmt.Fprintf(w, "  --%s %s\n    \t%s%s\n", f.Name, arg, usage, def)
	})
}

// request is the elastic lease the options ask for.
func (o options) request() *gpupoolv1.LeaseRequest {
	return &gpupoolv1.LeaseRequest{
		Count:          o.min,
		ElasticMax:     o.max,
		MemoryMib:      o.memory,
		ComputePercent: o.compute,
		TtlMs:          o.ttl.Milliseconds(),
		Tenant:         o.tenant,
		Holder:         o.holder,
		Class:          gpupoolv1.LeaseClass_LEASE_CLASS_GUARANTEED,
	}
}

// simulate acquires the lease, runs the job on it until it ends, then
// releases the lease and writes the CSV and the chart. It returns an
// error wrapping errLeaseLost when the lease ended under the job.
func simulate(ctx context.Context, o options, out io.Writer) error {
	// With ACL on, the job's client token comes from $GPUPOOL_TOKEN, as
	// for the CLI; 'gpupool dev' needs none.
	c, err := client.DialWith(o.brokers, client.Options{Token: os.Getenv("GPUPOOL_TOKEN")})
	if err != nil {
		return err
	}
	defer c.Close()

	fmt.Fprintf(out, "asking for %d guaranteed slices, up to %d in all, of %s and %d%% compute each (tenant %s); waiting up to %s\n",
		o.min, o.max, quantity.FormatMiB(o.memory), o.compute, o.tenant, o.wait)
	lastWhy := ""
	progress := func(p *gpupoolv1.Lease) {
		if why := p.GetPendingReason(); why != lastWhy {
			lastWhy = why
			fmt.Fprintf(out, "  waiting: %s\n", orDash(why))
		}
	}
	l, err := c.Acquire(ctx, o.request(), client.WithWait(o.wait), client.WithPendingProgress(progress))
	switch {
	case err != nil && ctx.Err() != nil:
		return fmt.Errorf("interrupted while waiting for %d guaranteed slices", o.min)
	case err != nil:
		return fmt.Errorf("acquire %d guaranteed slices: %s", o.min, status.Convert(err).Message())
	}
	granted := time.Now()
	fmt.Fprintf(out, "granted %s at %s\n", l.ID(), granted.Format(time.TimeOnly))

	j := newJob(jobConfig{parent: l.ID(), perGPU: o.perGPU, total: o.work, run: monteCarloPi, out: out})
	var watch *poolWatch
	var poolRead <-chan struct{} // nil, so never ready, without --show-pool
	if o.showPool {
		watch = newPoolWatch(l.ID(), poolListTimeout, listGranted(c))
		poolRead = watch.updated()
		stopWatch := watch.start(ctx)
		defer stopWatch()
	}
	var samples []sample
	record := func(s sample, now time.Time) {
		s.at = now.Sub(granted)
		samples = append(samples, s)
	}
	// tick hands out work, records how the job stands and prints the
	// progress line. It asks for a reading of the pool's load, which
	// replaces the last one in the tick's sample when it comes.
	tick := func(now time.Time) {
		s := j.tick()
		if watch != nil {
			s.otherGPUs, s.otherKnown = watch.last()
			watch.refresh()
		}
		record(s, now)
		prev := sample{}
		if n := len(samples); n > 1 {
			prev = samples[n-2]
		}
		fmt.Fprintln(out, samples[len(samples)-1].line(prev))
	}
	j.sync(l.Slices(), granted)
	tick(granted)

	runCtx := ctx
	if o.duration > 0 {
		var cancel context.CancelFunc
		runCtx, cancel = context.WithTimeout(ctx, o.duration)
		defer cancel()
	}
	ticker := time.NewTicker(o.tick)
	defer ticker.Stop()
	events := l.Events()
	var lost error
	why := ""
loop:
	for {
		select {
		case <-runCtx.Done():
			why = "stopped after --duration"
			if ctx.Err() != nil {
				why = "interrupted"
			}
			break loop
		case <-j.finished():
			why = "work done"
			break loop
		case ev, ok := <-events:
			if !ok {
				events = nil
				continue
			}
			if err := j.handle(ev, time.Now()); err != nil {
				lost = err
				break loop
			}
		case <-l.Done():
			lost = fmt.Errorf("%w: %v", errLeaseLost, l.Err())
			break loop
		case now := <-ticker.C:
			j.sync(l.Slices(), now)
			tick(now)
		case <-poolRead:
			// The reading the last tick asked for (or a later one, when
			// listing took longer than a tick).
			last := &samples[len(samples)-1]
			last.otherGPUs, last.otherKnown = watch.last()
			if msg := watch.warning(); msg != "" {
				fmt.Fprintln(out, msg)
			}
		}
	}
	if lost != nil {
		why = "lease lost"
	}

	j.close()
	end := time.Now()
	done, t := j.results()
	last := samples[len(samples)-1]
	record(sample{slices: last.slices, leaving: last.leaving, done: done, otherGPUs: last.otherGPUs, otherKnown: last.otherKnown}, end)
	most := 0
	for _, s := range samples {
		most = max(most, s.slices)
	}
	fmt.Fprintf(out, "%s: %d units done in %s on up to %d slices; pi is about %.6f (%d samples)\n",
		why, done, end.Sub(granted).Round(time.Second), most, t.pi(), t.samples)

	var errs []error
	if lost != nil {
		l.Close()
		errs = append(errs, lost)
	} else {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		if err := l.Release(rctx, "elastic-sim: "+why); err != nil {
			errs = append(errs, fmt.Errorf("release %s: %s", l.ID(), status.Convert(err).Message()))
		} else {
			fmt.Fprintf(out, "released %s\n", l.ID())
		}
		cancel()
	}
	if o.csv != "" {
		if err := writeCSV(o.csv, samples); err != nil {
			errs = append(errs, fmt.Errorf("--csv: %w", err))
		} else {
			fmt.Fprintf(out, "wrote %s\n", o.csv)
		}
	}
	if o.plot != "" {
		title := fmt.Sprintf("elastic-sim: %d to %d slices of %s, %d%% compute", o.min, o.max, quantity.FormatMiB(o.memory), o.compute)
		if err := writePlot(o.plot, title, samples); err != nil {
			errs = append(errs, fmt.Errorf("--plot: %w", err))
		} else {
			fmt.Fprintf(out, "wrote %s\n", o.plot)
		}
	}
	return errors.Join(errs...)
}
