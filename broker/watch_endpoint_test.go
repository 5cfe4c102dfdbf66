package broker

import (
	"context"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// recvUntil receives from a stream until cond holds for a message, or
// fails the test after 20 s.
func recvUntil[M any](t *testing.T, st grpc.ServerStreamingClient[M], what string, cond func(*M) bool) *M {
	t.Helper()
	type res struct {
		m   *M
		err error
	}
	ch := make(chan res, 1)
	go func() {
		for {
			m, err := st.Recv()
			if err != nil {
				ch <- res{err: err}
				return
			}
			if cond(m) {
				ch <- res{m: m}
				return
			}
		}
	}()
	select {
	case r := <-ch:
		if r.err != nil {
			t.Fatalf("waiting for %s: %v", what, r.err)
		}
		return r.m
	case <-time.After(20 * time.Second):
		t.Fatalf("timed out waiting for %s", what)
	}
	return nil
}

func TestWatchHostsSendsSnapshotsThenSyncedThenChanges(t *testing.T) {
	ts := startServer(t)
	ts.registerHost(t, "h1", 2, 81920)
	ts.registerHost(t, "h2", 2, 81920)
	st, err := ts.c.Pool.WatchHosts(ctx(t), &gpupoolv1.WatchHostsRequest{IntervalMs: 100})
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	recvUntil(t, st, "synced", func(ev *gpupoolv1.HostEvent) bool {
		if ev.Type == gpupoolv1.WatchEventType_WATCH_EVENT_TYPE_SNAPSHOT {
			got = append(got, ev.HostId)
			if len(ev.Host.GetDevices()) != 2 {
				t.Errorf("snapshot of %s: got %d devices, want 2", ev.HostId, len(ev.Host.GetDevices()))
			}
		}
		return ev.Type == gpupoolv1.WatchEventType_WATCH_EVENT_TYPE_SYNCED
	})
	if len(got) != 2 || got[0] != "h1" || got[1] != "h2" {
		t.Fatalf("snapshots: got %v, want [h1 h2]", got)
	}
	ts.drain(t, &gpupoolv1.DrainHostRequest{HostId: "h2", DeadlineAfterMs: 60_000})
	ev := recvUntil(t, st, "h2 draining", func(ev *gpupoolv1.HostEvent) bool {
		return ev.Type == gpupoolv1.WatchEventType_WATCH_EVENT_TYPE_UPDATED && ev.HostId == "h2"
	})
	if ev.Host.Drain == nil || ev.Host.Status == gpupoolv1.HostStatus_HOST_STATUS_READY {
		t.Errorf("update of h2: got status %s drain %v, want a drain", ev.Host.Status, ev.Host.Drain)
	}
}

func TestWatchDevicesSendsAnAllocationChange(t *testing.T) {
	ts := startServer(t)
	ts.registerHost(t, "h1", 1, 81920)
	st, err := ts.c.Pool.WatchDevices(ctx(t), &gpupoolv1.WatchDevicesRequest{Model: "A100*"})
	if err != nil {
		t.Fatal(err)
	}
	recvUntil(t, st, "synced", func(ev *gpupoolv1.DeviceEvent) bool {
		return ev.Type == gpupoolv1.WatchEventType_WATCH_EVENT_TYPE_SYNCED
	})
	ts.acquire(t, slice(20480, 25))
	ev := recvUntil(t, st, "allocation", func(ev *gpupoolv1.DeviceEvent) bool {
		return ev.Type == gpupoolv1.WatchEventType_WATCH_EVENT_TYPE_UPDATED
	})
	if got := ev.Device.AllocatedMemoryMib; got != 20480 {
		t.Errorf("allocated memory: got %d MiB, want 20480", got)
	}
}

func TestWatchQueueShowsPendingWithWhyToItsTenantOnly(t *testing.T) {
	as := startACLServer(t) // h1: 2 GPUs
	_, secretA := as.token(t, clientToken("a"))
	_, secretB := as.token(t, clientToken("b"))
	ca, cb := as.clientWith(t, secretA), as.clientWith(t, secretB)
	if _, err := cb.Lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: whole(2)}); err != nil {
		t.Fatal(err)
	}
	c, cancel := context.WithCancel(ctx(t))
	defer cancel()
	go ca.Lease.Acquire(c, &gpupoolv1.AcquireRequest{Request: &gpupoolv1.LeaseRequest{Count: 1, Exclusive: true, TtlMs: 60_000, Holder: "<script>a</script>"}, WaitMs: 60_000})

	sa, err := ca.Lease.WatchQueue(ctx(t), &gpupoolv1.WatchQueueRequest{IntervalMs: 100})
	if err != nil {
		t.Fatal(err)
	}
	q := recvUntil(t, sa, "a's pending lease", func(q *gpupoolv1.QueueSnapshot) bool { return len(q.Pending) == 1 })
	if q.Pending[0].PendingReason == "" {
		t.Errorf("pending lease: got no why-pending text, want one")
	}
	sb, err := cb.Lease.WatchQueue(ctx(t), &gpupoolv1.WatchQueueRequest{})
	if err != nil {
		t.Fatal(err)
	}
	qb := recvUntil(t, sb, "b's queue", func(*gpupoolv1.QueueSnapshot) bool { return true })
	if len(qb.Pending) != 0 {
		t.Errorf("tenant b's queue: got %d pending leases, want 0 (a's is not b's to see)", len(qb.Pending))
	}
	other, err := cb.Lease.WatchQueue(ctx(t), &gpupoolv1.WatchQueueRequest{Tenant: "a"})
	if err == nil {
		_, err = other.Recv()
	}
	wantStatus(t, err, codes.PermissionDenied, "tenant")
}

func TestWatchStreamsRejectBadInputNamingTheField(t *testing.T) {
	ts := startServer(t)
	recvErr := func(open func() (interface{ Recv() error }, error)) error {
		st, err := open()
		if err != nil {
			return err
		}
		return st.Recv()
	}
	for _, tc := range []struct {
		name  string
		field string
		open  func() error
	}{
		{"a hosts interval below 100 ms", "interval_ms", func() error {
			st, err := ts.c.Pool.WatchHosts(ctx(t), &gpupoolv1.WatchHostsRequest{IntervalMs: 5})
			return recvErr(func() (interface{ Recv() error }, error) { return recvOnly(st), err })
		}},
		{"a devices model that is no glob", "model", func() error {
			st, err := ts.c.Pool.WatchDevices(ctx(t), &gpupoolv1.WatchDevicesRequest{Model: "[A100"})
			return recvErr(func() (interface{ Recv() error }, error) { return recvOnly(st), err })
		}},
		{"a queue interval above a minute", "interval_ms", func() error {
			st, err := ts.c.Lease.WatchQueue(ctx(t), &gpupoolv1.WatchQueueRequest{IntervalMs: 61_000})
			return recvErr(func() (interface{ Recv() error }, error) { return recvOnly(st), err })
		}},
		{"a queue tenant with spaces", "tenant", func() error {
			st, err := ts.c.Lease.WatchQueue(ctx(t), &gpupoolv1.WatchQueueRequest{Tenant: "a b"})
			return recvErr(func() (interface{ Recv() error }, error) { return recvOnly(st), err })
		}},
		{"a history tenant with spaces", "tenant", func() error {
			_, err := ts.c.Operator.TenantHistory(ctx(t), &gpupoolv1.TenantHistoryRequest{Tenant: "a b"})
			return err
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			wantStatus(t, tc.open(), codes.InvalidArgument, tc.field)
		})
	}
}

// recvOnly adapts a typed stream to a Recv that only reports the error.
func recvOnly[M any](st grpc.ServerStreamingClient[M]) interface{ Recv() error } {
	return recvFunc(func() error {
		if st == nil {
			return nil
		}
		_, err := st.Recv()
		return err
	})
}

type recvFunc func() error

func (f recvFunc) Recv() error { return f() }

func TestWatchHostsEndsWhenItsTokenIsRevokedEvenWhenIdle(t *testing.T) {
	as := startACLServer(t)
	tok, secret := as.token(t, clientToken("a"))
	st, err := as.clientWith(t, secret).Pool.WatchHosts(ctx(t), &gpupoolv1.WatchHostsRequest{IntervalMs: 100})
	if err != nil {
		t.Fatal(err)
	}
	recvUntil(t, st, "synced", func(ev *gpupoolv1.HostEvent) bool {
		return ev.Type == gpupoolv1.WatchEventType_WATCH_EVENT_TYPE_SYNCED
	})
	if _, err := gpupoolv1.NewAclServiceClient(as.c.Conn()).RevokeToken(ctx(t), &gpupoolv1.RevokeAclTokenRequest{AccessorId: tok.AccessorId}); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		for {
			if _, err := st.Recv(); err != nil {
				done <- err
				return
			}
		}
	}()
	select {
	case err := <-done:
		wantStatus(t, err, codes.Unauthenticated, "revoked")
	case <-time.After(20 * time.Second):
		t.Fatal("the revoked token's watch is still open after 20s")
	}
}

func TestTenantHistoryKeepsRecentUsageToItsTenantOnly(t *testing.T) {
	ts := startServer(t, func(c *Config) { c.ACL = true; c.UsageHistoryInterval = 20 * time.Millisecond })
	boot, err := gpupoolv1.NewAclServiceClient(ts.c.Conn()).Bootstrap(ctx(t), &gpupoolv1.AclBootstrapRequest{})
	if err != nil {
		t.Fatal(err)
	}
	ts.c = ts.clientWith(t, boot.Secret)
	as := &aclServer{testServer: ts, mgmt: boot.Secret}
	ts.registerHost(t, "h1", 2, 81920)
	r := whole(1)
	r.Tenant = "a"
	ts.acquire(t, r)
	var got *gpupoolv1.TenantHistoryResponse
	waitFor(t, "a sample of tenant a holding 1 GPU", func() bool {
		got, err = ts.c.Operator.TenantHistory(ctx(t), &gpupoolv1.TenantHistoryRequest{})
		if err != nil {
			t.Fatal(err)
		}
		for _, h := range got.Tenants {
			if h.Tenant == "a" && len(h.Samples) > 0 && h.Samples[len(h.Samples)-1].Gpus == 1 {
				return true
			}
		}
		return false
	})
	_, secretB := as.token(t, clientToken("b"))
	gotB, err := as.clientWith(t, secretB).Operator.TenantHistory(ctx(t), &gpupoolv1.TenantHistoryRequest{})
	if err != nil {
		t.Fatal(err)
	}
	for _, h := range gotB.Tenants {
		if h.Tenant != "b" {
			t.Errorf("tenant b's history: got tenant %q, want b's only", h.Tenant)
		}
	}
}

func TestUsageHistoryIsBoundedInSamples(t *testing.T) {
	ts := startServer(t)
	ts.registerHost(t, "h1", 1, 81920)
	ts.acquire(t, slice(1024, 10))
	h := newUsageHistory()
	for i := range usageHistorySamples + 50 {
		h.record(ts.s.fsm.State(), int64(i))
	}
	got := h.snapshot(func(string) bool { return true })
	if len(got) != 1 || len(got[0].Samples) != usageHistorySamples {
		t.Fatalf("got %d tenants, want 1 with %d samples", len(got), usageHistorySamples)
	}
	if first := got[0].Samples[0].AtMs; first != 50 {
		t.Errorf("oldest sample kept: got at %d, want 50 (the oldest dropped first)", first)
	}
}
