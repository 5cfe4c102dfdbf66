package broker

import (
	"errors"
	"testing"
	"time"

	"github.com/hashicorp/raft"
)

// neverFuture is a Raft future nobody answers: a command left in Raft's
// buffered apply channel when Raft shut down.
type neverFuture struct{ block chan struct{} }

func (f neverFuture) Error() error { <-f.block; return nil }

func TestWaitingOnAProposalEndsWithTheServer(t *testing.T) {
	for _, tc := range []struct {
		name    string
		answer  bool // the future is answered before the server stops
		wantErr error
	}{
		{"an answered proposal returns Raft's answer", true, nil},
		{"an unanswered proposal returns at shutdown", false, raft.ErrRaftShutdown},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := neverFuture{block: make(chan struct{})}
			stopped := make(chan struct{})
			got := make(chan error, 1)
			go func() { got <- waitFuture(f, stopped) }()
			if tc.answer {
				close(f.block)
			} else {
				close(stopped)
				t.Cleanup(func() { close(f.block) })
			}
			select {
			case err := <-got:
				if !errors.Is(err, tc.wantErr) && err != tc.wantErr {
					t.Fatalf("waitFuture: got %v, want %v", err, tc.wantErr)
				}
			case <-time.After(20 * time.Second):
				t.Fatal("waitFuture never returned")
			}
		})
	}
}
