package broker

import (
	"sync/atomic"
	"testing"

	"google.golang.org/protobuf/proto"
)

// faultyProposer is a test double of Proposer: it passes commands on to
// the real one, except those the injected fault returns an error for,
// which fail as Raft would fail them (mapped by raftError) without
// reaching the log.
type faultyProposer struct {
	next  Proposer
	fault atomic.Pointer[func(proto.Message) error]
}

// wrap is set as Config.wrapProposer.
func (f *faultyProposer) wrap(next Proposer) Proposer {
	f.next = next
	return f
}

func (f *faultyProposer) Propose(cmd proto.Message) Proposal {
	if fault := f.fault.Load(); fault != nil {
		if err := (*fault)(cmd); err != nil {
			return failed{raftError(err)}
		}
	}
	return f.next.Propose(cmd)
}

// inject fails the commands fault returns an error for, until the test ends.
func (f *faultyProposer) inject(t testing.TB, fault func(proto.Message) error) {
	f.fault.Store(&fault)
	t.Cleanup(func() { f.fault.Store(nil) })
}
