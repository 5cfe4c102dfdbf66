package scale

import (
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/gpupool/gpupool/bench/report"
)

// results is what a run measured; it is written as JSON as is.
type results struct {
	Benchmark string      `json:"benchmark"`
	Config    config      `json:"config"`
	Env       environment `json:"env"`
	Metrics   metrics     `json:"metrics"`
	// RaftSnapshot is the newest snapshot Raft itself wrote to the data
	// dir; nil when it has written none.
	RaftSnapshot   *raftSnapshot `json:"raft_snapshot"`
	ElapsedSeconds float64       `json:"elapsed_seconds"`
	LoadAverage    string        `json:"load_average"`
}

type config struct {
	Hosts        int     `json:"hosts"`
	GPUsPerHost  int     `json:"gpus_per_host"`
	Leases       int     `json:"leases"`
	Clients      int     `json:"clients"`
	GrantBudget  string  `json:"grant_budget"`
	Seed         uint64  `json:"seed"`
	Brokers      int     `json:"brokers"`
	HeartbeatTTL string  `json:"heartbeat_ttl"`
	LeaseTTL     string  `json:"lease_ttl"`
	SliceMiB     []int64 `json:"slice_mib_choices"`
	SlicePercent []int32 `json:"slice_percent_choices"`
}

type environment struct {
	GoVersion string `json:"go_version"`
	OS        string `json:"os"`
	Arch      string `json:"arch"`
	CPUs      int    `json:"cpus"`
}

type metrics struct {
	RegisterSeconds float64 `json:"register_seconds"`
	HostsPerSecond  float64 `json:"hosts_per_second"`
	RegisterP50Ms   float64 `json:"register_p50_ms"`
	RegisterP99Ms   float64 `json:"register_p99_ms"`
	LeasesGranted   int     `json:"leases_granted"`
	GrantSeconds    float64 `json:"grant_seconds"`
	LeasesPerSecond float64 `json:"leases_per_second"`
	AcquireP50Ms    float64 `json:"acquire_p50_ms"`
	AcquireP99Ms    float64 `json:"acquire_p99_ms"`
	AppliedIndex    uint64  `json:"applied_index"`

	RSSEmptyMiB     float64 `json:"rss_empty_mib"`
	RSSLoadedMiB    float64 `json:"rss_loaded_mib"`
	PeakRSSMiB      float64 `json:"peak_rss_mib"`
	RSSRestartedMiB float64 `json:"rss_restarted_mib"`

	SnapshotSaveSeconds float64 `json:"snapshot_save_seconds"`
	SnapshotSaveBytes   int64   `json:"snapshot_save_bytes"`
	RaftDBBytes         int64   `json:"raft_db_bytes"`

	RestartToReadSeconds    float64 `json:"restart_to_consistent_read_seconds"`
	RestartToAcquireSeconds float64 `json:"restart_to_acquire_seconds"`
	ListSeconds             float64 `json:"list_all_seconds"`
}

// writeResults writes scale.json and scale.md (also to stdout) to dir,
// creating it.
func writeResults(dir string, res *results, stdout io.Writer) error {
	var md strings.Builder
	writeMarkdown(&md, res)
	_, err := report.Write(report.Results{Dir: dir, Name: resultsName(res.Config.Brokers), JSON: res, Markdown: md.String(), Echo: stdout})
	return err
}

func writeMarkdown(w io.Writer, res *results) {
	c, m := res.Config, res.Metrics
	fmt.Fprintf(w, "# Broker at scale\n\n")
	procs := "one broker process"
	if c.Brokers > 1 {
		procs = fmt.Sprintf("a cluster of %d broker processes (the leader's RSS; no restart)", c.Brokers)
	}
	fmt.Fprintf(w, "%d hosts × %d GPUs (%d GPUs), %d of %d leases granted, %s.\n\n", c.Hosts, c.GPUsPerHost, c.Hosts*c.GPUsPerHost, m.LeasesGranted, c.Leases, procs)
	if m.LeasesGranted < c.Leases {
		rest := time.Duration(float64(c.Leases-m.LeasesGranted)/m.LeasesPerSecond) * time.Second
		fmt.Fprintf(w, "**Partial load:** --grant-budget %s ran out after %d of the %d leases; at the measured %.1f leases/s the other %d would take about %s more. "+
			"Memory, snapshot and restart below are for the pool as loaded.\n\n", c.GrantBudget, m.LeasesGranted, c.Leases, m.LeasesPerSecond, c.Leases-m.LeasesGranted, rest.Round(time.Minute))
	}
	fmt.Fprintf(w, "| metric | value |\n|---|---:|\n")
	fmt.Fprintf(w, "| register hosts | %.1f s (%.0f hosts/s; p50 %.1f ms, p99 %.1f ms) |\n", m.RegisterSeconds, m.HostsPerSecond, m.RegisterP50Ms, m.RegisterP99Ms)
	fmt.Fprintf(w, "| grant leases | %d in %.1f s (%.1f leases/s; p50 %.1f ms, p99 %.1f ms) |\n", m.LeasesGranted, m.GrantSeconds, m.LeasesPerSecond, m.AcquireP50Ms, m.AcquireP99Ms)
	fmt.Fprintf(w, "| Raft applied index after loading | %d |\n", m.AppliedIndex)
	fmt.Fprintf(w, "| broker RSS: empty → loaded (peak) | %.0f MiB → %.0f MiB (%.0f MiB) |\n", m.RSSEmptyMiB, m.RSSLoadedMiB, m.PeakRSSMiB)
	fmt.Fprintf(w, "| operator snapshot save (size, time) | %s, %.2f s |\n", mib(m.SnapshotSaveBytes), m.SnapshotSaveSeconds)
	if s := res.RaftSnapshot; s != nil {
		fmt.Fprintf(w, "| newest Raft snapshot in the data dir (index, size, write time) | %d of %d, %s, %.2f s |\n", s.Index, m.AppliedIndex, mib(s.Size), s.WriteSeconds)
	} else {
		fmt.Fprintf(w, "| newest Raft snapshot in the data dir | none taken yet |\n")
	}
	fmt.Fprintf(w, "| raft.db (bbolt log) size | %s |\n", mib(m.RaftDBBytes))
	if c.Brokers == 1 {
		fmt.Fprintf(w, "| SIGKILL + restart → consistent Get answers | %.2f s |\n", m.RestartToReadSeconds)
		fmt.Fprintf(w, "| SIGKILL + restart → Acquire granted | %.2f s |\n", m.RestartToAcquireSeconds)
		fmt.Fprintf(w, "| broker RSS after the restart | %.0f MiB |\n", m.RSSRestartedMiB)
		fmt.Fprintf(w, "| consistent List of every lease, after the restart | %.2f s |\n", m.ListSeconds)
	}
	fmt.Fprintf(w, "| load average at the end | %s |\n\n", res.LoadAverage)
	fmt.Fprintf(w, "Setup: %d broker process(es) (`--bootstrap-expect`, Raft log in bbolt with fsync, snapshot looked for every 2–4 s "+
		"and taken once 2048 entries are new, 4096 trailing logs kept) started with `--heartbeat-ttl %s` so that hosts registered through the "+
		"agent API's Register RPC, with nothing heartbeating for them, stay ready; %d concurrent clients over one gRPC connection; "+
		"leases of one slice drawn (seed %d) from %v MiB × %v %% compute, TTL %s, never renewed; %s %s/%s, %d CPUs; the run took %s.\n\n",
		c.Brokers, c.HeartbeatTTL, c.Clients, c.Seed, c.SliceMiB, c.SlicePercent, c.LeaseTTL, res.Env.GoVersion, res.Env.OS, res.Env.Arch, res.Env.CPUs,
		time.Duration(res.ElapsedSeconds*float64(time.Second)).Round(time.Second))
	fmt.Fprintln(w, "RSS is VmRSS from /proc/PID/status after a GC of the benchmark (not the broker); peak is VmHWM. "+
		"Operator snapshot save is `gpupool operator snapshot save` through the API: a barrier, then the leader's state encoded and streamed. "+
		"The broker exposes no API that makes Raft take a snapshot, so the Raft snapshot reported is the newest Raft took on its own schedule; "+
		"its write time is from its creation (in its name) to its meta.json's last write. "+
		"Restart times run from starting the process, SIGKILLed, on its data dir: Raft restores the snapshot and replays the log after it.")
}

// resultsName is the results' file name, without extension, for a run on
// brokers brokers.
func resultsName(brokers int) string {
	if brokers == 1 {
		return "scale"
	}
	return fmt.Sprintf("scale-%dbrokers", brokers)
}

func mib(b int64) string { return fmt.Sprintf("%.1f MiB", float64(b)/(1<<20)) }
