package broker

import (
	"fmt"
	"slices"
	"strings"

	"github.com/gpupool/gpupool/broker/state"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// No second holder. While a host is down, the leader frees its released,
// expired and revoked leases after the lock-delay without its agent's
// confirmation (lockDelayPassed): the agent may still run them. When the
// host comes back, its agent must confirm that every lease freed that
// way is torn down before the host is ready again: until then the host
// stays down, so none of those slices is granted again, and the
// heartbeat responses list those leases for teardown. The leases are
// read from the state (ended, freed after the lock-delay, after the host
// went down), so a new leader picks the rule up where the old one was.
// A registration of such a host is answered without being applied (it
// would make the host ready in the same Raft entry): the host keeps its
// earlier record until its heartbeats confirm the teardowns.

// unconfirmedFreeReason ends the reason of a lease freed after the
// lock-delay; unconfirmedFrees finds those leases by it.
const unconfirmedFreeReason = "the agent could not confirm teardown"

// unconfirmedFrees are the leases of down host h freed after the
// lock-delay, without its agent's confirmation, since h went down.
func unconfirmedFrees(st *state.Reader, h *gpupoolv1.Host) []*gpupoolv1.Lease {
	if h.Status != gpupoolv1.HostStatus_HOST_STATUS_DOWN {
		return nil
	}
	// The host index holds only leases that hold capacity: scan them all.
	// Only a down host's heartbeats get here, which are rare.
	var out []*gpupoolv1.Lease
	for _, l := range st.Leases() {
		if ended(l.State) && l.StateChangedAtMs >= h.StatusChangedAtMs && strings.HasSuffix(l.Reason, unconfirmedFreeReason) &&
			slices.Contains(state.LeaseHosts(l), h.Id) {
			out = append(out, l)
		}
	}
	return out
}

// awaitingTeardown lists the leases of unconfirmedFrees(h) that the
// heartbeat req does not confirm torn down; the host may be ready again
// once it is empty.
func awaitingTeardown(st *state.Reader, h *gpupoolv1.Host, req *gpupoolv1.HeartbeatRequest) []string {
	var out []string
	for _, l := range unconfirmedFrees(st, h) {
		if !slices.Contains(req.GetTornDown(), l.Id) {
			out = append(out, l.Id)
		}
	}
	return out
}

// teardownOfFreed are the teardown assignments of the leases host h's
// agent must confirm before h is ready again.
func teardownOfFreed(st *state.Reader, h *gpupoolv1.Host) []*gpupoolv1.Assignment {
	var out []*gpupoolv1.Assignment
	for _, l := range unconfirmedFrees(st, h) {
		a := &gpupoolv1.Assignment{LeaseId: l.Id, FencingToken: l.FencingToken, State: l.State, Tenant: l.Tenant, Holder: l.Holder, TtlMs: l.TtlMs}
		for _, sl := range l.Slices {
			if sl.Host == h.Id {
				a.Slices = append(a.Slices, sl)
			}
		}
		out = append(out, a)
	}
	return out
}

// keptDown reports whether host id is down with leases freed while it
// was away that its agent has not confirmed torn down: its registration
// must not make it ready.
func keptDown(st *state.Reader, id string) bool {
	h := st.Host(id)
	return h != nil && len(unconfirmedFrees(st, h)) > 0
}

// stillAwaitingMsg is the log line of a host kept down.
func stillAwaitingMsg(ids []string) string {
	return fmt.Sprintf("host back, kept down until its agent confirms teardown of %d lease(s) freed while it was away: %s",
		len(ids), strings.Join(ids, ", "))
}
