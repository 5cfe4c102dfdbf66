package broker

import (
	"sync"
	"sync/atomic"
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/gpupool/gpupool/broker/fsm"
)

// faultyProposer is a test double of Proposer: it passes commands on to
// the real one, except those the injected fault returns an error for,
// which fail as Raft would fail them (mapped by raftError) without
// reaching the log.
type faultyProposer struct {
	next  Proposer
	fault atomic.Pointer[func(proto.Message) error]
	held  atomic.Pointer[heldCommands]
}

// heldCommands are the commands match picks, held back from the log until
// open is closed.
type heldCommands struct {
	match func(proto.Message) bool
	open  chan struct{}
}

// heldBack is a proposal sent to the log only once it may go: as if Raft
// took that long to commit it.
type heldBack struct {
	open <-chan struct{}
	send func() Proposal
}

func (h heldBack) Wait() (*fsm.Result, error) {
	<-h.open
	return h.send().Wait()
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
	if h := f.held.Load(); h != nil && h.match(cmd) {
		return heldBack{open: h.open, send: func() Proposal { return f.next.Propose(cmd) }}
	}
	return f.next.Propose(cmd)
}

// hold keeps the commands match picks from committing until the returned
// function is called (or the test ends). Propose still returns at once.
func (f *faultyProposer) hold(t testing.TB, match func(proto.Message) bool) (release func()) {
	h := &heldCommands{match: match, open: make(chan struct{})}
	f.held.Store(h)
	var once sync.Once
	release = func() {
		once.Do(func() {
			f.held.Store(nil)
			close(h.open)
		})
	}
	t.Cleanup(release)
	return release
}

// inject fails the commands fault returns an error for, until the test ends.
func (f *faultyProposer) inject(t testing.TB, fault func(proto.Message) error) {
	f.fault.Store(&fault)
	t.Cleanup(func() { f.fault.Store(nil) })
}
