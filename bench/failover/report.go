package failover

import (
	"fmt"
	"io"
	"os"
	"sort"
	"strings"
	"time"

	"github.com/gpupool/gpupool/bench/plot"
	"github.com/gpupool/gpupool/bench/report"
	"github.com/gpupool/gpupool/broker"
)

// results is what a run measured; it is written as JSON as is.
type results struct {
	Benchmark string        `json:"benchmark"`
	Config    config        `json:"config"`
	Raft      raftSettings  `json:"raft"`
	Env       environment   `json:"env"`
	Rounds    []roundResult `json:"rounds"`
	Summary   summary       `json:"summary"`
	// Curves are the acquires per second around each kill, for the chart.
	Curves []rateCurve `json:"curves"`
	// Failure says why the run stopped early; empty when every round ran.
	Failure string `json:"failure,omitempty"`
	// ElapsedSeconds is how long the whole run took, setup included.
	ElapsedSeconds float64 `json:"elapsed_seconds"`
}

type config struct {
	Rounds       int    `json:"rounds"`
	Clients      int    `json:"clients"`
	Hold         int    `json:"hold"`
	SettleMs     int64  `json:"settle_ms"`
	TTLMs        int64  `json:"ttl_ms"`
	Seed         uint64 `json:"seed"`
	SliceMiB     int64  `json:"slice_mib"`
	SlicePercent int32  `json:"slice_percent"`
	Brokers      int    `json:"brokers"`
	Agents       int    `json:"agents"`
	AgentSpec    string `json:"agent_spec"`
	// RestartAgents: the agents were restarted after every kill.
	RestartAgents bool `json:"restart_agents"`
}

// raftSettings are the hashicorp/raft timings the brokers run with
// (broker/raftconfig.go).
type raftSettings struct {
	Source             string `json:"source"`
	HeartbeatTimeoutMs int    `json:"heartbeat_timeout_ms"`
	ElectionTimeoutMs  int    `json:"election_timeout_ms"`
	LeaderLeaseMs      int    `json:"leader_lease_timeout_ms"`
	CommitTimeoutMs    int    `json:"commit_timeout_ms"`
}

var brokerRaft = raftSettings{
	Source:             "broker/raftconfig.go (hashicorp/raft v1.7.3, pre-vote on)",
	HeartbeatTimeoutMs: int(broker.RaftHeartbeatTimeout.Milliseconds()),
	ElectionTimeoutMs:  int(broker.RaftElectionTimeout.Milliseconds()),
	LeaderLeaseMs:      int(broker.RaftLeaderLeaseTimeout.Milliseconds()),
	CommitTimeoutMs:    int(broker.RaftCommitTimeout.Milliseconds()),
}

type environment struct {
	GoVersion string `json:"go_version"`
	OS        string `json:"os"`
	Arch      string `json:"arch"`
	CPUs      int    `json:"cpus"`
	// LoadAvg is /proc/loadavg at the start and at the end of the run:
	// other work on the machine slows elections down.
	LoadAvg []string `json:"loadavg"`
}

// loadAvg is /proc/loadavg, trimmed; "" where there is none.
func loadAvg() string {
	b, _ := os.ReadFile("/proc/loadavg")
	return strings.TrimSpace(string(b))
}

type roundResult struct {
	Round     int    `json:"round"`
	Killed    string `json:"killed"`
	NewLeader string `json:"new_leader"`
	// KillAtS is when the kill came, in seconds since the round's load
	// started.
	KillAtS float64 `json:"kill_at_s"`
	// KillToAcquireMs is from the SIGKILL to the return of the first
	// Acquire that was sent after it and returned OK.
	KillToAcquireMs float64 `json:"kill_to_acquire_ms"`
	// KillToLeaderMs is from the SIGKILL until both survivors, polled
	// every 20ms, name the same new leader.
	KillToLeaderMs float64 `json:"kill_to_leader_ms"`
	// RestartCatchUpMs is from restarting the killed broker until it
	// follows the new leader and has applied its commit index.
	RestartCatchUpMs float64        `json:"restart_catch_up_ms"`
	AcquiresOK       int            `json:"acquires_ok"`
	AcquireErrors    map[string]int `json:"acquire_errors"`
	Releases         int            `json:"releases"`
	ReleaseErrors    int            `json:"release_errors"`
	// Checked is how many acknowledged, unreleased leases (of every round
	// so far) were checked.
	Checked int `json:"checked"`
	// Lost are checked leases the leader does not have as granted;
	// LostOnRestarted those the restarted broker's local state lacks.
	Lost            []string `json:"lost"`
	LostOnRestarted []string `json:"lost_on_restarted"`
	// ReleasesNotApplied are leases whose Release returned OK that are
	// still granted.
	ReleasesNotApplied []string `json:"releases_not_applied"`
}

type summary struct {
	KillToAcquireP50Ms float64  `json:"kill_to_acquire_p50_ms"`
	KillToAcquireMaxMs float64  `json:"kill_to_acquire_max_ms"`
	AcquiresOK         int      `json:"acquires_ok"`
	Checked            int      `json:"checked_last_round"`
	Lost               int      `json:"lost"`
	LostLeaseIDs       []string `json:"lost_lease_ids"`
	ReleasesNotApplied int      `json:"releases_not_applied"`
}

// rateCurve is a round's OK acquires per second, in bins of binSeconds,
// at seconds relative to the kill.
type rateCurve struct {
	Round int       `json:"round"`
	T     []float64 `json:"t_s"`
	Rate  []float64 `json:"acquires_per_s"`
}

const binSeconds = 0.1

func curve(rl *roundLoad, round int) rateCurve {
	rl.mu.Lock()
	defer rl.mu.Unlock()
	c := rateCurve{Round: round}
	if rl.killAt.IsZero() || len(rl.okAt) == 0 {
		return c
	}
	kill := rl.killAt.Sub(rl.start).Seconds()
	last := rl.okAt[0]
	for _, t := range rl.okAt {
		last = max(last, t)
	}
	n := int(last/binSeconds) + 1
	counts := make([]float64, n)
	for _, t := range rl.okAt {
		counts[int(t/binSeconds)]++
	}
	for i, k := range counts {
		c.T = append(c.T, float64(i)*binSeconds-kill)
		c.Rate = append(c.Rate, k/binSeconds)
	}
	return c
}

func (r *results) finish(start time.Time) {
	r.Summary = summarize(r.Rounds)
	r.ElapsedSeconds = time.Since(start).Seconds()
	r.Env.LoadAvg = append(r.Env.LoadAvg, loadAvg())
}

// writeResults writes failover.json, failover.md (also to stdout) and
// failover.png to dir, creating it.
func writeResults(dir string, res *results, stdout io.Writer) error {
	var md strings.Builder
	writeMarkdown(&md, res)
	var series []plot.Series
	for _, c := range res.Curves {
		if len(c.T) > 0 {
			series = append(series, plot.Series{Name: fmt.Sprintf("round %d", c.Round), X: c.T, Y: c.Rate, Step: true})
		}
	}
	var charts []report.Chart
	if len(series) > 0 {
		charts = append(charts, report.Chart{Name: "failover", Chart: plot.Chart{Title: "Acquires around a leader SIGKILL (at 0)",
			XLabel: "seconds since the kill", YLabel: fmt.Sprintf("OK acquires per second (%.0f ms bins)", binSeconds*1000), Series: series}})
	}
	_, err := report.Write(report.Results{Dir: dir, Name: "failover", JSON: res, Markdown: md.String(), Echo: stdout, Charts: charts})
	return err
}

func writeMarkdown(w io.Writer, res *results) {
	s, c := res.Summary, res.Config
	fmt.Fprintf(w, "# Leader failover\n\n")
	if res.Failure != "" {
		fmt.Fprintf(w, "**The run failed after %d of %d rounds:** %s\n\n", len(res.Rounds), c.Rounds, res.Failure)
	}
	fmt.Fprintf(w, "| metric | value |\n|---|---:|\n")
	fmt.Fprintf(w, "| rounds (leader SIGKILLs) | %d of %d |\n", len(res.Rounds), c.Rounds)
	fmt.Fprintf(w, "| kill → next OK acquire, p50 | %.0f ms |\n", s.KillToAcquireP50Ms)
	fmt.Fprintf(w, "| kill → next OK acquire, max | %.0f ms |\n", s.KillToAcquireMaxMs)
	fmt.Fprintf(w, "| acquires OK (all rounds) | %d |\n", s.AcquiresOK)
	fmt.Fprintf(w, "| acknowledged unreleased leases checked (last round) | %d |\n", s.Checked)
	fmt.Fprintf(w, "| **acknowledged leases lost** | **%d** |\n", s.Lost)
	fmt.Fprintf(w, "| releases acknowledged but not applied | %d |\n\n", s.ReleasesNotApplied)

	fmt.Fprintf(w, "| round | killed | new leader | kill → leader agreed (ms) | kill → next acquire (ms) | restart → caught up (ms) | acquires OK | acquire errors | releases OK/failed | checked | lost |\n")
	fmt.Fprintf(w, "|---:|---|---|---:|---:|---:|---:|---|---:|---:|---:|\n")
	for _, r := range res.Rounds {
		fmt.Fprintf(w, "| %d | %s | %s | %.0f | %.0f | %.0f | %d | %s | %d/%d | %d | %d |\n",
			r.Round, r.Killed, r.NewLeader, r.KillToLeaderMs, r.KillToAcquireMs, r.RestartCatchUpMs,
			r.AcquiresOK, formatCounts(r.AcquireErrors), r.Releases, r.ReleaseErrors, r.Checked, len(r.Lost)+len(r.LostOnRestarted))
	}
	fmt.Fprintf(w, "\nSetup: %d broker processes (Raft log in bbolt, fsync on) and %d simulated agents (%s each) on loopback; "+
		"%d clients acquiring %d MiB / %d %% slices (TTL %s, never renewed) with fresh request ids, each releasing a random lease of its own "+
		"once it holds more than %d; %s of load before each kill and after the first acquire after it; seed %d; %s %s/%s, %d CPUs, load average %s (start / end); the run took %s.\n\n",
		c.Brokers, c.Agents, c.AgentSpec, c.Clients, c.SliceMiB, c.SlicePercent, time.Duration(c.TTLMs)*time.Millisecond, c.Hold,
		time.Duration(c.SettleMs)*time.Millisecond, c.Seed, res.Env.GoVersion, res.Env.OS, res.Env.Arch, res.Env.CPUs, strings.Join(res.Env.LoadAvg, " / "),
		time.Duration(res.ElapsedSeconds*float64(time.Second)).Round(time.Second))
	if c.RestartAgents {
		fmt.Fprintf(w, "**--restart-agents:** both agents were restarted (on their data dirs) after every kill, once the load stopped and before the checks, "+
			"to work around agents whose heartbeat stream hangs when the leader dies. Without it, a run measures that bug too.\n\n")
	}
	fmt.Fprintf(w, "Raft timings: %s — heartbeat timeout %d ms, election timeout %d ms, leader lease timeout %d ms, commit timeout %d ms. "+
		"A follower starts an election after a randomized 1–2× heartbeat timeout without contact.\n\n",
		res.Raft.Source, res.Raft.HeartbeatTimeoutMs, res.Raft.ElectionTimeoutMs, res.Raft.LeaderLeaseMs, res.Raft.CommitTimeoutMs)
	fmt.Fprintf(w, "\"kill → next acquire\" is from the SIGKILL to the return of the first Acquire *sent after* the kill that returned OK "+
		"(a broker that knows no leader holds the call until one is elected and answers from it; the Go client retries Unavailable with backoff from 25 ms, doubling to 250 ms, within a %s deadline per call). "+
		"\"Lost\" counts leases whose Acquire returned OK, not released by their client, that a consistent List on the new leader, "+
		"or a local List on the restarted broker after it caught up, does not show as granted.\n", callTimeout)
}

func formatCounts[V int | int32](m map[string]V) string {
	if len(m) == 0 {
		return "–"
	}
	var parts []string
	for k, v := range m {
		parts = append(parts, fmt.Sprintf("%s×%d", k, v))
	}
	sort.Strings(parts)
	return strings.Join(parts, ", ")
}
