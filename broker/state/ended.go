package state

import (
	"encoding/binary"
	"fmt"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// Ended leases (released, expired or revoked) stay in the state until the
// leader collects them (CollectEndedLeases), so that a holder can still
// read how its lease ended and a retry of its request still finds it. The
// ended index orders them by when they ended, oldest first, so that the
// leader finds what to collect without reading the leases that live.

const indexEnded = "ended"

// Ended reports whether a lease in state s has ended: released, expired or
// revoked. An ended lease holds nothing and never changes again.
func Ended(s gpupoolv1.LeaseState) bool {
	switch s {
	case gpupoolv1.LeaseState_LEASE_STATE_RELEASED, gpupoolv1.LeaseState_LEASE_STATE_EXPIRED, gpupoolv1.LeaseState_LEASE_STATE_REVOKED:
		return true
	}
	return false
}

// endedIndex indexes an ended lease under the time it ended (its
// state_changed_at_ms, big-endian, so that the radix order is the time
// order) followed by its id; it holds no other lease.
type endedIndex struct{}

func (endedIndex) FromObject(obj any) (bool, []byte, error) {
	l, ok := obj.(*gpupoolv1.Lease)
	if !ok {
		return false, nil, fmt.Errorf("state: ended lease index: got %T", obj)
	}
	if !Ended(l.State) {
		return false, nil, nil
	}
	key := binary.BigEndian.AppendUint64(make([]byte, 0, 8+len(l.Id)+1), uint64(max(l.StateChangedAtMs, 0)))
	return true, append(append(key, l.Id...), 0), nil
}

func (endedIndex) FromArgs(args ...any) ([]byte, error) {
	if len(args) != 0 {
		return nil, fmt.Errorf("state: the ended lease index is read whole, got %d args", len(args))
	}
	return nil, nil
}

// EndedLeases calls fn with the ended leases, oldest end first (ties by
// id), until fn returns false.
func (r *Reader) EndedLeases(fn func(l *gpupoolv1.Lease) bool) {
	it, err := r.txn.Get(tableLeases, indexEnded)
	if err != nil {
		panic(fmt.Sprintf("state: %s.%s: %v", tableLeases, indexEnded, err))
	}
	for obj := it.Next(); obj != nil; obj = it.Next() {
		if !fn(obj.(*gpupoolv1.Lease)) {
			return
		}
	}
}

// DeleteLease removes a lease from every table and index.
func (w *Writer) DeleteLease(l *gpupoolv1.Lease) {
	if err := w.txn.Delete(tableLeases, l); err != nil {
		panic(fmt.Sprintf("state: delete lease %s: %v", l.Id, err))
	}
}

// HoldingExtras reports whether an extra-slice lease of parentID has not
// ended yet. An ended elastic lease stays in the state while one of its
// extras has not ended: the extra names it as its parent.
func (r *Reader) HoldingExtras(parentID string) bool {
	it, err := r.txn.Get(tableLeases, indexParent, parentID)
	if err != nil {
		panic(fmt.Sprintf("state: %s.%s: %v", tableLeases, indexParent, err))
	}
	for obj := it.Next(); obj != nil; obj = it.Next() {
		if !Ended(obj.(*gpupoolv1.Lease).State) {
			return true
		}
	}
	return false
}

// Collectable reports whether an ended lease may leave the state: it has
// ended and none of its extras is still live.
func (r *Reader) Collectable(l *gpupoolv1.Lease) bool {
	return Ended(l.State) && !r.HoldingExtras(l.Id)
}
