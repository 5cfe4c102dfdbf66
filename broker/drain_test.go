package broker

import (
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// acquireOn acquires a one-hour lease of class on the pool and returns its id.
func (ts *testServer) acquireOn(t *testing.T, class gpupoolv1.LeaseClass) string {
	t.Helper()
	r := slice(1024, 5)
	r.TtlMs, r.Class = 3_600_000, class
	resp, err := ts.c.Lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: r})
	if err != nil {
		t.Fatal(err)
	}
	return resp.Lease.Id
}

func (ts *testServer) host(id string) *gpupoolv1.Host { return ts.s.fsm.State().Host(id) }

func (ts *testServer) leaseState(id string) gpupoolv1.LeaseState {
	return ts.s.fsm.State().Lease(id).State
}

func (ts *testServer) drain(t *testing.T, req *gpupoolv1.DrainHostRequest) *gpupoolv1.DrainHostResponse {
	t.Helper()
	resp, err := ts.c.Pool.DrainHost(ctx(t), req)
	if err != nil {
		t.Fatal(err)
	}
	ts.drainArmed(t, resp.Host)
	return resp
}

// drainArmed waits until the leader, which reacts to committed changes in
// its own goroutine, has armed h's drain deadline timer, so that advancing
// the fake clock afterwards fires it. A drain without a deadline, or a
// forced one, arms nothing.
func (ts *testServer) drainArmed(t *testing.T, h *gpupoolv1.Host) {
	t.Helper()
	d := h.GetDrain()
	if d == nil || d.DeadlineMs == 0 || d.Force {
		return
	}
	want := time.UnixMilli(d.DeadlineMs)
	waitFor(t, "the drain deadline armed", func() bool {
		ls := ts.s.leadership.currentLeader()
		if ls == nil {
			return false
		}
		at, ok := ls.drain.Deadline(h.Id)
		return ok && at.Equal(want)
	})
}

// nextEvent returns the next event a KeepAlive stream carries, skipping
// renewal answers.
func nextEvent(t *testing.T, ka gpupoolv1.LeaseService_KeepAliveClient) *gpupoolv1.LeaseEvent {
	t.Helper()
	for {
		r, err := ka.Recv()
		if err != nil {
			t.Fatal(err)
		}
		if r.Event != nil {
			return r.Event
		}
	}
}

func TestDrainRevokesPreemptibleLeasesAtOnceAndTheRestAtTheDeadline(t *testing.T) {
	ts := startServer(t)
	ts.registerHost(t, "h1", 2, 81920)
	beat := ts.heartbeater(t, "h1")
	pre := ts.acquireOn(t, gpupoolv1.LeaseClass_LEASE_CLASS_PREEMPTIBLE)
	kept := ts.acquireOn(t, gpupoolv1.LeaseClass_LEASE_CLASS_GUARANTEED)
	ka, err := ts.c.Lease.KeepAlive(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	if err := ka.Send(&gpupoolv1.KeepAliveRequest{LeaseId: kept}); err != nil {
		t.Fatal(err)
	}
	if r, err := ka.Recv(); err != nil || r.Error != "" {
		t.Fatalf("renewal: got %v %v", r, err)
	}

	start := ts.clock.Now()
	resp := ts.drain(t, &gpupoolv1.DrainHostRequest{HostId: "h1", Reason: "kernel upgrade", DeadlineAfterMs: 30_000})
	wantDeadline := start.Add(30 * time.Second).UnixMilli()
	if h := resp.Host; h.Status != gpupoolv1.HostStatus_HOST_STATUS_DRAINING || h.Eligible || h.Drain.GetDeadlineMs() != wantDeadline || h.Drain.Reason != "kernel upgrade" {
		t.Fatalf("drained host: got %v eligible=%t drain=%v, want draining, ineligible, deadline %d", h.Status, h.Eligible, h.Drain, wantDeadline)
	}
	if l := ts.s.fsm.State().Lease(pre); l.State != gpupoolv1.LeaseState_LEASE_STATE_RELEASING || l.EndState != gpupoolv1.LeaseState_LEASE_STATE_REVOKED || !strings.HasPrefix(l.Reason, "host h1 drained") {
		t.Fatalf("preemptible lease: got %v→%v %q, want releasing→revoked \"host h1 drained…\"", l.State, l.EndState, l.Reason)
	}
	if got := ts.leaseState(kept); got != gpupoolv1.LeaseState_LEASE_STATE_GRANTED {
		t.Fatalf("guaranteed lease at drain start: got %v, want granted", got)
	}
	ev := nextEvent(t, ka)
	if ev.Type != gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_DRAIN_NOTICE || ev.DeadlineMs != wantDeadline || !strings.Contains(ev.Message, "host h1 draining (kernel upgrade)") {
		t.Fatalf("KeepAlive event: got %v deadline %d %q, want DRAIN_NOTICE with deadline %d", ev.Type, ev.DeadlineMs, ev.Message, wantDeadline)
	}

	for range 7 { // 28 s, the host heartbeating: before the deadline
		ts.clock.Advance(4 * time.Second)
		beat()
	}
	if got := ts.leaseState(kept); got != gpupoolv1.LeaseState_LEASE_STATE_GRANTED {
		t.Fatalf("guaranteed lease 28 s into a 30 s drain: got %v, want granted", got)
	}
	ts.clock.Advance(4 * time.Second)
	beat()
	if l := ts.s.fsm.State().Lease(kept); l.State != gpupoolv1.LeaseState_LEASE_STATE_RELEASING || l.EndState != gpupoolv1.LeaseState_LEASE_STATE_REVOKED || !strings.Contains(l.Reason, "deadline passed") {
		t.Fatalf("guaranteed lease past the deadline: got %v→%v %q, want releasing→revoked, deadline passed", l.State, l.EndState, l.Reason)
	}
	if ev := nextEvent(t, ka); ev.Type != gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_RELEASING {
		t.Fatalf("KeepAlive event after the deadline: got %v, want RELEASING", ev.Type)
	}
	if got := ts.host("h1").Status; got != gpupoolv1.HostStatus_HOST_STATUS_DRAINING {
		t.Fatalf("host with leases releasing: got %v, want draining", got)
	}

	beat(pre, kept) // the agent confirms teardown: the last leases are freed
	waitFor(t, "host drained", func() bool { return ts.host("h1").Status == gpupoolv1.HostStatus_HOST_STATUS_DRAINED })
	if _, err := ts.c.Lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: slice(1024, 5)}); status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("acquire on the drained pool: got %v, want ResourceExhausted", err)
	}
	en, err := ts.c.Pool.SetEligibility(ctx(t), &gpupoolv1.SetEligibilityRequest{HostId: "h1", Eligible: true})
	if err != nil {
		t.Fatal(err)
	}
	if h := en.Host; h.Status != gpupoolv1.HostStatus_HOST_STATUS_READY || !h.Eligible || h.Drain != nil {
		t.Fatalf("enabled drained host: got %v eligible=%t drain=%v, want ready, eligible, no drain", h.Status, h.Eligible, h.Drain)
	}
	if _, err := ts.c.Lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: slice(1024, 5)}); err != nil {
		t.Fatalf("acquire after enabling: %v", err)
	}
}

func TestDrainOfAnEmptyHostIsDrainedAtOnceAndForceRevokesEverything(t *testing.T) {
	ts := startServer(t)
	ts.registerHost(t, "empty", 1, 81920)
	if got := ts.drain(t, &gpupoolv1.DrainHostRequest{HostId: "empty"}).Host.Status; got != gpupoolv1.HostStatus_HOST_STATUS_DRAINED {
		t.Fatalf("drain of a host without leases: got %v, want drained", got)
	}
	ts.registerHost(t, "busy", 1, 81920)
	id := ts.acquireOn(t, gpupoolv1.LeaseClass_LEASE_CLASS_GUARANTEED)
	resp := ts.drain(t, &gpupoolv1.DrainHostRequest{HostId: "busy", Force: true})
	if l := ts.s.fsm.State().Lease(id); l.State != gpupoolv1.LeaseState_LEASE_STATE_RELEASING || l.EndState != gpupoolv1.LeaseState_LEASE_STATE_REVOKED {
		t.Fatalf("guaranteed lease under --force: got %v→%v, want releasing→revoked", l.State, l.EndState)
	}
	if resp.Host.Status != gpupoolv1.HostStatus_HOST_STATUS_DRAINING || resp.Leases != 1 || !resp.Host.Drain.GetForce() {
		t.Fatalf("forced drain: got %v with %d leases, force=%t; want draining with 1 lease releasing, force", resp.Host.Status, resp.Leases, resp.Host.Drain.GetForce())
	}
	if n := ts.s.leadership.currentLeader().drain.Len(); n != 0 {
		t.Fatalf("drain timers after a forced drain and one without deadline: got %d, want 0", n)
	}
}

func TestDrainingHostThatGoesDownComesBackDrainingThenDrained(t *testing.T) {
	ts := startServer(t)
	ts.registerHost(t, "h1", 1, 81920)
	id := ts.acquireOn(t, gpupoolv1.LeaseClass_LEASE_CLASS_GUARANTEED)
	ts.drain(t, &gpupoolv1.DrainHostRequest{HostId: "h1"}) // no deadline
	ts.clock.Advance(6 * time.Second)                      // past the 5 s heartbeat TTL
	waitFor(t, "host down", func() bool { return ts.host("h1").Status == gpupoolv1.HostStatus_HOST_STATUS_DOWN })
	if h := ts.host("h1"); h.Drain == nil || h.Eligible {
		t.Fatalf("down draining host: got drain=%v eligible=%t, want the drain kept and ineligible", h.Drain, h.Eligible)
	}
	beat := ts.heartbeater(t, "h1")
	beat()
	waitFor(t, "host back", func() bool { return ts.host("h1").Status != gpupoolv1.HostStatus_HOST_STATUS_DOWN })
	if got := ts.host("h1").Status; got != gpupoolv1.HostStatus_HOST_STATUS_DRAINING {
		t.Fatalf("back with its lost lease still releasing: got %v, want draining", got)
	}
	// The agent re-registers (a restart): the drain survives that too.
	ts.registerHost(t, "h1", 1, 81920)
	beat(id)
	waitFor(t, "host drained", func() bool { return ts.host("h1").Status == gpupoolv1.HostStatus_HOST_STATUS_DRAINED })
	if h := ts.host("h1"); h.Eligible || h.Drain == nil {
		t.Fatalf("drained host: got eligible=%t drain=%v, want ineligible with its drain", h.Eligible, h.Drain)
	}
}

func TestDrainDeadlineSurvivesALeaderChangeAndFiresOnce(t *testing.T) {
	ts := startServer(t)
	ts.registerHost(t, "h1", 1, 81920)
	id := ts.acquireOn(t, gpupoolv1.LeaseClass_LEASE_CLASS_GUARANTEED)
	events, cancel := ts.s.fsm.Subscribe()
	t.Cleanup(cancel)
	ts.drain(t, &gpupoolv1.DrainHostRequest{HostId: "h1", DeadlineAfterMs: 20_000})
	deadline := time.UnixMilli(ts.host("h1").Drain.DeadlineMs)

	// Leadership moves: the new leader state is built from the replicated
	// state alone, as on another server.
	ls := ts.handOver(t)
	if at, ok := ls.drain.Deadline("h1"); !ok || !at.Equal(deadline) {
		t.Fatalf("drain deadline on the new leader: got %v armed=%t, want %v", at, ok, deadline)
	}
	beat := ts.heartbeater(t, "h1")
	for range 6 { // 24 s: past the 20 s deadline
		ts.clock.Advance(4 * time.Second)
		beat()
	}
	if got := ts.leaseState(id); got != gpupoolv1.LeaseState_LEASE_STATE_RELEASING {
		t.Fatalf("lease past the deadline after a leader change: got %v, want releasing", got)
	}
	if ls := ts.handOver(t); ls.drain.Len() != 0 {
		t.Fatalf("drain timers on a leader after the deadline fired: got %d, want 0", ls.drain.Len())
	}
	revoked := 0
	for done := false; !done; {
		select {
		case ev := <-events:
			if ev.Lease.GetId() == id && ev.Type == gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_RELEASING {
				revoked++
			}
		default:
			done = true
		}
	}
	if revoked != 1 {
		t.Fatalf("revocations of the lease: got %d, want 1", revoked)
	}
}

func TestDrainAndEligibilityRejectBadInputAndConflicts(t *testing.T) {
	ts := startServer(t)
	ts.registerHost(t, "h1", 1, 81920)
	ts.acquireOn(t, gpupoolv1.LeaseClass_LEASE_CLASS_GUARANTEED)
	for _, tc := range []struct {
		name string
		call func() error
		code codes.Code
		msg  string
	}{
		{"a negative deadline", func() error {
			_, err := ts.c.Pool.DrainHost(ctx(t), &gpupoolv1.DrainHostRequest{HostId: "h1", DeadlineAfterMs: -1})
			return err
		}, codes.InvalidArgument, "deadline_after_ms -1: must be between 0 (no deadline) and"},
		{"force with a deadline", func() error {
			_, err := ts.c.Pool.DrainHost(ctx(t), &gpupoolv1.DrainHostRequest{HostId: "h1", Force: true, DeadlineAfterMs: 1000})
			return err
		}, codes.InvalidArgument, "force true with deadline_after_ms 1000"},
		{"cancel with force", func() error {
			_, err := ts.c.Pool.DrainHost(ctx(t), &gpupoolv1.DrainHostRequest{HostId: "h1", Force: true, Cancel: true})
			return err
		}, codes.InvalidArgument, "cancel true: cannot be combined"},
		{"eligibility of no host", func() error {
			_, err := ts.c.Pool.SetEligibility(ctx(t), &gpupoolv1.SetEligibilityRequest{Eligible: true})
			return err
		}, codes.InvalidArgument, "host_id: is required"},
		{"eligibility of an unknown host", func() error {
			_, err := ts.c.Pool.SetEligibility(ctx(t), &gpupoolv1.SetEligibilityRequest{HostId: "nope", Eligible: true})
			return err
		}, codes.NotFound, `host "nope": not found`},
		{"disabling a ready host", func() error {
			resp, err := ts.c.Pool.SetEligibility(ctx(t), &gpupoolv1.SetEligibilityRequest{HostId: "h1"})
			if err == nil && (resp.Host.Eligible || resp.Host.Status != gpupoolv1.HostStatus_HOST_STATUS_READY) {
				t.Errorf("disabled host: got %v eligible=%t, want ready, ineligible", resp.Host.Status, resp.Host.Eligible)
			}
			return err
		}, codes.OK, ""},
		{"enabling it again", func() error {
			resp, err := ts.c.Pool.SetEligibility(ctx(t), &gpupoolv1.SetEligibilityRequest{HostId: "h1", Eligible: true})
			if err == nil && !resp.Host.Eligible {
				t.Errorf("enabled host: got ineligible")
			}
			return err
		}, codes.OK, ""},
		{"cancelling the drain of a host that is not draining", func() error {
			ts.c.Pool.SetEligibility(ctx(t), &gpupoolv1.SetEligibilityRequest{HostId: "h1"})
			_, err := ts.c.Pool.DrainHost(ctx(t), &gpupoolv1.DrainHostRequest{HostId: "h1", Cancel: true})
			if h := ts.host("h1"); h.Eligible {
				t.Errorf("disabled host after a refused cancel: got eligible, want still disabled")
			}
			ts.c.Pool.SetEligibility(ctx(t), &gpupoolv1.SetEligibilityRequest{HostId: "h1", Eligible: true})
			return err
		}, codes.FailedPrecondition, "host h1 is not draining"},
		{"keep_deadline with force", func() error {
			_, err := ts.c.Pool.DrainHost(ctx(t), &gpupoolv1.DrainHostRequest{HostId: "h1", Force: true, KeepDeadline: true})
			return err
		}, codes.InvalidArgument, "force true with keep_deadline true"},
		{"enabling a draining host", func() error {
			ts.drain(t, &gpupoolv1.DrainHostRequest{HostId: "h1"})
			_, err := ts.c.Pool.SetEligibility(ctx(t), &gpupoolv1.SetEligibilityRequest{HostId: "h1", Eligible: true})
			return err
		}, codes.FailedPrecondition, "host h1 is draining with 1 lease left: enable it once it is drained, or cancel the drain with 'gpupool host drain h1 --cancel'"},
		{"enabling a draining host that went down before it drained", func() error {
			ts.clock.Advance(6 * time.Second) // past the 5 s heartbeat TTL
			waitFor(t, "host down", func() bool { return ts.host("h1").Status == gpupoolv1.HostStatus_HOST_STATUS_DOWN })
			_, err := ts.c.Pool.SetEligibility(ctx(t), &gpupoolv1.SetEligibilityRequest{HostId: "h1", Eligible: true})
			if h := ts.host("h1"); h.Drain == nil || h.Eligible {
				t.Errorf("down draining host after a refused enable: got drain=%v eligible=%t, want its drain kept, ineligible", h.Drain, h.Eligible)
			}
			return err
		}, codes.FailedPrecondition, "host h1 is down and not drained yet (1 lease left): enable it once it is drained, or cancel the drain with 'gpupool host drain h1 --cancel'"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.call()
			if status.Code(err) != tc.code || (tc.msg != "" && !strings.Contains(status.Convert(err).Message(), tc.msg)) {
				t.Fatalf("got %v, want %v %q", err, tc.code, tc.msg)
			}
		})
	}
}

func TestDrainDeadlineRevocationThatFailsToCommitIsRetriedWithBackoff(t *testing.T) {
	for _, tc := range []struct {
		name string
		err  error
	}{
		{"a leadership transfer in progress", raft.ErrLeadershipTransferInProgress},
		{"an enqueue timeout", raft.ErrEnqueueTimeout},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ts := startServer(t)
			ts.registerHost(t, "h1", 1, 81920)
			beat := ts.heartbeater(t, "h1")
			id := ts.acquireOn(t, gpupoolv1.LeaseClass_LEASE_CLASS_GUARANTEED)
			ts.drain(t, &gpupoolv1.DrainHostRequest{HostId: "h1", DeadlineAfterMs: 20_000})
			var attempts atomic.Int32
			fault := func(cmd proto.Message) error {
				if c, ok := cmd.(*gpupoolv1.DrainHostCommand); ok && c.IfDeadlineMs != 0 && attempts.Add(1) <= 2 {
					return tc.err
				}
				return nil
			}
			ts.faults.inject(t, fault)

			for range 5 { // 20 s: the deadline fires, synchronously, in Advance
				ts.clock.Advance(4 * time.Second)
				beat()
			}
			ls := ts.s.leadership.currentLeader()
			for i, wait := range []time.Duration{50 * time.Millisecond, 100 * time.Millisecond} {
				if got := attempts.Load(); got != int32(i+1) {
					t.Fatalf("revocation attempts: got %d, want %d", got, i+1)
				}
				if got := ts.leaseState(id); got != gpupoolv1.LeaseState_LEASE_STATE_GRANTED {
					t.Fatalf("lease after %d failed attempts: got %v, want granted", i+1, got)
				}
				if at, ok := ls.drain.Deadline("h1"); !ok || !at.Equal(ts.clock.Now().Add(wait)) {
					t.Fatalf("drain timer after %d failed attempts: got %v armed=%t, want a retry in %s", i+1, at, ok, wait)
				}
				ts.clock.Advance(wait)
			}
			if l := ts.s.fsm.State().Lease(id); attempts.Load() != 3 || l.State != gpupoolv1.LeaseState_LEASE_STATE_RELEASING || !strings.Contains(l.Reason, "deadline passed") {
				t.Fatalf("after the third attempt: %d attempts, lease %v %q; want releasing, deadline passed", attempts.Load(), l.State, l.Reason)
			}
			waitFor(t, "the drain timer stopped", func() bool { return ls.drain.Len() == 0 })
			ls.mu.Lock()
			defer ls.mu.Unlock()
			if len(ls.drainRetry) != 0 {
				t.Fatalf("drain retries left after success: %v", ls.drainRetry)
			}
		})
	}
}

// handOver moves leadership away and back, so the leader state is rebuilt
// from the replicated state alone, as on another server.
func (ts *testServer) handOver(t *testing.T) *leaderState {
	t.Helper()
	old := ts.s.leadership.currentLeader()
	ts.s.leadership.notifyCh <- false
	ts.s.leadership.notifyCh <- true
	var ls *leaderState
	waitFor(t, "a new leader", func() bool { ls = ts.s.leadership.currentLeader(); return ls != nil && ls != old })
	return ls
}

func TestDrainNoticeReachesStreamsThatStartWatchingAfterTheDrain(t *testing.T) {
	notice, releasing := gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_DRAIN_NOTICE, gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_RELEASING
	for _, tc := range []struct {
		name          string
		watchFirst    bool  // the stream watches the lease before the drain starts
		failover      bool  // leadership moves between the drain and the stream
		deadlineAfter int64 // 0: no deadline
		want          []gpupoolv1.LeaseEventType
	}{
		{"a stream watching when the drain starts gets it once", true, false, 30_000, []gpupoolv1.LeaseEventType{notice, releasing}},
		{"a stream that starts after the drain gets it", false, false, 30_000, []gpupoolv1.LeaseEventType{notice, releasing}},
		{"a stream that starts after a failover gets it", false, true, 30_000, []gpupoolv1.LeaseEventType{notice, releasing}},
		{"a drain without a deadline is not announced late", false, false, 0, []gpupoolv1.LeaseEventType{releasing}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ts := startServer(t)
			ts.registerHost(t, "h1", 1, 81920)
			id := ts.acquireOn(t, gpupoolv1.LeaseClass_LEASE_CLASS_GUARANTEED)
			var events <-chan *gpupoolv1.LeaseEvent
			if tc.watchFirst {
				events = ts.keepAliveEvents(t, id)
			}
			ts.drain(t, &gpupoolv1.DrainHostRequest{HostId: "h1", Reason: "kernel upgrade", DeadlineAfterMs: tc.deadlineAfter})
			deadline := ts.host("h1").Drain.DeadlineMs
			if tc.failover {
				ts.handOver(t)
			}
			if !tc.watchFirst {
				events = ts.keepAliveEvents(t, id)
			}
			// The release's event closes the sequence: whatever came
			// before it on the stream is all the stream got.
			if _, err := ts.c.Lease.Release(ctx(t), &gpupoolv1.ReleaseRequest{LeaseId: id}); err != nil {
				t.Fatal(err)
			}
			var got []gpupoolv1.LeaseEventType
			for len(got) == 0 || got[len(got)-1] != releasing {
				select {
				case ev, ok := <-events:
					if !ok {
						t.Fatalf("keepalive stream ended after %v", got)
					}
					if ev.Type == notice && (ev.DeadlineMs != deadline || !strings.Contains(ev.Message, "host h1 draining (kernel upgrade)")) {
						t.Fatalf("DRAIN_NOTICE: got deadline %d %q, want deadline %d", ev.DeadlineMs, ev.Message, deadline)
					}
					got = append(got, ev.Type)
				case <-ctx(t).Done():
					t.Fatalf("events: got %v, want %v", got, tc.want)
				}
			}
			if fmt.Sprint(got) != fmt.Sprint(tc.want) {
				t.Fatalf("events: got %v, want %v", got, tc.want)
			}
		})
	}
}
