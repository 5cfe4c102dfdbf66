package state

import (
	"slices"

	"github.com/hashicorp/go-memdb"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// Indexes for the pending queue, elastic leases and preemption. Each is
// conditional or sparse, so a pool without queued, elastic or preempted
// leases pays nothing to read them.
const (
	indexPending   = "pending"
	indexElastic   = "elastic_granted"
	indexParent    = "parent"
	indexPreempted = "preempted_for"
	indexVictims   = "preemptible"
)

func queueIndexes() map[string]*memdb.IndexSchema {
	return map[string]*memdb.IndexSchema{
		indexPending: {Name: indexPending, Indexer: &memdb.ConditionalIndex{Conditional: func(obj any) (bool, error) {
			return obj.(*gpupoolv1.Lease).State == gpupoolv1.LeaseState_LEASE_STATE_PENDING, nil
		}}},
		indexElastic: {Name: indexElastic, Indexer: &memdb.ConditionalIndex{Conditional: func(obj any) (bool, error) {
			l := obj.(*gpupoolv1.Lease)
			return l.State == gpupoolv1.LeaseState_LEASE_STATE_GRANTED && l.GetRequest().GetElasticMax() > 0, nil
		}}},
		indexVictims: {Name: indexVictims, Indexer: &memdb.ConditionalIndex{Conditional: func(obj any) (bool, error) {
			l := obj.(*gpupoolv1.Lease)
			return l.State == gpupoolv1.LeaseState_LEASE_STATE_GRANTED && l.Class == gpupoolv1.LeaseClass_LEASE_CLASS_PREEMPTIBLE && l.PreemptAtMs == 0, nil
		}}},
		indexParent:    {Name: indexParent, AllowMissing: true, Indexer: &memdb.StringFieldIndex{Field: "Parent"}},
		indexPreempted: {Name: indexPreempted, AllowMissing: true, Indexer: &memdb.StringFieldIndex{Field: "PreemptedFor"}},
	}
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
