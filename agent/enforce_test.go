package agent

import (
	"context"
	"fmt"
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

func TestWatchdogStopsALeaseOverItsMemoryAndReportsTheViolation(t *testing.T) {
	f, _, cfg := enforcedAgent(t, nil)
	sim := simulator(t, cfg.Backend)
	over := startWorkload(t, "L1")
	other := startWorkload(t, "")
	if err := sim.SetProcess(0, other.pid, 70000); err != nil { // no lease: not the watchdog's business
		t.Fatal(err)
	}
	if err := sim.SetProcess(0, over.pid, 2048); err != nil { // L1's slice is 1 GiB
		t.Fatal(err)
	}
	start := time.Now()
	over.waitExit(t, "it used 2 GiB of a 1 GiB slice")
	t.Logf("over-quota process stopped %s after it went over (poll %s + grace %s)", over.at.Sub(start).Round(time.Millisecond),
		fastEnforcement.Poll, fastEnforcement.Grace)
	if over.at.Sub(start) < fastEnforcement.Grace {
		t.Fatalf("stopped after %s, before the grace of %s", over.at.Sub(start), fastEnforcement.Grace)
	}
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
	_, _, cfg := enforcedAgent(t, nil)
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
	select {
	case err := <-exited:
		if !strings.Contains(err.Error(), "killed") {
			t.Fatalf("the process ended with %v, want killed", err)
		}
	case <-time.After(waitTimeout):
		t.Fatal("a process that ignores SIGTERM was never killed")
	}
}

func TestWatchdogStopsALeaseOnAGPUItDoesNotHold(t *testing.T) {
	_, _, cfg := enforcedAgent(t, nil)
	w := startWorkload(t, "L1")
	if err := simulator(t, cfg.Backend).SetProcess(3, w.pid, 10); err != nil {
		t.Fatal(err)
	}
	w.waitExit(t, "it used GPU 3, which L1 does not hold")
}

func TestWatchdogLetsALeaseWithinItsSliceRun(t *testing.T) {
	_, a, cfg := enforcedAgent(t, nil)
	w := startWorkload(t, "L1")
	if err := simulator(t, cfg.Backend).SetProcess(0, w.pid, 1000); err != nil {
		t.Fatal(err)
	}
	// Wait for the watchdog to have measured it for longer than the grace.
	deadline := time.Now().Add(waitTimeout)
	var (
		first time.Time
		u     *gpupoolv1.LeaseUsage
	)
	for {
		a.leases.mu.Lock()
		if e := a.leases.entries["L1"]; e != nil {
			u = e.usage
		}
		a.leases.mu.Unlock()
		if u != nil && u.Slices[0].MemoryUsedMib == 1000 {
			if first.IsZero() {
				first = time.Now()
			} else if time.Since(first) > 2*fastEnforcement.Grace {
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("the watchdog never measured the workload's 1000 MiB for long; last usage %v", u)
		}
		time.Sleep(fastEnforcement.Poll)
	}
	if !w.running() {
		t.Fatal("a lease within its slice was stopped")
	}
}

func TestBrokerGoneStopsALeasesProcessesAfterExpiryPlusGraceNotBefore(t *testing.T) {
	f := newFakeBroker(10 * time.Millisecond)
	f.ttl = time.Second
	addr, stop := serveFake(t, f, "127.0.0.1:0")
	cfg := testConfig(t, addr)
	cfg.Enforcement = fastEnforcement
	a := startAgent(t, cfg)
	f.setAssignments([]string{"L1"}, nil)
	f.waitFor(t, "the agent enforces L1", func() bool { return slices.Equal(leaseIDs(a.Assignments()), []string{"L1"}) })
	w := startWorkload(t, "L1")

	stop()
	w.waitExit(t, "the brokers are gone and the lease expired")
	// The agent's deadline is the last renewal it received plus the TTL.
	// The fake's own send times do not bound it: on a loaded machine the
	// agent may give up on a stream before the fake's last answer reaches it.
	a.leases.mu.Lock()
	var deadline time.Time
	if e := a.leases.entries["L1"]; e != nil {
		deadline = e.deadline
	}
	a.leases.mu.Unlock()
	if deadline.IsZero() {
		t.Fatal("the agent forgot L1 once it expired; want it kept until the brokers say otherwise")
	}
	earliest := deadline.Add(cfg.Enforcement.ExpiryGrace)
	t.Logf("stopped %s after the lease's expiry as the agent knew it (grace %s)", w.at.Sub(deadline).Round(time.Millisecond), cfg.Enforcement.ExpiryGrace)
	if w.at.Before(earliest) {
		t.Fatalf("stopped %s before the lease's expiry plus grace", earliest.Sub(w.at))
	}
	if got := leaseIDs(a.Assignments()); !slices.Equal(got, []string{"L1"}) {
		t.Fatalf("after the expiry the agent enforces %v, want L1 still: the brokers may renew it when they return", got)
	}
}

func TestARestartedAgentKeepsEnforcingItsLeasesWithoutTheBroker(t *testing.T) {
	f := newFakeBroker(10 * time.Millisecond)
	addr, stop := serveFake(t, f, "127.0.0.1:0")
	cfg := testConfig(t, addr)
	cfg.Enforcement = fastEnforcement
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

	second := startAgent(t, cfg) // same data dir and backend
	waitUntil(t, "the restarted agent enforces L1 from its data dir", func() bool {
		return slices.Equal(leaseIDs(second.Assignments()), []string{"L1"})
	})
	w := startWorkload(t, "L1")
	if err := simulator(t, cfg.Backend).SetProcess(0, w.pid, 4096); err != nil {
		t.Fatal(err)
	}
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
				f.waitFor(t, "the marker Xid on GPU 7", func() bool { n, _ := sick(lastDevices(f)); return n > 0 })
				if n, reasons := sick(lastDevices(f)); n != 1 || reasons[0] != "Xid 94" {
					t.Fatalf("unhealthy: %d %v, want only the marker GPU 7", n, reasons)
				}
				return
			}
			f.waitFor(t, "unhealthy GPUs in a heartbeat", func() bool { n, _ := sick(lastDevices(f)); return n == tc.wantSick })
			if _, reasons := sick(lastDevices(f)); tc.wantReasons != nil && !slices.Equal(reasons, tc.wantReasons) {
				t.Fatalf("reasons %v, want %v", reasons, tc.wantReasons)
			}
		})
	}
}

func TestGPUProcessesOfALeaseTheHostDoesNotEnforceAreStopped(t *testing.T) {
	_, a, cfg := enforcedAgent(t, nil)
	sim := simulator(t, cfg.Backend)
	stray := startWorkload(t, "L9")
	elsewhere := startWorkload(t, "L8") // another agent's business: not on this host's GPUs
	mine := startWorkload(t, "L1")
	for _, w := range []*testProc{stray, mine} {
		if err := sim.SetProcess(0, w.pid, 100); err != nil {
			t.Fatal(err)
		}
	}
	stray.waitExit(t, "L9 is not a lease of this host and uses its GPU")
	// One more watchdog pass, so L8 and L1 have been looked at since.
	waitUntil(t, "a watchdog pass after the stop", func() bool {
		a.leases.mu.Lock()
		defer a.leases.mu.Unlock()
		return !a.leases.strays["L9"]
	})
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
