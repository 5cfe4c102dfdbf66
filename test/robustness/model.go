package robustness

import (
	"cmp"
	"fmt"
	"hash/fnv"
	"slices"
	"strings"

	"github.com/anishathalye/porcupine"
)

// OpKind is the kind of a recorded client operation.
type OpKind int

const (
	OpAcquire OpKind = iota
	OpRelease
	OpKeepAlive
	OpGet
	// OpEnd is not a client call: it is a lease's expiry or revocation, as
	// the final lease table dates it, put in the history so that the model
	// frees its capacity.
	OpEnd
	// OpExpiry is not a client call either: it is the instant an expired
	// lease's expiry was decided (the final table's date of it, rounded
	// up to the next millisecond). No renewal may be acknowledged after
	// it; reads and releases are not held to it, since the expiry takes
	// effect only once it commits.
	OpExpiry
)

func (k OpKind) String() string {
	return [...]string{"acquire", "release", "keepalive", "get", "end", "expiry"}[k]
}

// Lease states as the model sees them.
const (
	stActive   = "active"   // granted, not yet released or ended
	stReleased = "released" // its release was acknowledged
	stEnded    = "ended"    // expired or revoked by the brokers
)

// Input is one operation's call.
type Input struct {
	Kind    OpKind
	Lease   string
	Device  string
	Memory  int64 // acquire: MiB granted
	Compute int32 // acquire: percent granted
	Fence   uint64
}

// Output is one operation's answer. Outcome is "ok" or what the lease
// was seen as: "granted", "released" (its holder released it), "ended"
// (expired or revoked), "missing" (not found).
type Output struct {
	Outcome string
	Fence   uint64 // get: the lease's fencing token
}

// deviceState is the model's state for one device: its leases by id,
// and the highest fencing token granted on it.
type deviceState struct {
	leases   []leaseEntry // sorted by id
	maxFence uint64
}

type leaseEntry struct {
	id      string
	memory  int64
	compute int32
	fence   uint64
	state   string
	expired bool // its expiry was decided: no renewal may succeed
}

func (s deviceState) find(id string) int {
	i, ok := slices.BinarySearchFunc(s.leases, id, func(e leaseEntry, id string) int { return cmp.Compare(e.id, id) })
	if !ok {
		return -1
	}
	return i
}

func (s deviceState) with(e leaseEntry) deviceState {
	out := deviceState{leases: slices.Clone(s.leases), maxFence: s.maxFence}
	if i := s.find(e.id); i >= 0 {
		out.leases[i] = e
		return out
	}
	i, _ := slices.BinarySearchFunc(out.leases, e.id, func(e leaseEntry, id string) int { return cmp.Compare(e.id, id) })
	out.leases = slices.Insert(out.leases, i, e)
	return out
}

// LeaseModel is the sequential specification of one device's leases,
// checked per device (a lease holds one slice of one device, so the
// devices' histories are independent). It holds that
//   - the active leases of a device never need more than its memory or
//     100% of its compute;
//   - each grant on a device carries a higher fencing token than every
//     grant before it;
//   - a granted lease is seen granted, with its fencing token, until its
//     release is acknowledged or the brokers end it;
//   - an acknowledged release is durable: the lease is never again seen
//     granted nor renewed, and never ends any other way;
//   - no renewal is acknowledged after the lease's expiry was decided
//     (a renewal that started after it must fail, wherever it was sent:
//     a leader cut off from its quorum renews nothing).
//
// The brokers may end a lease on their own (TTL, host down); the model
// accepts that whenever an answer shows it. It frees a lease's capacity
// when its release is acknowledged, which is earlier than the brokers
// free it (after the agent confirms), so the model is permissive there
// and never reports an over-commit that did not happen.
func LeaseModel(memoryMiB int64) porcupine.Model {
	return porcupine.Model{
		Init: func() any { return deviceState{} },
		Step: func(st, in, out any) (bool, any) {
			return step(memoryMiB, st.(deviceState), in.(Input), out.(Output))
		},
		Equal: func(a, b any) bool {
			x, y := a.(deviceState), b.(deviceState)
			return x.maxFence == y.maxFence && slices.Equal(x.leases, y.leases)
		},
		Hash: func(st any) uint64 {
			h := fnv.New64a()
			s := st.(deviceState)
			fmt.Fprint(h, s.maxFence)
			for _, e := range s.leases {
				fmt.Fprint(h, e.id, e.state, e.expired)
			}
			return h.Sum64()
		},
		DescribeOperation: func(in, out any) string {
			i, o := in.(Input), out.(Output)
			switch i.Kind {
			case OpAcquire:
				return fmt.Sprintf("acquire %s %dMiB/%d%% fence %d", i.Lease, i.Memory, i.Compute, i.Fence)
			case OpGet:
				return fmt.Sprintf("get %s → %s fence %d", i.Lease, o.Outcome, o.Fence)
			}
			return fmt.Sprintf("%s %s → %s", i.Kind, i.Lease, o.Outcome)
		},
		DescribeState: func(st any) string {
			s := st.(deviceState)
			var b strings.Builder
			var mem int64
			var comp int32
			for _, e := range s.leases {
				if e.state == stActive {
					mem += e.memory
					comp += e.compute
				}
			}
			fmt.Fprintf(&b, "%d/%d MiB, %d%%, max fence %d; ", mem, memoryMiB, comp, s.maxFence)
			for _, e := range s.leases {
				fmt.Fprintf(&b, "%s:%s ", e.id, e.state)
			}
			return b.String()
		},
	}
}

func step(capacity int64, s deviceState, in Input, out Output) (bool, any) {
	i := s.find(in.Lease)
	var e leaseEntry
	if i >= 0 {
		e = s.leases[i]
	}
	switch in.Kind {
	case OpAcquire:
		if i >= 0 || in.Fence <= s.maxFence {
			return false, s
		}
		mem, comp := in.Memory, in.Compute
		for _, l := range s.leases {
			if l.state == stActive {
				mem += l.memory
				comp += l.compute
			}
		}
		if mem > capacity || comp > 100 {
			return false, s
		}
		ns := s.with(leaseEntry{id: in.Lease, memory: in.Memory, compute: in.Compute, fence: in.Fence, state: stActive})
		ns.maxFence = in.Fence
		return true, ns
	}
	if i < 0 {
		return false, s // every other operation follows its lease's grant
	}
	switch in.Kind {
	case OpRelease:
		switch {
		case out.Outcome == "released" && e.state != stEnded:
			e.state = stReleased
		case out.Outcome == "ended" && e.state != stReleased:
			e.state = stEnded
		default:
			return false, s
		}
		return true, s.with(e)
	case OpKeepAlive:
		switch out.Outcome {
		case "ok":
			return e.state == stActive && !e.expired, s
		case "released", "ended": // the renewal failed: no longer granted
			if e.state == stActive {
				e.state = stEnded
			}
			return true, s.with(e)
		}
		return false, s
	case OpGet:
		if out.Fence != e.fence {
			return false, s
		}
		switch out.Outcome {
		case "granted":
			return e.state == stActive, s
		case "released":
			return e.state == stReleased, s
		case "ended":
			if e.state == stReleased {
				return false, s
			}
			e.state = stEnded
			return true, s.with(e)
		}
		return false, s
	case OpExpiry:
		e.expired = true
		return true, s.with(e)
	case OpEnd:
		if e.state == stReleased {
			return false, s
		}
		e.state = stEnded
		return true, s.with(e)
	}
	return false, s
}
