package fsm

import (
	"bytes"
	"io"
	"testing"

	"github.com/gpupool/gpupool/broker/placement"
)

// rebuilt is the dump of an index built afresh from f's state.
func rebuilt(f *FSM) string {
	return placement.NewIndex(f.State().HostsWithDevices(), nil).Dump()
}

func TestThePoolIndexFollowsEveryAppliedChange(t *testing.T) {
	f := New(nil)
	log := testLog()
	for i := range log {
		applyAll(t, f, log[i:i+1])
		if got, want := f.PoolIndex().Dump(), rebuilt(f); got != want {
			t.Fatalf("after command %d (%T): index kept up to date:\n%s\nwant the one rebuilt from the state:\n%s", i, log[i], got, want)
		}
	}
	if f.PoolIndex().Len() != 2 {
		t.Errorf("got %d hosts indexed, want 2", f.PoolIndex().Len())
	}
}

func TestARestoreRebuildsThePoolIndex(t *testing.T) {
	f := New(nil)
	applyAll(t, f, testLog())
	snap := snapshotBytes(t, f)
	for _, tc := range []struct {
		name string
		into *FSM
	}{
		{"into a new FSM", New(nil)},
		{"into an FSM that held another pool", func() *FSM {
			g := New(nil)
			applyAll(t, g, testLog()[:5])
			return g
		}()},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if err := tc.into.Restore(io.NopCloser(bytes.NewReader(snap))); err != nil {
				t.Fatal(err)
			}
			if got, want := tc.into.PoolIndex().Dump(), f.PoolIndex().Dump(); got != want {
				t.Errorf("restored index:\n%s\nwant the one kept up to date before the snapshot:\n%s", got, want)
			}
		})
	}
}
