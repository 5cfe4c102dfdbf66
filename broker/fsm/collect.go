package fsm

import (
	"fmt"

	"github.com/gpupool/gpupool/broker/state"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// MaxCollectedPerCommand bounds the lease ids of one CollectEndedLeases
// command, so that one log entry stays small and one Apply short.
const MaxCollectedPerCommand = 1024

// applyCollectEndedLeases removes the named leases that ended at or before
// the command's cutoff. A lease that is unknown, has not ended, ended
// after the cutoff, or is the parent of an extra that still holds
// capacity is skipped: the leader chose the ids from a state that may
// have changed since, and Apply decides from the state alone. Audit
// entries are kept: they live in their own tables.
func applyCollectEndedLeases(w *state.Writer, c *gpupoolv1.CollectEndedLeasesCommand) *Result {
	if len(c.LeaseIds) == 0 || len(c.LeaseIds) > MaxCollectedPerCommand {
		return &Result{Err: fmt.Errorf("%w: collect %d leases: must be between 1 and %d", ErrInvalid, len(c.LeaseIds), MaxCollectedPerCommand)}
	}
	if c.EndedAtOrBeforeMs <= 0 {
		return &Result{Err: fmt.Errorf("%w: collect ended leases: cutoff %d ms: must be a time after the epoch", ErrInvalid, c.EndedAtOrBeforeMs)}
	}
	n := 0
	for _, id := range c.LeaseIds {
		l := w.Lease(id)
		if l == nil || l.StateChangedAtMs > c.EndedAtOrBeforeMs || !w.Collectable(l) {
			continue
		}
		w.DeleteLease(l)
		n++
	}
	return &Result{Collected: n}
}
