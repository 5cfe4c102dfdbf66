package placement

import (
	"context"
	"errors"
	"fmt"
	"math"
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
	// rand is the seed's generator after the protocol's draws; the random policy goes on
	// drawing from it. Each replay takes its own with newRand.
	newRand func() *rand.Rand
}

// arrive builds the seed's arrival as the FGD paper's artifact does: one Int draw; the tasks
// sorted by name and shuffled; while the request stays within inflate × capacity, clones drawn
// from the name-sorted tasks appended (a clone whose per-GPU share would pass it ends the
// inflation), or random tasks removed until the request is within it; ten Float64 draws; a
// permutation of the name-sorted nodes for ties.
func arrive(nodes []node, tasks []task, seed int64, inflate float64) *arrival {
	a, _ := arriveRand(nodes, tasks, seed, inflate)
	a.newRand = func() *rand.Rand {
		_, r := arriveRand(nodes, tasks, seed, inflate)
		return r
	}
	return a
}

func arriveRand(nodes []node, tasks []task, seed int64, inflate float64) (*arrival, *rand.Rand) {
	a := &arrival{seed: seed, rank: make(map[string]int, len(nodes))}
	for _, n := range nodes {
		a.capacity += 1000 * int64(n.gpus)
	}
	r := rand.New(rand.NewSource(seed))
	r.Int()
	byName := slices.Clone(tasks)
	slices.SortStableFunc(byName, func(x, y task) int { return strings.Compare(x.name, y.name) })
	work := slices.Clone(byName)
	r.Shuffle(len(work), func(i, j int) { work[i], work[j] = work[j], work[i] })
	var asked int64
	for i := range work {
		asked += work[i].gpuMilli()
	}
	target := inflate * float64(a.capacity)
	if float64(asked) < target {
		for {
			t := byName[r.Intn(len(byName))]
			if float64(asked+int64(t.milli)) > target {
				break
			}
			asked += t.gpuMilli()
			work = append(work, t)
		}
	} else {
		for float64(asked) > target {
			i := r.Intn(len(work))
			asked -= work[i].gpuMilli()
			work = slices.Delete(work, i, i+1)
		}
	}
	a.tasks = work
	sorted := slices.Clone(nodes)
	slices.SortStableFunc(sorted, func(x, y node) int { return strings.Compare(x.name, y.name) })
	for range 10 {
		r.Float64()
	}
	for i, p := range r.Perm(len(sorted)) {
		a.rank[sorted[i].name] = p
	}
	return a, r
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

// shape is the task's shape in an FGD mix, as the paper's artifact counts shapes: CPU (at
// least 100 millicores), GPU count, per-GPU share and allowed models, not memory.
func (t *task) shape() placement.Shape {
	s := placement.Shape{CPU: max(t.cpu, 100)}
	if t.gpus > 0 {
		s.GPUs, s.Milli, s.Models = int32(t.gpus), int32(t.milli), t.spec
	}
	return s
}

// cluster is the pool the replay places into: hosts as the broker holds them.
type cluster struct {
	hosts  []*gpupoolv1.Host
	byName map[string]*gpupoolv1.Host
}

func newCluster(nodes []node) *cluster {
	c := &cluster{byName: make(map[string]*gpupoolv1.Host, len(nodes))}
	nodes = slices.Clone(nodes)
	slices.SortStableFunc(nodes, func(x, y node) int { return strings.Compare(x.name, y.name) })
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

// placeHostOnly places a task without GPUs with the policy's rating of hosts
// (placement.PlaceHost) and reports whether one had room.
func (c *cluster) placeHostOnly(t *task, opts placement.Options) (bool, string, error) {
	id, err := placement.PlaceHost(c.hosts, t.cpu, t.mem, opts)
	var pe *placement.Error
	switch {
	case errors.As(err, &pe):
		return false, "", nil
	case err != nil:
		return false, "", err
	}
	h := c.byName[id]
	h.AllocatedCpuMillicores += t.cpu
	h.AllocatedMemoryMib += t.mem
	return true, id, nil
}

// onlineLearner is the learner of the broker's default policy (see broker.Policies).
func onlineLearner() placement.MixLearner { return placement.MixLearner{LookAhead: true} }

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

// replay offers every task of a once, in order, to policy on a fresh cluster of nodes. tasks
// are the trace's own tasks, of which fgd-oracle learns the mix. progress is called with the
// fraction done now and then.
func replay(ctx context.Context, nodes []node, tasks []task, a *arrival, policy string, progress func(float64)) (*outcome, error) {
	c := newCluster(nodes)
	opts := options(policy, tasks, a)
	learner := onlineLearner()
	// The index places as the exhaustive search does; random draws as the artifact does only
	// in the exhaustive search, and gpu-clustering reads affinity the index does not keep.
	var idx *placement.Index
	if policy != placement.Random && policy != placement.GPUClustering {
		idx = placement.NewIndex(c.hosts, a.rank)
	}
	var aff map[string]map[string]int
	if policy == placement.GPUClustering {
		aff = map[string]map[string]int{}
		opts.Affinity = aff
	}
	out := &outcome{Policy: policy, Seed: a.seed}
	var m metric
	var arrived, allocated int64
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
			opts.Mix = learner.Mix()
		}
		var ok bool
		var err error
		if t.gpus == 0 {
			var id string
			if ok, id, err = c.placeHostOnly(t, opts); ok && idx != nil {
				idx.Update(c.byName[id])
			}
		} else {
			req := t.request()
			var ss []*gpupoolv1.Slice
			if idx != nil {
				ss, err = idx.Place(req, opts)
			} else {
				ss, err = placement.PlaceWith(c.hosts, req, opts)
			}
			var pe *placement.Error
			if errors.As(err, &pe) {
				err = nil
			} else if err == nil {
				c.apply(req, ss)
				if idx != nil {
					idx.Update(c.byName[ss[0].GetHost()])
				}
				ok = true
				if aff != nil {
					h := ss[0].GetHost()
					if aff[h] == nil {
						aff[h] = map[string]int{}
					}
					aff[h][placement.Class(req)]++
				}
			}
		}
		if err != nil {
			return nil, fmt.Errorf("%s seed %d task %s: %w", policy, a.seed, t.name, err)
		}
		if ok {
			out.Placed++
			allocated += t.gpuMilli()
		} else {
			out.Failed++
		}
		m.add(arrived, allocated, a.capacity)
	}
	out.Unalloc = m.curve()
	out.FinalAlloc = 100 * float64(allocated) / float64(a.capacity)
	return out, nil
}

// metric is the artifact's metric: after every arrival, the arrived GPU request rounded (half
// to even) to a whole percent of capacity, and the allocated share rounded to 0.01 %; the
// allocation at p % arrived is the mean over the arrivals that rounded to p.
type metric struct {
	sum []float64
	cnt []int
}

func (m *metric) add(arrived, allocated, capacity int64) {
	gpus := capacity / 1000
	x := int(math.RoundToEven(float64(arrived) / float64(gpus) / 10))
	for len(m.sum) <= x {
		m.sum, m.cnt = append(m.sum, 0), append(m.cnt, 0)
	}
	m.sum[x] += math.Round(float64(allocated)/float64(gpus)/10*100) / 100
	m.cnt[x]++
}

// curve is the unallocated share at 0, 1, … % arrived. A point no arrival rounded to takes the
// mean of its neighbours' arrivals, as the artifact does, else the point before.
func (m *metric) curve() []float64 {
	out := make([]float64, len(m.sum))
	for x := range m.sum {
		var s float64
		var c int
		for d := -1; d <= 1 && m.cnt[x] == 0; d++ {
			if y := x + d; y >= 0 && y < len(m.sum) {
				s, c = s+m.sum[y], c+m.cnt[y]
			}
		}
		switch {
		case m.cnt[x] > 0:
			out[x] = 100 - m.sum[x]/float64(m.cnt[x])
		case c > 0:
			out[x] = 100 - s/float64(c)
		case x > 0:
			out[x] = out[x-1]
		default:
			out[x] = 100
		}
	}
	return out
}

// options are the engine options of a benchmark policy on arrival a, ties broken by a's rank.
// FGD's mix is left for the caller to learn; the oracle's is that of the trace's tasks, as the
// paper's artifact computes it.
func options(policy string, tasks []task, a *arrival) placement.Options {
	opts := placement.Options{Policy: policy, Rank: a.rank}
	switch policy {
	case FGDOracle:
		opts.Policy, opts.Mix = placement.FGD, oracleMix(tasks)
	case placement.Random:
		opts.Rand = a.newRand()
	}
	return opts
}

// oracleMix is the mix of tasks that covers 95 % of them.
func oracleMix(tasks []task) *placement.Mix {
	counts := map[placement.Shape]int{}
	for i := range tasks {
		counts[tasks[i].shape()]++
	}
	return placement.MixFromCounts(counts, mixCoverage)
}
