package broker

import (
	"slices"
	"testing"

	"github.com/gpupool/gpupool/broker/state"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

func TestAHostThatComesBackWaitsForTheTeardownOfLeasesFreedWhileItWasAway(t *testing.T) {
	st := state.New()
	w := st.Write()
	down := &gpupoolv1.Host{Id: "h1", Status: gpupoolv1.HostStatus_HOST_STATUS_DOWN, StatusChangedAtMs: 100}
	w.PutHost(down)
	lease := func(id string, st gpupoolv1.LeaseState, at int64, reason string) {
		w.PutLease(&gpupoolv1.Lease{Id: id, State: st, StateChangedAtMs: at, Reason: reason,
			Slices: []*gpupoolv1.Slice{{Host: "h1", Device: "GPU-1", MemoryMib: 1024}}})
	}
	lockDelay := "host h1 down: no heartbeat; capacity freed after the lock-delay of 6s: " + unconfirmedFreeReason
	lease("freed-while-away", gpupoolv1.LeaseState_LEASE_STATE_REVOKED, 150, lockDelay)
	lease("freed-before-it-went-down", gpupoolv1.LeaseState_LEASE_STATE_REVOKED, 50, lockDelay)
	lease("confirmed", gpupoolv1.LeaseState_LEASE_STATE_RELEASED, 150, "released by the holder; agent confirmed teardown")
	lease("still-releasing", gpupoolv1.LeaseState_LEASE_STATE_RELEASING, 150, "host h1 down")
	w.Commit(1)
	r := st.Read()

	if got := awaitingTeardown(r, down, &gpupoolv1.HeartbeatRequest{}); !slices.Equal(got, []string{"freed-while-away"}) {
		t.Fatalf("before the agent confirms: got %v, want [freed-while-away]", got)
	}
	var listed []string
	for _, a := range teardownOfFreed(r, down) {
		listed = append(listed, a.LeaseId)
	}
	if !slices.Equal(listed, []string{"freed-while-away"}) {
		t.Fatalf("teardown listed: got %v, want [freed-while-away]", listed)
	}
	if got := awaitingTeardown(r, down, &gpupoolv1.HeartbeatRequest{TornDown: []string{"freed-while-away"}}); len(got) != 0 {
		t.Fatalf("once the agent confirms: got %v, want none", got)
	}
	ready := &gpupoolv1.Host{Id: "h1", Status: gpupoolv1.HostStatus_HOST_STATUS_READY, StatusChangedAtMs: 200}
	if got := awaitingTeardown(r, ready, &gpupoolv1.HeartbeatRequest{}); len(got) != 0 {
		t.Fatalf("a ready host: got %v, want none", got)
	}
}
