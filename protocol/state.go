package protocol

import gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"

// LeaseEnded reports whether a lease in state s has ended: released,
// expired or revoked. An ended lease holds nothing and never changes
// again.
func LeaseEnded(s gpupoolv1.LeaseState) bool {
	switch s {
	case gpupoolv1.LeaseState_LEASE_STATE_RELEASED, gpupoolv1.LeaseState_LEASE_STATE_EXPIRED, gpupoolv1.LeaseState_LEASE_STATE_REVOKED:
		return true
	}
	return false
}
