package agent

import (
	"context"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/gpupool/gpupool/agent/device"
	"github.com/gpupool/gpupool/internal/clock"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// fastEnforcement keeps the watchdog's clocks short so the tests end
// quickly; no test asserts how fast it is.
var fastEnforcement = Enforcement{Poll: 20 * time.Millisecond, Grace: 200 * time.Millisecond,
	KillAfter: 500 * time.Millisecond, ExpiryGrace: 300 * time.Millisecond}

// testProc is a process of a lease, started by the test.
type testProc struct {
	pid    int
	exited chan struct{} // closed when the process exited
	at     time.Time     // when it exited; valid after exited is closed
}

// startWorkload runs `sleep 600` as a process of lease id (or of no lease
// when id is empty) and kills it at the end of the test.
func startWorkload(t *testing.T, id string) *testProc {
	t.Helper()
	cmd := exec.Command("sleep", "600")
	cmd.Env = os.Environ()
	if id != "" {
		cmd.Env = append(cmd.Env, LeaseEnvVar+"="+id)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	w := &testProc{pid: cmd.Process.Pid, exited: make(chan struct{})}
	go func() {
		cmd.Wait()
		w.at = time.Now()
		close(w.exited)
	}()
	t.Cleanup(func() {
		cmd.Process.Kill()
		<-w.exited
	})
	if id != "" {
		joinLease(t, id, w.pid)
	}
	return w
}

// joinLease puts pid in the lease's cgroup, as the sandbox's init does:
// where leases have cgroups, their processes are those the cgroup holds,
// whatever their environment says.
func joinLease(t *testing.T, id string, pid int) {
	t.Helper()
	if box := testBox(); box.HasCgroups() {
		if err := box.Join(id, pid); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { box.Remove(id) })
	}
}

func (w *testProc) running() bool {
	select {
	case <-w.exited:
		return false
	default:
		return true
	}
}

// waitExit waits until the workload exits.
func (w *testProc) waitExit(t *testing.T, why string) {
	t.Helper()
	select {
	case <-w.exited:
	case <-time.After(waitTimeout):
		t.Fatalf("the workload still runs after %s: %s", waitTimeout, why)
	}
}

// waitUntil polls cond until it holds, for state no channel announces.
func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(waitTimeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting until %s", waitTimeout, what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func simulator(t *testing.T, b device.Backend) device.Simulator {
	t.Helper()
	sim, ok := b.(device.Simulator)
	if !ok {
		t.Fatalf("%T is not a device.Simulator", b)
	}
	return sim
}

// enforcedAgent starts an agent that enforces lease L1 (1 GiB on GPU 0)
// with the fast watchdog settings.
func enforcedAgent(t *testing.T, edit func(*Config)) (*fakeBroker, *Agent, Config) {
	t.Helper()
	f := newFakeBroker(10 * time.Millisecond)
	addr, _ := serveFake(t, f, "127.0.0.1:0")
	cfg := testConfig(t, addr)
	cfg.Enforcement = fastEnforcement
	if edit != nil {
		edit(&cfg)
	}
	a := startAgent(t, cfg)
	f.setAssignments([]string{"L1"}, nil)
	f.waitFor(t, "the agent enforces L1", func() bool { return slices.Equal(leaseIDs(a.Assignments()), []string{"L1"}) })
	return f, a, cfg
}

// fakeEnforcement is the watchdog's timing on a fake clock. KillAfter is
// wall time (workload.Stop waits in the kernel), short so tests end soon.
var fakeEnforcement = Enforcement{Poll: time.Second, Grace: 5 * time.Second,
	KillAfter: 500 * time.Millisecond, ExpiryGrace: 10 * time.Second}

// testEpoch is where the tests' fake clocks start.
var testEpoch = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

// fakeClockAgent starts an agent on a fake clock that enforces lease L1
// (1 GiB on GPU 0). The broker's heartbeat interval is an hour, so that
// the advances that drive the watchdog never fire a heartbeat or the
// stream's silence: heartbeats go out on news alone.
func fakeClockAgent(t *testing.T) (*fakeBroker, *Agent, Config, *clock.Fake) {
	t.Helper()
	f := newFakeBroker(time.Hour)
	addr, _ := serveFake(t, f, "127.0.0.1:0")
	a, cfg, clk := fakeClockAgentOf(t, f, addr)
	return f, a, cfg, clk
}

// fakeClockAgentOf is fakeClockAgent with the broker f serving on addr.
func fakeClockAgentOf(t *testing.T, f *fakeBroker, addr string) (*Agent, Config, *clock.Fake) {
	t.Helper()
	cfg := testConfig(t, addr)
	cfg.Enforcement = fakeEnforcement
	clk := clock.NewFake(testEpoch)
	cfg.Clock = clk
	a := startAgent(t, cfg)
	f.setAssignments([]string{"L1"}, nil)
	// Polled: no heartbeat follows the push to tell the broker.
	waitUntil(t, "the agent enforces L1", func() bool { return slices.Equal(leaseIDs(a.Assignments()), []string{"L1"}) })
	return a, cfg, clk
}

// watchedL1 is what one watchdog pass left of lease L1, read at once.
type watchedL1 struct {
	at         time.Time // when the pass ran
	usedMiB    int64     // on the lease's GPU
	violations int
	expired    bool
	// overSince is when the watchdog first saw it over on a GPU, by uuid.
	overSince map[string]time.Time
	deadline  time.Time
}

// pass advances clk by one poll and returns what the next watchdog pass,
// one that ran after the advance began, left of L1.
func pass(t *testing.T, a *Agent, clk *clock.Fake) watchedL1 {
	t.Helper()
	before := clk.Now()
	clk.Advance(a.cfg.Enforcement.Poll)
	var w watchedL1
	waitUntil(t, "a watchdog pass at "+clk.Now().Format(time.TimeOnly), func() bool {
		a.leases.mu.Lock()
		defer a.leases.mu.Unlock()
		e := a.leases.entries["L1"]
		if e == nil || e.usage == nil || e.usage.SampledAtMs <= before.UnixMilli() {
			return false
		}
		w = watchedL1{at: time.UnixMilli(e.usage.SampledAtMs).UTC(), violations: e.violations, expired: e.expired,
			overSince: maps.Clone(e.over), deadline: e.deadline}
		if len(e.usage.Slices) > 0 {
			w.usedMiB = e.usage.Slices[0].MemoryUsedMib
		}
		return true
	})
	return w
}

// passUntilViolation runs watchdog passes until one records a violation
// of L1, checking at each that none came before the grace passed since
// the watchdog first saw the lease over on uuid.
func passUntilViolation(t *testing.T, a *Agent, clk *clock.Fake, uuid string) {
	t.Helper()
	grace := a.cfg.Enforcement.Grace
	var since time.Time
	for range 4 * int(grace/a.cfg.Enforcement.Poll) {
		w := pass(t, a, clk)
		if s, ok := w.overSince[uuid]; ok {
			since = s
		}
		over := !since.IsZero() && w.at.Sub(since) >= grace
		switch {
		case w.violations > 0 && !over:
			t.Fatalf("a violation at %s, %s after the watchdog first saw it over, before the grace of %s", w.at.Format(time.TimeOnly), w.at.Sub(since), grace)
		case w.violations > 0:
			return
		case over:
			t.Fatalf("no violation at %s, %s after the watchdog first saw it over, past the grace of %s", w.at.Format(time.TimeOnly), w.at.Sub(since), grace)
		}
	}
	t.Fatalf("no violation after %d polls", 4*int(grace/a.cfg.Enforcement.Poll))
}

func TestWatchdogStopsALeaseOverItsMemoryAfterTheGraceAndReportsTheViolation(t *testing.T) {
	f, a, cfg, clk := fakeClockAgent(t)
	sim := simulator(t, cfg.Backend)
	over := startWorkload(t, "L1")
	other := startWorkload(t, "")
	if err := sim.SetProcess(0, other.pid, 70000); err != nil { // no lease: not the watchdog's business
		t.Fatal(err)
	}
	if err := sim.SetProcess(0, over.pid, 2048); err != nil { // L1's slice is 1 GiB
		t.Fatal(err)
	}
	passUntilViolation(t, a, clk, hostAGPU0())
	over.waitExit(t, "it used 2 GiB of a 1 GiB slice for the grace")
	if !other.running() {
		t.Fatal("a process of no lease was stopped")
	}
	f.waitFor(t, "a heartbeat carried the violation", func() bool {
		return slices.ContainsFunc(f.heartbeats, func(hb *gpupoolv1.HeartbeatRequest) bool {
			return slices.ContainsFunc(hb.Events, func(e *gpupoolv1.AgentEvent) bool {
				return e.LeaseId == "L1" && e.Type == gpupoolv1.AgentEventType_AGENT_EVENT_TYPE_VIOLATION &&
					strings.Contains(e.Message, "used 2 GiB") && strings.Contains(e.Message, "slice of 1 GiB")
			})
		})
	})
}

func TestWatchdogStopsALeaseThatIgnoresSIGTERMWithSIGKILL(t *testing.T) {
	_, a, cfg, clk := fakeClockAgent(t)
	sim := simulator(t, cfg.Backend)
	cmd := exec.Command("sh", "-c", `trap "" TERM; while :; do sleep 0.05; done`)
	cmd.Env = append(os.Environ(), LeaseEnvVar+"=L1")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	joinLease(t, "L1", cmd.Process.Pid)
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() { cmd.Process.Kill() })
	if err := sim.SetProcess(0, cmd.Process.Pid, 4096); err != nil {
		t.Fatal(err)
	}
	passUntilViolation(t, a, clk, hostAGPU0())
	select {
	case err := <-exited:
		if !strings.Contains(err.Error(), "killed") {
			t.Fatalf("the process ended with %v, want killed", err)
		}
	case <-time.After(waitTimeout):
		t.Fatal("a process that ignores SIGTERM was never killed")
	}
}

func TestWatchdogStopsALeaseOnAGPUItDoesNotHoldAfterTheGrace(t *testing.T) {
	_, a, cfg, clk := fakeClockAgent(t)
	w := startWorkload(t, "L1")
	sim := simulator(t, cfg.Backend)
	if err := sim.SetProcess(3, w.pid, 10); err != nil {
		t.Fatal(err)
	}
	devs, err := cfg.Backend.Devices()
	if err != nil {
		t.Fatal(err)
	}
	passUntilViolation(t, a, clk, devs[3].Uuid)
	w.waitExit(t, "it used GPU 3, which L1 does not hold")
}

func TestWatchdogLetsALeaseWithinItsSliceRun(t *testing.T) {
	_, a, cfg, clk := fakeClockAgent(t)
	w := startWorkload(t, "L1")
	if err := simulator(t, cfg.Backend).SetProcess(0, w.pid, 1000); err != nil {
		t.Fatal(err)
	}
	// Passes for twice the grace once the watchdog measured the 1000 MiB.
	var first time.Time
	for polls := 0; first.IsZero() || clk.Now().Sub(first) <= 2*cfg.Enforcement.Grace; polls++ {
		if polls > 100 {
			t.Fatal("the watchdog never measured the workload's 1000 MiB")
		}
		p := pass(t, a, clk)
		if p.usedMiB == 1000 && first.IsZero() {
			first = p.at
		}
		if p.violations > 0 || len(p.overSince) > 0 {
			t.Fatalf("at %s: %d violations, over since %v; want none for 1000 MiB of a 1 GiB slice", p.at.Format(time.TimeOnly), p.violations, p.overSince)
		}
	}
	if !w.running() {
		t.Fatal("a lease within its slice was stopped")
	}
}

func TestBrokerGoneStopsALeasesProcessesAfterExpiryPlusGraceNotBefore(t *testing.T) {
	const ttl = 20 * time.Second
	f := newFakeBroker(time.Hour)
	f.ttl = ttl
	addr, stop := serveFake(t, f, "127.0.0.1:0")
	a, cfg, clk := fakeClockAgentOf(t, f, addr)
	w := startWorkload(t, "L1")
	// The brokers go before the clock moves, so the agent's deadline is
	// the lease's TTL from now.
	stop()
	deadline := clk.Now().Add(ttl)
	earliest := deadline.Add(cfg.Enforcement.ExpiryGrace)
	for {
		p := pass(t, a, clk)
		if !p.deadline.Equal(deadline) {
			t.Fatalf("the agent's deadline for L1 is %v, want %v: the TTL from the last list", p.deadline, deadline)
		}
		if p.expired != p.at.After(earliest) {
			t.Fatalf("at %s (expiry plus grace %s): expired %t, want %t", p.at.Format(time.TimeOnly), earliest.Format(time.TimeOnly), p.expired, !p.expired)
		}
		if p.expired {
			break
		}
		if !w.running() {
			t.Fatalf("stopped at %s, before the lease's expiry plus grace at %s", p.at.Format(time.TimeOnly), earliest.Format(time.TimeOnly))
		}
	}
	w.waitExit(t, "the brokers are gone and the lease expired")
	if got := leaseIDs(a.Assignments()); !slices.Equal(got, []string{"L1"}) {
		t.Fatalf("after the expiry the agent enforces %v, want L1 still: the brokers may renew it when they return", got)
	}
}

func TestARestartedAgentKeepsEnforcingItsLeasesWithoutTheBroker(t *testing.T) {
	f := newFakeBroker(10 * time.Millisecond)
	addr, stop := serveFake(t, f, "127.0.0.1:0")
	cfg := testConfig(t, addr)
	cfg.Enforcement = fakeEnforcement
	first, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- first.Run(ctx) }()
	f.setAssignments([]string{"L1"}, nil)
	f.waitFor(t, "the agent enforces L1", func() bool { return slices.Equal(leaseIDs(first.Assignments()), []string{"L1"}) })
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	stop() // the brokers are unreachable from now on

	// The lease's deadline is the first agent's, on the wall clock; whole
	// seconds, as the passes are dated in milliseconds.
	clk := clock.NewFake(time.Now().Truncate(time.Second))
	cfg.Clock = clk
	second := startAgent(t, cfg) // same data dir and backend
	waitUntil(t, "the restarted agent enforces L1 from its data dir", func() bool {
		return slices.Equal(leaseIDs(second.Assignments()), []string{"L1"})
	})
	w := startWorkload(t, "L1")
	if err := simulator(t, cfg.Backend).SetProcess(0, w.pid, 4096); err != nil {
		t.Fatal(err)
	}
	passUntilViolation(t, second, clk, hostAGPU0())
	w.waitExit(t, "the restarted agent's watchdog stops L1's over-quota process")
}

func TestACorruptLeaseFileIsQuarantinedAndTheBrokerRestoresTheLease(t *testing.T) {
	f := newFakeBroker(10 * time.Millisecond)
	addr, _ := serveFake(t, f, "127.0.0.1:0")
	cfg := testConfig(t, addr)
	leases := filepath.Join(cfg.DataDir, "leases")
	if err := os.MkdirAll(leases, 0o700); err != nil {
		t.Fatal(err)
	}
	for name, body := range map[string]string{
		"L1.json":    `{"version": 1, "assignment": {"leaseId": "L1", "sli`, // torn write
		"L9.json":    `{"version": 99}`,
		"other.json": `not json`,
	} {
		if err := os.WriteFile(filepath.Join(leases, name), []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	f.setAssignments([]string{"L1"}, nil)
	a := startAgent(t, cfg)
	f.waitFor(t, "the agent enforces L1 from the broker", func() bool { return slices.Equal(leaseIDs(a.Assignments()), []string{"L1"}) })
	q, err := os.ReadDir(filepath.Join(cfg.DataDir, "quarantine"))
	if err != nil || len(q) != 3 {
		t.Fatalf("quarantine holds %d files (%v), want the 3 unreadable ones", len(q), err)
	}
	if _, err := readLeaseFile(filepath.Join(leases, "L1.json")); err != nil {
		t.Fatalf("L1's state file was not rewritten: %v", err)
	}
}

func TestAnAssignmentOnAnUnknownDeviceIsRefusedWhole(t *testing.T) {
	f := newFakeBroker(10 * time.Millisecond)
	addr, _ := serveFake(t, f, "127.0.0.1:0")
	cfg := testConfig(t, addr)
	mpsDir := t.TempDir()
	cfg.MPS = &recordingMPS{dir: mpsDir}
	a := startAgent(t, cfg)
	f.waitFor(t, "the host registered", func() bool { return len(f.registrations) == 1 })
	bad := assignmentsOf([]string{"L1"})[0]
	bad.Slices[0].Isolation = gpupoolv1.Isolation_ISOLATION_MPS
	bad.Slices = append(bad.Slices, &gpupoolv1.Slice{Host: "host-a", Device: "GPU-not-here", MemoryMib: 1024, ComputePercent: 10})
	f.mu.Lock()
	f.enforce = []*gpupoolv1.Assignment{bad}
	f.mu.Unlock()
	f.setAssignmentsRaw()
	f.waitFor(t, "a heartbeat refused L1", func() bool {
		return slices.ContainsFunc(f.heartbeats, func(hb *gpupoolv1.HeartbeatRequest) bool {
			return len(hb.Rejected) == 1 && hb.Rejected[0].LeaseId == "L1" &&
				strings.Contains(hb.Rejected[0].Reason, "slices[1].device GPU-not-here: not a GPU of this host")
		})
	})
	if got := a.Assignments(); len(got) != 0 {
		t.Fatalf("enforcing %v, want nothing", leaseIDs(got))
	}
	if _, err := os.Stat(filepath.Join(cfg.DataDir, "leases", "L1.json")); !os.IsNotExist(err) {
		t.Fatalf("a refused lease left a state file: %v", err)
	}
	if started := cfg.MPS.(*recordingMPS).calls(); len(started) != 0 {
		t.Fatalf("a refused lease started MPS daemons: %v", started)
	}
}

func TestMPSDaemonStartsWithTheFirstSharedLeaseAndQuitsWithTheLast(t *testing.T) {
	f := newFakeBroker(10 * time.Millisecond)
	addr, _ := serveFake(t, f, "127.0.0.1:0")
	cfg := testConfig(t, addr)
	m := &recordingMPS{dir: t.TempDir()}
	cfg.MPS = m
	a := startAgent(t, cfg)
	as := assignmentsOf([]string{"L1", "L2"})
	for _, x := range as {
		x.Slices[0].Isolation = gpupoolv1.Isolation_ISOLATION_MPS
	}
	f.mu.Lock()
	f.enforce = as
	f.mu.Unlock()
	f.setAssignmentsRaw()
	f.waitFor(t, "the agent enforces L1 and L2", func() bool { return len(a.Assignments()) == 2 })
	env, ok := a.LeaseEnv("L1")
	if !ok {
		t.Fatal("no environment for L1")
	}
	for _, want := range []string{"GPUPOOL_LEASE_ID=L1", "CUDA_VISIBLE_DEVICES=" + hostAGPU0(), "MPS_LIMIT=" + hostAGPU0() + ":1024:10"} {
		if !slices.Contains(env, want) {
			t.Errorf("L1's environment %v lacks %s", env, want)
		}
	}
	f.mu.Lock()
	f.enforce, f.teardown = as[1:], as[:1]
	f.mu.Unlock()
	f.setAssignmentsRaw()
	f.waitFor(t, "L1 confirmed torn down", func() bool {
		return len(f.heartbeats) > 0 && slices.Equal(f.heartbeats[len(f.heartbeats)-1].TornDown, []string{"L1"})
	})
	f.mu.Lock()
	f.enforce, f.teardown = nil, as
	f.mu.Unlock()
	f.setAssignmentsRaw()
	f.waitFor(t, "L1 and L2 confirmed torn down", func() bool {
		return len(f.heartbeats) > 0 && slices.Equal(f.heartbeats[len(f.heartbeats)-1].TornDown, []string{"L1", "L2"})
	})
	want := []string{"start " + hostAGPU0(), "stop " + hostAGPU0()}
	if got := m.calls(); !slices.Equal(got, want) {
		t.Fatalf("MPS calls: got %v, want %v (one daemon for both leases)", got, want)
	}
}

// recordingMPS records Start and Stop calls that changed something.
type recordingMPS struct {
	dir     string
	mu      syncMutex
	log     []string
	running map[string]bool
}

func (m *recordingMPS) Start(_ context.Context, uuid string) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.running == nil {
		m.running = map[string]bool{}
	}
	if !m.running[uuid] {
		m.running[uuid] = true
		m.log = append(m.log, "start "+uuid)
	}
	return nil
}

func (m *recordingMPS) Stop(_ context.Context, uuid string) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.running[uuid] {
		delete(m.running, uuid)
		m.log = append(m.log, "stop "+uuid)
	}
	return nil
}

func (m *recordingMPS) ClientEnv(uuid string, memMiB int64, pct int) []string {
	return []string{"MPS_LIMIT=" + uuid + ":" + itoa(memMiB) + ":" + itoa(int64(pct))}
}

func (m *recordingMPS) calls() []string {
	m.mu.Lock()
	defer m.mu.Unlock()
	return slices.Clone(m.log)
}

func TestMetricsShowDeviceAndLeaseUsageAgainstLimits(t *testing.T) {
	for _, withIDs := range []bool{true, false} {
		t.Run(fmt.Sprintf("lease ids asked for: %t", withIDs), func(t *testing.T) {
			_, a, cfg := enforcedAgent(t, func(c *Config) { c.MetricsLeaseIDs = withIDs })
			w := startWorkload(t, "L1")
			sim := simulator(t, cfg.Backend)
			if err := sim.SetProcess(0, w.pid, 512); err != nil {
				t.Fatal(err)
			}
			if err := sim.InjectXid(2, 48); err != nil {
				t.Fatal(err)
			}
			reg := prometheus.NewRegistry()
			reg.MustRegister(a.Collector())
			gpu0 := hostAGPU0()
			// Without ids, the lease label is a pseudonym naming no lease.
			lease := "L1"
			if !withIDs {
				if lease = a.leaseLabel("L1"); !strings.HasPrefix(lease, "h-") || strings.Contains(lease, "L1") {
					t.Fatalf("the lease label %q names the lease", lease)
				}
			}
			want := []struct {
				name   string
				labels map[string]string
				value  float64
			}{
				{"gpupool_agent_lease_memory_used_bytes", map[string]string{"lease": lease, "device": gpu0}, 512 << 20},
				{"gpupool_agent_lease_memory_limit_bytes", map[string]string{"lease": lease, "device": gpu0}, 1024 << 20},
				{"gpupool_agent_lease_processes", map[string]string{"lease": lease, "device": gpu0}, 1},
				{"gpupool_agent_device_memory_used_bytes", map[string]string{"index": "0"}, 512 << 20},
				{"gpupool_agent_device_healthy", map[string]string{"index": "0"}, 1},
				{"gpupool_agent_device_healthy", map[string]string{"index": "2"}, 0},
				{"gpupool_agent_lease_violations_total", map[string]string{"lease": lease}, 0},
			}
			waitUntil(t, "the metrics show the workload and the Xid", func() bool {
				families, err := reg.Gather()
				if err != nil {
					t.Fatal(err)
				}
				for _, w := range want {
					if !hasMetric(families, w.name, w.labels, w.value) {
						return false
					}
				}
				return true
			})
		})
	}
}

func hasMetric(families []*dto.MetricFamily, name string, labels map[string]string, value float64) bool {
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
	metrics:
		for _, m := range f.GetMetric() {
			for _, lp := range m.GetLabel() {
				if v, ok := labels[lp.GetName()]; ok && v != lp.GetValue() {
					continue metrics
				}
			}
			got := m.GetGauge().GetValue()
			if m.GetCounter() != nil {
				got = m.GetCounter().GetValue()
			}
			if got == value {
				return true
			}
		}
	}
	return false
}

func TestHealthEventsReachTheBrokerInHeartbeats(t *testing.T) {
	lastDevices := func(f *fakeBroker) []*gpupoolv1.DeviceReport {
		if len(f.heartbeats) == 0 {
			return nil
		}
		return f.heartbeats[len(f.heartbeats)-1].Devices
	}
	sick := func(ds []*gpupoolv1.DeviceReport) (n int, reasons []string) {
		for _, d := range ds {
			if d.Health == gpupoolv1.DeviceHealth_DEVICE_HEALTH_UNHEALTHY {
				n++
				if !slices.Contains(reasons, d.HealthReason) {
					reasons = append(reasons, d.HealthReason)
				}
			}
		}
		return n, reasons
	}
	for _, tc := range []struct {
		name        string
		inject      func(device.Simulator) error
		wantSick    int
		wantReasons []string
	}{
		{"an application Xid changes nothing", func(s device.Simulator) error { return s.InjectXid(1, 43) }, 0, nil},
		{"a single-bit ECC error changes nothing", func(s device.Simulator) error { return s.InjectECC(1, false) }, 0, nil},
		{"Xid 79 makes its GPU unhealthy", func(s device.Simulator) error { return s.InjectXid(1, 79) }, 1, []string{"Xid 79"}},
		{"a double-bit ECC error makes its GPU unhealthy", func(s device.Simulator) error { return s.InjectECC(2, true) }, 1, nil},
		{"GPU lost makes every GPU unhealthy", func(s device.Simulator) error { return s.LoseGPUs() }, 8, []string{"GPU is lost"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFakeBroker(10 * time.Millisecond)
			addr, _ := serveFake(t, f, "127.0.0.1:0")
			cfg := testConfig(t, addr)
			startAgent(t, cfg)
			f.waitFor(t, "a heartbeat", func() bool { return len(f.heartbeats) > 0 })
			if err := tc.inject(simulator(t, cfg.Backend)); err != nil {
				t.Fatal(err)
			}
			// A marker event after the injected one: once it shows, the
			// injected one was handled.
			if tc.wantSick == 0 {
				if err := simulator(t, cfg.Backend).InjectXid(7, 94); err != nil {
					t.Fatal(err)
				}
				// Read under waitFor's lock: the agent keeps heartbeating.
				var last []*gpupoolv1.DeviceReport
				f.waitFor(t, "the marker Xid on GPU 7", func() bool { last = lastDevices(f); n, _ := sick(last); return n > 0 })
				if n, reasons := sick(last); n != 1 || reasons[0] != "Xid 94" {
					t.Fatalf("unhealthy: %d %v, want only the marker GPU 7", n, reasons)
				}
				return
			}
			var last []*gpupoolv1.DeviceReport
			f.waitFor(t, "unhealthy GPUs in a heartbeat", func() bool { last = lastDevices(f); n, _ := sick(last); return n == tc.wantSick })
			if _, reasons := sick(last); tc.wantReasons != nil && !slices.Equal(reasons, tc.wantReasons) {
				t.Fatalf("reasons %v, want %v", reasons, tc.wantReasons)
			}
		})
	}
}

func TestGPUProcessesOfALeaseTheHostDoesNotEnforceAreStopped(t *testing.T) {
	_, a, cfg, clk := fakeClockAgent(t)
	sim := simulator(t, cfg.Backend)
	stray := startWorkload(t, "L9")
	elsewhere := startWorkload(t, "L8") // another agent's business: not on this host's GPUs
	mine := startWorkload(t, "L1")
	for _, w := range []*testProc{stray, mine} {
		if err := sim.SetProcess(0, w.pid, 100); err != nil {
			t.Fatal(err)
		}
	}
	pass(t, a, clk) // no grace: the first pass that sees it stops it
	stray.waitExit(t, "L9 is not a lease of this host and uses its GPU")
	waitUntil(t, "the stop of L9 finished", func() bool {
		a.leases.mu.Lock()
		defer a.leases.mu.Unlock()
		return !a.leases.strays["L9"]
	})
	// One more watchdog pass, so L8 and L1 have been looked at since.
	pass(t, a, clk)
	if !mine.running() || !elsewhere.running() {
		t.Fatalf("stopped a process it should not: L1 running %t, L8 running %t", mine.running(), elsewhere.running())
	}
}

func TestATeardownSurvivesTheHeartbeatStreamBreaking(t *testing.T) {
	f, a, _ := enforcedAgent(t, nil)
	// A process that ignores SIGTERM keeps the teardown busy for the
	// kill-after while the stream breaks under it.
	cmd := exec.Command("sh", "-c", `trap "" TERM; while :; do sleep 0.05; done`)
	cmd.Env = append(os.Environ(), LeaseEnvVar+"=L1")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	joinLease(t, "L1", cmd.Process.Pid)
	exited := make(chan struct{})
	go func() { cmd.Wait(); close(exited) }()
	t.Cleanup(func() { cmd.Process.Kill(); <-exited })
	waitUntil(t, "the agent sees L1's process", func() bool {
		procs, _ := a.procs.Scan()
		return len(procs["L1"]) > 0
	})

	since := f.setAssignments(nil, []string{"L1"})
	waitUntil(t, "the teardown started", func() bool {
		a.leases.mu.Lock()
		defer a.leases.mu.Unlock()
		e := a.leases.entries["L1"]
		return e != nil && e.phase == tearingDown
	})
	f.dropStreams()
	select {
	case <-exited:
	case <-time.After(waitTimeout):
		t.Fatal("the teardown was abandoned when the stream broke: the process still runs")
	}
	f.waitFor(t, "L1 confirmed torn down on the new stream", func() bool {
		return len(f.heartbeats) > since && slices.Equal(f.heartbeats[len(f.heartbeats)-1].TornDown, []string{"L1"})
	})
}

func TestARestartedAgentKillsTheProcessesOfALeaseItNoLongerHolds(t *testing.T) {
	if !testBox().HasCgroups() {
		t.Skip("no cgroups on this host: leases' processes are found by their environment")
	}
	// An earlier agent was killed with SIGKILL: its data dir still holds
	// L-held, and nothing of l-00000000000000ff (released meanwhile, or
	// its data dir lost), whose process still runs in its cgroup. Beside
	// them under the cgroup parent run a process in a cgroup named like a
	// systemd unit and one in a cgroup named like no broker's lease id:
	// neither is a lease's. Their names sort before the orphan's, so the
	// reap, which goes through the cgroups in name order, has passed them
	// once the orphan is gone.
	cfg := testConfig(t, "127.0.0.1:1") // no broker answers
	files, err := openLeaseFiles(cfg.DataDir)
	if err != nil {
		t.Fatal(err)
	}
	held := assignmentsOf([]string{"L-held"})[0]
	if err := files.put(leaseRecord{Assignment: held, Deadline: time.Now().Add(time.Hour)}); err != nil {
		t.Fatal(err)
	}
	kept, orphan := startWorkload(t, "L-held"), startWorkload(t, "l-00000000000000ff")
	others := []*testProc{startWorkload(t, "init.scope"), startWorkload(t, "L-other")}

	a := startAgent(t, cfg)
	orphan.waitExit(t, "the restarted agent kills what runs in the cgroup of a lease it does not hold")
	waitUntil(t, "the orphan's cgroup is removed", func() bool {
		ids, err := a.box.Leases()
		return err == nil && !slices.Contains(ids, "l-00000000000000ff")
	})
	for i, name := range []string{"init.scope", "L-other"} {
		if pids, err := a.box.Procs(name); err != nil || !slices.Contains(pids, others[i].pid) || !others[i].running() {
			t.Errorf("cgroup %s, which is no lease's: got processes %v (%v), want %d still running in it", name, pids, err, others[i].pid)
		}
	}
	if !kept.running() {
		t.Fatal("the process of L-held, which the agent resumed, was killed")
	}
	pids, err := a.box.Procs("L-held")
	if err != nil || !slices.Contains(pids, kept.pid) {
		t.Errorf("L-held's cgroup: got processes %v (%v), want the adopted %d in it", pids, err, kept.pid)
	}
	if got := leaseIDs(a.Assignments()); !slices.Equal(got, []string{"L-held"}) {
		t.Errorf("enforced leases: got %v, want [L-held]", got)
	}
}
