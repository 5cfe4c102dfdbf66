package robustness

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/gpupool/gpupool/internal/clock"
	"github.com/gpupool/gpupool/internal/loopfs"
	"github.com/gpupool/gpupool/internal/proc"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// Faults of disks, floods and agents. The brokers are built with -tags
// faultinject, which lets a broker's data dir slow its Raft log writes
// (faultFsyncDelayFile); a full disk needs each broker's data dir on a
// loop-mounted file system of its own (root and loop devices).
const (
	FaultSlowDiskFollower = "slow disk (fsync +100ms..1s) on a follower"
	FaultSlowDiskLeader   = "slow disk (fsync +1s) on the leader"
	FaultFullDisk         = "full disk on a broker"
	FaultFlood            = "flood of waiting acquires from one tenant"
	FaultAgentRestart     = "agent SIGTERM + restart"
)

// MoreFaultKinds are the faults added to FaultKinds.
var MoreFaultKinds = []string{FaultSlowDiskFollower, FaultSlowDiskLeader, FaultFullDisk, FaultFlood, FaultAgentRestart}

func init() { FaultKinds = append(FaultKinds, MoreFaultKinds...) }

// faultFsyncDelayFile is broker.FaultFsyncDelayFile (a build with
// -tags faultinject).
const faultFsyncDelayFile = "fault-fsync-delay"

// Loop-mounted data dirs.
const (
	dataDiskMiB = 256
	// floodTenant is the tenant that floods; its quota of one small
	// slice keeps its requests waiting in the queue.
	floodTenant = "flood"
	// floodCap is the brokers' --limit-tenant-pending, and floodCalls
	// how many waiting acquires a flood opens at once.
	floodCap   = 50
	floodCalls = 500
)

// mountDataDirs puts each broker's data dir on a loop-mounted ext4 of
// its own, so that a full disk can be made; it returns why not when it
// cannot (the full-disk fault is then skipped, saying so).
func mountDataDirs(cl *Cluster) error {
	if os.Geteuid() != 0 {
		return fmt.Errorf("%w: a full disk needs loop-mounted data dirs: not root", ErrUnsupported)
	}
	if _, err := exec.LookPath("mkfs.ext4"); err != nil {
		return fmt.Errorf("%w: a full disk needs mkfs.ext4", ErrUnsupported)
	}
	for _, p := range cl.Brokers {
		img := p.DataDir + ".img"
		if err := os.MkdirAll(p.DataDir, 0o700); err != nil {
			return err
		}
		f, err := os.Create(img)
		if err != nil {
			return err
		}
		f.Close()
		if err := os.Truncate(img, dataDiskMiB<<20); err != nil {
			return err
		}
		if out, err := exec.Command("mkfs.ext4", "-q", "-F", "-m", "0", img).CombinedOutput(); err != nil {
			return fmt.Errorf("mkfs.ext4 %s: %v: %s", img, err, out)
		}
		if out, err := exec.Command("mount", "-o", "loop", img, p.DataDir).CombinedOutput(); err != nil {
			return fmt.Errorf("%w: a full disk needs loop devices: mount -o loop: %v: %s", ErrUnsupported, err, out)
		}
		cl.mounts = append(cl.mounts, p.DataDir)
	}
	return nil
}

// unmountDataDirs undoes mountDataDirs (lazily: a process may still be
// going away) and removes the images.
func unmountDataDirs(cl *Cluster) {
	for _, m := range cl.mounts {
		exec.Command("umount", "-l", m).Run()
		os.Remove(m + ".img")
	}
	cl.mounts = nil
}

// injectMore applies one of MoreFaultKinds; see Faults.inject.
func (f *Faults) injectMore(ctx context.Context, kind string, hold time.Duration, target, leader int) error {
	cl := f.Cluster
	holdFor := func() { clock.Sleep(ctx, clock.Real, hold) }
	switch kind {
	case FaultSlowDiskFollower, FaultSlowDiskLeader:
		i, delay := leader, time.Second
		if kind == FaultSlowDiskFollower {
			i = (leader + 1 + target%(len(cl.Brokers)-1)) % len(cl.Brokers)
			delay = []time.Duration{100 * time.Millisecond, time.Second}[target%2]
		}
		p := cl.Brokers[i]
		file := filepath.Join(p.DataDir, faultFsyncDelayFile)
		if err := os.WriteFile(file, []byte(delay.String()), 0o600); err != nil {
			return err
		}
		holdFor()
		moved := ""
		if kind == FaultSlowDiskLeader {
			// The slow leader hands leadership over (--slow-disk-threshold),
			// unless it did so less than 30 s ago (its cooldown) or no
			// follower could take it: wait for it, at most a minute, and
			// say which.
			err := proc.Poll(ctx, time.Minute, func(ctx context.Context) error {
				if l, err := cl.Leader(ctx); err != nil || l == i {
					return fmt.Errorf("%s still leads with a slow disk", brokerNode(i))
				}
				return nil
			})
			moved = ", leadership moved"
			if err != nil {
				moved = ", leadership stayed: " + err.Error()
			}
		}
		f.Logf("fault: %s: %s +%s%s", kind, p.Node, delay, moved)
		f.count(kind, nil, fmt.Sprintf("%s +%s%s", p.Node, delay, moved))
		return os.Remove(file)
	case FaultFullDisk:
		if cl.diskErr != nil {
			return cl.diskErr
		}
		// The leader's, every other time: it hands leadership to a
		// follower with room (and catches up once space returns).
		i := target % len(cl.Brokers)
		if target%2 == 0 {
			i = leader
		}
		p := cl.Brokers[i]
		filler := filepath.Join(p.DataDir, "filler")
		n, err := loopfs.Fill(filler)
		if err != nil {
			os.Remove(filler)
			return err
		}
		moved := ""
		if i == leader {
			err := proc.Poll(ctx, time.Minute, func(ctx context.Context) error {
				if l, err := cl.Leader(ctx); err != nil || l == i {
					return fmt.Errorf("%s still leads with a full disk", brokerNode(i))
				}
				return nil
			})
			moved = ", the leader's: leadership moved"
			if err != nil {
				moved = ", the leader's: leadership stayed: " + err.Error()
			}
		}
		f.Logf("fault: %s: %s (%d MiB filler)%s", kind, p.Node, n>>20, moved)
		f.count(kind, nil, fmt.Sprintf("%s filled (%d MiB)%s", p.Node, n>>20, moved))
		holdFor()
		return os.Remove(filler)
	case FaultFlood:
		refused, err := f.flood(ctx, hold)
		if err != nil {
			return err
		}
		what := fmt.Sprintf("%d of %d refused by the cap of %d", refused, floodCalls, floodCap)
		f.Logf("fault: %s: %s", kind, what)
		f.count(kind, nil, what)
		if refused < floodCalls-floodCap-floodCalls/10 {
			return fmt.Errorf("flood: only %s", what)
		}
		return nil
	case FaultAgentRestart:
		p := cl.Agents[target%len(cl.Agents)]
		f.Logf("fault: %s: %s", kind, p.Node)
		p.Stop(stopGrace)
		f.count(kind, nil, p.Node)
		holdFor()
		return p.Start()
	}
	return fmt.Errorf("unknown fault %q", kind)
}

// flood opens floodCalls waiting acquires of floodTenant at once, holds
// them for hold, cancels them, and returns how many the brokers refused
// with ResourceExhausted naming the tenant's cap.
func (f *Faults) flood(ctx context.Context, hold time.Duration) (int, error) {
	c := f.Cluster.Client
	f.quotaOnce.Do(func() {
		_, f.quotaErr = c.Operator.SetQuota(ctx, &gpupoolv1.SetQuotaRequest{Quota: &gpupoolv1.Quota{Tenant: floodTenant, Gpus: 1, MemoryMib: 1024, ComputePercent: 1}})
	})
	if f.quotaErr != nil {
		return 0, fmt.Errorf("flood: setting the flood tenant's quota: %w", f.quotaErr)
	}
	fctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var refused atomic.Int64
	var wg sync.WaitGroup
	for range floodCalls {
		wg.Go(func() {
			_, err := c.Lease.Acquire(fctx, &gpupoolv1.AcquireRequest{WaitMs: 60_000, Request: &gpupoolv1.LeaseRequest{
				Tenant: floodTenant, Count: 1, MemoryMib: 2048, ComputePercent: 5, TtlMs: 10_000,
			}})
			if status.Code(err) == codes.ResourceExhausted && strings.Contains(status.Convert(err).Message(), "limit tenant-pending-acquires") {
				refused.Add(1)
			}
		})
	}
	clock.Sleep(ctx, clock.Real, hold)
	cancel()
	wg.Wait()
	return int(refused.Load()), nil
}
