package broker

import (
	"context"
	"sync"
)

// leadVerifier confirms that this server still leads, for the renewals
// that the leader answers from its memory. hashicorp/raft has no leader
// lease to read, so each confirmation is a round of raft's VerifyLeader
// (a heartbeat that a quorum must acknowledge in this term); one round
// serves every renewal that waits on it.
//
// A renewal that calls Confirm is answered by a round that started after
// the call: renewals arriving while a round is in flight wait for the
// next one, so a round never vouches for a renewal it predates. Rounds
// run one at a time.
type leadVerifier struct {
	verify func() error // one round; nil error when a quorum acknowledged us
	start  func(func()) // runs the rounds' goroutine (the server's goFunc)

	mu      sync.Mutex
	running bool         // guarded by mu; a goroutine runs rounds
	next    *verifyRound // guarded by mu; the round the next verification serves
}

type verifyRound struct {
	waiters int // guarded by leadVerifier.mu while the round is next
	done    chan struct{}
	err     error // set before done closes
}

// newLeadVerifier returns a verifier whose rounds call verify, on a
// goroutine started with start.
func newLeadVerifier(verify func() error, start func(func())) *leadVerifier {
	return &leadVerifier{verify: verify, start: start}
}

// Confirm returns nil once a round of verification that started after the
// call confirmed leadership, the round's error if it did not, or ctx's
// error if ctx ends first.
func (v *leadVerifier) Confirm(ctx context.Context) error {
	v.mu.Lock()
	if v.next == nil {
		v.next = &verifyRound{done: make(chan struct{})}
	}
	r := v.next
	r.waiters++
	if !v.running {
		v.running = true
		v.start(v.run)
	}
	v.mu.Unlock()
	select {
	case <-r.done:
		return r.err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// run verifies round after round while renewals wait.
func (v *leadVerifier) run() {
	for {
		v.mu.Lock()
		r := v.next
		if r == nil {
			v.running = false
			v.mu.Unlock()
			return
		}
		v.next = nil
		v.mu.Unlock()
		r.err = v.verify()
		close(r.done)
	}
}
