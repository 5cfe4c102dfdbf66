package broker

import (
	"slices"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// The lock rule (doc.go): the queue decides and proposes under placeMu and
// waits for the commit outside it, as Acquire does, with what it proposed
// in flight.
func TestAnAcquireNeitherWaitsForTheQueuesGrantToCommitNorTakesItsRoom(t *testing.T) {
	ts := startServer(t)
	ts.registerHost(t, "h1", 1, 81920)
	beat := ts.heartbeater(t, "h1")
	full := ts.acquire(t, whole(1))
	w := ts.wait(t, "w", whole(1), time.Hour)
	pending := ts.byRequest("", "w").Id
	release := ts.faults.hold(t, func(cmd proto.Message) bool {
		g, ok := cmd.(*gpupoolv1.GrantLeaseCommand)
		return ok && g.Lease.Id == pending
	})

	ts.release(t, beat, full.Id)
	waitFor(t, "the queue's grant of w in flight", func() bool {
		return slices.ContainsFunc(ts.s.capacity.grants.snapshot(), func(l *gpupoolv1.Lease) bool { return l.Id == pending })
	})
	// The grant has not committed: an Acquire is answered now (the queue
	// does not hold placeMu), and finds the room taken by w.
	_, err := ts.c.Lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: whole(1)})
	if status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("acquire while the queue's grant commits: got %v, want ResourceExhausted", err)
	}
	if got := ts.leaseState(pending); got != gpupoolv1.LeaseState_LEASE_STATE_PENDING {
		t.Fatalf("w before its grant commits: got %v, want pending", got)
	}

	release()
	if l := w.granted(t); l.Id != pending {
		t.Fatalf("w granted as %s, want its pending lease %s", l.Id, pending)
	}
}
