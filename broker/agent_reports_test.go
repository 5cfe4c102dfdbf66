package broker

import (
	"strings"
	"testing"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// agentStream is a raw heartbeat stream: send a request, read the answer
// to it (pushes in between are skipped by waiting for the ack condition).
type agentStream struct {
	send func(*gpupoolv1.HeartbeatRequest)
	resp chan *gpupoolv1.HeartbeatResponse
}

func (ts *testServer) agentStream(t *testing.T) *agentStream {
	t.Helper()
	hb, err := ts.c.Agent.Heartbeat(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	as := &agentStream{resp: make(chan *gpupoolv1.HeartbeatResponse, 64)}
	go func() {
		for {
			r, err := hb.Recv()
			if err != nil {
				close(as.resp)
				return
			}
			as.resp <- r
		}
	}()
	as.send = func(r *gpupoolv1.HeartbeatRequest) {
		t.Helper()
		if err := hb.Send(r); err != nil {
			t.Fatal(err)
		}
	}
	return as
}

// next returns the next response that satisfies cond.
func (as *agentStream) next(t *testing.T, cond func(*gpupoolv1.HeartbeatResponse) bool) *gpupoolv1.HeartbeatResponse {
	t.Helper()
	c := ctx(t)
	for {
		select {
		case r, ok := <-as.resp:
			if !ok {
				t.Fatal("heartbeat stream ended")
			}
			if cond(r) {
				return r
			}
		case <-c.Done():
			t.Fatal("no matching heartbeat response")
		}
	}
}

// keepAliveEvents renews id once and returns a channel of the events the
// KeepAlive stream carries for it.
func (ts *testServer) keepAliveEvents(t *testing.T, id string) <-chan *gpupoolv1.LeaseEvent {
	t.Helper()
	ka, err := ts.c.Lease.KeepAlive(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	if err := ka.Send(&gpupoolv1.KeepAliveRequest{LeaseId: id}); err != nil {
		t.Fatal(err)
	}
	if r, err := ka.Recv(); err != nil || r.Error != "" {
		t.Fatalf("renew %s: %v %q", id, err, r.GetError())
	}
	ch := make(chan *gpupoolv1.LeaseEvent, 16)
	go func() {
		defer close(ch)
		for {
			r, err := ka.Recv()
			if err != nil {
				return
			}
			if r.Event != nil {
				ch <- r.Event
			}
		}
	}()
	return ch
}

func waitEvent(t *testing.T, ch <-chan *gpupoolv1.LeaseEvent, typ gpupoolv1.LeaseEventType) *gpupoolv1.LeaseEvent {
	t.Helper()
	c := ctx(t)
	for {
		select {
		case ev, ok := <-ch:
			if !ok {
				t.Fatalf("keepalive stream ended before a %v event", typ)
			}
			if ev.Type == typ {
				return ev
			}
		case <-c.Done():
			t.Fatalf("no %v event", typ)
		}
	}
}

func TestUnhealthyDeviceTakesNoNewLeasesAndItsHoldersAreTold(t *testing.T) {
	ts := startServer(t)
	ts.registerHost(t, "h1", 2, 81920)
	held, err := ts.c.Lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: slice(1024, 10)})
	if err != nil {
		t.Fatal(err)
	}
	sick := held.Lease.Slices[0].Device
	events := ts.keepAliveEvents(t, held.Lease.Id)

	as := ts.agentStream(t)
	as.send(&gpupoolv1.HeartbeatRequest{HostId: "h1", Devices: []*gpupoolv1.DeviceReport{
		{Uuid: sick, Health: gpupoolv1.DeviceHealth_DEVICE_HEALTH_UNHEALTHY, HealthReason: "Xid 79"},
		{Uuid: "GPU-h2-0", Health: gpupoolv1.DeviceHealth_DEVICE_HEALTH_UNHEALTHY, HealthReason: "not this host's"},
	}})
	as.next(t, func(*gpupoolv1.HeartbeatResponse) bool { return true })

	ev := waitEvent(t, events, gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_DEVICE_UNHEALTHY)
	if !strings.Contains(ev.Message, "Xid 79") {
		t.Fatalf("event message %q: want the reason Xid 79", ev.Message)
	}
	d := ts.s.fsm.State().Device(sick)
	if d.Health != gpupoolv1.DeviceHealth_DEVICE_HEALTH_UNHEALTHY || d.HealthReason != "Xid 79" {
		t.Fatalf("device: got %v %q, want unhealthy Xid 79", d.Health, d.HealthReason)
	}
	// Binpack would pick the fuller GPU: the sick one. It must not.
	for range 3 {
		got, err := ts.c.Lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: slice(1024, 10)})
		if err != nil {
			t.Fatal(err)
		}
		if got.Lease.Slices[0].Device == sick {
			t.Fatalf("new lease %s placed on the unhealthy device", got.Lease.Id)
		}
	}
	if l := ts.s.fsm.State().Lease(held.Lease.Id); l.State != gpupoolv1.LeaseState_LEASE_STATE_GRANTED {
		t.Fatalf("the holder's lease: got %v, want it to stay granted", l.State)
	}
}

func TestViolationsAreRecordedOnceAndReachTheHolder(t *testing.T) {
	ts := startServer(t)
	ts.registerHost(t, "h1", 1, 81920)
	ts.registerHost(t, "h2", 1, 81920)
	held, err := ts.c.Lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: &gpupoolv1.LeaseRequest{
		Count: 1, MemoryMib: 1024, ComputePercent: 10, TtlMs: 60_000, Constraints: &gpupoolv1.Constraints{Host: "h1"}}})
	if err != nil {
		t.Fatal(err)
	}
	id := held.Lease.Id
	events := ts.keepAliveEvents(t, id)
	violation := &gpupoolv1.AgentEvent{Seq: 7, Type: gpupoolv1.AgentEventType_AGENT_EVENT_TYPE_VIOLATION, LeaseId: id,
		Device: held.Lease.Slices[0].Device, Message: "used 2048 MiB of a 1024 MiB slice for 2s: processes stopped"}

	tests := []struct {
		name      string
		host      string
		events    []*gpupoolv1.AgentEvent
		wantAcked uint64
		wantCount int32
	}{
		{"another host cannot report on the lease", "h2", []*gpupoolv1.AgentEvent{violation}, 7, 0},
		{"the lease's host records it", "h1", []*gpupoolv1.AgentEvent{violation}, 7, 1},
		{"a resent event counts once", "h1", []*gpupoolv1.AgentEvent{violation}, 7, 1},
	}
	streams := map[string]*agentStream{"h1": ts.agentStream(t), "h2": ts.agentStream(t)}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			as := streams[tt.host]
			as.send(&gpupoolv1.HeartbeatRequest{HostId: tt.host, Events: tt.events})
			r := as.next(t, func(r *gpupoolv1.HeartbeatResponse) bool { return r.AckedEventSeq != 0 })
			if r.AckedEventSeq != tt.wantAcked {
				t.Fatalf("acked: got %d, want %d", r.AckedEventSeq, tt.wantAcked)
			}
			if got := ts.s.fsm.State().Lease(id).Violations; got != tt.wantCount {
				t.Fatalf("violations: got %d, want %d", got, tt.wantCount)
			}
		})
	}
	ev := waitEvent(t, events, gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_VIOLATION)
	if ev.Message != violation.Message {
		t.Fatalf("holder's event: got %q, want %q", ev.Message, violation.Message)
	}
	if got := ts.s.fsm.State().Lease(id).LastViolation; got != violation.Message {
		t.Fatalf("last_violation: got %q", got)
	}
}

func TestAgentReportsReachLeaseAndHostViews(t *testing.T) {
	ts := startServer(t)
	ts.registerHost(t, "h1", 1, 81920)
	held, err := ts.c.Lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: slice(4096, 25)})
	if err != nil {
		t.Fatal(err)
	}
	l := held.Lease
	dev := l.Slices[0].Device
	// Another host's agent reports usage for the lease: it is not shown.
	ts.registerHost(t, "h2", 1, 81920)
	other := ts.agentStream(t)
	other.send(&gpupoolv1.HeartbeatRequest{HostId: "h2", Usage: []*gpupoolv1.LeaseUsage{{LeaseId: l.Id, SampledAtMs: 1,
		Slices: []*gpupoolv1.SliceUsage{{Device: dev, MemoryUsedMib: 99999}}}}})
	other.next(t, func(*gpupoolv1.HeartbeatResponse) bool { return true })
	as := ts.agentStream(t)
	as.send(&gpupoolv1.HeartbeatRequest{HostId: "h1",
		Devices: []*gpupoolv1.DeviceReport{{Uuid: dev, Health: gpupoolv1.DeviceHealth_DEVICE_HEALTH_HEALTHY, UsedMemoryMib: 3000, UtilizationPercent: 40}},
		Usage: []*gpupoolv1.LeaseUsage{{LeaseId: l.Id, SampledAtMs: 1, Slices: []*gpupoolv1.SliceUsage{
			{Device: dev, MemoryUsedMib: 3000, UtilizationPercent: 40, Processes: 2}}}},
	})
	r := as.next(t, func(r *gpupoolv1.HeartbeatResponse) bool { return len(r.Enforce) == 1 })
	a := r.Enforce[0]
	if a.TtlMs != 60_000 || a.ExpiresInMs <= 0 || a.ExpiresInMs > 60_000 {
		t.Fatalf("assignment: ttl %d expires in %d, want 60000 and (0, 60000]", a.TtlMs, a.ExpiresInMs)
	}
	if a.Slices[0].Isolation != gpupoolv1.Isolation_ISOLATION_WATCHDOG {
		t.Fatalf("isolation on a host without MPS: got %v, want WATCHDOG", a.Slices[0].Isolation)
	}
	got, err := ts.c.Lease.Get(ctx(t), &gpupoolv1.GetLeaseRequest{LeaseId: l.Id})
	if err != nil {
		t.Fatal(err)
	}
	if u := got.Lease.Usage; len(u) != 1 || u[0].Host != "h1" || u[0].Slices[0].MemoryUsedMib != 3000 {
		t.Fatalf("lease usage: got %v, want 3000 MiB on h1 and nothing from h2", u)
	}
	host, err := ts.c.Pool.GetHost(ctx(t), &gpupoolv1.GetHostRequest{HostId: "h1"})
	if err != nil {
		t.Fatal(err)
	}
	if d := host.Host.Devices[0]; d.UsedMemoryMib != 3000 || d.UtilizationPercent != 40 {
		t.Fatalf("device readings: got %d MiB %d%%, want 3000 MiB 40%%", d.UsedMemoryMib, d.UtilizationPercent)
	}
}

func TestIsolationFollowsTheSliceAndTheHost(t *testing.T) {
	ts := startServer(t)
	h := &gpupoolv1.Host{Id: "mps", Mps: true, Devices: []*gpupoolv1.Device{
		{Uuid: "GPU-mps-0", Model: "A100-SXM4-80GB", MemoryMib: 81920},
		{Uuid: "GPU-mps-1", Model: "A100-SXM4-80GB", MemoryMib: 81920, Index: 1},
	}}
	if _, err := ts.c.Agent.Register(ctx(t), &gpupoolv1.RegisterRequest{Host: h}); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name string
		req  *gpupoolv1.LeaseRequest
		want gpupoolv1.Isolation
	}{
		{"a fractional slice on an MPS host", slice(1024, 10), gpupoolv1.Isolation_ISOLATION_MPS},
		{"a whole GPU", &gpupoolv1.LeaseRequest{Count: 1, Exclusive: true, TtlMs: 60_000}, gpupoolv1.Isolation_ISOLATION_EXCLUSIVE},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r, err := ts.c.Lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: tt.req})
			if err != nil {
				t.Fatal(err)
			}
			if got := r.Lease.Slices[0].Isolation; got != tt.want {
				t.Fatalf("got %v, want %v", got, tt.want)
			}
		})
	}
}

func TestARefusedLeaseIsRevokedWithTheAgentsReason(t *testing.T) {
	ts := startServer(t)
	ts.registerHost(t, "h1", 1, 81920)
	held, err := ts.c.Lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: slice(1024, 10)})
	if err != nil {
		t.Fatal(err)
	}
	as := ts.agentStream(t)
	as.send(&gpupoolv1.HeartbeatRequest{HostId: "h1", Rejected: []*gpupoolv1.Rejection{
		{LeaseId: held.Lease.Id, Reason: "device GPU-x is not on this host"},
		{LeaseId: "l-unknown", Reason: "ignored"},
	}})
	r := as.next(t, func(r *gpupoolv1.HeartbeatResponse) bool { return len(r.Teardown) == 1 })
	if r.Teardown[0].LeaseId != held.Lease.Id {
		t.Fatalf("teardown: got %s, want %s", r.Teardown[0].LeaseId, held.Lease.Id)
	}
	l := ts.s.fsm.State().Lease(held.Lease.Id)
	// The reason is the agent's word: quoted, and the agent is who ended it.
	wantReason := `the agent of host h1 refused the lease, saying: "device GPU-x is not on this host"`
	if l.EndState != gpupoolv1.LeaseState_LEASE_STATE_REVOKED || l.Reason != wantReason || l.EndedBy.GetName() != "agent h1" {
		t.Fatalf("lease: end %v reason %q by %v, want revoked with reason %q by agent h1", l.EndState, l.Reason, l.EndedBy, wantReason)
	}
	var audited bool
	for _, e := range ts.s.fsm.State().AuditLog(0) {
		audited = audited || e.Kind == gpupoolv1.AuditKind_AUDIT_KIND_LEASE_REVOKED && e.Subject == held.Lease.Id && e.Actor.GetName() == "agent h1" && e.Detail == wantReason
	}
	if !audited {
		t.Fatalf("no lease-revoked audit entry by agent h1 with the agent's reason: %v", ts.s.fsm.State().AuditLog(0))
	}
}

func TestViolationsFromTwoHostsOfOneLeaseAreBothRecorded(t *testing.T) {
	ts := startServer(t)
	ts.registerHost(t, "h1", 1, 81920)
	ts.registerHost(t, "h2", 1, 81920)
	r, err := ts.c.Lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: &gpupoolv1.LeaseRequest{Count: 2, Exclusive: true, TtlMs: 60_000}})
	if err != nil {
		t.Fatal(err)
	}
	id := r.Lease.Id
	// Each agent numbers its own events: h2's clock is behind h1's.
	for _, ev := range []struct {
		host string
		seq  uint64
		want int32
	}{{"h1", 1000, 1}, {"h2", 999, 2}, {"h2", 999, 2}} {
		as := ts.agentStream(t)
		as.send(&gpupoolv1.HeartbeatRequest{HostId: ev.host, Events: []*gpupoolv1.AgentEvent{{Seq: ev.seq,
			Type: gpupoolv1.AgentEventType_AGENT_EVENT_TYPE_VIOLATION, LeaseId: id, Message: "over on " + ev.host}}})
		as.next(t, func(r *gpupoolv1.HeartbeatResponse) bool { return r.AckedEventSeq == ev.seq })
		if got := ts.s.fsm.State().Lease(id).Violations; got != ev.want {
			t.Fatalf("after %s's event %d: %d violations, want %d", ev.host, ev.seq, got, ev.want)
		}
	}
}
