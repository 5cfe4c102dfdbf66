package placement

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"slices"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpupool/gpupool/broker/placement"
)

// throughputBudget bounds the time one policy's placements/s measurement takes.
const throughputBudget = 20 * time.Second

// throughput measures the engine alone: placements per second of policy on an empty synthetic
// pool of cfg.SyntheticHosts hosts with 8 GPUs each (models of the trace in turn, CPU and
// memory of the trace's largest node), placing the GPU tasks of a in order, up to
// cfg.SyntheticTasks of them or throughputBudget, through an index (placement.Index), as the
// broker places. Failed placements count too.
func throughput(ctx context.Context, cfg *config, hosts int, nodes []node, tasks []task, a *arrival, policy string) (rate, error) {
	var models []string
	var big node
	for _, n := range nodes {
		if n.gpus > 0 && !slices.Contains(models, n.model) {
			models = append(models, n.model)
		}
		if n.cpu > big.cpu {
			big = n
		}
	}
	synth := make([]node, hosts)
	for i := range synth {
		synth[i] = node{name: fmt.Sprintf("synth-%06d", i), cpu: big.cpu, mem: big.mem, gpus: 8, model: models[i%len(models)]}
	}
	c := newCluster(synth)
	opts := options(policy, tasks, a)
	idx := placement.NewIndex(c.hosts, nil) // ties break by host name
	learner := onlineLearner()
	var n int
	// The machine may be shared: the CPU time of this thread says what the placements cost,
	// the wall time what they took.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	cpu0 := threadCPU()
	var spent time.Duration
	for i := range a.tasks {
		if n >= cfg.SyntheticTasks || spent > throughputBudget {
			break
		}
		if err := ctx.Err(); err != nil {
			return rate{}, err
		}
		t := &a.tasks[i]
		if t.gpus == 0 {
			continue
		}
		req := t.request()
		t0 := time.Now()
		if policy == placement.FGD {
			learner.Observe(t.shape())
			opts.Mix = learner.Mix()
		}
		ss, err := idx.Place(req, opts)
		var pe *placement.Error
		switch {
		case err == nil:
			c.apply(req, ss)
			idx.Update(c.byName[ss[0].GetHost()])
		case !errors.As(err, &pe):
			return rate{}, fmt.Errorf("%s on the synthetic pool: %w", policy, err)
		}
		spent += time.Since(t0)
		n++
	}
	r := rate{Wall: float64(n) / spent.Seconds()}
	if cpu := threadCPU() - cpu0; cpu > 0 {
		r.CPU = float64(n) / cpu.Seconds()
	}
	return r, nil
}

// rate is placements per second of wall time and of CPU time.
type rate struct {
	Wall float64 `json:"wall"`
	CPU  float64 `json:"cpu"`
}

// threadCPU is the CPU time (user and system) the calling OS thread has used.
func threadCPU() time.Duration {
	var ru unix.Rusage
	if err := unix.Getrusage(unix.RUSAGE_THREAD, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
