package state

import (
	"fmt"
	"slices"

	"github.com/hashicorp/go-memdb"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// Indexes for the pending queue, elastic leases and preemption. Each is
// sparse: it holds only the leases it finds (memdb's ConditionalIndex
// would hold every lease, under false), so a pool without queued, elastic
// or preempted leases pays nothing for them, in memory or on writes.
const (
	indexPending   = "pending"
	indexElastic   = "elastic_granted"
	indexParent    = "parent"
	indexPreempted = "preempted_for"
	indexVictims   = "preemptible"
)

func queueIndexes() map[string]*memdb.IndexSchema {
	return map[string]*memdb.IndexSchema{
		indexPending: {Name: indexPending, AllowMissing: true, Indexer: leaseSubset(func(l *gpupoolv1.Lease) bool {
			return l.State == gpupoolv1.LeaseState_LEASE_STATE_PENDING
		})},
		indexElastic: {Name: indexElastic, AllowMissing: true, Indexer: leaseSubset(func(l *gpupoolv1.Lease) bool {
			return l.State == gpupoolv1.LeaseState_LEASE_STATE_GRANTED && l.GetRequest().GetElasticMax() > 0
		})},
		indexVictims: {Name: indexVictims, AllowMissing: true, Indexer: leaseSubset(func(l *gpupoolv1.Lease) bool {
			return l.State == gpupoolv1.LeaseState_LEASE_STATE_GRANTED && l.Class == gpupoolv1.LeaseClass_LEASE_CLASS_PREEMPTIBLE && l.PreemptAtMs == 0
		})},
		indexParent:    {Name: indexParent, AllowMissing: true, Indexer: &memdb.StringFieldIndex{Field: "Parent"}},
		indexPreempted: {Name: indexPreempted, AllowMissing: true, Indexer: &memdb.StringFieldIndex{Field: "PreemptedFor"}},
	}
}

// leaseSubset indexes the leases for which in is true, and only those:
// read it with the argument true.
type leaseSubset func(l *gpupoolv1.Lease) bool

func (in leaseSubset) FromObject(obj any) (bool, []byte, error) {
	l, ok := obj.(*gpupoolv1.Lease)
	if !ok {
		return false, nil, fmt.Errorf("state: lease subset index: got %T", obj)
	}
	if !in(l) {
		return false, nil, nil
	}
	return true, []byte{1}, nil
}

func (leaseSubset) FromArgs(args ...any) ([]byte, error) {
	if len(args) != 1 || args[0] != true {
		return nil, fmt.Errorf("state: a lease subset index is read with the one argument true, got %v", args)
	}
	return []byte{1}, nil
}

// PendingLeases returns the queue in order: higher priority first, then
// arrival (the Raft index of the enqueue).
func (r *Reader) PendingLeases() []*gpupoolv1.Lease {
	ls := all[gpupoolv1.Lease](r, tableLeases, indexPending, true)
	slices.SortFunc(ls, QueueOrder)
	return ls
}

// QueueOrder orders pending leases: higher priority first, then arrival.
func QueueOrder(a, b *gpupoolv1.Lease) int {
	if a.Priority != b.Priority {
		return int(b.Priority) - int(a.Priority)
	}
	switch {
	case a.CreateIndex < b.CreateIndex:
		return -1
	case a.CreateIndex > b.CreateIndex:
		return 1
	}
	return 0
}

// ElasticLeases returns the granted elastic leases, by id.
func (r *Reader) ElasticLeases() []*gpupoolv1.Lease {
	return all[gpupoolv1.Lease](r, tableLeases, indexElastic, true)
}

// Extras returns the extra-slice leases of an elastic lease, in any state,
// oldest first.
func (r *Reader) Extras(parentID string) []*gpupoolv1.Lease {
	ls := all[gpupoolv1.Lease](r, tableLeases, indexParent, parentID)
	slices.SortFunc(ls, func(a, b *gpupoolv1.Lease) int { return int(a.CreateIndex) - int(b.CreateIndex) })
	return ls
}

// PreemptedFor returns the leases preempted to make room for a pending
// lease that still hold capacity.
func (r *Reader) PreemptedFor(pendingID string) []*gpupoolv1.Lease {
	return slices.DeleteFunc(all[gpupoolv1.Lease](r, tableLeases, indexPreempted, pendingID),
		func(l *gpupoolv1.Lease) bool { return !Holding(l.State) })
}

// Preemptible returns the granted preemptible leases not yet preempted, by
// id: the leases a guaranteed request may preempt.
func (r *Reader) Preemptible() []*gpupoolv1.Lease {
	return all[gpupoolv1.Lease](r, tableLeases, indexVictims, true)
}
