// Package placement chooses where the slices of a lease go.
//
// Place is a pure function of the pool it is given: it reads hosts and their devices, never
// modifies them, and returns the same slices for the same inputs. The broker's leader calls it
// to build a grant; the FSM re-checks every slice with CheckSlice before it applies the grant
// with Allocate, so a stale placement is rejected rather than over-committing a GPU.
package placement

import (
	"fmt"
	"slices"
	"strings"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// Policy names.
const (
	// Binpack is the default: fill the fullest device (and host) that fits, to keep whole GPUs
	// free.
	Binpack = "binpack"
	// Spread picks the emptiest device (and host) that fits.
	Spread = "spread"
)

// Policies lists the policies Place accepts: those that need no options.
var Policies = []string{Binpack, Spread}

// Error explains why a request could not be placed.
type Error struct {
	// Never is true when the request cannot fit even if every lease were released and every
	// host and GPU were up (e.g. more memory than the largest matching GPU, more GPUs than the
	// pool has, no host matches the constraints). The broker maps Never to FailedPrecondition,
	// otherwise ResourceExhausted.
	Never bool
	// Reason is one human sentence, or a few joined by "; ".
	Reason string
}

// Error returns the Reason.
func (e *Error) Error() string { return e.Reason }

// Place chooses req.Count slices for req among hosts and returns them, sorted by host id and
// then device index.
//
// hosts carry their devices in Host.Devices, with the allocation fields filled
// (Device.AllocatedMemoryMib, AllocatedComputePercent, AllocatedExclusive, LeaseCount and
// Host.AllocatedCpuMillicores, AllocatedMemoryMib). Only ready, eligible hosts and devices that
// are not unhealthy receive slices.
//
// Place never modifies its inputs and is deterministic: the same inputs, in any host order,
// give the same slices. Applying the returned slices one after the other with CheckSlice and
// Allocate succeeds for every slice (two slices of one request may share a device).
//
// Constraints.Model is a shell glob, or several separated by "|" ("V100M16|V100M32"): a device
// matches when its model matches any of them.
//
// Place accepts the policies in Policies; PlaceWith accepts more. An unknown policy is a plain
// error. A request that does not fit is an *Error whose Never field says whether it could fit
// in an empty pool.
func Place(hosts []*gpupoolv1.Host, req *gpupoolv1.LeaseRequest, policy string) ([]*gpupoolv1.Slice, error) {
	if !slices.Contains(Policies, policy) {
		return nil, fmt.Errorf("policy %q: must be one of %s", policy, strings.Join(Policies, ", "))
	}
	return place(hosts, req, &Options{Policy: policy})
}

// place is Place and PlaceWith after the policy was checked.
func place(hosts []*gpupoolv1.Host, req *gpupoolv1.LeaseRequest, opts *Options) ([]*gpupoolv1.Slice, error) {
	if req == nil {
		return nil, &Error{Never: true, Reason: "empty lease request"}
	}
	rq, reason := newRequest(req, opts)
	if reason != "" {
		return nil, &Error{Never: true, Reason: reason}
	}

	now := newPool(hosts, rq, viewNow)
	defer now.free()
	if picks := now.search(); picks != nil {
		return now.slices(picks), nil
	}
	empty := newPool(hosts, rq, viewEmpty)
	defer empty.free()
	if empty.search() == nil {
		return nil, &Error{Never: true, Reason: explainNever(hosts, rq, empty)}
	}
	return nil, &Error{Reason: explainNow(hosts, rq, now)}
}

// slices turns picked candidates into slices sorted by host id, then device index.
func (p *pool) slices(picks []int) []*gpupoolv1.Slice {
	out := make([]*gpupoolv1.Slice, 0, len(picks))
	for _, i := range picks {
		c := &p.cands[i]
		out = append(out, &gpupoolv1.Slice{
			Host:           p.hosts[c.host].h.GetId(),
			Device:         c.d.GetUuid(),
			MemoryMib:      p.rq.sliceMem(c.d),
			ComputePercent: p.rq.sliceCompute(),
			Exclusive:      p.rq.exclusive,
			Model:          c.d.GetModel(),
			DeviceIndex:    c.d.GetIndex(),
		})
	}
	slices.SortStableFunc(out, func(a, b *gpupoolv1.Slice) int {
		if c := strings.Compare(a.GetHost(), b.GetHost()); c != 0 {
			return c
		}
		return int(a.GetDeviceIndex()) - int(b.GetDeviceIndex())
	})
	return out
}
