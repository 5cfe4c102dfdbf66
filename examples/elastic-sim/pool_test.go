package main

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

const (
	guaranteedClass  = gpupoolv1.LeaseClass_LEASE_CLASS_GUARANTEED
	preemptibleClass = gpupoolv1.LeaseClass_LEASE_CLASS_PREEMPTIBLE
)

// exclusive returns n whole-GPU slices.
func exclusive(n int) []*gpupoolv1.Slice {
	ss := make([]*gpupoolv1.Slice, n)
	for i := range ss {
		ss[i] = &gpupoolv1.Slice{Host: "host-1", DeviceIndex: int32(i), Exclusive: true, ComputePercent: 100}
	}
	return ss
}

// shared returns slices of the given compute shares.
func shared(percents ...int32) []*gpupoolv1.Slice {
	ss := make([]*gpupoolv1.Slice, len(percents))
	for i, p := range percents {
		ss[i] = &gpupoolv1.Slice{Host: "host-2", DeviceIndex: int32(i), ComputePercent: p}
	}
	return ss
}

func lease(id, parent string, class gpupoolv1.LeaseClass, ss []*gpupoolv1.Slice) *gpupoolv1.Lease {
	return &gpupoolv1.Lease{Id: id, Parent: parent, Class: class, Slices: ss}
}

func TestOtherGuaranteedGPUsCountsTheLoadTheJobMakesRoomFor(t *testing.T) {
	tests := []struct {
		name   string
		leases []*gpupoolv1.Lease
		own    string
		want   float64
	}{
		{"an empty pool has no load", nil, parentID, 0},
		{"an exclusive slice counts as a whole GPU", []*gpupoolv1.Lease{
			lease("l-batch", "", guaranteedClass, exclusive(6)),
		}, parentID, 6},
		{"a shared slice counts its compute share", []*gpupoolv1.Lease{
			lease("l-a", "", guaranteedClass, shared(25, 50)),
			lease("l-b", "", guaranteedClass, shared(30)),
		}, parentID, 1.05},
		{"an exclusive slice counts whole whatever its compute says", []*gpupoolv1.Lease{
			lease("l-a", "", guaranteedClass, []*gpupoolv1.Slice{{Exclusive: true, ComputePercent: 40}}),
		}, parentID, 1},
		{"the job's own lease is left out", []*gpupoolv1.Lease{
			lease(parentID, "", guaranteedClass, shared(50, 50)),
			lease("l-batch", "", guaranteedClass, exclusive(1)),
		}, parentID, 1},
		{"the job's extras are left out, whatever their class", []*gpupoolv1.Lease{
			lease("l-e1", parentID, preemptibleClass, shared(50)),
			lease("l-e2", parentID, guaranteedClass, shared(50)),
			lease("l-batch", "", guaranteedClass, exclusive(2)),
		}, parentID, 2},
		{"preemptible leases are left out, another elastic lease's extras among them", []*gpupoolv1.Lease{
			lease("l-spot", "", preemptibleClass, exclusive(3)),
			lease("l-other", "", guaranteedClass, shared(25)),
			lease("l-other-e1", "l-other", preemptibleClass, shared(25)),
		}, parentID, 0.25},
		{"an unspecified class counts, as the brokers treat it as guaranteed", []*gpupoolv1.Lease{
			lease("l-old", "", gpupoolv1.LeaseClass_LEASE_CLASS_UNSPECIFIED, exclusive(1)),
		}, parentID, 1},
		{"a lease with no slices adds nothing", []*gpupoolv1.Lease{
			lease("l-empty", "", guaranteedClass, nil), nil,
		}, parentID, 0},
		{"with no own lease every guaranteed lease counts", []*gpupoolv1.Lease{
			lease("l-a", "", guaranteedClass, exclusive(1)),
			lease("l-b", "", guaranteedClass, shared(50)),
		}, "", 1.5},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := otherGuaranteedGPUs(tt.leases, tt.own); got != tt.want {
				t.Errorf("got %v GPUs, want %v", got, tt.want)
			}
		})
	}
}

// fakeList answers a poolWatch's listings from its fields.
type fakeList struct {
	leases []*gpupoolv1.Lease
	err    error
	calls  int
}

func (f *fakeList) list(ctx context.Context) ([]*gpupoolv1.Lease, error) {
	f.calls++
	if _, ok := ctx.Deadline(); !ok {
		return nil, errors.New("listed without a deadline")
	}
	return f.leases, f.err
}

func TestPoolWatchKeepsTheLastReadingAndWarnsOnce(t *testing.T) {
	f := &fakeList{}
	w := newPoolWatch(parentID, time.Second, f.list)
	ctx := context.Background()

	if _, known := w.last(); known {
		t.Fatal("got a known reading before any listing, want none")
	}

	f.leases = []*gpupoolv1.Lease{lease("l-batch", "", guaranteedClass, exclusive(6)), lease(parentID, "", guaranteedClass, shared(50))}
	w.poll(ctx)
	if gpus, known := w.last(); gpus != 6 || !known {
		t.Fatalf("got %v GPUs (known %v), want 6 known", gpus, known)
	}
	if msg := w.warning(); msg != "" {
		t.Errorf("got warning %q after a listing that worked, want none", msg)
	}

	f.err = status.Error(codes.Unavailable, "no leader")
	w.poll(ctx)
	w.poll(ctx)
	select {
	case <-w.updated():
	default:
		t.Error("updated was not told of the listings, want it told")
	}
	if gpus, known := w.last(); gpus != 6 || !known {
		t.Errorf("got %v GPUs (known %v) after failures, want the last reading, 6", gpus, known)
	}
	if msg := w.warning(); !strings.Contains(msg, "no leader") {
		t.Errorf("got warning %q, want one naming the failure, no leader", msg)
	}
	w.poll(ctx)
	if msg := w.warning(); msg != "" {
		t.Errorf("got a second warning %q, want the first failure reported only", msg)
	}

	f.err, f.leases = nil, nil
	w.poll(ctx)
	if gpus, known := w.last(); gpus != 0 || !known {
		t.Errorf("got %v GPUs (known %v) once the load left, want 0 known", gpus, known)
	}
	if f.calls != 5 {
		t.Errorf("got %d listings, want one a poll, 5", f.calls)
	}
}

func TestAListingCutShortByStopIsNoFailure(t *testing.T) {
	w := newPoolWatch(parentID, time.Second, func(ctx context.Context) ([]*gpupoolv1.Lease, error) {
		return nil, ctx.Err()
	})
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	w.poll(ctx)
	if msg := w.warning(); msg != "" {
		t.Errorf("got warning %q for a listing cancelled by stop, want none", msg)
	}
	if _, known := w.last(); known {
		t.Error("got a known reading from a cancelled listing, want none")
	}
}

func TestRefreshNeverBlocks(t *testing.T) {
	w := newPoolWatch(parentID, time.Second, (&fakeList{}).list)
	// Nothing is listing: the first refresh is held, the rest add nothing.
	for range 3 {
		w.refresh()
	}
	if n := len(w.due); n != 1 {
		t.Errorf("got %d listings asked for, want 1", n)
	}
}

func TestPoolWatchListsWhenAskedAndTellsWhenItHasARead(t *testing.T) {
	f := &fakeList{leases: []*gpupoolv1.Lease{lease("l-batch", "", guaranteedClass, exclusive(2))}}
	w := newPoolWatch(parentID, time.Second, f.list)
	stop := w.start(context.Background())
	t.Cleanup(stop)
	w.refresh()
	<-w.updated()
	if gpus, known := w.last(); gpus != 2 || !known {
		t.Errorf("got %v GPUs (known %v), want 2 known", gpus, known)
	}
}
