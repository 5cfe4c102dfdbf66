package agent

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/gpupool/gpupool/agent/device"
	"github.com/gpupool/gpupool/agent/sandbox"
	"github.com/gpupool/gpupool/internal/loopfs"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// waitTimeout bounds every wait; tests never sleep.
const waitTimeout = 10 * time.Second

// fakeBroker is an AgentService test double: it remembers registered
// hosts, answers every heartbeat with the assignment list the test set,
// pushes that list when it changes, and refuses heartbeats of unknown
// hosts with NotFound, as a broker restored without the host would.
type fakeBroker struct {
	gpupoolv1.UnimplementedAgentServiceServer
	interval time.Duration

	mu            sync.Mutex
	hosts         map[string]bool               // guarded by mu
	registrations []*gpupoolv1.RegisterRequest  // guarded by mu
	heartbeats    []*gpupoolv1.HeartbeatRequest // guarded by mu
	streams       int                           // heartbeat streams opened; guarded by mu
	notFound      int                           // streams refused with NotFound; guarded by mu
	refuse        int                           // registrations still to refuse; guarded by mu
	refused       int                           // registrations refused; guarded by mu
	enforce       []*gpupoolv1.Assignment       // guarded by mu
	teardown      []*gpupoolv1.Assignment       // guarded by mu
	version       int                           // bumped by setAssignments; guarded by mu
	pushed        chan struct{}                 // closed by setAssignments; guarded by mu
	dropped       chan struct{}                 // closed by dropStreams; guarded by mu
	seen          chan struct{}                 // closed on every change; guarded by mu
	ttl           time.Duration                 // TTL of the assignments, if set; guarded by mu
}

func newFakeBroker(interval time.Duration) *fakeBroker {
	return &fakeBroker{
		interval: interval,
		hosts:    map[string]bool{},
		pushed:   make(chan struct{}),
		dropped:  make(chan struct{}),
		seen:     make(chan struct{}),
	}
}

// notifyLocked wakes everyone waiting for a change.
func (f *fakeBroker) notifyLocked() {
	close(f.seen)
	f.seen = make(chan struct{})
}

func (f *fakeBroker) Register(_ context.Context, req *gpupoolv1.RegisterRequest) (*gpupoolv1.RegisterResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.refuse > 0 {
		f.refuse--
		f.refused++
		f.notifyLocked()
		return nil, status.Error(codes.InvalidArgument, "fake broker: refused")
	}
	f.registrations = append(f.registrations, req)
	f.hosts[req.GetHost().GetId()] = true
	f.notifyLocked()
	return &gpupoolv1.RegisterResponse{
		HostId:              req.GetHost().GetId(),
		HeartbeatIntervalMs: f.interval.Milliseconds(),
		HeartbeatTtlMs:      3 * f.interval.Milliseconds(),
	}, nil
}

func (f *fakeBroker) Heartbeat(stream grpc.BidiStreamingServer[gpupoolv1.HeartbeatRequest, gpupoolv1.HeartbeatResponse]) error {
	f.mu.Lock()
	f.streams++
	dropped := f.dropped
	sent := f.version
	f.notifyLocked()
	f.mu.Unlock()

	reqs := make(chan *gpupoolv1.HeartbeatRequest)
	errs := make(chan error, 1)
	go func() {
		for {
			req, err := stream.Recv()
			if err != nil {
				errs <- err
				return
			}
			select {
			case reqs <- req:
			case <-stream.Context().Done():
				return
			}
		}
	}()
	for {
		f.mu.Lock()
		pushed := f.pushed
		var push *gpupoolv1.HeartbeatResponse
		if f.version != sent {
			push, sent = f.responseLocked(), f.version
		}
		f.mu.Unlock()
		if push != nil {
			if err := stream.Send(push); err != nil {
				return err
			}
			continue
		}
		select {
		case err := <-errs:
			return err
		case <-dropped:
			return status.Error(codes.Unavailable, "fake broker: stream dropped")
		case <-pushed:
		case req := <-reqs:
			f.mu.Lock()
			if !f.hosts[req.GetHostId()] {
				f.notFound++
				f.notifyLocked()
				f.mu.Unlock()
				return status.Errorf(codes.NotFound, "host %q is not registered", req.GetHostId())
			}
			f.heartbeats = append(f.heartbeats, req)
			resp := f.responseLocked()
			sent = f.version
			f.notifyLocked()
			f.mu.Unlock()
			if err := stream.Send(resp); err != nil {
				return err
			}
		}
	}
}

func (f *fakeBroker) responseLocked() *gpupoolv1.HeartbeatResponse {
	if f.ttl > 0 {
		for _, a := range f.enforce {
			a.TtlMs = f.ttl.Milliseconds()
		}
	}
	return &gpupoolv1.HeartbeatResponse{
		Enforce:             f.enforce,
		Teardown:            f.teardown,
		HeartbeatIntervalMs: f.interval.Milliseconds(),
	}
}

// setAssignments replaces the host's assignment list and pushes it to the
// open streams. It returns how many heartbeats had arrived before.
func (f *fakeBroker) setAssignments(enforce, teardown []string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.enforce, f.teardown = assignmentsOf(enforce), assignmentsOf(teardown)
	f.version++
	close(f.pushed)
	f.pushed = make(chan struct{})
	return len(f.heartbeats)
}

// hostAGPU0 is the UUID of GPU 0 of the simulated host-a.
var hostAGPU0 = sync.OnceValue(func() string {
	b, err := device.NewSimulated("1xA100-80GB", "host-a")
	if err != nil {
		panic(err)
	}
	defer b.Close()
	devs, err := b.Devices()
	if err != nil {
		panic(err)
	}
	return devs[0].Uuid
})

// assignmentsOf makes granted leases of 1 GiB each on host-a's GPU 0.
// setAssignmentsRaw pushes f.enforce and f.teardown as the test set them.
func (f *fakeBroker) setAssignmentsRaw() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.version++
	close(f.pushed)
	f.pushed = make(chan struct{})
}

type syncMutex = sync.Mutex

func itoa(n int64) string { return strconv.FormatInt(n, 10) }

func assignmentsOf(ids []string) []*gpupoolv1.Assignment {
	var out []*gpupoolv1.Assignment
	for i, id := range ids {
		out = append(out, &gpupoolv1.Assignment{
			LeaseId:      id,
			FencingToken: uint64(100 + i),
			State:        gpupoolv1.LeaseState_LEASE_STATE_GRANTED,
			TtlMs:        60_000,
			Slices: []*gpupoolv1.Slice{{Host: "host-a", Device: hostAGPU0(), MemoryMib: 1024, ComputePercent: 10,
				Isolation: gpupoolv1.Isolation_ISOLATION_WATCHDOG}},
		})
	}
	return out
}

// dropStreams ends every open heartbeat stream with Unavailable, as a
// follower does when the leader changes. It returns how many streams had
// been opened before.
func (f *fakeBroker) dropStreams() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	close(f.dropped)
	f.dropped = make(chan struct{})
	return f.streams
}

// waitFor blocks until cond, called with f.mu held, holds.
func (f *fakeBroker) waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.NewTimer(waitTimeout)
	defer deadline.Stop()
	for {
		f.mu.Lock()
		ok, seen := cond(), f.seen
		f.mu.Unlock()
		if ok {
			return
		}
		select {
		case <-seen:
		case <-deadline.C:
			t.Fatalf("timed out after %s waiting until %s", waitTimeout, what)
		}
	}
}

// serveFake serves f on addr until stop or the end of the test.
func serveFake(t *testing.T, f *fakeBroker, addr string) (boundAddr string, stop func()) {
	t.Helper()
	lis, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatalf("listen on %s: %v", addr, err)
	}
	srv := grpc.NewServer()
	gpupoolv1.RegisterAgentServiceServer(srv, f)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	return lis.Addr().String(), srv.Stop
}

func simBackend(t *testing.T, spec, hostID string) device.Backend {
	t.Helper()
	b, err := device.NewSimulated(spec, hostID)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = b.Close() })
	return b
}

func testConfig(t *testing.T, addr string) Config {
	return Config{
		Brokers:       []string{addr},
		HostID:        "host-a",
		Address:       "10.0.0.7:7700",
		Labels:        map[string]string{"zone": "a"},
		CPUMillicores: 16000,
		MemoryMiB:     65536,
		Backend:       simBackend(t, "8xA100-80GB", "host-a"),
		Version:       "v0.0.0-test",
		Logger:        slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelDebug})),
		DataDir:       t.TempDir(),
		CgroupParent:  testCgroupParent + "/host-a",
	}
}

// testCgroupParent holds the cgroups of this test process's agents.
var testCgroupParent = fmt.Sprintf("gpupool-test/agent-%d", os.Getpid())

// testBox is a sandbox manager with the cgroups of host-a's agents, to
// put test workloads in a lease's cgroup as the sandbox's init would.
var testBox = sync.OnceValue(func() *sandbox.Manager {
	m, err := sandbox.New(sandbox.Config{CgroupParent: testCgroupParent + "/host-a"})
	if err != nil {
		panic(err)
	}
	return m
})

func TestMain(m *testing.M) {
	sandbox.Init()
	code := m.Run()
	// Leases still enforced when a test's agent stopped keep their
	// cgroups, as across an agent restart: remove them.
	testBox().Purge()
	os.Exit(code)
}

// startAgent runs an agent until the end of the test, then checks that
// Run returned nil.
func startAgent(t *testing.T, cfg Config) *Agent {
	t.Helper()
	a, err := New(cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run returned %v, want nil after cancel", err)
		}
	})
	return a
}

func leaseIDs(as []*gpupoolv1.Assignment) []string {
	var out []string
	for _, a := range as {
		out = append(out, a.GetLeaseId())
	}
	return out
}

func TestNewRefusesBadConfig(t *testing.T) {
	backend := simBackend(t, "1xA100-80GB", "host-a")
	good := Config{Brokers: []string{"127.0.0.1:7641"}, HostID: "host-a", Backend: backend, DataDir: t.TempDir()}
	for _, tc := range []struct {
		name    string
		edit    func(*Config)
		wantErr string
	}{
		{"a config with brokers, host id and backend is accepted", func(*Config) {}, ""},
		{"a dotted host name is accepted", func(c *Config) { c.HostID = "gpu-7.rack-2.example.com" }, ""},
		{"no broker is refused", func(c *Config) { c.Brokers = nil }, "no broker address"},
		{"an empty host id is refused", func(c *Config) { c.HostID = "" }, `host id "": must be 1 to 253`},
		{"a host id with a space is refused", func(c *Config) { c.HostID = "gpu 7" }, `host id "gpu 7"`},
		{"a host id of 254 characters is refused", func(c *Config) { c.HostID = strings.Repeat("a", 254) }, "must be 1 to 253"},
		{"no backend is refused", func(c *Config) { c.Backend = nil }, "no device backend"},
		{"negative host CPU is refused", func(c *Config) { c.CPUMillicores = -1 }, "host CPU -1 millicores: must be 0 or more"},
		{"negative host memory is refused", func(c *Config) { c.MemoryMiB = -1 }, "host memory -1 MiB: must be 0 or more"},
		{"a label with an empty key is refused", func(c *Config) { c.Labels = map[string]string{"": "x"} }, "empty key"},
		{"no data dir is refused", func(c *Config) { c.DataDir = "" }, "no data dir"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := good
			tc.edit(&cfg)
			_, err := New(cfg)
			switch {
			case tc.wantErr == "" && err != nil:
				t.Fatalf("New: %v, want no error", err)
			case tc.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tc.wantErr)):
				t.Fatalf("New error = %v, want one containing %q", err, tc.wantErr)
			}
		})
	}
}

func TestAgentRegistersItsGPUsAndHeartbeats(t *testing.T) {
	f := newFakeBroker(10 * time.Millisecond)
	addr, _ := serveFake(t, f, "127.0.0.1:0")
	startAgent(t, testConfig(t, addr))

	f.waitFor(t, "the host registered and sent 3 heartbeats", func() bool {
		return len(f.registrations) == 1 && len(f.heartbeats) >= 3
	})
	f.mu.Lock()
	h := f.registrations[0].GetHost()
	hb := f.heartbeats[0]
	f.mu.Unlock()
	for _, c := range []struct {
		field     string
		got, want any
	}{
		{"id", h.GetId(), "host-a"},
		{"address", h.GetAddress(), "10.0.0.7:7700"},
		{"labels", len(h.GetLabels()) == 1 && h.GetLabels()["zone"] == "a", true},
		{"agent version", h.GetAgentVersion(), "v0.0.0-test"},
		{"backend", h.GetBackend(), "simulated"},
		{"backend note", h.GetBackendNote(), ""},
		{"CPU", h.GetCpuMillicores(), int64(16000)},
		{"memory", h.GetMemoryMib(), int64(65536)},
		{"device count", len(h.GetDevices()), 8},
		{"heartbeat host id", hb.GetHostId(), "host-a"},
	} {
		if c.got != c.want {
			t.Errorf("registered %s = %v, want %v", c.field, c.got, c.want)
		}
	}
	for _, d := range h.GetDevices() {
		if d.GetHostId() != "host-a" || d.GetMemoryMib() != 81920 || len(d.GetNvlinkPeers()) != 7 {
			t.Errorf("registered device %s: host %q, %d MiB, %d NVLink peers; want host-a, 81920 MiB, 7 peers",
				d.GetUuid(), d.GetHostId(), d.GetMemoryMib(), len(d.GetNvlinkPeers()))
		}
	}
}

func TestAgentReportsWhyAnNVMLHostHasNoGPUs(t *testing.T) {
	f := newFakeBroker(10 * time.Millisecond)
	addr, _ := serveFake(t, f, "127.0.0.1:0")
	cfg := testConfig(t, addr)
	cfg.Backend = noGPUs{}
	startAgent(t, cfg)

	f.waitFor(t, "the host registered", func() bool { return len(f.registrations) == 1 })
	f.mu.Lock()
	h := f.registrations[0].GetHost()
	f.mu.Unlock()
	if note := (noGPUs{}).Note(); len(h.GetDevices()) != 0 || h.GetBackend() != "nvml" || h.GetBackendNote() != note {
		t.Errorf("registered %d devices, backend %q, note %q; want none, nvml, %q",
			len(h.GetDevices()), h.GetBackend(), h.GetBackendNote(), note)
	}
}

// noGPUs is what device.NewNVML returns on a host without libnvidia-ml.
type noGPUs struct{}

func (noGPUs) Name() string                          { return "nvml" }
func (noGPUs) Devices() ([]*gpupoolv1.Device, error) { return nil, nil }
func (noGPUs) Note() string {
	return "NVML library libnvidia-ml.so.1 not found: this host offers no GPUs"
}
func (noGPUs) Close() error                     { return nil }
func (noGPUs) Sample() ([]device.Sample, error) { return nil, nil }
func (noGPUs) WatchHealth(context.Context, func(device.HealthEvent)) error {
	return nil
}

func TestAgentFollowsAssignmentsAndConfirmsTeardown(t *testing.T) {
	f := newFakeBroker(10 * time.Millisecond)
	addr, _ := serveFake(t, f, "127.0.0.1:0")
	a := startAgent(t, testConfig(t, addr))
	f.waitFor(t, "the host registered", func() bool { return len(f.registrations) == 1 })

	f.setAssignments([]string{"L1", "L2"}, nil)
	f.waitFor(t, "the agent enforces L1 and L2", func() bool {
		return slices.Equal(leaseIDs(a.Assignments()), []string{"L1", "L2"})
	})

	// L1 moves to teardown: the agent forgets it and confirms, again and
	// again, until the broker stops asking.
	since := f.setAssignments([]string{"L2"}, []string{"L1"})
	f.waitFor(t, "three heartbeats confirmed L1 torn down", func() bool {
		n := 0
		for _, hb := range f.heartbeats[since:] {
			if slices.Equal(hb.GetTornDown(), []string{"L1"}) {
				n++
			}
		}
		return n >= 3
	})
	if got := leaseIDs(a.Assignments()); !slices.Equal(got, []string{"L2"}) {
		t.Errorf("enforcing %v after L1's teardown, want [L2]", got)
	}

	since = f.setAssignments([]string{"L2"}, nil)
	f.waitFor(t, "a heartbeat stopped confirming L1", func() bool {
		return slices.ContainsFunc(f.heartbeats[since:], func(hb *gpupoolv1.HeartbeatRequest) bool {
			return len(hb.GetTornDown()) == 0
		})
	})
}

func TestAgentConfirmsATeardownWithoutWaitingForTheNextHeartbeat(t *testing.T) {
	// With an hour between heartbeats, only the first heartbeat and the
	// prompt confirmation can arrive within the test.
	f := newFakeBroker(time.Hour)
	addr, _ := serveFake(t, f, "127.0.0.1:0")
	a := startAgent(t, testConfig(t, addr))
	f.waitFor(t, "the first heartbeat arrived", func() bool { return len(f.heartbeats) == 1 })

	since := f.setAssignments(nil, []string{"L1"})
	f.waitFor(t, "the agent confirmed L1 torn down", func() bool {
		return len(f.heartbeats) > since && slices.Equal(f.heartbeats[len(f.heartbeats)-1].GetTornDown(), []string{"L1"})
	})
	if got := a.Assignments(); len(got) != 0 {
		t.Errorf("enforcing %v after teardown, want nothing", leaseIDs(got))
	}
}

func TestAgentReconnectsWhenTheBrokerDropsTheStream(t *testing.T) {
	f := newFakeBroker(10 * time.Millisecond)
	addr, _ := serveFake(t, f, "127.0.0.1:0")
	startAgent(t, testConfig(t, addr))
	f.waitFor(t, "the host registered and heartbeats", func() bool { return len(f.heartbeats) >= 1 })

	streams := f.dropStreams()
	f.mu.Lock()
	since := len(f.heartbeats)
	f.mu.Unlock()
	f.waitFor(t, "heartbeats resumed on a new stream", func() bool {
		return f.streams > streams && len(f.heartbeats) > since+2
	})
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.registrations) != 1 {
		t.Errorf("the host registered %d times, want once: the broker still knows it", len(f.registrations))
	}
}

func TestAgentRegistersAgainWithARestartedBrokerThatForgotTheHost(t *testing.T) {
	first := newFakeBroker(10 * time.Millisecond)
	addr, stop := serveFake(t, first, "127.0.0.1:0")
	a := startAgent(t, testConfig(t, addr))
	first.setAssignments([]string{"L1"}, nil)
	first.waitFor(t, "the agent enforces L1", func() bool {
		return slices.Equal(leaseIDs(a.Assignments()), []string{"L1"})
	})

	stop()
	second := newFakeBroker(10 * time.Millisecond)
	second.setAssignments([]string{"L1", "L2"}, nil)
	serveFake(t, second, addr)
	second.waitFor(t, "the agent was refused, registered again and heartbeats", func() bool {
		return second.notFound >= 1 && len(second.registrations) == 1 && len(second.heartbeats) >= 2
	})
	second.waitFor(t, "the agent follows the new broker's assignments", func() bool {
		return slices.Equal(leaseIDs(a.Assignments()), []string{"L1", "L2"})
	})
}

func TestAgentKeepsTryingToRegisterUntilABrokerListens(t *testing.T) {
	// Find a free port, then leave it closed while the agent starts.
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := lis.Addr().String()
	lis.Close()
	startAgent(t, testConfig(t, addr))

	f := newFakeBroker(10 * time.Millisecond)
	serveFake(t, f, addr)
	f.waitFor(t, "the host registered and heartbeats", func() bool {
		return len(f.registrations) == 1 && len(f.heartbeats) >= 1
	})
}

func TestAgentRetriesARefusedRegistration(t *testing.T) {
	f := newFakeBroker(10 * time.Millisecond)
	f.refuse = 2
	addr, _ := serveFake(t, f, "127.0.0.1:0")
	startAgent(t, testConfig(t, addr))
	f.waitFor(t, "the host registered after two refusals and heartbeats", func() bool {
		return f.refused == 2 && len(f.registrations) == 1 && len(f.heartbeats) >= 1
	})
}

func TestAnAgentOnAFullDiskRefusesNewLeasesAndRecoversBySelf(t *testing.T) {
	mnt := loopfs.Mount(t, 16)
	f := newFakeBroker(10 * time.Millisecond)
	addr, _ := serveFake(t, f, "127.0.0.1:0")
	cfg := testConfig(t, addr)
	cfg.DataDir = filepath.Join(mnt, "agent")
	a := startAgent(t, cfg)
	f.waitFor(t, "the host registered", func() bool { return len(f.registrations) == 1 })
	f.setAssignments([]string{"L1"}, nil)
	f.waitFor(t, "the agent enforces L1", func() bool { return slices.Equal(leaseIDs(a.Assignments()), []string{"L1"}) })

	filler := filepath.Join(mnt, "filler")
	if _, err := loopfs.Fill(filler); err != nil {
		t.Fatal(err)
	}
	since := f.setAssignments([]string{"L1", "L2"}, nil)
	var reason string
	f.waitFor(t, "a heartbeat refusing L2", func() bool {
		for _, hb := range f.heartbeats[since:] {
			for _, r := range hb.GetRejected() {
				if r.GetLeaseId() == "L2" {
					reason = r.GetReason()
					return true
				}
			}
		}
		return false
	})
	if !strings.Contains(reason, "disk full") || !strings.Contains(reason, cfg.DataDir) {
		t.Errorf("L2 refused with %q, want it to say the data dir %s is full", reason, cfg.DataDir)
	}
	if got := leaseIDs(a.Assignments()); !slices.Equal(got, []string{"L1"}) {
		t.Errorf("enforcing %v on a full disk, want [L1] still", got)
	}

	if err := os.Remove(filler); err != nil {
		t.Fatal(err)
	}
	f.setAssignments([]string{"L1", "L3"}, nil)
	f.waitFor(t, "the agent enforces L3 once space returned", func() bool {
		return slices.Equal(leaseIDs(a.Assignments()), []string{"L1", "L3"})
	})
	// Nothing is corrupt: the lease files read back whole.
	recs, bad, err := a.files.load()
	if err != nil || len(bad) != 0 {
		t.Fatalf("reading the lease files: %v, quarantined %v", err, bad)
	}
	var ids []string
	for _, r := range recs {
		ids = append(ids, r.Assignment.GetLeaseId())
	}
	if !slices.Equal(ids, []string{"L1", "L3"}) {
		t.Errorf("lease files of %v, want [L1 L3]", ids)
	}
}
