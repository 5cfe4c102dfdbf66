package robustness

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"syscall"
	"time"

	"github.com/gpupool/gpupool/internal/clock"
)

// Fault kinds, in the summary's order.
const (
	FaultKillLeader   = "kill -9 leader, restart from data dir"
	FaultKillFollower = "kill -9 follower, restart from data dir"
	FaultRestart      = "SIGTERM + restart from data dir"
	FaultPartition    = "leader partitioned from majority"
	FaultAsymmetric   = "asymmetric partition (leader hears nobody)"
	FaultSlowLink     = "slow/lossy link on a broker"
	FaultAgentCut     = "agent cut off from brokers"
	FaultPause        = "leader paused (SIGSTOP)"
)

// FaultKinds are the faults a run picks from (disk.go adds more).
var FaultKinds = []string{FaultKillLeader, FaultKillFollower, FaultRestart, FaultPartition, FaultAsymmetric, FaultSlowLink, FaultAgentCut}

// FaultCount counts one kind of fault.
type FaultCount struct {
	Injected int
	Skipped  int
	Why      string // why the last one was skipped
	Detail   string // what the last injection did, e.g. the qdisc
}

// Faults injects seeded random faults into a cluster until its context
// ends, one at a time, each followed by a full recovery.
type Faults struct {
	Cluster *Cluster
	Net     Network
	Seed    uint64
	Logf    func(format string, args ...any)

	// First are faults injected first, in order, before the random ones:
	// a short run covers them for sure.
	First []string

	quotaOnce sync.Once // the flood tenant's quota, set once
	quotaErr  error

	mu     sync.Mutex
	counts map[string]*FaultCount // guarded by mu
}

// Counts returns the faults so far, by kind.
func (f *Faults) Counts() map[string]FaultCount {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := map[string]FaultCount{}
	for k, c := range f.counts {
		out[k] = *c
	}
	return out
}

func (f *Faults) count(kind string, skipped error, detail string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	c := f.counts[kind]
	if c == nil {
		c = &FaultCount{}
		f.counts[kind] = c
	}
	if skipped != nil {
		c.Skipped++
		c.Why = skipped.Error()
		return
	}
	c.Injected++
	c.Detail = detail
}

// Run injects faults until ctx ends; it returns an error when the cluster
// did not recover from one (no leader, or hosts not ready, within 60s).
func (f *Faults) Run(ctx context.Context) error {
	f.mu.Lock()
	f.counts = map[string]*FaultCount{}
	f.mu.Unlock()
	rng := rand.New(rand.NewPCG(f.Seed, 0xfa))
	for n := 0; ; n++ {
		if !clock.Sleep(ctx, clock.Real, time.Duration(1000+rng.IntN(2000))*time.Millisecond) {
			return nil
		}
		kind := FaultKinds[rng.IntN(len(FaultKinds))]
		if n < len(f.First) {
			kind = f.First[n]
		}
		hold := time.Duration(2000+rng.IntN(4000)) * time.Millisecond
		target := rng.IntN(1 << 30)
		if err := f.inject(ctx, kind, hold, target); err != nil {
			if errors.Is(err, ErrUnsupported) {
				f.count(kind, err, "")
				continue
			}
			return fmt.Errorf("%s: %w", kind, err)
		}
		if err := f.recover(context.WithoutCancel(ctx)); err != nil {
			return fmt.Errorf("recovering from %s: %w", kind, err)
		}
	}
}

// inject applies one fault, holds it (or until ctx ends) and lifts it.
func (f *Faults) inject(ctx context.Context, kind string, hold time.Duration, target int) error {
	cl := f.Cluster
	leader, err := cl.WaitLeader(ctx, 30*time.Second)
	if err != nil {
		return err
	}
	others := func(i int) []int {
		var out []int
		for j := range cl.Brokers {
			if j != i {
				out = append(out, j)
			}
		}
		return out
	}
	holdFor := func() { clock.Sleep(ctx, clock.Real, hold) }
	switch kind {
	case FaultKillLeader, FaultKillFollower, FaultRestart:
		i := leader
		if kind != FaultKillLeader {
			o := others(leader)
			i = o[target%len(o)]
			if kind == FaultRestart {
				i = target % len(cl.Brokers)
			}
		}
		f.Logf("fault: %s: %s", kind, brokerNode(i))
		if kind == FaultRestart {
			cl.Brokers[i].Stop(stopGrace)
		} else {
			cl.Brokers[i].Kill()
		}
		f.count(kind, nil, brokerNode(i))
		holdFor()
		return cl.Brokers[i].Start()
	case FaultPartition, FaultAsymmetric:
		for _, j := range others(leader) {
			if err := f.Net.Block(brokerNode(j), brokerNode(leader)); err != nil {
				f.Net.Heal()
				if errors.Is(err, ErrUnsupported) && kind == FaultPartition {
					return f.pause(ctx, leader, hold)
				}
				return err
			}
			if kind == FaultPartition {
				if err := f.Net.Block(brokerNode(leader), brokerNode(j)); err != nil {
					f.Net.Heal()
					return err
				}
			}
		}
		f.Logf("fault: %s: %s", kind, brokerNode(leader))
		f.count(kind, nil, brokerNode(leader))
		holdFor()
		return f.Net.Heal()
	case FaultSlowLink:
		i := target % len(cl.Brokers)
		what, err := f.Net.Degrade(brokerNode(i), 100*time.Millisecond, 5)
		if err != nil {
			f.Net.Heal()
			return err
		}
		f.Logf("fault: %s: %s: %s", kind, brokerNode(i), what)
		f.count(kind, nil, what)
		holdFor()
		return f.Net.Heal()
	case FaultAgentCut:
		a := cl.Agents[target%len(cl.Agents)]
		for j := range cl.Brokers {
			for _, err := range []error{f.Net.Block(a.Node, brokerNode(j)), f.Net.Block(brokerNode(j), a.Node)} {
				if err != nil {
					f.Net.Heal()
					return err
				}
			}
		}
		f.Logf("fault: %s: %s", kind, a.Node)
		f.count(kind, nil, a.Node)
		holdFor()
		return f.Net.Heal()
	}
	return f.injectMore(ctx, kind, hold, target, leader)
}

// pause stops the leader's process for hold: from the other servers'
// side, a full partition. The proxy network uses it for FaultPartition.
func (f *Faults) pause(ctx context.Context, leader int, hold time.Duration) error {
	p := f.Cluster.Brokers[leader]
	f.Logf("fault: %s: %s", FaultPause, p.Node)
	p.Signal(syscall.SIGSTOP)
	f.count(FaultPause, nil, p.Node)
	clock.Sleep(ctx, clock.Real, hold)
	return p.Signal(syscall.SIGCONT)
}

// recover heals the network, restarts whatever is down, and waits for a
// leader and every host.
func (f *Faults) recover(ctx context.Context) error {
	if err := f.Net.Heal(); err != nil {
		return err
	}
	for _, p := range append(append([]*Proc(nil), f.Cluster.Brokers...), f.Cluster.Agents...) {
		if !p.Running() {
			if err := p.Start(); err != nil {
				return err
			}
		}
	}
	if _, err := f.Cluster.WaitLeader(ctx, 60*time.Second); err != nil {
		return err
	}
	return f.Cluster.WaitHosts(ctx, len(f.Cluster.Agents), 60*time.Second)
}
