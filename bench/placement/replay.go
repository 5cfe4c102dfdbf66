package placement

import (
	"context"
	"errors"
	"fmt"
	"math/rand"
	"slices"
	"strings"

	"github.com/gpupool/gpupool/broker/placement"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// FGDOracle is FGD with the mix of the whole replayed trace, as the paper runs it. FGD
// (placement.FGD) learns its mix from the tasks seen so far.
const FGDOracle = "fgd-oracle"

// benchPolicies lists the policies the benchmark runs, in report order.
var benchPolicies = append(slices.Clone(placement.AllPolicies), FGDOracle)

// mibPerMilli is the GPU memory of a thousandth of a GPU: every replayed GPU has 16000 MiB, so
// a task's share of a GPU is exact both as memory (gpu_milli × 16 MiB) and as compute
// (gpu_milli / 10 %).
const mibPerMilli = 16

// mixCoverage is the share of tasks the FGD mix covers, as in the paper.
const mixCoverage = 0.95

// arrival is the replay of one seed: the tasks in the order offered and the tie-break order
// of the nodes.
type arrival struct {
	seed     int64
	tasks    []task
	rank     map[string]int // node name → place in the seed's node order
	capacity int64          // GPU milli of the cluster
	// randSeed seeds the random policy's draws: the seed generator's next Int63 after the
	// protocol's draws.
	randSeed int64
}

// arrive builds the seed's arrival as the FGD paper's artifact does: tasks sorted by name,
// shuffled, cloned until they ask for inflate × capacity (or trimmed to it), then ten
// Float64 draws and a permutation of the nodes for ties.
func arrive(nodes []node, tasks []task, seed int64, inflate float64) *arrival {
	a := &arrival{seed: seed, rank: make(map[string]int, len(nodes))}
	for _, n := range nodes {
		a.capacity += 1000 * int64(n.gpus)
	}
	r := rand.New(rand.NewSource(seed))
	r.Int()
	sorted := slices.Clone(tasks)
	slices.SortStableFunc(sorted, func(x, y task) int { return strings.Compare(x.name, y.name) })
	r.Shuffle(len(sorted), func(i, j int) { sorted[i], sorted[j] = sorted[j], sorted[i] })
	target := int64(inflate * float64(a.capacity))
	var asked int64
	for i, t := range sorted {
		if asked >= target {
			sorted = sorted[:i]
			break
		}
		asked += t.gpuMilli()
	}
	for n := len(sorted); asked < target; {
		t := sorted[r.Intn(n)]
		sorted = append(sorted, t)
		asked += t.gpuMilli()
	}
	a.tasks = sorted
	for range 10 {
		r.Float64()
	}
	for i, p := range r.Perm(len(nodes)) {
		a.rank[nodes[i].name] = p
	}
	a.randSeed = r.Int63()
	return a
}

// request is the lease a GPU task asks the broker for: one fractional slice of gpu_milli
// (as gpu_milli×16 MiB and gpu_milli/10 % compute) or gpus exclusive GPUs, all on one host
// with the task's CPU and memory, on a GPU of a model its gpu_spec allows.
func (t *task) request() *gpupoolv1.LeaseRequest {
	req := &gpupoolv1.LeaseRequest{
		Count: int32(t.gpus), HostCpuMillicores: t.cpu, HostMemoryMib: t.mem,
		Topology: gpupoolv1.Topology_TOPOLOGY_SAME_HOST,
	}
	if t.milli == 1000 {
		req.Exclusive = true
	} else {
		req.MemoryMib, req.ComputePercent = int64(t.milli)*mibPerMilli, int32(t.milli/10)
	}
	if t.spec != "" {
		req.Constraints = &gpupoolv1.Constraints{Model: t.spec}
	}
	return req
}

// shape is the task's shape in an FGD mix.
func (t *task) shape() placement.Shape {
	if t.gpus == 0 {
		return placement.Shape{CPU: t.cpu, Memory: t.mem}
	}
	return placement.ShapeOf(t.request())
}

// cluster is the pool the replay places into: hosts as the broker holds them.
type cluster struct {
	hosts  []*gpupoolv1.Host
	byName map[string]*gpupoolv1.Host
}

func newCluster(nodes []node) *cluster {
	c := &cluster{byName: make(map[string]*gpupoolv1.Host, len(nodes))}
	for _, n := range nodes {
		h := &gpupoolv1.Host{
			Id: n.name, Status: gpupoolv1.HostStatus_HOST_STATUS_READY, Eligible: true,
			CpuMillicores: n.cpu, MemoryMib: n.mem,
		}
		for i := range n.gpus {
			h.Devices = append(h.Devices, &gpupoolv1.Device{
				Uuid: fmt.Sprintf("%s/%d", n.name, i), Index: int32(i), Model: n.model,
				MemoryMib: 1000 * mibPerMilli, HostId: n.name,
			})
		}
		c.hosts = append(c.hosts, h)
		c.byName[n.name] = h
	}
	return c
}

// apply allocates the granted slices and the host CPU and memory of req, as the FSM does.
func (c *cluster) apply(req *gpupoolv1.LeaseRequest, ss []*gpupoolv1.Slice) {
	h := c.byName[ss[0].GetHost()]
	h.AllocatedCpuMillicores += req.GetHostCpuMillicores()
	h.AllocatedMemoryMib += req.GetHostMemoryMib()
	for _, s := range ss {
		placement.Allocate(h.Devices[s.GetDeviceIndex()], s)
	}
}

// placeHostOnly places a task without GPUs on the first host in order with its CPU and memory
// free; it reports whether one had room. The broker leases GPUs only, so such tasks are
// placed here, the same way under every policy.
func (c *cluster) placeHostOnly(t *task, order []*gpupoolv1.Host) bool {
	for _, h := range order {
		if h.CpuMillicores-h.AllocatedCpuMillicores >= t.cpu && h.MemoryMib-h.AllocatedMemoryMib >= t.mem {
			h.AllocatedCpuMillicores += t.cpu
			h.AllocatedMemoryMib += t.mem
			return true
		}
	}
	return false
}

// curveStep is the resolution of the recorded curve, in percent of capacity arrived.
const curveStep = 1

// outcome is the result of one policy on one seed.
type outcome struct {
	Policy string `json:"policy"`
	Seed   int64  `json:"seed"`
	// Unalloc[p] is the unallocated GPU share in percent of capacity when p % of capacity has
	// arrived, for p = 0, curveStep, … up to the inflation.
	Unalloc []float64 `json:"unalloc_by_arrived_pct"`
	// FinalAlloc is the allocated GPU share in percent of capacity after the last task.
	FinalAlloc float64 `json:"final_alloc_pct"`
	Placed     int     `json:"placed"`
	Failed     int     `json:"failed"`
	Seconds    float64 `json:"seconds"`
}

// replay offers every task of a once, in order, to policy on a fresh cluster of nodes.
// progress is called with the fraction done now and then.
func replay(ctx context.Context, nodes []node, a *arrival, policy string, progress func(float64)) (*outcome, error) {
	c := newCluster(nodes)
	order := slices.Clone(c.hosts)
	slices.SortFunc(order, func(x, y *gpupoolv1.Host) int { return a.rank[x.Id] - a.rank[y.Id] })
	opts := options(policy, a, a.rank)
	var learner placement.MixLearner
	out := &outcome{Policy: policy, Seed: a.seed}
	var arrived, allocated int64
	next := int64(0) // the next curve point, in milli
	step := a.capacity * curveStep / 100
	for i := range a.tasks {
		if i%512 == 0 {
			if err := ctx.Err(); err != nil {
				return nil, err
			}
			if progress != nil {
				progress(float64(i) / float64(len(a.tasks)))
			}
		}
		t := &a.tasks[i]
		arrived += t.gpuMilli()
		if policy == placement.FGD {
			learner.Observe(t.shape())
		}
		var ok bool
		if t.gpus == 0 {
			ok = c.placeHostOnly(t, order)
		} else {
			req := t.request()
			if policy == placement.FGD {
				opts.Mix = learner.Mix()
			}
			ss, err := placement.PlaceWith(c.hosts, req, opts)
			var pe *placement.Error
			switch {
			case err == nil:
				c.apply(req, ss)
				ok = true
			case !errors.As(err, &pe):
				return nil, fmt.Errorf("%s seed %d task %s: %w", policy, a.seed, t.name, err)
			}
		}
		if ok {
			out.Placed++
			allocated += t.gpuMilli()
		} else {
			out.Failed++
		}
		for ; next <= arrived; next += step {
			out.Unalloc = append(out.Unalloc, 100-100*float64(allocated)/float64(a.capacity))
		}
	}
	out.FinalAlloc = 100 * float64(allocated) / float64(a.capacity)
	return out, nil
}

// options are the engine options of a benchmark policy on arrival a, ties broken by rank.
// FGD's mix is left for the caller to learn; the oracle's is that of all of a's tasks.
func options(policy string, a *arrival, rank map[string]int) placement.Options {
	opts := placement.Options{Policy: policy, Rank: rank}
	switch policy {
	case FGDOracle:
		counts := map[placement.Shape]int{}
		for i := range a.tasks {
			counts[a.tasks[i].shape()]++
		}
		opts.Policy, opts.Mix = placement.FGD, placement.MixFromCounts(counts, mixCoverage)
	case placement.Random:
		opts.Rand = rand.New(rand.NewSource(a.randSeed))
	}
	return opts
}
