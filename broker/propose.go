package broker

import (
	"time"

	"github.com/hashicorp/raft"
	"google.golang.org/protobuf/proto"

	"github.com/gpupool/gpupool/broker/fsm"
)

// Proposer is the broker's one way to change the replicated state: every
// command (Acquire's grants, the queue's plans, timers, admin calls) is
// proposed through it. The server's is Raft; tests wrap it with a double
// that fails chosen commands before they reach the log.
type Proposer interface {
	// Propose sends cmd to the log and returns at once, without waiting
	// for it to commit. Commands proposed one after another commit in
	// that order. Only the leader proposes.
	Propose(cmd proto.Message) Proposal
}

// Proposal is a command sent to the log and not yet known to commit.
type Proposal interface {
	// Wait blocks until the command is applied on this server and returns
	// its result. The error is the result's own error (the FSM refused
	// the command: the result may still say why), or a Raft error mapped
	// to one clients can act on (see raftError), with a nil result.
	Wait() (*fsm.Result, error)
}

// raftProposer proposes commands to Raft.
type raftProposer struct {
	r *raft.Raft
	// observe, when set, gets each applied proposal's time from Propose
	// to applied (gpupool_raft_apply_seconds).
	observe func(time.Duration)
	// roomFor, when set, refuses a proposal the log has no room for (a
	// full disk) before Raft sees it: a leader whose own log write fails
	// steps down, and a new election writes the term, which Raft cannot
	// survive failing.
	roomFor func() error
	// stopped is closed when the server shuts down. A proposal still in
	// Raft's buffered apply channel when Raft shuts down is never
	// answered (hashicorp/raft drains that channel only while it runs),
	// so Wait gives up on it here instead of blocking shutdown for good.
	stopped <-chan struct{}
}

func (p raftProposer) Propose(cmd proto.Message) Proposal {
	if p.roomFor != nil {
		if err := p.roomFor(); err != nil {
			return failed{err}
		}
	}
	b, err := fsm.Encode(cmd)
	if err != nil {
		return failed{err}
	}
	return raftProposal{f: p.r.Apply(b, applyTimeout), sent: time.Now(), observe: p.observe, stopped: p.stopped}
}

type raftProposal struct {
	f       raft.ApplyFuture
	sent    time.Time
	observe func(time.Duration)
	stopped <-chan struct{}
}

func (p raftProposal) Wait() (*fsm.Result, error) {
	if err := waitFuture(p.f, p.stopped); err != nil {
		return nil, raftError(err)
	}
	if p.observe != nil {
		p.observe(time.Since(p.sent))
	}
	res := p.f.Response().(*fsm.Result)
	return res, res.Err
}

// waitFuture is f.Error(), or raft.ErrRaftShutdown once stopped is
// closed, whichever comes first. The command may still commit after a
// shutdown answer, like any command whose answer is lost: clients retry
// with the same request id.
func waitFuture(f raft.Future, stopped <-chan struct{}) error {
	if stopped == nil {
		return f.Error()
	}
	done := make(chan error, 1)
	go func() { done <- f.Error() }()
	select {
	case err := <-done:
		return err
	case <-stopped:
		return raft.ErrRaftShutdown
	}
}

// failed is a proposal that could not be sent.
type failed struct{ err error }

func (p failed) Wait() (*fsm.Result, error) { return nil, p.err }

// applyTimeout bounds how long a command may wait to be enqueued.
const applyTimeout = 10 * time.Second

// apply proposes cmd and waits until it is applied here; see Proposal.
// Only the leader calls it, and never under placeMu (see doc.go).
func (nd *node) apply(cmd proto.Message) (*fsm.Result, error) {
	return nd.proposer.Propose(cmd).Wait()
}

// applyAsync proposes cmd and returns at once; see Proposer.
func (nd *node) applyAsync(cmd proto.Message) Proposal {
	return nd.proposer.Propose(cmd)
}
