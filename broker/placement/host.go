package placement

import (
	"fmt"
	"math"
	"slices"
	"strings"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// PlaceHost chooses the host for a task that asks for host CPU (millicores) and memory (MiB)
// but no GPU, under opts as PlaceWith would rate it, and returns the host's id. The broker
// leases GPUs only; the placement benchmark replays such tasks of a trace with it, because
// they take CPU that GPU tasks then lack.
//
// A host fits when it is ready and eligible and has cpu and mem free. FGD takes the host whose
// expected fragmentation grows least when its CPU shrinks; best-fit, dot-product and random
// rate as for a GPU task of no GPUs; gpu-packing and gpu-clustering rate every host alike, so
// the tie-break decides; binpack takes the host with the least CPU free, spread the most.
// Ties break by Options.Rank, then host id. PlaceHost does not modify hosts. A task that fits
// no host is an *Error.
func PlaceHost(hosts []*gpupoolv1.Host, cpu, mem int64, opts Options) (string, error) {
	switch {
	case !slices.Contains(AllPolicies, opts.Policy):
		return "", fmt.Errorf("policy %q: must be one of %s", opts.Policy, strings.Join(AllPolicies, ", "))
	case opts.Policy == FGD && opts.Mix == nil:
		return "", fmt.Errorf("policy %q: needs a task mix (Options.Mix)", opts.Policy)
	case opts.Policy == Random && opts.Rand == nil:
		return "", fmt.Errorf("policy %q: needs a random source (Options.Rand)", opts.Policy)
	case cpu < 0 || mem < 0:
		return "", &Error{Never: true, Reason: fmt.Sprintf("host cpu %d millicores, memory %d MiB: must not be negative", cpu, mem)}
	}
	var maxCPU, maxGPU int64
	var fits []*gpupoolv1.Host
	for _, h := range hosts {
		if h == nil {
			continue
		}
		maxCPU, maxGPU = max(maxCPU, h.GetCpuMillicores()), max(maxGPU, 1000*int64(len(h.GetDevices())))
		if viewNow.hostUsable(h) && viewNow.hostFreeCPU(h) >= cpu && viewNow.hostFreeMem(h) >= mem {
			fits = append(fits, h)
		}
	}
	if len(fits) == 0 {
		return "", &Error{Reason: fmt.Sprintf("host cpu %d millicores and memory %d MiB: no ready host has both free", cpu, mem)}
	}
	if opts.Policy == Random {
		return fits[opts.Rand.Intn(len(fits))].GetId(), nil
	}
	var st nodeState
	scores := make([]int, len(fits))
	lo, hi := math.MaxInt, math.MinInt
	for i, h := range fits {
		st.cpu, st.mem = viewNow.hostFreeCPU(h), viewNow.hostFreeMem(h)
		st.free, st.models = st.free[:0], st.models[:0]
		for _, d := range h.GetDevices() {
			if d != nil && viewNow.deviceUsable(d) {
				st.free = append(st.free, freeMilli(d, viewNow.freeMem(d), viewNow.freeCompute(d)))
				st.models = append(st.models, d.GetModel())
			}
		}
		switch opts.Policy {
		case FGD:
			before := opts.Mix.frag(&st)
			st.cpu, st.mem = st.cpu-cpu, st.mem-mem
			scores[i] = fgdScore(before, opts.Mix.frag(&st))
		case BestFit:
			scores[i] = bestFitRaw(st.cpu, sum(st.free), cpu, 0, maxCPU, maxGPU)
			lo, hi = min(lo, scores[i]), max(hi, scores[i])
		case DotProduct:
			scores[i] = dotProduct(st.cpu, sum(st.free), cpu, 0, maxCPU, maxGPU)
		case Binpack:
			scores[i] = -int(st.cpu)
		case Spread:
			scores[i] = int(st.cpu)
		}
	}
	var top rating
	var win string
	for i, h := range fits {
		sc := scores[i]
		if opts.Policy == BestFit {
			sc = normalise(sc, lo, hi)
		}
		r := rating{score: sc, rank: math.MaxInt, host: h.GetId()}
		if opts.Rank == nil {
			r.rank = 0
		} else if n, ok := opts.Rank[r.host]; ok {
			r.rank = n
		}
		if i == 0 || r.beats(top) {
			top, win = r, r.host
		}
	}
	return win, nil
}
