package broker

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// waiter is an Acquire that waits in the queue, running in the background.
type waiter struct {
	reqID  string
	cancel context.CancelFunc
	done   chan struct{}
	resp   *gpupoolv1.AcquireResponse
	err    error
}

func whole(n int32) *gpupoolv1.LeaseRequest {
	return &gpupoolv1.LeaseRequest{Count: n, Exclusive: true, TtlMs: 3_600_000}
}

// acquire grants r at once or fails the test.
func (ts *testServer) acquire(t *testing.T, r *gpupoolv1.LeaseRequest) *gpupoolv1.Lease {
	t.Helper()
	resp, err := ts.c.Lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: r})
	if err != nil {
		t.Fatal(err)
	}
	return resp.Lease
}

// wait starts an Acquire of r with request id reqID that may wait up to
// wait, and returns once its lease is pending or granted.
func (ts *testServer) wait(t *testing.T, reqID string, r *gpupoolv1.LeaseRequest, wait time.Duration) *waiter {
	t.Helper()
	r.RequestId = reqID
	c, cancel := context.WithCancel(ctx(t))
	w := &waiter{reqID: reqID, cancel: cancel, done: make(chan struct{})}
	t.Cleanup(cancel)
	go func() {
		defer close(w.done)
		w.resp, w.err = ts.c.Lease.Acquire(c, &gpupoolv1.AcquireRequest{Request: r, WaitMs: wait.Milliseconds()})
	}()
	waitFor(t, reqID+" waiting in the queue or granted", func() bool {
		l := ts.byRequest(r.Tenant, reqID)
		ls := ts.s.leadership.currentLeader()
		return l != nil && (l.State != gpupoolv1.LeaseState_LEASE_STATE_PENDING || ls != nil && ls.waiting(l.Id))
	})
	return w
}

func (ts *testServer) byRequest(tenant, reqID string) *gpupoolv1.Lease {
	if tenant == "" {
		tenant = "default"
	}
	return ts.s.fsm.State().LeaseByRequest(tenant, reqID)
}

// granted waits for w's Acquire to return a grant.
func (w *waiter) granted(t *testing.T) *gpupoolv1.Lease {
	t.Helper()
	select {
	case <-w.done:
	case <-ctx(t).Done():
		t.Fatalf("%s: never returned", w.reqID)
	}
	if w.err != nil {
		t.Fatalf("%s: %v", w.reqID, w.err)
	}
	return w.resp.Lease
}

func (w *waiter) returned() bool {
	select {
	case <-w.done:
		return true
	default:
		return false
	}
}

// release releases id and confirms its teardown, so its capacity is free.
func (ts *testServer) release(t *testing.T, beat func(...string), id string) {
	t.Helper()
	if _, err := ts.c.Lease.Release(ctx(t), &gpupoolv1.ReleaseRequest{LeaseId: id}); err != nil {
		t.Fatal(err)
	}
	beat(id)
}

func pendingIDs(ts *testServer) []string {
	var out []string
	for _, l := range ts.s.fsm.State().PendingLeases() {
		out = append(out, l.RequestId)
	}
	return out
}

func TestQueueGrantsByPriorityThenArrival(t *testing.T) {
	ts := startServer(t)
	ts.registerHost(t, "h1", 2, 81920)
	beat := ts.heartbeater(t, "h1")
	full := ts.acquire(t, whole(2))

	a := ts.wait(t, "a", whole(2), time.Hour)
	b := ts.wait(t, "b", whole(1), time.Hour)
	high := whole(2)
	high.Priority = 5
	c := ts.wait(t, "c", high, time.Hour)
	if got, want := pendingIDs(ts), []string{"c", "a", "b"}; !slices.Equal(got, want) {
		t.Fatalf("queue %v, want %v (priority, then arrival)", got, want)
	}

	ts.release(t, beat, full.Id)
	lc := c.granted(t)
	if lc.State != gpupoolv1.LeaseState_LEASE_STATE_GRANTED || !strings.HasPrefix(lc.Reason, "granted from the queue after") {
		t.Fatalf("c: %v %q", lc.State, lc.Reason)
	}
	if a.returned() || b.returned() {
		t.Fatal("a or b granted while c held every GPU")
	}
	ts.release(t, beat, lc.Id)
	la := a.granted(t) // a arrived before b, and both GPUs are free
	if b.returned() {
		t.Fatal("b granted while a held every GPU")
	}
	ts.release(t, beat, la.Id)
	b.granted(t)
	if q := pendingIDs(ts); len(q) != 0 {
		t.Fatalf("queue %v, want empty", q)
	}
}

func TestQueueBackfillsSmallerRequestsThatFit(t *testing.T) {
	ts := startServer(t)
	ts.registerHost(t, "h1", 2, 81920)
	beat := ts.heartbeater(t, "h1")
	one := ts.acquire(t, whole(1))
	two := ts.acquire(t, whole(1))

	big := ts.wait(t, "big", whole(2), time.Hour)
	small := ts.wait(t, "small", whole(1), time.Hour)
	ts.release(t, beat, two.Id)
	small.granted(t) // one GPU free: the head needs two, the later one fits
	if big.returned() {
		t.Fatal("big granted with one GPU free")
	}
	ts.release(t, beat, one.Id)
	if big.returned() {
		t.Fatal("big granted while the backfilled lease holds a GPU")
	}
	ts.release(t, beat, small.resp.Lease.Id)
	big.granted(t)
}

func TestWhyPendingNamesTheRealBlockers(t *testing.T) {
	ts := startServer(t)
	ts.registerHost(t, "h1", 2, 81920)
	ts.registerHost(t, "h2", 1, 81920)
	ts.setQuota(t, &gpupoolv1.Quota{Tenant: "sim", MemoryMib: 150 * 1024})
	on := func(host string, r *gpupoolv1.LeaseRequest) *gpupoolv1.LeaseRequest {
		r.Constraints = &gpupoolv1.Constraints{Host: host}
		return r
	}
	// sim holds 60 GiB on each of h1's GPUs (120 of its 150 GiB); h2 holds
	// a lease and drains.
	ts.acquire(t, on("h1", tenantSlice("sim", 60*1024, 25)))
	ts.acquire(t, on("h1", tenantSlice("sim", 60*1024, 25)))
	ts.acquire(t, on("h2", slice(1024, 5)))
	ts.drain(t, &gpupoolv1.DrainHostRequest{HostId: "h2", Reason: "kernel upgrade"})

	tests := []struct {
		name, reqID string
		req         *gpupoolv1.LeaseRequest
		want        string
	}{
		{"memory short, a host draining, quota pressure", "first", tenantSlice("sim", 40*1024, 25),
			"no A100-SXM4-80GB with 40 GiB and 25% compute free (2 have 20 GiB free); host h2 draining; tenant sim at 80% of memory quota"},
		{"a second one is behind the first", "second", tenantSlice("sim", 40*1024, 25),
			"no A100-SXM4-80GB with 40 GiB and 25% compute free (2 have 20 GiB free); host h2 draining; tenant sim at 80% of memory quota; 1 request ahead in the queue"},
		{"whole GPUs", "whole", whole(1),
			"no idle A100-SXM4-80GB (all 2 in use); host h2 draining; 2 requests ahead in the queue"},
	}
	for _, tt := range tests {
		ts.wait(t, tt.reqID, tt.req, time.Hour)
	}
	list, err := ts.c.Lease.List(ctx(t), &gpupoolv1.ListLeasesRequest{States: []gpupoolv1.LeaseState{gpupoolv1.LeaseState_LEASE_STATE_PENDING}})
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]string{}
	for _, l := range list.Leases {
		got[l.RequestId] = l.PendingReason
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got[tt.reqID] != tt.want {
				t.Errorf("why pending:\n got %q\nwant %q", got[tt.reqID], tt.want)
			}
		})
	}
	// Over the quota once granted: the quota is the blocker.
	ts.setQuota(t, &gpupoolv1.Quota{Tenant: "sim", MemoryMib: 130 * 1024})
	id := ts.byRequest("sim", "first").Id
	g, err := ts.c.Lease.Get(ctx(t), &gpupoolv1.GetLeaseRequest{LeaseId: id})
	if err != nil {
		t.Fatal(err)
	}
	if want := "no A100-SXM4-80GB with 40 GiB and 25% compute free (2 have 20 GiB free); host h2 draining; tenant sim at 92% of memory quota"; g.Lease.PendingReason != want {
		t.Errorf("why pending over quota:\n got %q\nwant %q", g.Lease.PendingReason, want)
	}
}

func TestAWaiterThatGoesAwayLeavesTheQueue(t *testing.T) {
	ts := startServer(t)
	ts.registerHost(t, "h1", 1, 81920)
	ts.acquire(t, whole(1))
	w := ts.wait(t, "gone", whole(1), time.Hour)
	w.cancel()
	<-w.done
	waitFor(t, "the pending lease ended", func() bool {
		return ts.byRequest("", "gone").State == gpupoolv1.LeaseState_LEASE_STATE_RELEASED
	})
	if l := ts.byRequest("", "gone"); !strings.Contains(l.Reason, "the waiting client went away") {
		t.Fatalf("reason %q", l.Reason)
	}
	if q := pendingIDs(ts); len(q) != 0 {
		t.Fatalf("queue %v, want empty", q)
	}
	// The same request id cannot come back to a lease that left the queue.
	r := whole(1)
	r.RequestId = "gone"
	_, err := ts.c.Lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: r, WaitMs: 1000})
	if status.Code(err) != codes.ResourceExhausted || !strings.Contains(err.Error(), "left the queue without a grant") {
		t.Fatalf("rejoin after leaving: %v", err)
	}
}

func TestAWaitThatRunsOutSaysWhyAndLeavesTheQueue(t *testing.T) {
	ts := startServer(t)
	ts.registerHost(t, "h1", 1, 81920)
	ts.acquire(t, whole(1))
	w := ts.wait(t, "short", whole(1), 4*time.Second) // within the heartbeat TTL
	ts.clock.Advance(4 * time.Second)
	<-w.done
	if status.Code(w.err) != codes.ResourceExhausted || !strings.Contains(w.err.Error(), "not granted within the wait of 4s: no idle A100-SXM4-80GB (all 1 in use)") {
		t.Fatalf("got %v", w.err)
	}
	if l := ts.byRequest("", "short"); l.State != gpupoolv1.LeaseState_LEASE_STATE_EXPIRED {
		t.Fatalf("pending lease is %v, want expired", l.State)
	}
}

func TestAcquireRejectsABadWaitAndBadElastic(t *testing.T) {
	ts := startServer(t)
	ts.registerHost(t, "h1", 1, 81920)
	elastic := func(min, max int32, f func(*gpupoolv1.LeaseRequest)) *gpupoolv1.LeaseRequest {
		r := slice(1024, 10)
		r.Count, r.ElasticMax = min, max
		if f != nil {
			f(r)
		}
		return r
	}
	tests := []struct {
		name string
		req  *gpupoolv1.AcquireRequest
		want string
	}{
		{"a negative wait", &gpupoolv1.AcquireRequest{Request: slice(1024, 10), WaitMs: -1}, "wait_ms -1: must be between 0 (fail at once) and 86400000 (24h)"},
		{"a wait over a day", &gpupoolv1.AcquireRequest{Request: slice(1024, 10), WaitMs: 86_400_001}, "wait_ms 86400001"},
		{"elastic 5..2", &gpupoolv1.AcquireRequest{Request: elastic(5, 2, nil)}, "elastic_max 2: must be between count (5, the guaranteed slices) and 256"},
		{"elastic and preemptible", &gpupoolv1.AcquireRequest{Request: elastic(1, 4, func(r *gpupoolv1.LeaseRequest) { r.Class = pre })}, "class preemptible: an elastic lease must be guaranteed"},
		{"elastic with a topology", &gpupoolv1.AcquireRequest{Request: elastic(1, 4, func(r *gpupoolv1.LeaseRequest) { r.Topology = gpupoolv1.Topology_TOPOLOGY_SAME_HOST })}, "must be unset for an elastic lease"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := ts.c.Lease.Acquire(ctx(t), tt.req)
			if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("got %v, want InvalidArgument with %q", err, tt.want)
			}
		})
	}
}

func TestAWaiterRejoinsItsPendingLeaseAcrossALeaderChange(t *testing.T) {
	ts := startServer(t)
	ts.registerHost(t, "h1", 1, 81920)
	full := ts.acquire(t, whole(1))
	w := ts.wait(t, "rejoin", whole(1), time.Hour)
	id := ts.byRequest("", "rejoin").Id
	ls := ts.handOver(t) // the call gets Unavailable; the client retries with the same request id
	waitFor(t, "the retried call waiting on the new leader", func() bool { return ls.waiting(id) })
	beat := ts.heartbeater(t, "h1")
	ts.release(t, beat, full.Id)
	if l := w.granted(t); l.Id != id {
		t.Fatalf("granted %s, want the pending lease %s", l.Id, id)
	}
}

func TestAPendingLeaseWithoutAWaiterLeavesAfterTheGrace(t *testing.T) {
	ts := startServer(t)
	ts.registerHost(t, "h1", 1, 81920)
	ts.acquire(t, whole(1))
	// A pending lease whose waiting call was on the old leader and never
	// came back: nobody waits on it here.
	r := whole(1)
	r.Tenant, r.RequestId, r.Class = "default", "orphan", gua
	l, err := ts.s.capacity.enqueue(r, nil)
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the grace timer", func() bool {
		_, ok := ts.s.leadership.currentLeader().pendingGrace.Deadline(l.Id)
		return ok
	})
	ts.clock.Advance(ts.s.cfg.PendingGrace)
	waitFor(t, "the orphan leaves the queue", func() bool {
		return ts.byRequest("", "orphan").State == gpupoolv1.LeaseState_LEASE_STATE_EXPIRED
	})
}

func (ts *testServer) lease(id string) *gpupoolv1.Lease { return ts.s.fsm.State().Lease(id) }

func TestAGuaranteedRequestPreemptsTheYoungestPreemptibleLeaseOnly(t *testing.T) {
	ts := startServer(t)
	ts.registerHost(t, "h1", 2, 81920)
	beat := ts.heartbeater(t, "h1")
	preemptible := func(prio int32) *gpupoolv1.LeaseRequest {
		r := whole(1)
		r.Class, r.Priority = pre, prio
		return r
	}
	older := ts.acquire(t, preemptible(0))
	ts.clock.Advance(time.Millisecond)
	younger := ts.acquire(t, preemptible(0))
	events := ts.keepAliveEvents(t, younger.Id)

	g := ts.wait(t, "g", whole(1), time.Hour)
	notice := waitEvent(t, events, gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_PREEMPT_NOTICE)
	gID := ts.byRequest("", "g").Id
	if want := ts.clock.Now().Add(ts.s.cfg.PreemptGrace).UnixMilli(); notice.DeadlineMs != want || !strings.Contains(notice.Message, "preempted for "+gID) {
		t.Fatalf("notice: deadline %d (want %d), message %q", notice.DeadlineMs, want, notice.Message)
	}
	if ts.lease(older.Id).PreemptAtMs != 0 {
		t.Fatal("the older lease was preempted too: one GPU was enough")
	}
	if why := ts.s.capacity.whyPending(ts.s.fsm.State(), ts.lease(gID)); !strings.HasPrefix(why, "preempting 1 lease ("+younger.Id+"), revoked in 2s") {
		t.Fatalf("why pending: %q", why)
	}
	ts.preemptArmed(t, younger.Id)
	beat()
	ts.clock.Advance(ts.s.cfg.PreemptGrace)
	waitFor(t, "the victim revoked", func() bool { return ts.lease(younger.Id).State == gpupoolv1.LeaseState_LEASE_STATE_RELEASING })
	if r := ts.lease(younger.Id).Reason; !strings.Contains(r, "preempted for "+gID) {
		t.Fatalf("victim's reason %q", r)
	}
	preempted, err := auditLog(ctx(t), ts.c, &gpupoolv1.AuditLogRequest{Kinds: []gpupoolv1.AuditKind{gpupoolv1.AuditKind_AUDIT_KIND_LEASE_PREEMPTED}})
	if err != nil {
		t.Fatal(err)
	}
	if len(preempted) != 1 || preempted[0].Subject != younger.Id || preempted[0].Actor.GetName() != "broker" {
		t.Fatalf("audit log: got %d lease-preempted entries (%v), want one of %s by the broker", len(preempted), preempted, younger.Id)
	}
	beat(younger.Id)
	lg := g.granted(t)

	// Two GPUs at priority 10 would need the guaranteed lease too: it is
	// never preempted, and the older preemptible lease alone does not make
	// room, so nothing is preempted.
	high := whole(2)
	high.Priority = 10
	ts.wait(t, "high", high, time.Hour)
	ts.s.leadership.currentLeader().kickQueue()
	beat()
	if l := ts.lease(older.Id); l.PreemptAtMs != 0 {
		t.Fatalf("older lease preempted (%s) although that cannot make room", l.PreemptedFor)
	}
	if ts.lease(lg.Id).State != gpupoolv1.LeaseState_LEASE_STATE_GRANTED {
		t.Fatal("a guaranteed lease was preempted")
	}
}

func TestAPreemptibleLeaseOfHigherPriorityIsNotPreempted(t *testing.T) {
	ts := startServer(t)
	ts.registerHost(t, "h1", 1, 81920)
	r := whole(1)
	r.Class, r.Priority = pre, 5
	p := ts.acquire(t, r)
	ts.wait(t, "low", whole(1), time.Hour) // priority 0
	ts.s.capacity.schedule(ts.s.leadership.currentLeader())
	if l := ts.lease(p.Id); l.PreemptAtMs != 0 {
		t.Fatal("a priority-5 lease was preempted for a priority-0 request")
	}
}

// preemptArmed waits until the leader armed the preemption deadlines of ids.
func (ts *testServer) preemptArmed(t *testing.T, ids ...string) {
	t.Helper()
	waitFor(t, "preemption deadlines armed", func() bool {
		for _, id := range ids {
			if _, ok := ts.s.leadership.currentLeader().preempt.Deadline(id); !ok {
				return false
			}
		}
		return true
	})
}

// extras returns the granted extras of an elastic lease.
func (ts *testServer) extras(parent string) []*gpupoolv1.Lease {
	var out []*gpupoolv1.Lease
	for _, x := range ts.s.fsm.State().Extras(parent) {
		if x.State == gpupoolv1.LeaseState_LEASE_STATE_GRANTED {
			out = append(out, x)
		}
	}
	return out
}

// eventsOf collects n distinct leases' events of typ from ch.
func eventsOf(t *testing.T, ch <-chan *gpupoolv1.LeaseEvent, typ gpupoolv1.LeaseEventType, n int) map[string]*gpupoolv1.LeaseEvent {
	t.Helper()
	got := map[string]*gpupoolv1.LeaseEvent{}
	for len(got) < n {
		ev := waitEvent(t, ch, typ)
		got[ev.Lease.Id] = ev
	}
	return got
}

func TestAnElasticLeaseGrowsShrinksWithNoticesAndGrowsBack(t *testing.T) {
	ts := startServer(t)
	ts.registerHost(t, "h1", 4, 81920)
	beat := ts.heartbeater(t, "h1")
	r := whole(1)
	r.ElasticMax, r.Tenant = 4, "sim"
	parent := ts.acquire(t, r)
	events := ts.keepAliveEvents(t, parent.Id)
	grown := eventsOf(t, events, gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_GROWN, 3)
	for id, ev := range grown {
		x := ts.lease(id)
		if x.Parent != parent.Id || x.Class != pre || ev.Lease.Parent != parent.Id || len(x.Slices) != 1 {
			t.Fatalf("extra %s: parent %q class %v slices %d", id, x.Parent, x.Class, len(x.Slices))
		}
	}

	// Guaranteed work that needs two GPUs takes back the two youngest extras.
	g := ts.wait(t, "g", whole(2), time.Hour)
	notices := eventsOf(t, events, gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_PREEMPT_NOTICE, 2)
	xs := ts.s.fsm.State().Extras(parent.Id)
	if _, ok := notices[xs[0].Id]; ok {
		t.Fatalf("the oldest extra %s was taken back; want the two youngest", xs[0].Id)
	}
	var taken []string
	for id := range notices {
		taken = append(taken, id)
	}
	ts.preemptArmed(t, taken...)
	beat()
	ts.clock.Advance(ts.s.cfg.PreemptGrace)
	waitFor(t, "the extras revoked", func() bool {
		return ts.lease(taken[0]).State == gpupoolv1.LeaseState_LEASE_STATE_RELEASING && ts.lease(taken[1]).State == gpupoolv1.LeaseState_LEASE_STATE_RELEASING
	})
	beat(taken...)
	lg := g.granted(t)
	if n := len(ts.extras(parent.Id)); n != 1 {
		t.Fatalf("%d extras while the guaranteed lease runs, want 1", n)
	}

	// The guaranteed work ends: the elastic lease grows back.
	ts.release(t, beat, lg.Id)
	waitFor(t, "growing back to 4 slices", func() bool { return len(ts.extras(parent.Id)) == 3 })
	eventsOf(t, events, gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_GROWN, 2)

	// Its end ends its extras.
	if _, err := ts.c.Lease.Release(ctx(t), &gpupoolv1.ReleaseRequest{LeaseId: parent.Id}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the extras end with the lease", func() bool { return len(ts.extras(parent.Id)) == 0 })
}

func TestVictimsAreSparedWhenRoomAppearsElsewhere(t *testing.T) {
	ts := startServer(t)
	ts.registerHost(t, "h1", 2, 81920)
	beat := ts.heartbeater(t, "h1")
	g := ts.acquire(t, whole(1))
	pr := whole(1)
	pr.Class = pre
	v := ts.acquire(t, pr)
	a := ts.wait(t, "a", whole(1), time.Hour)
	waitFor(t, "v preempted", func() bool { return ts.lease(v.Id).PreemptAtMs != 0 })
	ts.release(t, beat, g.Id) // room elsewhere before the grace ends
	a.granted(t)
	waitFor(t, "v spared", func() bool { return ts.lease(v.Id).PreemptAtMs == 0 })
	if l := ts.lease(v.Id); l.State != gpupoolv1.LeaseState_LEASE_STATE_GRANTED {
		t.Fatalf("v is %v, want granted", l.State)
	}
}

func TestExtrasOfAHigherPriorityElasticLeaseAreStillTakenBack(t *testing.T) {
	ts := startServer(t)
	ts.registerHost(t, "h1", 2, 81920)
	r := whole(1)
	r.ElasticMax, r.Priority = 2, 9
	parent := ts.acquire(t, r)
	waitFor(t, "growth", func() bool { return len(ts.extras(parent.Id)) == 1 })
	// Without a wait, the refusal says how to get the room.
	_, err := ts.c.Lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: whole(1)})
	if status.Code(err) != codes.ResourceExhausted || !strings.Contains(err.Error(), "preempting 1 preemptible lease would make room: acquire with a wait of more than the 2s grace") {
		t.Fatalf("acquire without a wait: %v", err)
	}
	ts.wait(t, "low", whole(1), time.Hour) // priority 0
	waitFor(t, "the extra preempted", func() bool { return ts.extras(parent.Id)[0].PreemptAtMs != 0 })
}

func TestATenantsOwnExtrasMakeRoomInItsQuota(t *testing.T) {
	ts := startServer(t)
	ts.registerHost(t, "h1", 4, 81920)
	ts.setQuota(t, &gpupoolv1.Quota{Tenant: "sim", Gpus: 2})
	r := whole(1)
	r.ElasticMax, r.Tenant = 4, "sim"
	parent := ts.acquire(t, r)
	waitFor(t, "growth up to the quota", func() bool { return len(ts.extras(parent.Id)) == 1 })
	g := whole(1)
	g.Tenant = "sim"
	ts.wait(t, "sim-guaranteed", g, time.Hour) // 2 GPUs free, but sim's quota is full
	waitFor(t, "sim's extra preempted for its own guaranteed work", func() bool { return ts.extras(parent.Id)[0].PreemptAtMs != 0 })
}
