package broker

import (
	"errors"
	"fmt"
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/gpupool/gpupool/broker/fsm"
	"github.com/gpupool/gpupool/broker/lease"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

func TestTheLeaderLeaseIsShorterThanTheElectionTimeout(t *testing.T) {
	// verify.go's renewals rely on it: a cut-off leader steps down before
	// another server can be elected.
	if RaftLeaderLeaseTimeout >= RaftElectionTimeout {
		t.Fatalf("leader lease %s, election timeout %s: want the lease shorter", RaftLeaderLeaseTimeout, RaftElectionTimeout)
	}
	conf := raftConfig("b1", nil, nil)
	if conf.PreVoteDisabled {
		t.Fatal("pre-vote is off: want it on, so that a server coming back does not depose a healthy leader")
	}
	if !conf.BatchApplyCh || conf.MaxAppendEntries != RaftMaxAppendEntries {
		t.Fatalf("BatchApplyCh %t, MaxAppendEntries %d: want group commit of up to %d entries", conf.BatchApplyCh, conf.MaxAppendEntries, RaftMaxAppendEntries)
	}
}

// Grants proposed back to back share Raft's batches (BatchApplyCh), and
// the FSM still checks each one against the state the earlier ones left:
// one that no longer fits fails alone, with its own error.
func TestAGrantThatNoLongerFitsInABatchFailsAloneAndTheRestAreGranted(t *testing.T) {
	ts := startServer(t)
	ts.registerHost(t, "h1", 1, 10240)
	s := &gpupoolv1.Slice{Host: "h1", Device: "GPU-h1-0", MemoryMib: 4096, ComputePercent: 10}
	var props []Proposal
	var ids []string
	for i := range 3 {
		r := slice(4096, 10)
		r.Tenant, r.RequestId = "default", fmt.Sprintf("batch-%d", i)
		l := lease.New(newLeaseID(), r, []*gpupoolv1.Slice{proto.CloneOf(s)}, ts.s.nowMs(), nil)
		ids = append(ids, l.Id)
		props = append(props, ts.s.applyAsync(&gpupoolv1.GrantLeaseCommand{Lease: l}))
	}
	for i, p := range props {
		res, err := p.Wait()
		var conflict *fsm.ConflictError
		switch {
		case i < 2 && err != nil:
			t.Errorf("grant %d (%d MiB of 10240 taken before it): got %v, want it granted", i, 4096*i, err)
		case i < 2 && res.Lease.GetState() != gpupoolv1.LeaseState_LEASE_STATE_GRANTED:
			t.Errorf("grant %d: got state %s, want GRANTED", i, res.Lease.GetState())
		case i == 2 && !errors.As(err, &conflict):
			t.Errorf("grant 2 (8192 MiB of 10240 taken before it): got %v, want a ConflictError", err)
		}
	}
	if l := ts.s.fsm.State().Lease(ids[2]); l != nil {
		t.Errorf("the grant that did not fit left lease %s in the state (%s), want none", ids[2], l.State)
	}
}
