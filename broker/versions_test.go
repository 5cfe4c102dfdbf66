package broker

import (
	"errors"
	"strings"
	"testing"

	"github.com/hashicorp/raft"
	"google.golang.org/protobuf/proto"

	"github.com/gpupool/gpupool/broker/fsm"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

type countingProposer struct{ n int }

func (p *countingProposer) Propose(proto.Message) Proposal { p.n++; return failed{nil} }

func TestANewCommandWaitsUntilEveryBrokerKnowsIt(t *testing.T) {
	f := fsm.New(nil)
	index := uint64(0)
	upsert := func(id string, v uint32) {
		index++
		b, err := fsm.Encode(&gpupoolv1.UpsertServerCommand{Id: id, RpcAddress: id + ":1", RaftAddress: id + ":2", FsmVersion: v})
		if err != nil {
			t.Fatal(err)
		}
		f.Apply(&raft.Log{Index: index, Type: raft.LogCommand, Data: b})
	}
	next := &countingProposer{}
	// SetQuota plays a command added in version 2.
	g := versionGate{next: next, fsm: f, need: func(t fsm.MessageType) (uint32, bool) {
		if t == fsm.SetQuotaType {
			return 2, true
		}
		return 1, true
	}}
	newCmd, oldCmd := &gpupoolv1.SetQuotaCommand{}, &gpupoolv1.FreeLeaseCommand{}

	upsert("b1", 2)
	upsert("b2", 0) // a binary from before the reports
	upsert("b3", 2)
	if _, err := g.Propose(newCmd).Wait(); !errors.Is(err, ErrPrecondition) || !strings.Contains(err.Error(), "broker b2 reports version 1") {
		t.Fatalf("with b2 at version 1: got %v, want a refusal naming b2 and its version", err)
	}
	if next.n != 0 {
		t.Fatalf("the refused command reached the log")
	}
	g.Propose(oldCmd)
	if next.n != 1 {
		t.Fatalf("a version-1 command: got %d proposals, want 1", next.n)
	}
	upsert("b2", 2)
	g.Propose(newCmd)
	if next.n != 2 {
		t.Fatalf("once every broker reports version 2: got %d proposals, want 2", next.n)
	}
}
