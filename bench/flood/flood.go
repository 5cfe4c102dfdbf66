// Package flood is 'gpupool-bench flood': one ACL token floods a broker
// with acquires and streams while another token acquires, and one tenant
// opens 8,000 waiting acquires and cancels them. The broker and two
// simulated agents run in this process, with ACL on and the default
// limits.
package flood

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/encoding"
	grpcproto "google.golang.org/grpc/encoding/proto"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/status"

	"github.com/gpupool/gpupool/agent"
	"github.com/gpupool/gpupool/agent/device"
	"github.com/gpupool/gpupool/bench/report"
	"github.com/gpupool/gpupool/broker"
	"github.com/gpupool/gpupool/client"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

type phase struct {
	Name         string         `json:"name"`
	Grants       int            `json:"victim_grants"`
	Errors       int            `json:"victim_errors"`
	ErrorsBy     map[string]int `json:"victim_errors_by,omitempty"`     // by limit, or gRPC code
	ErrorSamples []string       `json:"victim_error_samples,omitempty"` // the first error of each kind
	P50Ms        float64        `json:"victim_acquire_p50_ms"`
	P99Ms        float64        `json:"victim_acquire_p99_ms"`
	FloodCalls   int64          `json:"flood_calls,omitempty"`
	FloodRefused map[string]int `json:"flood_refused_by_limit,omitempty"`
}

type replay struct {
	Calls          int            `json:"calls"`
	Tokens         int            `json:"tokens"`
	SettledSeconds float64        `json:"seconds_to_refused_or_queued"`
	Refused        map[string]int `json:"refused_by_limit"`
	Waited         int            `json:"waited"`
	Other          map[string]int `json:"other_outcomes"` // by gRPC code (OK: granted within the quota)
	HeapBeforeMiB  float64        `json:"heap_before_mib"`
	HeapPeakMiB    float64        `json:"heap_peak_mib"`
	HeapAfterMiB   float64        `json:"heap_after_mib"`
	// Live is the bytes of the objects reachable (HeapAlloc after a GC);
	// the heap in use (HeapInuse) also counts the free room in its spans.
	LiveBeforeMiB    float64 `json:"heap_live_before_mib"`
	LivePeakMiB      float64 `json:"heap_live_peak_mib"`
	LiveAfterMiB     float64 `json:"heap_live_after_mib"`
	LeasesBefore     int     `json:"leases_in_state_before"`
	LeasesAfter      int     `json:"leases_in_state_after"`
	AuditBootstrap   bool    `json:"audit_has_bootstrap"`
	AuditTokens      int     `json:"audit_token_entries"`
	AuditEntriesSeen int     `json:"audit_entries"`
}

type results struct {
	Benchmark string  `json:"benchmark"`
	Date      string  `json:"date"`
	Seconds   float64 `json:"seconds_per_phase"`
	Victims   int     `json:"victim_clients"`
	Flooders  int     `json:"flood_clients"`
	Streams   int     `json:"flood_streams"`
	// The broker's fair share of writes (0: none).
	WriteSeats      int     `json:"limit_write_seats"`
	TokenWrites     int     `json:"limit_token_writes"`
	TokenWriteQueue int     `json:"limit_token_write_queue"`
	Phases          []phase `json:"phases"`
	P99Ratio        float64 `json:"p99_ratio"`
	Replay          replay  `json:"replay"`
	LoadStart       string  `json:"load_average_start"`
	LoadEnd         string  `json:"load_average_end"`
	GoVersion       string  `json:"go_version"`
	CPUs            int     `json:"cpus"`
}

const usageHead = `Usage: gpupool-bench flood [flags]

One broker with ACL on and the default limits, two simulated agents, in this
process. A victim token acquires and releases without a flood, then while a
flooding token acquires as fast as it can and holds watch streams: the victim's
acquire p99 in both (goal: within 2x). Then one tenant opens waiting acquires at
once and cancels them: refusals, heap, and the audit log's first entries.

Flags:
`

// Run is 'gpupool-bench flood'.
func Run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := report.NewFlags("flood")
	out := fs.String("out", "bench/results", "directory for flood.{json,md}")
	dur := fs.Duration("duration", 10*time.Second, "how long each phase (without, then with the flood) runs")
	victims := fs.Int("victims", 4, "the other token's clients, each looping acquire + release")
	flooders := fs.Int("flooders", 64, "the flooding token's clients, each acquiring as fast as it can")
	streams := fs.Int("streams", 500, "watch streams the flooding token tries to hold open")
	pending := fs.Int("pending", 8000, "waiting acquires one tenant opens at once, then cancels (the replay)")
	heapProfile := fs.String("heapprofile", "", "write heap profiles of this process to `file`.before and file.after the replay, each after a GC (go tool pprof -base reads the growth); empty takes none")
	profile := fs.String("cpuprofile", "", "write a CPU profile of this process (the broker, its agents and both tokens' clients) over the phase with the flood to `file` (go tool pprof reads it); empty takes none")
	lim := broker.DefaultLimits()
	fs.IntVar(&lim.Writes.Seats, broker.FlagWriteSeats, lim.Writes.Seats, "the broker's --"+broker.FlagWriteSeats+" (0: none, to compare)")
	fs.IntVar(&lim.Writes.Share, broker.FlagTokenWrites, lim.Writes.Share, "the broker's --"+broker.FlagTokenWrites+" (0: none, to compare)")
	if err := report.ParseFlags(fs, args, usageHead, stdout); err != nil {
		return report.UsageExit(stderr, "flood", err)
	}
	for _, c := range []struct {
		name string
		v    int
	}{{"victims", *victims}, {"flooders", *flooders}, {"streams", *streams}, {"pending", *pending}} {
		if c.v < 1 || c.v > 100_000 {
			return report.UsageExit(stderr, "flood", fmt.Errorf("--%s %d: must be between 1 and 100000", c.name, c.v))
		}
	}
	if err := lim.Validate(); err != nil {
		return report.UsageExit(stderr, "flood", err)
	}
	if *dur < time.Second {
		return report.UsageExit(stderr, "flood", fmt.Errorf("--duration %s: must be at least 1s", *dur))
	}
	res, stop, err := bench(ctx, lim, *dur, *victims, *flooders, *streams, *pending, *profile, *heapProfile, stderr)
	if res != nil {
		if werr := write(*out, res, stdout); werr != nil {
			return report.Fail(stderr, "flood", werr)
		}
	}
	if stop != nil {
		// The broker's shutdown may wait on grants the flood left in
		// flight; the figures are written, so bound it.
		done := make(chan struct{})
		go func() { stop(); close(done) }()
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			logf(stderr, "the broker did not shut down within 30s; exiting without it")
		}
	}
	if err != nil {
		return report.Fail(stderr, "flood", err)
	}
	return 0
}

func logf(w io.Writer, format string, args ...any) {
	fmt.Fprintf(w, "%s flood: %s\n", time.Now().Format("15:04:05"), fmt.Sprintf(format, args...))
}

func loadAvg() string {
	b, _ := os.ReadFile("/proc/loadavg")
	return strings.TrimSpace(string(b))
}

// env is the broker, its agents and the clients of the benchmark.
type env struct {
	s                 *broker.Server
	mgmt, victim, bad *client.Client
}

func start(ctx context.Context, lim broker.Limits, dir string, stderr io.Writer) (*env, func(), error) {
	s, err := broker.New(broker.Config{DataDir: filepath.Join(dir, "broker"), BindAddr: "127.0.0.1:0", RaftBindAddr: "127.0.0.1:0",
		BootstrapExpect: 1, ACL: true, Limits: &lim})
	if err != nil {
		return nil, nil, err
	}
	var closers []func()
	stop := func() {
		for _, c := range slices.Backward(closers) {
			c()
		}
		s.Shutdown()
	}
	fail := func(err error) (*env, func(), error) { stop(); return nil, nil, err }
	dial := func(secret string) (*client.Client, error) {
		c, err := client.DialWith([]string{s.Addr()}, client.Options{Token: secret})
		if err == nil {
			closers = append(closers, func() { c.Close() })
		}
		return c, err
	}
	anon, err := dial("")
	if err != nil {
		return fail(err)
	}
	var boot *gpupoolv1.AclTokenSecret
	deadline := time.Now().Add(30 * time.Second)
	for {
		boot, err = gpupoolv1.NewAclServiceClient(anon.Conn()).Bootstrap(ctx, &gpupoolv1.AclBootstrapRequest{})
		if err == nil || time.Now().After(deadline) {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if err != nil {
		return fail(fmt.Errorf("ACL bootstrap: %w", err))
	}
	e := &env{s: s}
	if e.mgmt, err = dial(boot.Secret); err != nil {
		return fail(err)
	}
	token := func(req *gpupoolv1.CreateAclTokenRequest) (string, error) {
		r, err := gpupoolv1.NewAclServiceClient(e.mgmt.Conn()).CreateToken(ctx, req)
		if err != nil {
			return "", err
		}
		return r.Secret, nil
	}
	client := func(name, tenant string) (*client.Client, string, error) {
		secret, err := token(&gpupoolv1.CreateAclTokenRequest{Name: name, Kind: gpupoolv1.TokenKind_TOKEN_KIND_CLIENT, Tenants: []string{tenant}})
		if err != nil {
			return nil, "", err
		}
		c, err := dial(secret)
		return c, secret, err
	}
	if e.victim, _, err = client("victim", "victim"); err != nil {
		return fail(err)
	}
	if e.bad, _, err = client("flooder", "flood"); err != nil {
		return fail(err)
	}
	actx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	closers = append(closers, func() { cancel(); wg.Wait() })
	for i := range 2 {
		host := fmt.Sprintf("host-%d", i+1)
		secret, err := token(&gpupoolv1.CreateAclTokenRequest{Name: host, Kind: gpupoolv1.TokenKind_TOKEN_KIND_AGENT, HostId: host})
		if err != nil {
			return fail(err)
		}
		be, err := device.NewSimulated("8xA100-80GB", host)
		if err != nil {
			return fail(err)
		}
		a, err := agent.New(agent.Config{Brokers: []string{s.Addr()}, Token: secret, HostID: host, Address: "127.0.0.1:1",
			CPUMillicores: 64000, MemoryMiB: 256 << 10, Backend: be, Version: "bench", DataDir: filepath.Join(dir, host),
			AllowReducedIsolation: true, Logger: slog.New(slog.DiscardHandler)})
		if err != nil {
			return fail(err)
		}
		wg.Go(func() { _ = a.Run(actx) })
	}
	for {
		st, err := e.mgmt.Pool.Status(ctx, &gpupoolv1.StatusRequest{})
		if err == nil && st.HostsReady >= 2 {
			break
		}
		if time.Now().After(deadline) {
			return fail(fmt.Errorf("the agents' hosts are not ready after 30s: %v", err))
		}
		time.Sleep(100 * time.Millisecond)
	}
	logf(stderr, "broker %s with ACL on and limits %+v, 2 simulated agents of 8 A100-80GB", s.Addr(), lim)
	return e, stop, nil
}

func slice() *gpupoolv1.LeaseRequest {
	return &gpupoolv1.LeaseRequest{Count: 1, MemoryMib: 1024, ComputePercent: 1, TtlMs: 60_000}
}

// bench runs the phases and the replay; stop ends the broker and its
// agents, and removes their data.
func bench(ctx context.Context, lim broker.Limits, dur time.Duration, victims, flooders, streams, pending int, profile, heapProfile string, stderr io.Writer) (_ *results, stop func(), _ error) {
	dir, err := os.MkdirTemp("", "gpupool-flood-bench-")
	if err != nil {
		return nil, nil, err
	}
	e, stopEnv, err := start(ctx, lim, dir, stderr)
	if err != nil {
		os.RemoveAll(dir)
		return nil, nil, err
	}
	stop = func() { stopEnv(); os.RemoveAll(dir) }
	res := &results{WriteSeats: lim.Writes.Seats, TokenWrites: lim.Writes.Share, TokenWriteQueue: lim.Writes.Queue, Benchmark: "flood", Date: time.Now().UTC().Format(time.RFC3339), Seconds: dur.Seconds(), Victims: victims,
		Flooders: flooders, Streams: streams, LoadStart: loadAvg(), GoVersion: runtime.Version(), CPUs: runtime.NumCPU()}
	for _, flood := range []bool{false, true} {
		stopProfile := func() {}
		if flood {
			if stopProfile, err = startProfile(profile); err != nil {
				return nil, stop, err
			}
		}
		ph := runPhase(ctx, e, dur, victims, flood, flooders, streams)
		stopProfile()
		logf(stderr, "%s: victim %d grants, p50 %.1f ms, p99 %.1f ms, %d errors %v; flood %d calls, refused %v",
			ph.Name, ph.Grants, ph.P50Ms, ph.P99Ms, ph.Errors, ph.ErrorsBy, ph.FloodCalls, ph.FloodRefused)
		for _, msg := range ph.ErrorSamples {
			logf(stderr, "%s: the victim's first error of its kind: %s", ph.Name, msg)
		}
		res.Phases = append(res.Phases, ph)
	}
	if res.Phases[0].P99Ms > 0 {
		res.P99Ratio = res.Phases[1].P99Ms / res.Phases[0].P99Ms
	}
	res.Replay, err = runReplay(ctx, e, pending, heapProfile)
	logf(stderr, "replay: %d waiting acquires, refused %v, %d waited, other %v; heap %.1f -> peak %.1f -> %.1f MiB (live %.1f -> %.1f -> %.1f); leases in state %d -> %d; audit: bootstrap %v, %d token entries",
		res.Replay.Calls, res.Replay.Refused, res.Replay.Waited, res.Replay.Other, res.Replay.HeapBeforeMiB, res.Replay.HeapPeakMiB, res.Replay.HeapAfterMiB, res.Replay.LiveBeforeMiB, res.Replay.LivePeakMiB, res.Replay.LiveAfterMiB,
		res.Replay.LeasesBefore, res.Replay.LeasesAfter, res.Replay.AuditBootstrap, res.Replay.AuditTokens)
	res.LoadEnd = loadAvg()
	return res, stop, err
}

// limitOf is the limit a refusal names, or its code.
func limitOf(err error) string {
	msg := status.Convert(err).Message()
	if rest, ok := strings.CutPrefix(msg, "limit "); ok {
		name, _, _ := strings.Cut(rest, " ")
		return name
	}
	return status.Code(err).String()
}

func runPhase(ctx context.Context, e *env, dur time.Duration, victims int, flood bool, flooders, streams int) phase {
	ph := phase{Name: "without the flood"}
	pctx, cancel := context.WithTimeout(ctx, dur)
	defer cancel()
	end, _ := pctx.Deadline()
	// running says the phase has not ended. grpc fails a call at once
	// with DeadlineExceeded once its deadline has passed, before the
	// context's own timer (late on a busy machine) ends the context:
	// without the clock, the loops counted that gap's calls as hundreds
	// or thousands of errors and calls.
	running := func() bool { return pctx.Err() == nil && time.Now().Before(end) }
	var mu sync.Mutex
	var lat []float64
	refused := map[string]int{}
	var calls atomic.Int64
	var wg sync.WaitGroup
	if flood {
		ph.Name = "with the flood"
		for range flooders {
			wg.Go(func() {
				for running() {
					r, err := e.bad.Lease.Acquire(pctx, &gpupoolv1.AcquireRequest{Request: slice()})
					if !running() {
						return // see the victims' loop
					}
					calls.Add(1)
					if err == nil {
						_, _ = e.bad.Lease.Release(context.WithoutCancel(pctx), &gpupoolv1.ReleaseRequest{LeaseId: r.Lease.Id})
					} else if status.Code(err) == codes.ResourceExhausted {
						mu.Lock()
						refused[limitOf(err)]++
						mu.Unlock()
					}
				}
			})
		}
		for range streams {
			wg.Go(func() {
				w, err := e.bad.Lease.Watch(pctx, &gpupoolv1.WatchLeasesRequest{}, grpc.ForceCodecV2(discardReplies{encoding.GetCodecV2(grpcproto.Name)}))
				calls.Add(1)
				for err == nil {
					_, err = w.Recv()
				}
				if status.Code(err) == codes.ResourceExhausted {
					mu.Lock()
					refused[limitOf(err)]++
					mu.Unlock()
				}
			})
		}
	}
	for range victims {
		wg.Go(func() {
			for running() {
				sent := time.Now()
				r, err := e.victim.Lease.Acquire(pctx, &gpupoolv1.AcquireRequest{Request: slice()})
				took := time.Since(sent)
				if !running() {
					return
				}
				mu.Lock()
				if err != nil {
					ph.Errors++
					if ph.ErrorsBy == nil {
						ph.ErrorsBy = map[string]int{}
					}
					if ph.ErrorsBy[limitOf(err)] == 0 {
						ph.ErrorSamples = append(ph.ErrorSamples, err.Error())
					}
					ph.ErrorsBy[limitOf(err)]++
				} else {
					ph.Grants++
					lat = append(lat, float64(took.Microseconds())/1000)
				}
				mu.Unlock()
				if err == nil {
					_, _ = e.victim.Lease.Release(context.WithoutCancel(pctx), &gpupoolv1.ReleaseRequest{LeaseId: r.Lease.Id})
				}
			}
		})
	}
	wg.Wait()
	slices.Sort(lat)
	ph.P50Ms, ph.P99Ms = percentile(lat, 50), percentile(lat, 99)
	if flood {
		ph.FloodCalls, ph.FloodRefused = calls.Load(), refused
	}
	return ph
}

// discardReplies is the proto codec, except that it does not decode what
// it receives: the flood's watch streams read every event the broker
// sends (so the broker keeps sending) without spending this process's
// CPU, which the broker shares, on decoding them, as an attacker's own
// machine would.
type discardReplies struct{ encoding.CodecV2 }

func (discardReplies) Unmarshal(mem.BufferSlice, any) error { return nil }

func percentile(sorted []float64, q int) float64 {
	if len(sorted) == 0 {
		return 0
	}
	return sorted[min(len(sorted)-1, len(sorted)*q/100)]
}

// startProfile starts a CPU profile to path, if one is asked for, and
// returns what stops it.
func startProfile(path string) (func(), error) {
	if path == "" {
		return func() {}, nil
	}
	f, err := os.Create(path)
	if err != nil {
		return nil, fmt.Errorf("--cpuprofile: %w", err)
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		f.Close()
		return nil, fmt.Errorf("--cpuprofile: %w", err)
	}
	return func() { pprof.StopCPUProfile(); f.Close() }, nil
}

// writeHeap writes a heap profile to path+suffix, if one is asked for.
func writeHeap(path, suffix string) error {
	if path == "" {
		return nil
	}
	f, err := os.Create(path + suffix)
	if err != nil {
		return fmt.Errorf("--heapprofile: %w", err)
	}
	defer f.Close()
	if err := pprof.Lookup("heap").WriteTo(f, 0); err != nil {
		return fmt.Errorf("--heapprofile: %w", err)
	}
	return f.Close()
}

// heapMiB returns the heap in use and its live objects, after a GC.
func heapMiB() (inuse, live float64) {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return float64(m.HeapInuse) / (1 << 20), float64(m.HeapAlloc) / (1 << 20)
}

// replayTokens is how many tokens of the tenant the replay's calls come
// from.
const replayTokens = 40

// runReplay opens n waiting acquires of one tenant at once, from
// replayTokens tokens, whose quota keeps them waiting, holds them 2s and
// cancels them.
func runReplay(ctx context.Context, e *env, n int, heapProfile string) (replay, error) {
	rp := replay{Calls: n, Refused: map[string]int{}, Other: map[string]int{}}
	if _, err := e.mgmt.Operator.SetQuota(ctx, &gpupoolv1.SetQuotaRequest{Quota: &gpupoolv1.Quota{Tenant: "flood", Gpus: 1, MemoryMib: 1024, ComputePercent: 1}}); err != nil {
		return rp, err
	}
	leases := func() int {
		l, err := e.mgmt.Lease.List(ctx, &gpupoolv1.ListLeasesRequest{IncludeEnded: true})
		if err != nil {
			return -1
		}
		return len(l.Leases)
	}
	rp.HeapBeforeMiB, rp.LiveBeforeMiB = heapMiB()
	rp.LeasesBefore = leases()
	if err := writeHeap(heapProfile, ".before"); err != nil {
		return rp, err
	}
	// The tenant's calls come from replayTokens tokens of its own, each
	// within its request rate's burst, so that what refuses them is the
	// tenant's pending cap, as it would be for an attacker with several
	// tokens (one token alone is stopped by its rate first).
	per := (n + replayTokens - 1) / replayTokens
	rp.Tokens = replayTokens
	var cs []*client.Client
	defer func() {
		for _, c := range cs {
			c.Close()
		}
	}()
	for i := range replayTokens {
		r, err := gpupoolv1.NewAclServiceClient(e.mgmt.Conn()).CreateToken(ctx, &gpupoolv1.CreateAclTokenRequest{
			Name: fmt.Sprintf("replay-%d", i), Kind: gpupoolv1.TokenKind_TOKEN_KIND_CLIENT, Tenants: []string{"flood"}})
		if err != nil {
			return rp, err
		}
		c, err := client.DialWith([]string{e.s.Addr()}, client.Options{Token: r.Secret})
		if err != nil {
			return rp, err
		}
		cs = append(cs, c)
	}
	rctx, cancel := context.WithCancel(ctx)
	var mu sync.Mutex
	var wg sync.WaitGroup
	var done atomic.Int64
	opened := time.Now()
	for i := range n {
		c := cs[i/per]
		wg.Go(func() {
			_, err := c.Lease.Acquire(rctx, &gpupoolv1.AcquireRequest{WaitMs: 60_000, Request: &gpupoolv1.LeaseRequest{
				Count: 1, MemoryMib: 1024, ComputePercent: 1, TtlMs: 60_000}})
			mu.Lock()
			switch {
			case status.Code(err) == codes.ResourceExhausted && strings.HasPrefix(status.Convert(err).Message(), "limit "):
				rp.Refused[limitOf(err)]++
			case status.Code(err) == codes.Canceled:
				rp.Waited++
			default:
				rp.Other[status.Code(err).String()]++
			}
			mu.Unlock()
			done.Add(1)
		})
	}
	// Hold them until every call was refused or waits in the lease
	// queue (the write share admits them a few at a time), at most a
	// minute, then 2 s more.
	settle := time.Now().Add(time.Minute)
	for time.Now().Before(settle) {
		st, err := e.mgmt.Pool.Status(ctx, &gpupoolv1.StatusRequest{})
		if err == nil && done.Load()+int64(st.LeasesByState["pending"]+st.LeasesByState["PENDING"]) >= int64(n) {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	rp.SettledSeconds = time.Since(opened).Seconds()
	time.Sleep(2 * time.Second)
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	rp.HeapPeakMiB, rp.LivePeakMiB = float64(m.HeapInuse)/(1<<20), float64(m.HeapAlloc)/(1<<20)
	cancel()
	wg.Wait()
	// The waiting ones leave the queue after their calls end.
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		st, err := e.mgmt.Pool.Status(ctx, &gpupoolv1.StatusRequest{})
		if err == nil && st.LeasesByState["pending"] == 0 && st.LeasesByState["PENDING"] == 0 {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	rp.HeapAfterMiB, rp.LiveAfterMiB = heapMiB()
	rp.LeasesAfter = leases()
	if err := writeHeap(heapProfile, ".after"); err != nil {
		return rp, err
	}
	al, err := e.mgmt.Operator.AuditLog(ctx, &gpupoolv1.AuditLogRequest{})
	if err != nil {
		return rp, err
	}
	for {
		a, err := al.Recv()
		if err != nil {
			break
		}
		rp.AuditEntriesSeen++
		switch a.Kind {
		case gpupoolv1.AuditKind_AUDIT_KIND_ACL_BOOTSTRAP:
			rp.AuditBootstrap = true
		case gpupoolv1.AuditKind_AUDIT_KIND_ACL_TOKEN_CREATED:
			rp.AuditTokens++
		}
	}
	return rp, nil
}

func write(dir string, res *results, stdout io.Writer) error {
	var md strings.Builder
	fmt.Fprintf(&md, "# A flood from one token, and another token's acquires\n\n%s. One broker (ACL on, default limits; writes shared between tokens: --limit-write-seats %d, --limit-token-writes %d, --limit-token-write-queue %d) and 2 simulated agents in one process; %d victim clients loop acquire + release for %.0fs per phase; the flood is %d clients of another token acquiring as fast as they can and %d watch streams it tries to hold.\n\n",
		res.Date, res.WriteSeats, res.TokenWrites, res.TokenWriteQueue, res.Victims, res.Seconds, res.Flooders, res.Streams)
	md.WriteString("| phase | victim grants | victim acquire p50 (ms) | victim acquire p99 (ms) | victim errors | flood calls | flood refused, by limit |\n|---|---:|---:|---:|---:|---:|---|\n")
	for _, p := range res.Phases {
		fmt.Fprintf(&md, "| %s | %d | %.2f | %.2f | %d | %d | %s |\n", p.Name, p.Grants, p.P50Ms, p.P99Ms, p.Errors, p.FloodCalls, counts(p.FloodRefused))
	}
	fmt.Fprintf(&md, "\nVictim acquire p99 with / without the flood: **%.2f** (goal: within 2).\n\n", res.P99Ratio)
	r := res.Replay
	fmt.Fprintf(&md, "## Replay: %d waiting acquires of one tenant from %d of its tokens, opened at once and cancelled\n\n| refused, by limit | waited (then cancelled) | other outcomes | heap in use before / while open / after (MiB) | live heap before / while open / after (MiB) | leases in state before | after | audit: bootstrap entry | token entries |\n|---|---:|---|---:|---:|---:|---:|---|---:|\n| %s | %d | %s | %.1f / %.1f / %.1f | %.1f / %.1f / %.1f | %d | %d | %v | %d |\n\n",
		r.Calls, r.Tokens, counts(r.Refused), r.Waited, counts(r.Other), r.HeapBeforeMiB, r.HeapPeakMiB, r.HeapAfterMiB, r.LiveBeforeMiB, r.LivePeakMiB, r.LiveAfterMiB, r.LeasesBefore, r.LeasesAfter, r.AuditBootstrap, r.AuditTokens)
	fmt.Fprintf(&md, "Every call had been refused or was waiting in the lease queue %.1f s after they were opened (the write share admits them a few at a time; a minute at most); they were held 2 s more, then cancelled. ", r.SettledSeconds)
	fmt.Fprintf(&md, "Heap is this process's Go heap (the broker, its agents and the clients) after a GC: in use (HeapInuse, the spans holding objects, with their free room) and live (HeapAlloc, the objects themselves). Load average %s (start) / %s (end); %s, %d CPUs.\n", res.LoadStart, res.LoadEnd, res.GoVersion, res.CPUs)
	_, err := report.Write(report.Results{Dir: dir, Name: "flood", JSON: res, Markdown: md.String(), Echo: stdout})
	return err
}

func counts(m map[string]int) string {
	var parts []string
	for _, k := range slices.Sorted(maps.Keys(m)) {
		parts = append(parts, fmt.Sprintf("%s %d", k, m[k]))
	}
	if len(parts) == 0 {
		return "none"
	}
	return strings.Join(parts, ", ")
}
