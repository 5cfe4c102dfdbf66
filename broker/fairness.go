package broker

import (
	"context"
	"sync"

	"google.golang.org/grpc/peer"
)

// acquiresPerCaller is how many Acquire calls of one caller may wait for
// or hold placeMu at once; the caller's further calls wait their turn
// behind its own, so that a burst from one caller queues behind its own
// calls, not in front of everyone else's. A call gives its turn back with
// placeMu, before its grant commits: how many grants a caller has
// committing at once is not limited, so they still share commits.
const acquiresPerCaller = 16

// maxStreamsPerConn is how many calls one connection may have open on a
// broker at once (HTTP/2's SETTINGS_MAX_CONCURRENT_STREAMS): a client
// sending more waits in its own gRPC transport for one of its calls to end,
// instead of handing the broker thousands of calls to decode and hold.
// Far above what a process needs (each Watch, heartbeat stream and call
// in flight is one; the benchmark's 256 clients share one connection).
const maxStreamsPerConn = 1024

// callerGate bounds the Acquire calls each caller has in placement at
// once (acquiresPerCaller). A caller is its ACL token, or without ACL the
// connection it calls on.
type callerGate struct {
	mu    sync.Mutex
	slots map[string]*callerSlots // guarded by mu; caller -> its slots while it has calls
}

type callerSlots struct {
	sem   chan struct{}
	users int // guarded by callerGate.mu; calls holding or waiting for a slot
}

func newCallerGate() *callerGate {
	return &callerGate{slots: map[string]*callerSlots{}}
}

// enter waits for one of the caller's slots and returns the function that
// gives it back, or ctx's error if ctx ends first.
func (g *callerGate) enter(ctx context.Context, caller string) (leave func(), err error) {
	g.mu.Lock()
	s := g.slots[caller]
	if s == nil {
		s = &callerSlots{sem: make(chan struct{}, acquiresPerCaller)}
		g.slots[caller] = s
	}
	s.users++
	g.mu.Unlock()
	done := func() {
		g.mu.Lock()
		if s.users--; s.users == 0 {
			delete(g.slots, caller)
		}
		g.mu.Unlock()
	}
	select {
	case s.sem <- struct{}{}:
		return func() { <-s.sem; done() }, nil
	case <-ctx.Done():
		done()
		return nil, ctx.Err()
	}
}

// gateKey names the caller of ctx for the gate: its ACL token, else the
// address it calls from (one connection of a client), else "".
func gateKey(ctx context.Context) string {
	if c := callerFrom(ctx); c.token != nil {
		return "token:" + c.token.AccessorId
	}
	if p, ok := peer.FromContext(ctx); ok && p.Addr != nil {
		return "conn:" + p.Addr.String()
	}
	return ""
}
