package leasebench

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"time"

	"github.com/google/uuid"

	"github.com/gpupool/gpupool/client"
	"github.com/gpupool/gpupool/internal/proc"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// readyTimeout bounds how long a cluster has to come up.
const readyTimeout = 60 * time.Second

// gpupoolCluster is three brokers and the simulated agents, as child
// processes, and a client of the brokers.
type gpupoolCluster struct {
	children []*proc.Proc
	c        *client.Client
	pprof    map[string]string // broker name -> --pprof-bind address; nil without profiles
	metrics  map[string]string // broker name -> --metrics-bind address; nil without profiles
	addrs    []string          // the brokers' gRPC addresses
}

// startGpupool starts three brokers on 127.0.0.2-4 and hosts simulated
// agents of gpusPerHost A100-80GB each, with data dirs under dir, and
// waits until every host is ready. With pprof, each broker serves its
// profiles (--pprof-bind) on a free port.
func startGpupool(ctx context.Context, dir, bin string, hosts int, pprof bool) (*gpupoolCluster, error) {
	addrs, err := freeAddrs(2, 3)
	if err != nil {
		return nil, err
	}
	raftAddrs, err := freeAddrs(2, 3)
	if err != nil {
		return nil, err
	}
	cl := &gpupoolCluster{}
	start := func(name string, args ...string) error {
		c, err := startChild(dir, name, bin, args...)
		if err != nil {
			return err
		}
		cl.children = append(cl.children, c)
		return nil
	}
	for i := range addrs {
		var join []string
		for j, a := range addrs {
			if j != i {
				join = append(join, a)
			}
		}
		id := fmt.Sprintf("broker-%d", i+1)
		// --insecure: compared with a plaintext etcd without auth.
		args := []string{"broker", "--insecure", "--node-id", id, "--data-dir", filepath.Join(dir, id),
			"--bind", addrs[i], "--raft-bind", raftAddrs[i], "--bootstrap-expect", "3", "--join", strings.Join(join, ","),
			"--log-level", "warn"}
		if pprof {
			pa, err := proc.FreeAddr("127.0.0.1")
			if err != nil {
				cl.stop()
				return nil, err
			}
			if cl.pprof == nil {
				cl.pprof = map[string]string{}
			}
			cl.pprof[id] = pa
			ma, err := proc.FreeAddr("127.0.0.1")
			if err != nil {
				cl.stop()
				return nil, err
			}
			if cl.metrics == nil {
				cl.metrics = map[string]string{}
			}
			cl.metrics[id] = ma
			args = append(args, "--pprof-bind", pa, "--metrics-bind", ma)
		}
		if err := start(id, args...); err != nil {
			cl.stop()
			return nil, err
		}
	}
	for i := range hosts {
		id := fmt.Sprintf("host-%d", i+1)
		if err := start(id, "agent", "--insecure", "--broker", strings.Join(addrs, ","), "--simulate", fmt.Sprintf("%dx%s", gpusPerHost, gpuModel),
			"--host-id", id, "--data-dir", filepath.Join(dir, id), "--data-bind", "127.0.0.1:0", "--mps", "off",
			"--log-level", "warn"); err != nil {
			cl.stop()
			return nil, err
		}
	}
	cl.addrs = addrs
	if cl.c, err = client.Dial(addrs); err != nil {
		cl.stop()
		return nil, err
	}
	if err := cl.waitReady(ctx, hosts); err != nil {
		cl.stop()
		return nil, err
	}
	return cl, nil
}

// waitReady waits until hosts hosts are ready and a leader answers.
func (cl *gpupoolCluster) waitReady(ctx context.Context, hosts int) error {
	return proc.Poll(ctx, readyTimeout, func(ctx context.Context) error {
		if err := diedError(cl.children); err != nil {
			return proc.GiveUp{Err: errors.Join(errStopped, err)} // no use waiting
		}
		st, err := cl.c.Pool.Status(ctx, &gpupoolv1.StatusRequest{})
		if err != nil {
			return err
		}
		if int(st.HostsReady) < hosts {
			return fmt.Errorf("%d of %d hosts ready", st.HostsReady, hosts)
		}
		return nil
	})
}

// stop stops the agents, then the brokers.
func (cl *gpupoolCluster) stop() {
	if cl.c != nil {
		cl.c.Close()
	}
	for i := len(cl.children) - 1; i >= 0; i-- {
		cl.children[i].Stop(stopTimeout)
	}
}

// gpupoolSystem is the gpupool side of the benchmark.
type gpupoolSystem struct {
	cl    *gpupoolCluster
	slice slice
	ttl   time.Duration
	hosts int // how many hosts the pool has when all are ready
}

// acquire is one Acquire RPC with a fresh request id, no wait; its release
// is one Release RPC, which returns once the lease is RELEASING (the agent
// frees the capacity after that, asynchronously).
func (s *gpupoolSystem) acquire(ctx context.Context) (func(context.Context) error, error) {
	resp, err := s.cl.c.Lease.Acquire(ctx, &gpupoolv1.AcquireRequest{Request: &gpupoolv1.LeaseRequest{
		Count: 1, MemoryMib: s.slice.MemoryMiB, ComputePercent: int32(s.slice.ComputePercent),
		TtlMs: s.ttl.Milliseconds(), RequestId: uuid.NewString(), Holder: "bench-lease",
	}})
	if err != nil {
		return nil, err
	}
	id := resp.GetLease().GetId()
	return func(ctx context.Context) error {
		_, err := s.cl.c.Lease.Release(ctx, &gpupoolv1.ReleaseRequest{LeaseId: id, Reason: "bench"})
		return err
	}, nil
}

// idle waits until the agents have torn every released slice down, the
// brokers show nothing allocated, and every host is ready (a host whose
// heartbeats were late under load is down until its next one).
func (s *gpupoolSystem) idle(ctx context.Context) error {
	return proc.Poll(ctx, readyTimeout, func(ctx context.Context) error {
		st, err := s.cl.c.Pool.Status(ctx, &gpupoolv1.StatusRequest{})
		if err != nil {
			return err
		}
		if int(st.HostsReady) < s.hosts {
			return fmt.Errorf("%d of %d hosts ready", st.HostsReady, s.hosts)
		}
		if st.AllocatedMemoryMib != 0 || st.AllocatedComputePercent != 0 {
			return fmt.Errorf("%d MiB and %d%% compute still allocated (leases by state: %v)",
				st.AllocatedMemoryMib, st.AllocatedComputePercent, st.LeasesByState)
		}
		return nil
	})
}

func (s *gpupoolSystem) retries() int64 { return 0 }
