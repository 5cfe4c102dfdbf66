package failover

import (
	"context"
	"fmt"
	"os"
	"runtime"
	"slices"
	"sort"
	"strings"
	"time"

	"google.golang.org/grpc"

	"github.com/gpupool/gpupool/bench/report"
	"github.com/gpupool/gpupool/client"
	"github.com/gpupool/gpupool/internal/proc"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// benchmark runs every round in a temporary directory under opts.tmp,
// which it removes. It returns the results so far along with an error when
// a round fails part-way.
func benchmark(ctx context.Context, o options, p *report.Progress) (*results, error) {
	start := time.Now()
	dir, err := os.MkdirTemp(o.tmp, "gpupool-failover-bench-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	p.Logf("working in %s", dir)
	bin := o.gpupool
	if bin == "" {
		p.Logf("building gpupool")
		if bin, err = report.BuildGpupool(ctx, dir); err != nil {
			return nil, err
		}
	}
	cl, err := startCluster(ctx, bin, dir, p)
	if err != nil {
		return nil, err
	}
	defer cl.stop()

	res := &results{
		Benchmark: "failover",
		Config: config{
			Rounds: o.rounds, Clients: o.clients, Hold: o.hold, SettleMs: o.settle.Milliseconds(), TTLMs: o.ttl.Milliseconds(),
			Seed: o.seed, SliceMiB: sliceMiB, SlicePercent: slicePercent, Brokers: brokers, Agents: agents, AgentSpec: agentSpec, RestartAgents: o.restartAgents,
		},
		Raft: brokerRaft,
		Env:  environment{GoVersion: runtime.Version(), OS: runtime.GOOS, Arch: runtime.GOARCH, CPUs: runtime.NumCPU(), LoadAvg: []string{loadAvg()}},
	}
	led := newLedger()
	held := make([][]string, o.clients)
	for r := 1; r <= o.rounds; r++ {
		rr, rl, err := runRound(ctx, cl, o, r, held, led, p)
		if rl != nil {
			res.Curves = append(res.Curves, curve(rl, r))
		}
		if err != nil {
			err = fmt.Errorf("round %d: %w (pool: %s)", r, err, poolState(ctx, cl))
			res.Failure = err.Error()
			res.finish(start)
			// Best effort: what the failure cost the clients.
			v := led.view()
			if lost, _, cerr := check(ctx, cl.c, v, false); cerr == nil {
				res.Summary.addLost(annotate(lost, led))
				p.Logf("after the failure: %d of %d acknowledged, unreleased leases lost", len(lost), len(v.held))
			}
			return res, fmt.Errorf("%w%s", err, cl.logTails())
		}
		res.Rounds = append(res.Rounds, rr)
		p.Logf("round %d: killed %s, next acquire after %.0f ms, new leader %s; %s restarted and caught up in %.0f ms; %d acknowledged leases checked, %d lost on the leader, %d on the restarted broker",
			r, rr.Killed, rr.KillToAcquireMs, rr.NewLeader, rr.Killed, rr.RestartCatchUpMs, rr.Checked, len(rr.Lost), len(rr.LostOnRestarted))
	}
	res.finish(start)
	return res, nil
}

// runRound runs one kill under load. The round's load is returned even
// when the round fails, for the curve.
func runRound(ctx context.Context, cl *cluster, o options, round int, held [][]string, led *ledger, p *report.Progress) (roundResult, *roundLoad, error) {
	rr := roundResult{Round: round}
	li, err := cl.leader(ctx, o.timeout)
	if err != nil {
		return rr, nil, fmt.Errorf("no leader: %w", err)
	}
	rr.Killed = brokerID(li)

	lctx, stopLoad := context.WithCancel(ctx)
	rl := newRoundLoad()
	loadDone := make(chan struct{})
	go func() {
		runLoad(lctx, cl.c, o, round, held, led, rl)
		close(loadDone)
	}()
	defer func() {
		stopLoad()
		<-loadDone
	}()
	if err := sleep(ctx, o.settle); err != nil {
		return rr, rl, err
	}
	if li2, err := cl.agreedLeader(ctx); err != nil || li2 != li {
		return rr, rl, fmt.Errorf("the leader changed under load before the kill (%s, then %v, %v)", rr.Killed, li2, err)
	}

	killAt := time.Now()
	rl.kill(killAt)
	cl.brokers[li].Kill()
	rr.KillAtS = killAt.Sub(rl.start).Seconds()

	// The survivors' own view of the election, polled locally.
	elected := make(chan time.Duration, 1)
	go func() {
		if _, err := cl.leader(lctx, o.timeout); err == nil {
			elected <- time.Since(killAt)
		}
		close(elected)
	}()
	err = proc.Poll(ctx, o.timeout, func(context.Context) error {
		if _, ok := rl.sinceKill(); !ok {
			return fmt.Errorf("no acquire sent after the kill has returned OK")
		}
		return nil
	})
	if err != nil {
		return rr, rl, err
	}
	d, _ := rl.sinceKill()
	rr.KillToAcquireMs = millis(d)
	if e, ok := <-elected; ok {
		rr.KillToLeaderMs = millis(e)
	}
	if err := sleep(ctx, o.settle); err != nil {
		return rr, rl, err
	}
	stopLoad()
	<-loadDone
	rl.mu.Lock()
	rr.AcquiresOK, rr.AcquireErrors, rr.Releases, rr.ReleaseErrors = rl.oks, rl.errs, rl.releases, rl.relErrs
	rl.mu.Unlock()

	if o.restartAgents {
		if err := cl.restartAgents(ctx, o.timeout); err != nil {
			return rr, rl, err
		}
	}
	newLeader, err := cl.leader(ctx, o.timeout)
	if err != nil {
		return rr, rl, fmt.Errorf("no leader after the kill: %w", err)
	}
	rr.NewLeader = brokerID(newLeader)

	restartAt := time.Now()
	if err := cl.brokers[li].Start(); err != nil {
		return rr, rl, err
	}
	if err := catchUp(ctx, cl, li, newLeader, o.timeout); err != nil {
		return rr, rl, fmt.Errorf("%s restarted but did not catch up: %w", rr.Killed, err)
	}
	rr.RestartCatchUpMs = millis(time.Since(restartAt))

	v := led.view()
	lost, notApplied, err := check(ctx, cl.c, v, false)
	if err != nil {
		return rr, rl, fmt.Errorf("list the leases on the leader: %w", err)
	}
	staleLost, _, err := check(ctx, cl.direct[li], v, true)
	if err != nil {
		return rr, rl, fmt.Errorf("list the leases on the restarted %s: %w", rr.Killed, err)
	}
	rr.Checked, rr.Lost, rr.LostOnRestarted, rr.ReleasesNotApplied = len(v.held), annotate(lost, led), annotate(staleLost, led), notApplied
	return rr, rl, nil
}

// annotate adds to each "id: why" when the lease was acknowledged.
func annotate(lost []string, led *ledger) []string {
	out := make([]string, len(lost))
	for i, l := range lost {
		id, _, _ := strings.Cut(l, ":")
		out[i] = l + "; " + led.describe(id)
	}
	return out
}

// poolState describes the hosts and leases, for a failure message.
func poolState(ctx context.Context, cl *cluster) string {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	st, err := cl.c.Pool.Status(ctx, &gpupoolv1.StatusRequest{})
	if err != nil {
		return fmt.Sprintf("status: %v", err)
	}
	return fmt.Sprintf("%d hosts ready, %d down; leases %s", st.HostsReady, st.HostsDown, formatCounts(st.LeasesByState))
}

// catchUp waits until broker i follows the leader and its state has what
// the leader's state had when catchUp started. It compares the state
// stores' own indexes (Status, stale): raft's applied index runs ahead of
// the FSM, which applies in its own goroutine.
func catchUp(ctx context.Context, cl *cluster, i, leader int, timeout time.Duration) error {
	ls, err := cl.direct[leader].Pool.Status(ctx, &gpupoolv1.StatusRequest{Stale: true})
	if err != nil {
		return err
	}
	return proc.Poll(ctx, timeout, func(ctx context.Context) error {
		if !cl.brokers[i].Running() {
			return proc.GiveUp{Err: fmt.Errorf("%s exited: %s", cl.brokers[i].Name, cl.brokers[i].ProcessState())}
		}
		st, err := cl.direct[i].Pool.Status(ctx, &gpupoolv1.StatusRequest{Stale: true})
		if err != nil {
			return err
		}
		if st.LeaderId != brokerID(leader) || st.AppliedIndex < ls.AppliedIndex {
			return fmt.Errorf("follows %q with its state at index %d; the leader %s's was at %d", st.LeaderId, st.AppliedIndex, brokerID(leader), ls.AppliedIndex)
		}
		return nil
	})
}

// check lists every lease through c and returns the held leases that are
// missing or no longer granted ("id: why"), and the leases whose Release
// returned OK but that are still granted.
func check(ctx context.Context, c *client.Client, v ledgerView, stale bool) (lost, notApplied []string, err error) {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	// Every lease ever granted, ended ones with their reason: tens of
	// thousands after a few rounds, more than gRPC's default 4 MiB.
	resp, err := c.Lease.List(ctx, &gpupoolv1.ListLeasesRequest{IncludeEnded: true, Stale: stale}, grpc.MaxCallRecvMsgSize(512<<20))
	if err != nil {
		return nil, nil, err
	}
	byID := make(map[string]*gpupoolv1.Lease, len(resp.Leases))
	for _, l := range resp.Leases {
		byID[l.Id] = l
	}
	return lostLeases(byID, v)
}

// lostLeases compares the ledger with the leases the brokers have.
func lostLeases(have map[string]*gpupoolv1.Lease, v ledgerView) (lost, notApplied []string, err error) {
	for _, id := range v.held {
		switch l, ok := have[id]; {
		case !ok:
			lost = append(lost, id+": not found")
		case l.State != gpupoolv1.LeaseState_LEASE_STATE_GRANTED:
			lost = append(lost, fmt.Sprintf("%s: %s (%s)", id, l.State, l.Reason))
		case l.Lost:
			lost = append(lost, id+": marked lost (its host went down)")
		}
	}
	for _, id := range v.released {
		if l, ok := have[id]; ok && l.State == gpupoolv1.LeaseState_LEASE_STATE_GRANTED {
			notApplied = append(notApplied, id)
		}
	}
	sort.Strings(lost)
	return lost, notApplied, nil
}

func sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

func millis(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

// percentile returns the q-th percentile (nearest rank) of sorted, which
// must not be empty.
func percentile(sorted []float64, q int) float64 {
	i := (q*len(sorted)+99)/100 - 1
	return sorted[max(i, 0)]
}

// summarize fills the summary from the rounds.
func summarize(rounds []roundResult) summary {
	var s summary
	var ds []float64
	seen := map[string]bool{}
	for _, r := range rounds {
		ds = append(ds, r.KillToAcquireMs)
		for _, l := range append(slices.Clone(r.Lost), r.LostOnRestarted...) {
			if !seen[l] {
				seen[l] = true
				s.LostLeaseIDs = append(s.LostLeaseIDs, l)
			}
		}
		s.ReleasesNotApplied += len(r.ReleasesNotApplied)
		s.AcquiresOK += r.AcquiresOK
	}
	if len(ds) == 0 {
		return s
	}
	if n := len(rounds); n > 0 {
		s.Checked = rounds[n-1].Checked
	}
	slices.Sort(ds)
	s.KillToAcquireP50Ms, s.KillToAcquireMaxMs = percentile(ds, 50), ds[len(ds)-1]
	s.addLost(nil)
	return s
}

// addLost adds lost leases to the summary, once each.
func (s *summary) addLost(lost []string) {
	for _, l := range lost {
		if !slices.Contains(s.LostLeaseIDs, l) {
			s.LostLeaseIDs = append(s.LostLeaseIDs, l)
		}
	}
	sort.Strings(s.LostLeaseIDs)
	s.Lost = len(s.LostLeaseIDs)
}
