package client_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/gpupool/gpupool/client"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
	"github.com/gpupool/gpupool/protocol"
)

// fakeLeases is a LeaseService that follows the brokers' contract for
// waiting requests and elastic leases, scripted by the test: it grants
// parent, announces its live extras (GROWN) when a stream first renews
// it, and answers every renewal with a fresh token.
type fakeLeases struct {
	gpupoolv1.UnimplementedLeaseServiceServer
	parent *gpupoolv1.Lease

	// block makes Acquire wait, its request pending, until grant is
	// closed.
	block bool
	grant chan struct{}
	// reason is the pending_reason of a waiting request.
	reason string
	// who is the caller's token WhoAmI answers with, nil for brokers
	// without ACL. As on the brokers, a waiting request is queued under
	// the tenant protocol.FillDefaults gives it, and List refuses a
	// tenant the token does not hold.
	who *gpupoolv1.AclToken

	acquires chan *gpupoolv1.AcquireRequest // every Acquire
	lists    chan *gpupoolv1.ListLeasesRequest
	renewals chan string      // every renewal, by lease id
	streams  chan *fakeStream // every KeepAlive stream, newest last

	mu        sync.Mutex
	extras    []*gpupoolv1.Lease          // guarded by mu; live extras, oldest first
	failRenew map[string]string           // guarded by mu; lease → why its renewal fails
	waiting   []*gpupoolv1.AcquireRequest // guarded by mu; blocked Acquires
	tokens    int                         // guarded by mu; tokens handed out
}

// fakeStream is one KeepAlive stream of fakeLeases.
type fakeStream struct {
	push    chan *gpupoolv1.KeepAliveResponse // sent to the client as is
	broken  chan error                        // ends the stream with this error
	renewed chan string                       // the renewals on this stream, by lease id
}

func newFakeLeases(extras ...*gpupoolv1.Lease) *fakeLeases {
	return &fakeLeases{
		parent: &gpupoolv1.Lease{Id: "p-1", Tenant: "sim", State: gpupoolv1.LeaseState_LEASE_STATE_GRANTED, TtlMs: 1500,
			Class: gpupoolv1.LeaseClass_LEASE_CLASS_GUARANTEED, Slices: []*gpupoolv1.Slice{{Host: "h1", Device: "GPU-1", MemoryMib: 1024}}},
		grant:     make(chan struct{}),
		acquires:  make(chan *gpupoolv1.AcquireRequest, 16),
		lists:     make(chan *gpupoolv1.ListLeasesRequest, 1024),
		renewals:  make(chan string, 4096),
		streams:   make(chan *fakeStream, 16),
		extras:    extras,
		failRenew: map[string]string{},
	}
}

// extra is an extra of p-1 holding one slice on host.
func extra(id, host string) *gpupoolv1.Lease {
	return &gpupoolv1.Lease{Id: id, Parent: "p-1", Tenant: "sim", State: gpupoolv1.LeaseState_LEASE_STATE_GRANTED, TtlMs: 1500,
		Class: gpupoolv1.LeaseClass_LEASE_CLASS_PREEMPTIBLE, Slices: []*gpupoolv1.Slice{{Host: host, Device: "GPU-" + id, MemoryMib: 1024}}}
}

func (f *fakeLeases) Acquire(ctx context.Context, req *gpupoolv1.AcquireRequest) (*gpupoolv1.AcquireResponse, error) {
	f.acquires <- req
	if f.block {
		f.mu.Lock()
		f.waiting = append(f.waiting, req)
		f.mu.Unlock()
		select {
		case <-f.grant:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	return &gpupoolv1.AcquireResponse{Lease: f.parent, Tokens: []*gpupoolv1.HostToken{f.token("p-1", "h1")}}, nil
}

func (f *fakeLeases) List(_ context.Context, req *gpupoolv1.ListLeasesRequest) (*gpupoolv1.ListLeasesResponse, error) {
	f.lists <- req
	if err := protocol.FillDefaults(&gpupoolv1.LeaseRequest{Tenant: req.Tenant}, f.who); req.Tenant != "" && err != nil {
		return nil, status.Error(codes.PermissionDenied, err.Error())
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	// Another tenant's request waits too.
	out := []*gpupoolv1.Lease{{Id: "l-other", RequestId: "someone-else", State: gpupoolv1.LeaseState_LEASE_STATE_PENDING, PendingReason: "not ours"}}
	for _, a := range f.waiting {
		r := proto.CloneOf(a.Request)
		if err := protocol.FillDefaults(r, f.who); err != nil || r.Tenant != req.Tenant {
			continue
		}
		out = append(out, &gpupoolv1.Lease{Id: "l-waiting", Tenant: r.Tenant, RequestId: r.RequestId,
			State: gpupoolv1.LeaseState_LEASE_STATE_PENDING, PendingReason: f.reason})
	}
	return &gpupoolv1.ListLeasesResponse{Leases: out}, nil
}

// fakeACL answers WhoAmI for f.
type fakeACL struct {
	gpupoolv1.UnimplementedAclServiceServer
	f *fakeLeases
}

func (a fakeACL) WhoAmI(context.Context, *gpupoolv1.WhoAmIRequest) (*gpupoolv1.WhoAmIResponse, error) {
	return &gpupoolv1.WhoAmIResponse{Token: a.f.who, AclEnabled: a.f.who != nil}, nil
}

// token hands out a new token for id on host.
func (f *fakeLeases) token(id, host string) *gpupoolv1.HostToken {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.tokens++
	// No agent listens at the address.
	return &gpupoolv1.HostToken{Host: host, Token: fmt.Sprintf("%s@%s#%d", id, host, f.tokens), Address: "127.0.0.1:1"}
}

// renew answers one renewal.
func (f *fakeLeases) renew(id string) *gpupoolv1.KeepAliveResponse {
	f.mu.Lock()
	why := f.failRenew[id]
	var l *gpupoolv1.Lease
	for _, x := range append([]*gpupoolv1.Lease{f.parent}, f.extras...) {
		if x.Id == id {
			l = x
		}
	}
	f.mu.Unlock()
	switch {
	case why != "":
		return &gpupoolv1.KeepAliveResponse{LeaseId: id, State: gpupoolv1.LeaseState_LEASE_STATE_REVOKED, Error: why}
	case l == nil:
		return &gpupoolv1.KeepAliveResponse{LeaseId: id, Error: "lease " + id + " not found"}
	}
	return &gpupoolv1.KeepAliveResponse{LeaseId: id, State: gpupoolv1.LeaseState_LEASE_STATE_GRANTED, TtlMs: l.TtlMs,
		Tokens: []*gpupoolv1.HostToken{f.token(id, l.Slices[0].Host)}}
}

func grownEvent(x *gpupoolv1.Lease) *gpupoolv1.KeepAliveResponse {
	return &gpupoolv1.KeepAliveResponse{LeaseId: x.Id, State: x.State,
		Event: &gpupoolv1.LeaseEvent{Type: gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_GROWN, Lease: x, Message: "grew by 1 slice"}}
}

func (f *fakeLeases) KeepAlive(stream grpc.BidiStreamingServer[gpupoolv1.KeepAliveRequest, gpupoolv1.KeepAliveResponse]) error {
	st := &fakeStream{push: make(chan *gpupoolv1.KeepAliveResponse, 16), broken: make(chan error, 1), renewed: make(chan string, 4096)}
	f.streams <- st
	reqs := make(chan string)
	go func() {
		defer close(reqs)
		for {
			r, err := stream.Recv()
			if err != nil {
				return
			}
			select {
			case reqs <- r.LeaseId:
			case <-stream.Context().Done():
				return
			}
		}
	}()
	renewedParent := false
	for {
		select {
		case <-stream.Context().Done():
			return nil
		case err := <-st.broken:
			return err
		case r := <-st.push:
			if err := stream.Send(r); err != nil {
				return err
			}
		case id, ok := <-reqs:
			if !ok {
				return nil
			}
			f.renewals <- id
			st.renewed <- id
			if err := stream.Send(f.renew(id)); err != nil {
				return err
			}
			if id != f.parent.Id || renewedParent {
				continue
			}
			renewedParent = true
			f.mu.Lock()
			live := append([]*gpupoolv1.Lease(nil), f.extras...)
			f.mu.Unlock()
			for _, x := range live {
				if err := stream.Send(grownEvent(x)); err != nil {
					return err
				}
			}
		}
	}
}

// start serves f on a loopback port and dials it.
func (f *fakeLeases) start(t *testing.T) *client.Client {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := grpc.NewServer()
	gpupoolv1.RegisterLeaseServiceServer(s, f)
	gpupoolv1.RegisterAclServiceServer(s, fakeACL{f: f})
	go s.Serve(lis)
	t.Cleanup(s.Stop)
	c, err := client.Dial([]string{lis.Addr().String()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// stream waits for the next KeepAlive stream the client opens.
func (f *fakeLeases) stream(t *testing.T) *fakeStream {
	t.Helper()
	select {
	case st := <-f.streams:
		return st
	case <-time.After(10 * time.Second):
		t.Fatal("the client opened no KeepAlive stream")
		return nil
	}
}

// grow adds an extra and announces it on st.
func (f *fakeLeases) grow(st *fakeStream, x *gpupoolv1.Lease) {
	f.mu.Lock()
	f.extras = append(f.extras, x)
	f.mu.Unlock()
	st.push <- grownEvent(x)
}

// end ends the extra id and says so on st.
func (f *fakeLeases) end(st *fakeStream, id string) {
	f.mu.Lock()
	var x *gpupoolv1.Lease
	for i, e := range f.extras {
		if e.Id == id {
			x = e
			f.extras = append(f.extras[:i:i], f.extras[i+1:]...)
			break
		}
	}
	f.mu.Unlock()
	ended := proto.CloneOf(x)
	ended.State = gpupoolv1.LeaseState_LEASE_STATE_REVOKED
	st.push <- &gpupoolv1.KeepAliveResponse{LeaseId: id, State: ended.State,
		Event: &gpupoolv1.LeaseEvent{Type: gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_ENDED, Lease: ended, Message: "revoked: preempted"}}
}

// renewalsUntil collects the renewals the fake receives until id was
// renewed n times.
func (f *fakeLeases) renewalsUntil(t *testing.T, id string, n int) []string {
	t.Helper()
	var got []string
	timeout := time.After(10 * time.Second)
	for n > 0 {
		select {
		case r := <-f.renewals:
			got = append(got, r)
			if r == id {
				n--
			}
		case <-timeout:
			t.Fatalf("renewals %v: %s renewed %d times too few", got, id, n)
		}
	}
	return got
}

// afterNth joins what follows the nth id in ids.
func afterNth(ids []string, id string, n int) string {
	for i, x := range ids {
		if x == id {
			if n--; n == 0 {
				return strings.Join(ids[i+1:], " ")
			}
		}
	}
	return ""
}

// drainRenewals forgets the renewals received so far.
func (f *fakeLeases) drainRenewals() {
	for {
		select {
		case <-f.renewals:
		default:
			return
		}
	}
}

// nextEvent reads l's events until one of type typ.
func nextEvent(t *testing.T, l *client.Lease, typ gpupoolv1.LeaseEventType) *gpupoolv1.LeaseEvent {
	t.Helper()
	timeout := time.After(10 * time.Second)
	for {
		select {
		case ev, ok := <-l.Events():
			if !ok {
				t.Fatalf("events closed waiting for %v: %v", typ, l.Err())
			}
			if ev.Type == typ {
				return ev
			}
		case <-timeout:
			t.Fatalf("no %v event", typ)
		}
	}
}

// sliceIDs describes what Slices lists: "p-1/h1 e-1/h2+ e-2/h3+!" (+ for
// an extra, ! for one leaving).
func sliceIDs(ss []client.HeldSlice) string {
	var parts []string
	for _, s := range ss {
		p := s.LeaseID + "/" + s.Host
		if s.Extra {
			p += "+"
		}
		if s.Leaving {
			p += "!"
		}
		parts = append(parts, p)
	}
	return strings.Join(parts, " ")
}

func acquireElastic(t *testing.T, c *client.Client) *client.Lease {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	l, err := c.Acquire(ctx, &gpupoolv1.LeaseRequest{Count: 1, ElasticMax: 3, MemoryMib: 1024, ComputePercent: 10, TtlMs: 1500, Tenant: "sim"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(l.Close)
	return l
}

func TestElasticLeaseRenewsItsExtrasOnTheSameStream(t *testing.T) {
	f := newFakeLeases(extra("e-1", "h2"))
	l := acquireElastic(t, f.start(t))
	st := f.stream(t)

	ev := nextEvent(t, l, gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_GROWN)
	if ev.Lease.GetId() != "e-1" || ev.Lease.GetParent() != l.ID() {
		t.Fatalf("GROWN for %s (parent %q), want e-1 of %s", ev.Lease.GetId(), ev.Lease.GetParent(), l.ID())
	}
	// GROWN comes once the extra's first renewal brought its token.
	if tok, ok := l.TokenFor("e-1", "h2"); !ok || !strings.HasPrefix(tok.Token, "e-1@h2#") {
		t.Errorf("TokenFor(e-1, h2) = %v, %t; want the extra's token", tok, ok)
	}
	if tok, ok := l.TokenFor("p-1", "h1"); !ok || !strings.HasPrefix(tok.Token, "p-1@h1#") {
		t.Errorf("TokenFor(p-1, h1) = %v, %t; want the lease's own token", tok, ok)
	}
	if _, ok := l.TokenFor("e-1", "h1"); ok {
		t.Errorf("TokenFor(e-1, h1) found a token for a host the extra does not hold")
	}

	f.grow(st, extra("e-2", "h3"))
	if ev := nextEvent(t, l, gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_GROWN); ev.Lease.GetId() != "e-2" {
		t.Fatalf("second GROWN for %s, want e-2", ev.Lease.GetId())
	}
	if got, want := sliceIDs(l.Slices()), "p-1/h1 e-1/h2+ e-2/h3+"; got != want {
		t.Errorf("Slices = %q, want %q", got, want)
	}
	// Every round renews the lease and both extras.
	got := f.renewalsUntil(t, "p-1", 3)
	if n := strings.Count(strings.Join(got, " "), "e-2"); n < 2 {
		t.Errorf("renewals %v: e-2 renewed %d times over 2 rounds, want it renewed with the lease", got, n)
	}
	if l.Err() != nil {
		t.Errorf("Err = %v, want the lease still renewed", l.Err())
	}
}

func TestAShrinkNoticeMarksTheExtraAndItsEndLeavesTheLeaseRunning(t *testing.T) {
	f := newFakeLeases(extra("e-1", "h2"))
	l := acquireElastic(t, f.start(t))
	st := f.stream(t)
	nextEvent(t, l, gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_GROWN)

	leaveAt := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC).UnixMilli()
	st.push <- &gpupoolv1.KeepAliveResponse{LeaseId: "e-1", Event: &gpupoolv1.LeaseEvent{
		Type: gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_PREEMPT_NOTICE, Lease: extra("e-1", "h2"), DeadlineMs: leaveAt, Message: "room for l-9"}}
	if ev := nextEvent(t, l, gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_PREEMPT_NOTICE); ev.DeadlineMs != leaveAt || ev.Lease.GetParent() != "p-1" {
		t.Fatalf("notice: deadline %d, parent %q; want %d, p-1", ev.DeadlineMs, ev.Lease.GetParent(), leaveAt)
	}
	ss := l.Slices()
	if got, want := sliceIDs(ss), "p-1/h1 e-1/h2+!"; got != want {
		t.Fatalf("Slices after the notice = %q, want %q", got, want)
	}
	if ss[1].LeaveAtMs != leaveAt {
		t.Errorf("LeaveAtMs = %d, want %d", ss[1].LeaveAtMs, leaveAt)
	}

	// The brokers withdraw the preemption: the extra stays, not leaving.
	st.push <- &gpupoolv1.KeepAliveResponse{LeaseId: "e-1", Event: &gpupoolv1.LeaseEvent{
		Type: gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_UPDATED, Lease: extra("e-1", "h2"), Message: "preemption withdrawn"}}
	nextEvent(t, l, gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_UPDATED)
	if got, want := sliceIDs(l.Slices()), "p-1/h1 e-1/h2+"; got != want {
		t.Fatalf("Slices after the withdrawal = %q, want %q", got, want)
	}

	f.end(st, "e-1")
	if ev := nextEvent(t, l, gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_ENDED); ev.Lease.GetId() != "e-1" {
		t.Fatalf("ENDED for %s, want e-1", ev.Lease.GetId())
	}
	if got, want := sliceIDs(l.Slices()), "p-1/h1"; got != want {
		t.Errorf("Slices after the extra ended = %q, want %q", got, want)
	}
	if _, ok := l.TokenFor("e-1", "h2"); ok {
		t.Errorf("TokenFor still has a token for the ended extra")
	}
	// The lease is still renewed, without the extra. The round in flight
	// when the end arrived may still carry it.
	f.drainRenewals()
	got := f.renewalsUntil(t, "p-1", 3)
	if strings.Contains(afterNth(got, "p-1", 2), "e-1") {
		t.Errorf("renewals %v: e-1 still renewed after it ended", got)
	}
	select {
	case <-l.Done():
		t.Fatalf("the lease stopped with its extra: %v", l.Err())
	default:
	}
}

func TestAnExtraThatCannotBeRenewedIsDroppedAlone(t *testing.T) {
	f := newFakeLeases(extra("e-1", "h2"), extra("e-2", "h3"))
	l := acquireElastic(t, f.start(t))
	f.stream(t)
	nextEvent(t, l, gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_GROWN)
	nextEvent(t, l, gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_GROWN)

	f.mu.Lock()
	f.failRenew["e-1"] = "lease e-1 is revoked and cannot be renewed: preempted"
	f.mu.Unlock()
	ev := nextEvent(t, l, gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_ENDED)
	if ev.Lease.GetId() != "e-1" || !strings.Contains(ev.Message, "preempted") {
		t.Fatalf("ENDED for %s %q, want e-1 with the broker's reason", ev.Lease.GetId(), ev.Message)
	}
	if got, want := sliceIDs(l.Slices()), "p-1/h1 e-2/h3+"; got != want {
		t.Errorf("Slices = %q, want %q", got, want)
	}
	f.renewalsUntil(t, "p-1", 2)
	if l.Err() != nil {
		t.Errorf("Err = %v, want the lease still renewed", l.Err())
	}
}

func TestAfterReconnectingTheLeaseRenewsItsExtrasWithoutAnnouncingThemAgain(t *testing.T) {
	f := newFakeLeases(extra("e-1", "h2"))
	l := acquireElastic(t, f.start(t))
	st := f.stream(t)
	nextEvent(t, l, gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_GROWN)

	st.broken <- status.Error(codes.Unavailable, "leader lost")
	st = f.stream(t)
	// The new stream renews both at once: the lease (the fake then
	// announces e-1 again) and e-1.
	var first []string
	for len(first) < 2 {
		select {
		case id := <-st.renewed:
			first = append(first, id)
		case <-time.After(10 * time.Second):
			t.Fatalf("renewals on the new stream: %v, want p-1 and e-1", first)
		}
	}
	if got := strings.Join(first, " "); got != "p-1 e-1" {
		t.Errorf("first renewals on the new stream: %q, want \"p-1 e-1\"", got)
	}
	// Events keep their order: a marker after the repeated GROWN shows
	// whether it was passed on.
	st.push <- &gpupoolv1.KeepAliveResponse{LeaseId: "p-1", Event: &gpupoolv1.LeaseEvent{
		Type: gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_UPDATED, Lease: f.parent, Message: "marker"}}
	timeout := time.After(10 * time.Second)
	for done := false; !done; {
		select {
		case ev := <-l.Events():
			switch ev.Type {
			case gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_GROWN:
				t.Errorf("GROWN for %s again after reconnecting", ev.Lease.GetId())
			case gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_UPDATED:
				done = true
			}
		case <-timeout:
			t.Fatal("no marker event")
		}
	}
	if got, want := sliceIDs(l.Slices()), "p-1/h1 e-1/h2+"; got != want {
		t.Errorf("Slices = %q, want %q", got, want)
	}
}

func TestWithWaitWaitsInTheQueueAndReportsWhyPending(t *testing.T) {
	f := newFakeLeases()
	f.block, f.reason = true, "no A100 with 40 GiB free (12 have 20 GiB)"
	c := f.start(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	progress := make(chan *gpupoolv1.Lease, 16)
	type result struct {
		l   *client.Lease
		err error
	}
	done := make(chan result, 1)
	go func() {
		l, err := c.Acquire(ctx, &gpupoolv1.LeaseRequest{Count: 1, Exclusive: true, TtlMs: 60_000},
			client.WithWait(90*time.Second),
			client.WithPendingProgress(func(l *gpupoolv1.Lease) {
				select {
				case progress <- l:
				default:
				}
			}))
		done <- result{l, err}
	}()

	req := <-f.acquires
	if req.WaitMs != 90_000 || req.Request.GetRequestId() == "" {
		t.Errorf("Acquire sent wait_ms %d, request id %q; want 90000 and a generated id", req.WaitMs, req.Request.GetRequestId())
	}
	select {
	case p := <-progress:
		if p.GetRequestId() != req.Request.GetRequestId() || p.GetPendingReason() != f.reason {
			t.Errorf("progress with %q %q, want the request's pending lease and its reason", p.GetRequestId(), p.GetPendingReason())
		}
	case <-ctx.Done():
		t.Fatal("no pending progress")
	}
	list := <-f.lists
	if want := (&gpupoolv1.ListLeasesRequest{Tenant: "default", States: []gpupoolv1.LeaseState{gpupoolv1.LeaseState_LEASE_STATE_PENDING}}); !proto.Equal(list, want) {
		t.Errorf("List %v, want %v", list, want)
	}

	close(f.grant)
	r := <-done
	if r.err != nil {
		t.Fatal(r.err)
	}
	defer r.l.Close()
	if r.l.ID() != "p-1" {
		t.Errorf("granted %s, want p-1", r.l.ID())
	}
}

func TestWithoutWaitAcquireAsksForNoWaitAndWatchesNoQueue(t *testing.T) {
	f := newFakeLeases()
	c := f.start(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	l, err := c.Acquire(ctx, &gpupoolv1.LeaseRequest{Count: 1, Exclusive: true, TtlMs: 60_000},
		client.WithPendingProgress(func(*gpupoolv1.Lease) { t.Error("progress reported without WithWait") }))
	if err != nil {
		t.Fatal(err)
	}
	l.Close()
	if req := <-f.acquires; req.WaitMs != 0 {
		t.Errorf("wait_ms = %d, want 0 without WithWait", req.WaitMs)
	}
	if len(f.lists) != 0 {
		t.Errorf("listed pending leases %d times without WithWait", len(f.lists))
	}
}

func TestAPreemptNoticeMarksTheLeaseItselfAndItsEndStopsIt(t *testing.T) {
	f := newFakeLeases()
	f.parent.Class = gpupoolv1.LeaseClass_LEASE_CLASS_PREEMPTIBLE
	l := acquireElastic(t, f.start(t))
	st := f.stream(t)
	f.renewalsUntil(t, "p-1", 1)

	leaveAt := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC).UnixMilli()
	noticed := proto.CloneOf(f.parent)
	noticed.PreemptAtMs, noticed.PreemptedFor = leaveAt, "l-9"
	st.push <- &gpupoolv1.KeepAliveResponse{LeaseId: "p-1", Event: &gpupoolv1.LeaseEvent{
		Type: gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_PREEMPT_NOTICE, Lease: noticed, DeadlineMs: leaveAt, Message: "room for l-9"}}
	nextEvent(t, l, gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_PREEMPT_NOTICE)
	if ss := l.Slices(); sliceIDs(ss) != "p-1/h1!" || ss[0].LeaveAtMs != leaveAt {
		t.Errorf("Slices after the notice = %q (leaving at %d), want p-1/h1! at %d", sliceIDs(ss), ss[0].LeaveAtMs, leaveAt)
	}
	if got := l.Info().GetPreemptedFor(); got != "l-9" {
		t.Errorf("Info().PreemptedFor = %q, want l-9", got)
	}

	st.push <- &gpupoolv1.KeepAliveResponse{LeaseId: "p-1", Event: &gpupoolv1.LeaseEvent{
		Type: gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_ENDED, Lease: noticed, Message: "revoked: preempted"}}
	select {
	case <-l.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("the lease carried on after it ended")
	}
	if !errors.Is(l.Err(), client.ErrLeaseEnded) {
		t.Errorf("Err = %v, want ErrLeaseEnded", l.Err())
	}
}

func TestDialSliceUsesTheTokenOfTheLeaseHoldingTheSlice(t *testing.T) {
	f := newFakeLeases(extra("e-1", "h2"))
	l := acquireElastic(t, f.start(t))
	st := f.stream(t)
	nextEvent(t, l, gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_GROWN)
	ss := l.Slices()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	// No agent listens: the error shows which host and token were used.
	if _, err := l.DialSlice(ctx, ss[1]); err == nil || !strings.Contains(err.Error(), "reach the agent of h2 at 127.0.0.1:1") {
		t.Errorf("DialSlice(e-1's slice) = %v, want it to reach for h2's agent", err)
	}
	f.end(st, "e-1")
	nextEvent(t, l, gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_ENDED)
	if _, err := l.DialSlice(ctx, ss[1]); err == nil || !strings.Contains(err.Error(), "lease e-1 has no token for host h2") {
		t.Errorf("DialSlice of an ended extra = %v, want it to say the extra has no token", err)
	}
}
