package broker

import (
	"context"
	"log/slog"
	"sync"

	"github.com/gpupool/gpupool/broker/fsm"
)

// node is what every component of one broker shares: its configuration,
// its logger, the state it has applied, the log it proposes to, and its
// lifetime. It is built once, in New, before any component; proposer is
// set before the server serves and never changed.
//
// Every background goroutine of a broker starts through goFunc and ends
// when ctx is done: Shutdown cancels ctx, then waits for them all.
type node struct {
	cfg      Config
	log      *slog.Logger
	fsm      *fsm.FSM
	proposer Proposer

	// ctx is the server's lifetime: cancelled by Shutdown, or when the
	// server stops because a part of it failed (see fail).
	ctx    context.Context
	cancel context.CancelCauseFunc
	wg     sync.WaitGroup

	goMu   sync.Mutex
	closed bool // guarded by goMu; set by closeAndWait, after which goFunc tracks nothing
}

func newNode(cfg Config) *node {
	ctx, cancel := context.WithCancelCause(context.Background())
	return &node{
		cfg:    cfg,
		log:    cfg.Logger,
		fsm:    fsm.New(cfg.Logger, fsm.WithAuditSink(cfg.AuditSink)),
		ctx:    ctx,
		cancel: cancel,
	}
}

// goFunc runs f on a goroutine that Shutdown waits for. f must return
// once nd.ctx is done. Once Shutdown has begun waiting, f still runs
// (callers may wait for it to close a channel) but untracked: an RPC
// handler that grpc.Stop did not wait for may still call goFunc, and
// adding to the WaitGroup then would race Shutdown's Wait. nd.ctx is done
// by then, so f returns at once.
func (nd *node) goFunc(f func()) {
	nd.goMu.Lock()
	defer nd.goMu.Unlock()
	if nd.closed {
		go f()
		return
	}
	nd.wg.Add(1)
	go func() {
		defer nd.wg.Done()
		f()
	}()
}

// closeAndWait stops goFunc from starting goroutines and waits for those
// it started.
func (nd *node) closeAndWait() {
	nd.goMu.Lock()
	nd.closed = true
	nd.goMu.Unlock()
	nd.wg.Wait()
}

// nowMs is the server's clock now, as a command's NowMs.
func (nd *node) nowMs() int64 { return nd.cfg.Clock.Now().UnixMilli() }
