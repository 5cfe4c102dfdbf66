package agent

import (
	"fmt"
	"maps"
	"slices"
	"strings"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// A slice is one lease's allocation on one GPU: the GPU's uuid plus the
// lease. Several slices share a fractional GPU; the fencing token of the
// grant orders them. The fence keeps, per slice, the newest fencing token
// the brokers assigned it and the capacity it holds.
//
// A token is fenced out on a slice when
//   - it is older than the newest token of that same slice, or
//   - newer slices on the same GPU hold capacity that leaves no room for
//     it: the GPU's capacity was granted again while this agent still
//     holds the older assignment (an exclusive slice leaves room for
//     nothing; memory and compute percent add up to the GPU's memory and
//     100).
//
// Coexisting fractional slices that fit on their GPU together therefore
// all keep data-plane access, whatever their order.
type sliceKey struct{ device, lease string }

// sliceHold is what one slice holds, as last assigned.
type sliceHold struct {
	token     uint64
	memoryMiB int64
	compute   int32
	exclusive bool
}

// fenceTable maps every slice the brokers list for this host (enforced or
// being torn down: both still hold their capacity) to what it holds. It is
// not safe for concurrent use; keyring.mu guards it.
type fenceTable map[sliceKey]sliceHold

// sawResponse records the slices of a heartbeat response, which lists all
// the leases of this host, and forgets the slices it no longer lists.
func (f fenceTable) sawResponse(resp *gpupoolv1.HeartbeatResponse) {
	listed := map[string]bool{}
	for _, as := range slices.Concat(resp.GetEnforce(), resp.GetTeardown()) {
		listed[as.GetLeaseId()] = true
		f.saw(as)
	}
	for k := range f {
		if !listed[k.lease] {
			delete(f, k)
		}
	}
}

// saw records the slices of one assignment, keeping the newest token.
func (f fenceTable) saw(as *gpupoolv1.Assignment) {
	for _, s := range as.GetSlices() {
		k := sliceKey{s.GetDevice(), as.GetLeaseId()}
		if cur, ok := f[k]; ok && cur.token > as.GetFencingToken() {
			continue
		}
		f[k] = sliceHold{token: as.GetFencingToken(), memoryMiB: s.GetMemoryMib(), compute: s.GetComputePercent(), exclusive: s.GetExclusive()}
	}
}

// check says why a token of lease with fencing token tok claiming slices
// is fenced out, or returns nil. gpuMemoryMiB is a GPU's memory by uuid
// (0 when unknown: memory is then not compared).
func (f fenceTable) check(lease string, tok uint64, claimed []*gpupoolv1.Slice, gpuMemoryMiB func(uuid string) int64) error {
	for _, s := range claimed {
		dev := s.GetDevice()
		if cur, ok := f[sliceKey{dev, lease}]; ok && tok < cur.token {
			return fmt.Errorf("token for lease %s is fenced out: fencing token %d is older than %d for its slice on %s", lease, tok, cur.token, dev)
		}
		var (
			newer     []string
			mem       = s.GetMemoryMib()
			compute   = s.GetComputePercent()
			exclusive = s.GetExclusive()
		)
		for _, k := range slices.SortedFunc(maps.Keys(f), func(a, b sliceKey) int { return strings.Compare(a.lease, b.lease) }) {
			h := f[k]
			if k.device != dev || k.lease == lease || h.token <= tok {
				continue
			}
			newer = append(newer, fmt.Sprintf("%s (fencing token %d)", k.lease, h.token))
			mem += h.memoryMiB
			compute += h.compute
			exclusive = exclusive || h.exclusive
		}
		if len(newer) == 0 {
			continue
		}
		total := gpuMemoryMiB(dev)
		if exclusive || compute > 100 || (total > 0 && mem > total) {
			return fmt.Errorf("token for lease %s is fenced out: its capacity on %s was granted again to the newer %s %s, and fencing token %d is older",
				lease, dev, plural(len(newer), "lease", "leases"), strings.Join(newer, ", "), tok)
		}
	}
	return nil
}

func plural(n int, one, many string) string {
	if n == 1 {
		return one
	}
	return many
}
