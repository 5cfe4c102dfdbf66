package broker

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/gpupool/gpupool/client"
	"github.com/gpupool/gpupool/internal/clock"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// testServer is one in-process broker that forms a single-server cluster.
type testServer struct {
	s     *Server
	c     *client.Client
	clock *clock.Fake
	// faults fails chosen commands before they reach Raft.
	faults *faultyProposer
}

// startServer starts a server; opts change its Config first.
func startServer(t testing.TB, opts ...func(*Config)) *testServer {
	t.Helper()
	fake := clock.NewFake(time.Unix(1_700_000_000, 0))
	cfg := Config{
		DataDir: t.TempDir(), BindAddr: "127.0.0.1:0", RaftBindAddr: "127.0.0.1:0", BootstrapExpect: 1,
		Clock: fake, HeartbeatInterval: time.Second, HeartbeatTTL: 5 * time.Second, LockDelay: 10 * time.Second,
		PreemptGrace: 2 * time.Second, PendingGrace: 3 * time.Second,
		SlowDiskThreshold: -1, // a loaded machine must not move leadership under a test
	}
	faults := &faultyProposer{}
	cfg.wrapProposer = faults.wrap
	for _, o := range opts {
		o(&cfg)
	}
	s, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Shutdown() })
	c, err := client.Dial([]string{s.Addr()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	waitFor(t, "leadership", func() bool { return s.leadership.currentLeader() != nil })
	return &testServer{s: s, c: c, clock: fake, faults: faults}
}

// waitFor polls cond until it holds or 20 s pass.
func waitFor(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func ctx(t testing.TB) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	return c
}

func (ts *testServer) registerHost(t testing.TB, id string, gpus int, memMiB int64) {
	t.Helper()
	h := &gpupoolv1.Host{Id: id, Address: "127.0.0.1:1", CpuMillicores: 64000, MemoryMib: 256 << 10}
	for i := range gpus {
		h.Devices = append(h.Devices, &gpupoolv1.Device{
			Uuid: fmt.Sprintf("GPU-%s-%d", id, i), Index: int32(i), Model: "A100-SXM4-80GB", MemoryMib: memMiB,
		})
	}
	if _, err := ts.c.Agent.Register(ctx(t), &gpupoolv1.RegisterRequest{Host: h}); err != nil {
		t.Fatal(err)
	}
	// The leader arms the heartbeat deadline in its own goroutine: wait for
	// it, so that advancing the fake clock afterwards counts against it.
	waitFor(t, "the heartbeat deadline of "+id+" armed", func() bool {
		ls := ts.s.leadership.currentLeader()
		if ls == nil {
			return false
		}
		_, ok := ls.heartbeat.Deadline(id)
		return ok
	})
}

// heartbeater opens a heartbeat stream for host and returns beat, which
// sends one heartbeat (confirming tornDown) and returns once the leader
// has re-armed the host's deadline. Assignment pushes are drained.
func (ts *testServer) heartbeater(t *testing.T, host string) (beat func(tornDown ...string)) {
	t.Helper()
	hb, err := ts.c.Agent.Heartbeat(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		for {
			if _, err := hb.Recv(); err != nil {
				return
			}
		}
	}()
	return func(tornDown ...string) {
		t.Helper()
		if err := hb.Send(&gpupoolv1.HeartbeatRequest{HostId: host, TornDown: tornDown}); err != nil {
			t.Fatal(err)
		}
		want := ts.clock.Now().Add(ts.s.cfg.HeartbeatTTL)
		waitFor(t, "heartbeat handled", func() bool {
			d, ok := ts.s.leadership.currentLeader().heartbeat.Deadline(host)
			return ok && d.Equal(want)
		})
	}
}

func slice(mem int64, compute int32) *gpupoolv1.LeaseRequest {
	return &gpupoolv1.LeaseRequest{Count: 1, MemoryMib: mem, ComputePercent: compute, TtlMs: 60_000}
}

func TestAcquireRejectsBadInputNamingTheField(t *testing.T) {
	ts := startServer(t)
	ts.registerHost(t, "h1", 2, 81920)
	mod := func(f func(r *gpupoolv1.LeaseRequest)) *gpupoolv1.LeaseRequest {
		r := slice(1024, 10)
		f(r)
		return r
	}
	tests := []struct {
		name string
		req  *gpupoolv1.LeaseRequest
		code codes.Code
		want string // in the message
	}{
		{"a missing request", nil, codes.InvalidArgument, "request"},
		{"memory 0", mod(func(r *gpupoolv1.LeaseRequest) { r.MemoryMib = 0 }), codes.InvalidArgument, "memory_mib 0"},
		{"compute 0", mod(func(r *gpupoolv1.LeaseRequest) { r.ComputePercent = 0 }), codes.InvalidArgument, "compute_percent 0: must be between 1 and 100"},
		{"compute over 100", mod(func(r *gpupoolv1.LeaseRequest) { r.ComputePercent = 101 }), codes.InvalidArgument, "compute_percent 101"},
		{"count 0", mod(func(r *gpupoolv1.LeaseRequest) { r.Count = 0 }), codes.InvalidArgument, "count 0: must be between 1 and"},
		{"exclusive with memory", mod(func(r *gpupoolv1.LeaseRequest) { r.Exclusive = true }), codes.InvalidArgument, "exclusive true: cannot be combined"},
		{"ttl under a second", mod(func(r *gpupoolv1.LeaseRequest) { r.TtlMs = 500 }), codes.InvalidArgument, "ttl_ms 500: must be between 1000"},
		{"ttl over a day", mod(func(r *gpupoolv1.LeaseRequest) { r.TtlMs = 25 * 3600 * 1000 }), codes.InvalidArgument, "ttl_ms 90000000"},
		{"an unknown model", mod(func(r *gpupoolv1.LeaseRequest) { r.Constraints = &gpupoolv1.Constraints{Model: "H200*"} }), codes.InvalidArgument, `constraints.model "H200*": matches no GPU in the pool; models: A100-SXM4-80GB`},
		{"an empty device uuid", mod(func(r *gpupoolv1.LeaseRequest) { r.Constraints = &gpupoolv1.Constraints{Devices: []string{""}} }), codes.InvalidArgument, `constraints.devices "": must be device UUIDs`},
		{"a bad model glob", mod(func(r *gpupoolv1.LeaseRequest) { r.Constraints = &gpupoolv1.Constraints{Model: "A100["} }), codes.InvalidArgument, "constraints.model"},
		{"an unknown host", mod(func(r *gpupoolv1.LeaseRequest) { r.Constraints = &gpupoolv1.Constraints{Host: "nope"} }), codes.InvalidArgument, `constraints.host "nope"`},
		{"a bad tenant", mod(func(r *gpupoolv1.LeaseRequest) { r.Tenant = "Bad Tenant" }), codes.InvalidArgument, "tenant"},
		{"a negative priority", mod(func(r *gpupoolv1.LeaseRequest) { r.Priority = -1 }), codes.InvalidArgument, "priority -1"},
		{"an unknown topology", mod(func(r *gpupoolv1.LeaseRequest) { r.Topology = 42 }), codes.InvalidArgument, "topology 42"},
		{"more memory than any GPU", mod(func(r *gpupoolv1.LeaseRequest) { r.MemoryMib = 90000 }), codes.FailedPrecondition, "90000"},
		{"more whole GPUs than the pool has", &gpupoolv1.LeaseRequest{Count: 3, Exclusive: true, TtlMs: 60_000}, codes.FailedPrecondition, "can never fit"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := ts.c.Lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: tt.req})
			st, _ := status.FromError(err)
			if st.Code() != tt.code || !strings.Contains(st.Message(), tt.want) {
				t.Fatalf("got %v %q, want %v containing %q", st.Code(), st.Message(), tt.code, tt.want)
			}
		})
	}
	// Nothing was half-applied.
	l, err := ts.c.Lease.List(ctx(t), &gpupoolv1.ListLeasesRequest{IncludeEnded: true})
	if err != nil || len(l.Leases) != 0 {
		t.Fatalf("after bad requests: got %d leases (err %v), want 0", len(l.GetLeases()), err)
	}
}

func TestOtherCallsRejectBadInput(t *testing.T) {
	ts := startServer(t)
	tests := []struct {
		name string
		call func() error
		code codes.Code
	}{
		{"release of an unknown lease", func() error {
			_, err := ts.c.Lease.Release(ctx(t), &gpupoolv1.ReleaseRequest{LeaseId: "l-nope"})
			return err
		}, codes.NotFound},
		{"release without an id", func() error {
			_, err := ts.c.Lease.Release(ctx(t), &gpupoolv1.ReleaseRequest{})
			return err
		}, codes.InvalidArgument},
		{"get of an unknown lease", func() error {
			_, err := ts.c.Lease.Get(ctx(t), &gpupoolv1.GetLeaseRequest{LeaseId: "l-nope"})
			return err
		}, codes.NotFound},
		{"list with an unknown state", func() error {
			_, err := ts.c.Lease.List(ctx(t), &gpupoolv1.ListLeasesRequest{States: []gpupoolv1.LeaseState{99}})
			return err
		}, codes.InvalidArgument},
		{"get of an unknown host", func() error {
			_, err := ts.c.Pool.GetHost(ctx(t), &gpupoolv1.GetHostRequest{HostId: "nope"})
			return err
		}, codes.NotFound},
		{"register with a bad host id", func() error {
			_, err := ts.c.Agent.Register(ctx(t), &gpupoolv1.RegisterRequest{Host: &gpupoolv1.Host{Id: "bad host"}})
			return err
		}, codes.InvalidArgument},
		{"register with a device without memory", func() error {
			_, err := ts.c.Agent.Register(ctx(t), &gpupoolv1.RegisterRequest{Host: &gpupoolv1.Host{Id: "h", Devices: []*gpupoolv1.Device{{Uuid: "GPU-1", Model: "X"}}}})
			return err
		}, codes.InvalidArgument},
		{"remove of an unknown peer", func() error {
			_, err := ts.c.Operator.RemovePeer(ctx(t), &gpupoolv1.RemovePeerRequest{Id: "nope"})
			return err
		}, codes.NotFound},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := status.Code(tt.call()); got != tt.code {
				t.Fatalf("got %v, want %v", got, tt.code)
			}
		})
	}
}

func TestAcquireGrantsUntilFullThenExhausted(t *testing.T) {
	ts := startServer(t)
	ts.registerHost(t, "h1", 1, 81920)
	var ids []string
	for i := range 4 {
		r := slice(20480, 25)
		r.RequestId = fmt.Sprintf("req-%d", i)
		resp, err := ts.c.Lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: r})
		if err != nil {
			t.Fatalf("acquire %d: %v", i, err)
		}
		ids = append(ids, resp.Lease.Id)
		if resp.Lease.FencingToken == 0 || resp.Lease.State != gpupoolv1.LeaseState_LEASE_STATE_GRANTED {
			t.Fatalf("acquire %d: got state %v fencing %d", i, resp.Lease.State, resp.Lease.FencingToken)
		}
	}
	_, err := ts.c.Lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: slice(1024, 1)})
	if status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("a fifth slice on a full GPU: got %v, want ResourceExhausted", err)
	}
	// A retry with the same request id returns the same lease.
	r := slice(20480, 25)
	r.RequestId = "req-0"
	resp, err := ts.c.Lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: r})
	if err != nil || resp.Lease.Id != ids[0] || !resp.Existing {
		t.Fatalf("retry: got %v existing=%t err %v, want %s", resp.GetLease().GetId(), resp.GetExisting(), err, ids[0])
	}
	// The same request id for a different request is refused.
	r.MemoryMib = 1024
	if _, err := ts.c.Lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: r}); status.Code(err) != codes.AlreadyExists {
		t.Fatalf("reused request id: got %v, want AlreadyExists", err)
	}
	// The metrics agree.
	for _, m := range []struct {
		name, label, value string
		want               float64
	}{
		{"gpupool_leases", "state", "granted", 4},
		{"gpupool_gpu_memory_mib", "kind", "allocated", 4 * 20480},
		{"gpupool_acquire_total", "code", "OK", 5},
		{"gpupool_acquire_total", "code", "ResourceExhausted", 1},
	} {
		if got := metricValue(t, ts.s, m.name, m.label, m.value); got != m.want {
			t.Errorf("%s{%s=%q}: got %v, want %v", m.name, m.label, m.value, got, m.want)
		}
	}
}

// metricValue gathers the server's metrics and returns the one sample of
// name whose label has value, or -1.
func metricValue(t *testing.T, s *Server, name, label, value string) float64 {
	t.Helper()
	families, err := s.Metrics().Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == label && l.GetValue() == value {
					if m.GetCounter() != nil {
						return m.GetCounter().GetValue()
					}
					return m.GetGauge().GetValue()
				}
			}
		}
	}
	return -1
}

func TestHostWithoutHeartbeatsGoesDownAndItsLeasesAreLostThenFreed(t *testing.T) {
	ts := startServer(t)
	ts.registerHost(t, "h1", 1, 81920)
	resp, err := ts.c.Lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: slice(8192, 10)})
	if err != nil {
		t.Fatal(err)
	}
	id := resp.Lease.Id
	ts.clock.Advance(6 * time.Second) // past the 5 s heartbeat TTL
	waitFor(t, "host down", func() bool {
		return ts.s.fsm.State().Host("h1").Status == gpupoolv1.HostStatus_HOST_STATUS_DOWN
	})
	l := ts.s.fsm.State().Lease(id)
	if l.State != gpupoolv1.LeaseState_LEASE_STATE_RELEASING || !l.Lost || l.EndState != gpupoolv1.LeaseState_LEASE_STATE_REVOKED {
		t.Fatalf("lease on the down host: got %v lost=%t end=%v", l.State, l.Lost, l.EndState)
	}
	if got := ts.s.fsm.State().Device("GPU-h1-0").AllocatedMemoryMib; got != 8192 {
		t.Fatalf("capacity freed before the lock-delay: allocated %d, want 8192", got)
	}
	waitFor(t, "lock-delay armed", func() bool {
		_, ok := ts.s.leadership.currentLeader().lockDelay.Deadline(id)
		return ok
	})
	ts.clock.Advance(11 * time.Second) // past the 10 s lock-delay
	waitFor(t, "capacity freed", func() bool {
		return ts.s.fsm.State().Lease(id).State == gpupoolv1.LeaseState_LEASE_STATE_REVOKED
	})
	if got := ts.s.fsm.State().Device("GPU-h1-0").AllocatedMemoryMib; got != 0 {
		t.Fatalf("after the lock-delay: allocated %d, want 0", got)
	}
}

func TestLeaseExpiresWithoutKeepAliveAndNotWithIt(t *testing.T) {
	ts := startServer(t)
	ts.registerHost(t, "h1", 1, 81920)
	a, err := ts.c.Lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: slice(1024, 5)})
	if err != nil {
		t.Fatal(err)
	}
	b, err := ts.c.Lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: slice(1024, 5)})
	if err != nil {
		t.Fatal(err)
	}
	// The leader arms TTL timers in its own goroutine: time counts against
	// them once they are armed.
	waitFor(t, "the TTLs of both leases armed", func() bool {
		ls := ts.s.leadership.currentLeader()
		_, okA := ls.ttl.Deadline(a.Lease.Id)
		_, okB := ls.ttl.Deadline(b.Lease.Id)
		return okA && okB
	})
	// Keep the host alive and renew only b, in steps shorter than the TTL.
	beat := ts.heartbeater(t, "h1")
	ka, err := ts.c.Lease.KeepAlive(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	tick := func() { // 4 s pass and the host heartbeats (its TTL is 5 s)
		ts.clock.Advance(4 * time.Second)
		beat()
	}
	for range 3 {
		tick()
		if err := ka.Send(&gpupoolv1.KeepAliveRequest{LeaseId: b.Lease.Id}); err != nil {
			t.Fatal(err)
		}
		for {
			r, err := ka.Recv()
			if err != nil {
				t.Fatal(err)
			}
			if r.Event == nil {
				if r.TtlMs != 60_000 || r.Error != "" {
					t.Fatalf("renewal: got ttl %d error %q", r.TtlMs, r.Error)
				}
				break
			}
		}
	}
	for range 13 {
		tick() // at 64 s, a (60 s TTL, never renewed) expired; b (renewed at 12 s) did not
	}
	waitFor(t, "a expires", func() bool {
		return ts.s.fsm.State().Lease(a.Lease.Id).State == gpupoolv1.LeaseState_LEASE_STATE_RELEASING
	})
	if got := ts.s.fsm.State().Lease(b.Lease.Id).State; got != gpupoolv1.LeaseState_LEASE_STATE_GRANTED {
		t.Fatalf("renewed lease: got %v (%s), want GRANTED", got, ts.s.fsm.State().Lease(b.Lease.Id).Reason)
	}
	// The agent confirms teardown; only then is the capacity freed.
	beat(a.Lease.Id)
	waitFor(t, "a freed", func() bool {
		return ts.s.fsm.State().Lease(a.Lease.Id).State == gpupoolv1.LeaseState_LEASE_STATE_EXPIRED
	})
	if got := ts.s.fsm.State().Device("GPU-h1-0").AllocatedMemoryMib; got != 1024 {
		t.Fatalf("after a's teardown: allocated %d, want b's 1024", got)
	}
}

func TestHostBackBeforeTheLockDelayKeepsCapacityUntilTeardownIsConfirmed(t *testing.T) {
	ts := startServer(t)
	ts.registerHost(t, "h1", 1, 81920)
	resp, err := ts.c.Lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: slice(8192, 10)})
	if err != nil {
		t.Fatal(err)
	}
	id := resp.Lease.Id
	ts.clock.Advance(6 * time.Second) // past the 5 s heartbeat TTL: down, lease lost
	waitFor(t, "lock-delay armed", func() bool {
		_, ok := ts.s.leadership.currentLeader().lockDelay.Deadline(id)
		return ok
	})
	beat := ts.heartbeater(t, "h1")
	beat()
	waitFor(t, "host back", func() bool {
		return ts.s.fsm.State().Host("h1").Status == gpupoolv1.HostStatus_HOST_STATUS_READY
	})
	for range 4 { // 16 s: well past the 10 s lock-delay, the host heartbeating all along
		ts.clock.Advance(4 * time.Second)
		beat()
	}
	if got := ts.s.fsm.State().Lease(id).State; got != gpupoolv1.LeaseState_LEASE_STATE_RELEASING {
		t.Fatalf("the lock-delay freed a lease whose host is back: got %v, want RELEASING", got)
	}
	if got := ts.s.fsm.State().Device("GPU-h1-0").AllocatedMemoryMib; got != 8192 {
		t.Fatalf("allocated %d MiB before teardown was confirmed, want 8192", got)
	}
	beat(id)
	waitFor(t, "freed on confirmation", func() bool {
		return ts.s.fsm.State().Lease(id).State == gpupoolv1.LeaseState_LEASE_STATE_REVOKED
	})
}

func TestWatchStreamsExistingLeasesThenChanges(t *testing.T) {
	ts := startServer(t)
	ts.registerHost(t, "h1", 1, 81920)
	first, err := ts.c.Lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: slice(1024, 5)})
	if err != nil {
		t.Fatal(err)
	}
	w, err := ts.c.Lease.Watch(ctx(t), &gpupoolv1.WatchLeasesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	next := func() *gpupoolv1.LeaseEvent {
		t.Helper()
		ev, err := w.Recv()
		if err != nil {
			t.Fatal(err)
		}
		return ev
	}
	if ev := next(); ev.Type != gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_SNAPSHOT || ev.Lease.Id != first.Lease.Id {
		t.Fatalf("first event: got %v %s, want SNAPSHOT of %s", ev.Type, ev.Lease.GetId(), first.Lease.Id)
	}
	second, err := ts.c.Lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: slice(1024, 5)})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ts.c.Lease.Release(ctx(t), &gpupoolv1.ReleaseRequest{LeaseId: second.Lease.Id}); err != nil {
		t.Fatal(err)
	}
	for _, want := range []gpupoolv1.LeaseEventType{gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_GRANTED, gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_RELEASING} {
		if ev := next(); ev.Type != want || ev.Lease.Id != second.Lease.Id || ev.Index == 0 {
			t.Fatalf("got %v for %s at index %d, want %v for %s", ev.Type, ev.Lease.GetId(), ev.Index, want, second.Lease.Id)
		}
	}
}

// TestWatchStreamsShareAnEventsEncoding checks that the watches that
// send one event, which share its encoding, each send it whole.
func TestWatchStreamsShareAnEventsEncoding(t *testing.T) {
	ts := startServer(t)
	ts.registerHost(t, "h1", 1, 81920)
	var watches []grpc.ServerStreamingClient[gpupoolv1.LeaseEvent]
	for range 3 {
		w, err := ts.c.Lease.Watch(ctx(t), &gpupoolv1.WatchLeasesRequest{})
		if err != nil {
			t.Fatal(err)
		}
		watches = append(watches, w)
	}
	got, err := ts.c.Lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: slice(1024, 5)})
	if err != nil {
		t.Fatal(err)
	}
	want := ts.s.fsm.State().Lease(got.Lease.Id)
	for i, w := range watches {
		ev, err := w.Recv()
		if err != nil {
			t.Fatalf("watch %d: %v", i, err)
		}
		if ev.Type != gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_GRANTED || !proto.Equal(ev.Lease, want) || ev.Index != want.ModifyIndex || ev.Actor == nil {
			t.Errorf("watch %d got %v at %d by %v: %v; want GRANTED at %d of %v", i, ev.Type, ev.Index, ev.Actor, ev.Lease, want.ModifyIndex, want)
		}
	}
}

func TestDrainHostStopsNewLeasesThereUntilCancelled(t *testing.T) {
	ts := startServer(t)
	ts.registerHost(t, "h1", 1, 81920)
	held, err := ts.c.Lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: slice(1024, 5)})
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name     string
		req      *gpupoolv1.DrainHostRequest
		code     codes.Code
		msg      string
		status   gpupoolv1.HostStatus
		eligible bool
		leases   int32
		acquire  codes.Code
	}{
		{"no host id", &gpupoolv1.DrainHostRequest{}, codes.InvalidArgument, "host_id: is required", 0, false, 0, 0},
		{"an unknown host", &gpupoolv1.DrainHostRequest{HostId: "nope"}, codes.NotFound, `host "nope": not found`, 0, false, 0, 0},
		{"drain", &gpupoolv1.DrainHostRequest{HostId: "h1", Reason: "kernel upgrade"}, codes.OK, "",
			gpupoolv1.HostStatus_HOST_STATUS_DRAINING, false, 1, codes.ResourceExhausted},
		{"drain again changes nothing", &gpupoolv1.DrainHostRequest{HostId: "h1"}, codes.OK, "",
			gpupoolv1.HostStatus_HOST_STATUS_DRAINING, false, 1, codes.ResourceExhausted},
		{"cancel", &gpupoolv1.DrainHostRequest{HostId: "h1", Cancel: true}, codes.OK, "",
			gpupoolv1.HostStatus_HOST_STATUS_READY, true, 1, codes.OK},
	} {
		t.Run(tc.name, func(t *testing.T) {
			resp, err := ts.c.Pool.DrainHost(ctx(t), tc.req)
			if status.Code(err) != tc.code || (tc.msg != "" && !strings.Contains(err.Error(), tc.msg)) {
				t.Fatalf("got %v, want %v %q", err, tc.code, tc.msg)
			}
			if tc.code != codes.OK {
				return
			}
			h := resp.Host
			if h.Status != tc.status || h.Eligible != tc.eligible || resp.Leases != tc.leases {
				t.Fatalf("got %v eligible=%t leases=%d, want %v eligible=%t leases=%d", h.Status, h.Eligible, resp.Leases, tc.status, tc.eligible, tc.leases)
			}
			_, err = ts.c.Lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: slice(1024, 5)})
			if status.Code(err) != tc.acquire {
				t.Fatalf("acquire: got %v, want %v", err, tc.acquire)
			}
		})
	}
	if l := ts.s.fsm.State().Lease(held.Lease.Id); l.State != gpupoolv1.LeaseState_LEASE_STATE_GRANTED {
		t.Fatalf("the lease on the drained host: got %v, want granted", l.State)
	}
}

func TestListByHostReadsEndedLeasesOutsideTheHostIndex(t *testing.T) {
	st := func(ss ...gpupoolv1.LeaseState) *gpupoolv1.ListLeasesRequest {
		return &gpupoolv1.ListLeasesRequest{Host: "h1", States: ss}
	}
	tests := []struct {
		name string
		req  *gpupoolv1.ListLeasesRequest
		want bool
	}{
		{"granted only", st(gpupoolv1.LeaseState_LEASE_STATE_GRANTED), true},
		{"granted and releasing", st(gpupoolv1.LeaseState_LEASE_STATE_GRANTED, gpupoolv1.LeaseState_LEASE_STATE_RELEASING), true},
		{"released asked for", st(gpupoolv1.LeaseState_LEASE_STATE_RELEASED), false},
		{"no state: pending ones too", st(), false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := onlyHolding(tt.req); got != tt.want {
				t.Fatalf("onlyHolding = %t, want %t", got, tt.want)
			}
		})
	}
}

// A new leader gives each host twice the heartbeat TTL before it marks it
// down: the agent may first have to give up a stream on a broker that went
// silent (one TTL) and then find the new leader.
func TestANewLeaderWaitsTwoHeartbeatTTLsBeforeAHostIsDown(t *testing.T) {
	for _, tc := range []struct {
		name     string
		advance  time.Duration // after the handover, with no heartbeat
		wantDown bool
	}{
		{"one TTL after the election the host is still up", 5*time.Second + 500*time.Millisecond, false},
		{"two TTLs after the election the host is down", 10*time.Second + 500*time.Millisecond, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ts := startServer(t)
			ts.registerHost(t, "h1", 1, 81920)
			ls := ts.handOver(t)
			if _, ok := ls.heartbeat.Deadline("h1"); !ok {
				t.Fatal("the new leader armed no heartbeat deadline for h1")
			}
			ts.clock.Advance(tc.advance)
			if tc.wantDown {
				waitFor(t, "host down", func() bool {
					return ts.host("h1").Status == gpupoolv1.HostStatus_HOST_STATUS_DOWN
				})
				return
			}
			// The timer did not fire: its deadline is still ahead.
			d, ok := ls.heartbeat.Deadline("h1")
			if !ok || !d.After(ts.clock.Now()) {
				t.Fatalf("heartbeat deadline %v (armed %t), now %v: want one still ahead", d, ok, ts.clock.Now())
			}
			if st := ts.host("h1").Status; st == gpupoolv1.HostStatus_HOST_STATUS_DOWN {
				t.Fatalf("host down one TTL after the election")
			}
		})
	}
}
