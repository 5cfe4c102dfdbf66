package broker

import (
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/gpupool/gpupool/broker/fsm"
	"github.com/gpupool/gpupool/broker/lease"
	"github.com/gpupool/gpupool/broker/planner"
	"github.com/gpupool/gpupool/broker/state"
	"github.com/gpupool/gpupool/internal/clock"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// heldProposer is a Proposer double without Raft: it records what is
// proposed, and its proposals land only when the test lets them, with
// the result answer gives.
type heldProposer struct {
	mu       sync.Mutex
	proposed []string
	land     chan struct{}
	answer   func(proto.Message) (*fsm.Result, error)
}

func (p *heldProposer) Propose(cmd proto.Message) Proposal {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.proposed = append(p.proposed, describe(cmd))
	return heldProposal{p, cmd}
}

type heldProposal struct {
	p   *heldProposer
	cmd proto.Message
}

func (h heldProposal) Wait() (*fsm.Result, error) {
	<-h.p.land
	return h.p.answer(h.cmd)
}

func describe(cmd proto.Message) string {
	switch c := cmd.(type) {
	case *gpupoolv1.GrantLeaseCommand:
		if c.Lease.Parent != "" {
			return "grant extra of " + c.Lease.Parent
		}
		return "grant " + c.Lease.Id
	case *gpupoolv1.PreemptLeasesCommand:
		if c.DeadlineMs == 0 {
			return fmt.Sprintf("withdraw %v for %s", c.LeaseIds, c.ForLease)
		}
		return fmt.Sprintf("preempt %v for %s", c.LeaseIds, c.ForLease)
	case *gpupoolv1.EnqueueLeaseCommand:
		return "enqueue"
	}
	return fmt.Sprintf("%T", cmd)
}

func granting(cmd proto.Message) (*fsm.Result, error) {
	if g, ok := cmd.(*gpupoolv1.GrantLeaseCommand); ok {
		l := proto.CloneOf(g.Lease)
		l.State = gpupoolv1.LeaseState_LEASE_STATE_GRANTED
		return &fsm.Result{Lease: l}, nil
	}
	return &fsm.Result{}, nil
}

func wholeGPUOn(host string) []*gpupoolv1.Slice {
	return []*gpupoolv1.Slice{{Host: host, Device: host + "-gpu0", MemoryMib: 81920, ComputePercent: 100, Exclusive: true}}
}

func TestTheQueueWriterProposesAPlanInOrderAndHoldsItInFlightUntilItLands(t *testing.T) {
	props := &heldProposer{land: make(chan struct{}), answer: granting}
	w := &queueWriter{props: props, grants: newInflight(), log: slog.New(slog.DiscardHandler), grace: time.Second}
	req := &gpupoolv1.LeaseRequest{Count: 1, Exclusive: true, TtlMs: 60_000}
	plan := &planner.Plan{
		Grants:      []*gpupoolv1.Lease{{Id: "a", Request: req, Slices: wholeGPUOn("h1"), TtlMs: 60_000}},
		Preemptions: []*gpupoolv1.PreemptLeasesCommand{{LeaseIds: []string{"v"}, ForLease: "g", DeadlineMs: 5_000}},
		Withdrawals: []*gpupoolv1.PreemptLeasesCommand{planner.Withdrawal("old", []string{"w"})},
		Grows:       []*gpupoolv1.Lease{{Id: "x", Parent: "e", Request: req, Slices: wholeGPUOn("h3"), TtlMs: 60_000}},
		Reserved:    map[string][]*gpupoolv1.Slice{"g": wholeGPUOn("h2")},
	}
	sent := w.proposePlan(state.New().Read(), plan, 1_000)

	want := []string{"grant a", "preempt [v] for g", "withdraw [w] for old", "grant extra of e"}
	if !slices.Equal(props.proposed, want) {
		t.Fatalf("proposed %v, want %v", props.proposed, want)
	}
	var inFlight []string
	for _, l := range w.grants.snapshot() {
		inFlight = append(inFlight, l.Id)
	}
	slices.Sort(inFlight)
	if want := []string{"a", "reserved-for-g", "x"}; !slices.Equal(inFlight, want) {
		t.Fatalf("in flight before landing: got %v, want %v", inFlight, want)
	}

	ttl := lease.NewTimers(clock.NewFake(time.Unix(0, 0)), func(string) {})
	close(props.land)
	w.landPlan(ttl, sent)
	if got := w.grants.snapshot(); len(got) != 0 {
		t.Fatalf("in flight after landing: got %d, want none", len(got))
	}
	for _, id := range []string{"a", "x"} {
		if _, ok := ttl.Deadline(id); !ok {
			t.Errorf("TTL of %s after its grant landed: not armed, want armed", id)
		}
	}
}

func TestTheQueueWriterArmsNoTTLForAGrantTheLogRefused(t *testing.T) {
	props := &heldProposer{land: make(chan struct{}), answer: func(proto.Message) (*fsm.Result, error) {
		return nil, errors.New("slice no longer fits")
	}}
	close(props.land)
	w := &queueWriter{props: props, grants: newInflight(), log: slog.New(slog.DiscardHandler)}
	req := &gpupoolv1.LeaseRequest{Count: 1, Exclusive: true, TtlMs: 60_000}
	sent := w.proposePlan(state.New().Read(), &planner.Plan{Grants: []*gpupoolv1.Lease{{Id: "a", Request: req, Slices: wholeGPUOn("h1")}}}, 1_000)
	ttl := lease.NewTimers(clock.NewFake(time.Unix(0, 0)), func(string) {})
	w.landPlan(ttl, sent)
	if _, ok := ttl.Deadline("a"); ok {
		t.Fatal("TTL of a refused grant: armed, want not armed")
	}
	if got := w.grants.snapshot(); len(got) != 0 {
		t.Fatalf("in flight after a refused grant: got %d, want none", len(got))
	}
}
