package robustness

import (
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/anishathalye/porcupine"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// Record is one client operation: its call and return times (Unix ns),
// and what it asked and got. Unknown operations got no definite answer
// (a timeout, a cut connection): they may or may not have taken effect.
type Record struct {
	Client    int
	Kind      OpKind
	RequestID string // acquire
	Lease     string
	Device    string
	Memory    int64
	Compute   int32
	Fence     uint64
	Outcome   string // see Output; "refused" for an acquire that did not fit
	Unknown   bool
	Err       string
	Call, Ret int64
}

// History records operations from many goroutines.
type History struct {
	mu      sync.Mutex
	records []Record // guarded by mu
}

// Add appends r.
func (h *History) Add(r Record) {
	h.mu.Lock()
	h.records = append(h.records, r)
	h.mu.Unlock()
}

// Records returns a copy of every record so far.
func (h *History) Records() []Record {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.Clone(h.records)
}

// never is the return time of an operation whose answer never came: it
// may take effect at any time after its call.
const never = math.MaxInt64 / 2

// Violation is a device whose history has no linearization.
type Violation struct {
	Device string
	Window string // the operations around the point where checking failed
	File   string // porcupine's HTML visualization of the whole device history
}

// CheckResult is what Check found.
type CheckResult struct {
	Result     porcupine.CheckResult // Ok, Illegal or Unknown (timed out)
	Devices    int
	Operations int // operations checked (after resolving unknown ones)
	Dropped    int // unknown reads and refused or never-applied acquires
	Violations []Violation
}

// Check resolves unknown operations against the final lease table,
// partitions the history by device and checks each device's history
// against LeaseModel. final must include ended leases; devices give each
// device's memory. Visualizations of failing devices go to outDir.
func Check(records []Record, final []*gpupoolv1.Lease, devices []*gpupoolv1.Device, outDir string, timeout time.Duration) CheckResult {
	byReq := map[string]*gpupoolv1.Lease{}
	byID := map[string]*gpupoolv1.Lease{}
	for _, l := range final {
		byReq[l.RequestId] = l
		byID[l.Id] = l
	}
	deviceOf := map[string]string{} // lease → device, from acquires
	var ops []porcupine.Operation
	var res CheckResult
	add := func(r Record, in Input, out Output, ret int64) {
		ops = append(ops, porcupine.Operation{ClientId: r.Client, Input: in, Output: out, Call: r.Call, Return: ret, Metadata: r.Device})
	}
	for _, r := range records {
		if r.Kind != OpAcquire {
			continue
		}
		switch {
		case !r.Unknown && r.Outcome == "ok":
			deviceOf[r.Lease] = r.Device
			add(r, Input{Kind: OpAcquire, Lease: r.Lease, Device: r.Device, Memory: r.Memory, Compute: r.Compute, Fence: r.Fence}, Output{Outcome: "ok"}, r.Ret)
		case r.Unknown:
			l := byReq[r.RequestID]
			if l == nil || len(l.Slices) != 1 || l.FencingToken == 0 {
				res.Dropped++ // never granted
				continue
			}
			s := l.Slices[0]
			r.Device, r.Lease = s.Device, l.Id
			deviceOf[l.Id] = s.Device
			add(r, Input{Kind: OpAcquire, Lease: l.Id, Device: s.Device, Memory: s.MemoryMib, Compute: s.ComputePercent, Fence: l.FencingToken}, Output{Outcome: "ok"}, never)
		default:
			res.Dropped++
		}
	}
	for _, r := range records {
		dev, ok := deviceOf[r.Lease]
		if r.Kind == OpAcquire || !ok {
			continue
		}
		r.Device = dev
		in := Input{Kind: r.Kind, Lease: r.Lease, Device: dev}
		switch {
		case !r.Unknown:
			add(r, in, Output{Outcome: r.Outcome, Fence: r.Fence}, r.Ret)
		case r.Kind == OpRelease && byID[r.Lease] != nil && outcomeOf(byID[r.Lease]) == "released":
			add(r, in, Output{Outcome: "released"}, never)
		default:
			res.Dropped++ // an unknown read changes nothing
		}
	}
	for id, dev := range deviceOf {
		l := byID[id]
		if l == nil || outcomeOf(l) != "ended" {
			continue
		}
		ops = append(ops, porcupine.Operation{ClientId: -1, Input: Input{Kind: OpEnd, Lease: id, Device: dev}, Output: Output{Outcome: "ended"},
			Call: l.StateChangedAtMs * int64(time.Millisecond), Return: never, Metadata: dev})
		if l.State == gpupoolv1.LeaseState_LEASE_STATE_EXPIRED || l.EndState == gpupoolv1.LeaseState_LEASE_STATE_EXPIRED {
			at := (l.StateChangedAtMs + 1) * int64(time.Millisecond)
			ops = append(ops, porcupine.Operation{ClientId: -1, Input: Input{Kind: OpExpiry, Lease: id, Device: dev}, Output: Output{Outcome: "ended"},
				Call: at, Return: at, Metadata: dev})
		}
	}
	memory := map[string]int64{}
	for _, d := range devices {
		memory[d.Uuid] = d.MemoryMib
	}
	perDevice := map[string][]porcupine.Operation{}
	for _, op := range ops {
		d := op.Metadata.(string)
		perDevice[d] = append(perDevice[d], op)
	}
	res.Result = porcupine.Ok
	res.Devices = len(perDevice)
	res.Operations = len(ops)
	names := make([]string, 0, len(perDevice))
	for d := range perDevice {
		names = append(names, d)
	}
	slices.Sort(names)
	for _, d := range names {
		model := LeaseModel(memory[d])
		if memory[d] == 0 {
			model = LeaseModel(math.MaxInt64 / 4) // an unknown device: check all but memory
		}
		r, info := porcupine.CheckOperationsVerbose(model, perDevice[d], timeout)
		switch r {
		case porcupine.Illegal:
			res.Result = porcupine.Illegal
			v := Violation{Device: d, Window: window(model, perDevice[d], info)}
			if outDir != "" {
				v.File = filepath.Join(outDir, "porcupine-"+d+".html")
				if f, err := os.Create(v.File); err == nil {
					porcupine.Visualize(model, info, f)
					f.Close()
				}
			}
			res.Violations = append(res.Violations, v)
		case porcupine.Unknown:
			if res.Result == porcupine.Ok {
				res.Result = porcupine.Unknown
			}
		}
	}
	return res
}

// outcomeOf says how a lease ended, as Output.Outcome names it.
func outcomeOf(l *gpupoolv1.Lease) string {
	st := l.State
	if st == gpupoolv1.LeaseState_LEASE_STATE_RELEASING {
		st = l.EndState
	}
	switch st {
	case gpupoolv1.LeaseState_LEASE_STATE_GRANTED:
		return "granted"
	case gpupoolv1.LeaseState_LEASE_STATE_RELEASED:
		return "released"
	case gpupoolv1.LeaseState_LEASE_STATE_EXPIRED, gpupoolv1.LeaseState_LEASE_STATE_REVOKED:
		return "ended"
	}
	return "pending"
}

// window prints the device's operations in call order around the end of
// the longest linearizable prefix, where the checker got stuck.
func window(model porcupine.Model, ops []porcupine.Operation, info porcupine.LinearizationInfo) string {
	longest := 0
	for _, partial := range info.PartialLinearizations() {
		for _, lin := range partial {
			longest = max(longest, len(lin))
		}
	}
	sorted := slices.Clone(ops)
	slices.SortFunc(sorted, func(a, b porcupine.Operation) int { return int(a.Call - b.Call) })
	lo, hi := max(0, longest-20), min(len(sorted), longest+10)
	var b strings.Builder
	fmt.Fprintf(&b, "%d operations; the longest linearizable prefix has %d; operations %d..%d by call time:\n", len(ops), longest, lo, hi-1)
	base := sorted[0].Call
	for i := lo; i < hi; i++ {
		op := sorted[i]
		ret := "never"
		if op.Return != never {
			ret = fmt.Sprintf("%.3fs", float64(op.Return-base)/1e9)
		}
		fmt.Fprintf(&b, "  #%d client %d [%.3fs, %s] %s\n", i, op.ClientId, float64(op.Call-base)/1e9, ret, model.DescribeOperation(op.Input, op.Output))
	}
	return b.String()
}
