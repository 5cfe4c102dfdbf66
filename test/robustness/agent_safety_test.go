package robustness

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/gpupool/gpupool/internal/clock"
	"github.com/gpupool/gpupool/internal/proc"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// holderProcess is a lease's workload: `sleep 600` carrying
// GPUPOOL_LEASE_ID, which is how the agent finds a lease's processes. It
// ignores SIGTERM, the worst case: the agent's SIGKILL after
// --kill-after stops it.
type holderProcess struct {
	cmd    *exec.Cmd
	exited chan struct{}
	at     time.Time // when it exited; valid once exited is closed
}

// errEndedBeforeTaken ends the wait for the agent to take a lease that
// ended first.
var errEndedBeforeTaken = errors.New("the lease ended before the agent took it")

func startHolderProcess(t *testing.T, leaseID string) *holderProcess {
	t.Helper()
	p := &holderProcess{cmd: exec.Command("sh", "-c", `trap "" TERM; exec sleep 600`), exited: make(chan struct{})}
	p.cmd.Env = append(os.Environ(), "GPUPOOL_LEASE_ID="+leaseID)
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		p.cmd.Wait()
		p.at = time.Now()
		close(p.exited)
	}()
	t.Cleanup(func() {
		p.cmd.Process.Kill()
		<-p.exited
	})
	return p
}

// doubleHolderTrial is one way to measure how long two holders of one
// GPU may run at once when its agent is cut off from the brokers.
type doubleHolderTrial struct {
	name     string
	leaseTTL time.Duration
	// healWhen is the first lease's state on the brokers at which the
	// agent's links come back: RELEASING once the host is down (the
	// lock-delay still holds the GPU), REVOKED once it freed the GPU.
	healWhen gpupoolv1.LeaseState
}

type doubleHolderResult struct {
	name                   string
	timing                 Timing
	leaseTTL               time.Duration
	healed, stopped, grant time.Duration // since the cut: heal started, holder 1 exited, holder 2's successful acquire was called
}

// gap is how long after the first holder stopped the second one could
// start; negative is an overlap.
func (r doubleHolderResult) gap() time.Duration { return r.grant - r.stopped }

// TestCutOffAgentAndTheSecondHolder cuts an agent off from the brokers
// while a holder (never cut off) renews its lease and runs a workload
// there, lets it back at different points, and measures how long after
// the workload stopped a second holder got the same GPU. It asserts no
// overlap with every timer combination: with lock-delay + heartbeat-ttl ≥
// lease TTL + expiry-grace + kill-after the agent stops the workload on
// its own before the GPU is freed; with a shorter lock-delay the GPU is
// freed first, and the host that comes back stays down until its agent
// confirms the workload is torn down.
func TestCutOffAgentAndTheSecondHolder(t *testing.T) {
	needsCluster(t)
	repeat := 2
	if v := os.Getenv("GPUPOOL_ROBUSTNESS_TRIALS"); v != "" {
		fmt.Sscan(v, &repeat)
	}
	short := DefaultTiming
	short.LockDelay = 300 * time.Millisecond
	configs := []struct {
		name   string
		timing Timing
		trials []doubleHolderTrial
	}{
		{"lock-delay covers the lease TTL and the agent's grace", DefaultTiming, []doubleHolderTrial{
			{"the agent comes back before the lock-delay ends", 3 * time.Second, gpupoolv1.LeaseState_LEASE_STATE_RELEASING},
			{"the agent comes back after the lock-delay freed the GPU", 3 * time.Second, gpupoolv1.LeaseState_LEASE_STATE_REVOKED},
		}},
		{"lock-delay shorter than the lease TTL", short, []doubleHolderTrial{
			{"the agent comes back after the lock-delay freed the GPU, before the lease's expiry", 10 * time.Second, gpupoolv1.LeaseState_LEASE_STATE_REVOKED},
		}},
	}
	var results []doubleHolderResult
	for _, c := range configs {
		t.Run(c.name, func(t *testing.T) {
			cl, nw := startSafetyCluster(t, c.timing)
			for _, tr := range c.trials {
				for i := range repeat {
					r := runDoubleHolderTrial(t, cl, nw, tr, c.timing, i)
					results = append(results, r)
					if r.gap() < -time.Millisecond { // the grant's stamp has millisecond resolution
						t.Errorf("%s: two holders ran at once for %s: the first stopped %s after the cut, the second was granted %s after it",
							tr.name, -r.gap(), r.stopped, r.grant)
					}
				}
			}
		})
	}
	var b strings.Builder
	fmt.Fprintf(&b, "| trial | lock-delay | lease TTL | agent back | holder 1 stopped | holder 2 granted | gap (negative: overlap) |\n|---|---|---|---|---|---|---|\n")
	for _, r := range results {
		fmt.Fprintf(&b, "| %s | %s | %s | %s | %s | %s | %s |\n", r.name, r.timing.LockDelay, r.leaseTTL,
			r.healed.Round(time.Millisecond), r.stopped.Round(time.Millisecond), r.grant.Round(time.Millisecond), r.gap().Round(time.Millisecond))
	}
	t.Logf("times since the agent was cut off (heartbeat-ttl %s, expiry-grace %s, kill-after %s):\n%s",
		DefaultTiming.HeartbeatTTL, DefaultTiming.ExpiryGrace, DefaultTiming.KillAfter, b.String())
	if d := os.Getenv("GPUPOOL_ROBUSTNESS_OUT"); d != "" {
		os.MkdirAll(d, 0o755)
		os.WriteFile(filepath.Join(d, "double-holder.md"), []byte(b.String()), 0o644)
	}
}

func startSafetyCluster(t *testing.T, timing Timing) (*Cluster, Network) {
	t.Helper()
	nw, why := NewNetwork(os.Getenv("GPUPOOL_ROBUSTNESS_NET") == "proxy")
	t.Cleanup(func() { nw.Close() })
	t.Logf("network %s: %s (%s)", nw.Kind(), nw.Describe(), why)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cl, err := StartCluster(ctx, ClusterOptions{Bin: binary, Dir: t.TempDir(), Net: nw, Brokers: 3, Agents: 1, Timing: timing})
	t.Cleanup(cl.Stop)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("%s", cl.logTails())
		}
	})
	if err != nil {
		t.Fatalf("start cluster: %v", err)
	}
	return cl, nw
}

func runDoubleHolderTrial(t *testing.T, cl *Cluster, nw Network, tr doubleHolderTrial, timing Timing, n int) doubleHolderResult {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	agent := cl.Agents[0]

	// The first holder: a whole GPU, renewed by a holder that is never
	// cut off, and its workload. The agent may still be reconnecting
	// after the last trial (its backoff), and a lease granted meanwhile
	// ends when the host goes down again: then take another.
	var l1 *gpupoolv1.Lease
	for attempt := 1; l1 == nil; attempt++ {
		if attempt > 5 {
			t.Fatalf("the agent took none of %d leases", attempt-1)
		}
		if err := cl.WaitHosts(ctx, 1, 60*time.Second); err != nil {
			t.Fatal(err)
		}
		resp, err := cl.Client.Lease.Acquire(ctx, &gpupoolv1.AcquireRequest{Request: &gpupoolv1.LeaseRequest{
			Count: 1, Exclusive: true, TtlMs: tr.leaseTTL.Milliseconds(), Holder: "holder-1", RequestId: fmt.Sprintf("holder-1-%d", time.Now().UnixNano()),
		}})
		if err != nil {
			t.Fatal(err)
		}
		err = proc.Poll(ctx, 30*time.Second, func(ctx context.Context) error {
			if _, err := os.Stat(filepath.Join(cl.opts.Dir, agent.Node, "leases", resp.Lease.Id+".json")); err == nil {
				return nil
			}
			r, err := cl.Client.Lease.Get(ctx, &gpupoolv1.GetLeaseRequest{LeaseId: resp.Lease.Id})
			if err == nil && r.Lease.State != gpupoolv1.LeaseState_LEASE_STATE_GRANTED {
				return proc.GiveUp{Err: errEndedBeforeTaken}
			}
			return fmt.Errorf("the agent has not taken lease %s yet", resp.Lease.Id)
		})
		switch {
		case err == nil:
			l1 = resp.Lease
		case errors.Is(err, errEndedBeforeTaken):
			t.Logf("lease %s ended before the agent took it (the host went down meanwhile); taking another", resp.Lease.Id)
		default:
			t.Fatal(err)
		}
	}
	device := l1.Slices[0].Device
	w1 := startHolderProcess(t, l1.Id)
	renewCtx, stopRenew := context.WithCancel(ctx)
	defer stopRenew()
	go func() {
		for clock.Sleep(renewCtx, clock.Real, 300*time.Millisecond) {
			if r, err := keepAliveOnce(renewCtx, cl.Client, l1.Id); err == nil && r.Error != "" {
				return
			}
		}
	}()

	cut := time.Now()
	for j := range cl.Brokers {
		for _, err := range []error{nw.Block(agent.Node, brokerNode(j)), nw.Block(brokerNode(j), agent.Node)} {
			if err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := proc.Poll(ctx, 60*time.Second, func(ctx context.Context) error {
		r, err := cl.Client.Lease.Get(ctx, &gpupoolv1.GetLeaseRequest{LeaseId: l1.Id})
		if err != nil {
			return err
		}
		if r.Lease.State != tr.healWhen {
			return fmt.Errorf("lease %s is %v, want %v", l1.Id, r.Lease.State, tr.healWhen)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}

	// The second holder asks for the same GPU every 10ms from just
	// before the agent comes back until it gets it.
	granted := make(chan time.Time, 1)
	go func() {
		for ctx.Err() == nil {
			call := time.Now()
			cctx, ccancel := context.WithTimeout(ctx, 5*time.Second)
			r, err := cl.Client.Lease.Acquire(cctx, &gpupoolv1.AcquireRequest{Request: &gpupoolv1.LeaseRequest{
				Count: 1, Exclusive: true, TtlMs: 60_000, Holder: "holder-2", RequestId: fmt.Sprintf("holder-2-%d", call.UnixNano()),
				Constraints: &gpupoolv1.Constraints{Devices: []string{device}},
			}})
			ccancel()
			if err == nil && r.Lease.State == gpupoolv1.LeaseState_LEASE_STATE_GRANTED {
				// The leader stamps CreatedAtMs after it placed the lease,
				// on the state in which the host was eligible again; the
				// call may have started long before that (a loaded
				// machine). The later of the two is when the GPU could
				// first have been handed over, to the stamp's millisecond.
				at := call
				if c := time.UnixMilli(r.Lease.CreatedAtMs); c.After(at) {
					at = c
				}
				granted <- at
				cl.Client.Lease.Release(ctx, &gpupoolv1.ReleaseRequest{LeaseId: r.Lease.Id})
				return
			}
			// 10ms between attempts: the resolution of the measurement,
			// without a flood of acquires that slows the leader down.
			clock.Sleep(ctx, clock.Real, 10*time.Millisecond)
		}
	}()
	healed := time.Since(cut)
	if err := nw.Heal(); err != nil {
		t.Fatal(err)
	}
	var grant time.Time
	select {
	case grant = <-granted:
	case <-time.After(60 * time.Second):
		t.Fatalf("the GPU was never granted again")
	}
	select {
	case <-w1.exited:
	case <-time.After(60 * time.Second):
		t.Fatalf("the first holder's workload still runs 60s after the second holder got its GPU")
	}
	stopRenew()
	res := doubleHolderResult{name: tr.name, timing: timing, leaseTTL: tr.leaseTTL, healed: healed, stopped: w1.at.Sub(cut), grant: grant.Sub(cut)}
	t.Logf("trial %d: %s: holder 1 stopped %s after the cut; agent back from %s; holder 2 granted %s after the cut; gap %s",
		n+1, tr.name, res.stopped.Round(time.Millisecond), healed.Round(time.Millisecond), res.grant.Round(time.Millisecond), res.gap().Round(time.Millisecond))
	return res
}
