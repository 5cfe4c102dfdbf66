package scale

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"

	"github.com/gpupool/gpupool/bench/report"
	"github.com/gpupool/gpupool/client"
	"github.com/gpupool/gpupool/internal/proc"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

const (
	brokerID = "broker-1"
	// heartbeatTTL keeps the registered hosts ready although nothing
	// heartbeats for them.
	heartbeatTTL = time.Hour
	leaseTTL     = 24 * time.Hour
	gpuModel     = "NVIDIA A100-SXM4-80GB"
	gpuMiB       = 81920
	holder       = "bench-scale"
	// callTimeout bounds one RPC of the load, retries of Unavailable
	// included.
	callTimeout = 60 * time.Second
	// progressEvery is how often a slow load logs its progress.
	progressEvery = 15 * time.Second
	// maxMsg lets a List of every lease through.
	maxMsg = 1 << 30
)

// Slice sizes the leases draw from.
var (
	sliceMiB     = []int64{2048, 4096, 8192, 16384}
	slicePercent = []int32{5, 10, 20, 25}
)

// broker is the broker processes and a client to them. proc is
// broker-1, the one the benchmark measures and restarts; others are the
// rest of a cluster of more than one.
type broker struct {
	proc   *proc.Proc
	others []*proc.Proc
	addr   string
	c      *client.Client
}

// startBroker starts one broker, or a cluster of n that forms with
// --bootstrap-expect n; extra flags go to every broker.
func startBroker(ctx context.Context, bin, dir string, n int, extra ...string) (*broker, error) {
	addrs := make([]string, n)
	raftAddrs := make([]string, n)
	for i := range n {
		var err error
		if addrs[i], err = proc.FreeAddr("127.0.0.1"); err != nil {
			return nil, err
		}
		if raftAddrs[i], err = proc.FreeAddr("127.0.0.1"); err != nil {
			return nil, err
		}
	}
	b := &broker{addr: addrs[0]}
	for i := range n {
		id := fmt.Sprintf("broker-%d", i+1)
		p := &proc.Proc{Name: id, Bin: bin, OwnGroup: true, Log: filepath.Join(dir, id+".log"), Args: []string{
			"broker", "--insecure", "--node-id", id, "--data-dir", filepath.Join(dir, id), "--bind", addrs[i], "--raft-bind", raftAddrs[i],
			"--bootstrap-expect", strconv.Itoa(n), "--heartbeat-ttl", heartbeatTTL.String(), "--log-level", "warn",
		}}
		if n > 1 {
			p.Args = append(p.Args, "--join", strings.Join(slices.Delete(slices.Clone(addrs), i, i+1), ","))
		}
		p.Args = append(p.Args, extra...)
		if i == 0 {
			b.proc = p
		} else {
			b.others = append(b.others, p)
		}
	}
	var err error
	if b.c, err = client.Dial(addrs, grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(maxMsg))); err != nil {
		return nil, err
	}
	for _, p := range b.all() {
		if err := p.Start(); err != nil {
			b.stop()
			return nil, err
		}
	}
	return b, nil
}

func (b *broker) all() []*proc.Proc { return append([]*proc.Proc{b.proc}, b.others...) }

func (b *broker) stop() {
	for _, p := range b.all() {
		p.Kill()
	}
	b.c.Close()
}

// byID returns the broker process named id, or nil.
func (b *broker) byID(id string) *proc.Proc {
	for _, p := range b.all() {
		if p.Name == id {
			return p
		}
	}
	return nil
}

// waitLeader waits until broker-1 leads (a single broker) or a leader is
// elected (a cluster), and returns the leader's id.
func (b *broker) waitLeader(ctx context.Context) (string, error) {
	var leader string
	err := proc.Poll(ctx, 120*time.Second, func(ctx context.Context) error {
		for _, p := range b.all() {
			if !p.Running() {
				return proc.GiveUp{Err: fmt.Errorf("%s exited: %s\n---- %s, last 2 KiB ----\n%s", p.Name, p.ProcessState(), p.Log, p.LogTail(2048))}
			}
		}
		r, err := b.c.Operator.RaftPeers(ctx, &gpupoolv1.RaftPeersRequest{})
		if err != nil {
			return err
		}
		if r.LeaderId == "" || (len(b.others) == 0 && r.LeaderId != brokerID) {
			return fmt.Errorf("leader %q", r.LeaderId)
		}
		leader = r.LeaderId
		return nil
	})
	return leader, err
}

// benchmark runs the whole benchmark in a temporary directory under
// opts.tmp, which it removes.
func benchmark(ctx context.Context, o options, p *report.Progress) (*results, error) {
	start := time.Now()
	dir, err := os.MkdirTemp(o.tmp, "gpupool-scale-bench-")
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
	b, err := startBroker(ctx, bin, dir, o.brokers)
	if err != nil {
		return nil, err
	}
	defer func() { b.stop() }()
	leaderID, err := b.waitLeader(ctx)
	if err != nil {
		return nil, fmt.Errorf("the broker did not start: %w", err)
	}
	leader := b.byID(leaderID)
	fail := func(what string, err error) (*results, error) {
		return nil, fmt.Errorf("%s: %w\n---- %s, last 2 KiB ----\n%s", what, err, b.proc.Log, b.proc.LogTail(2048))
	}
	p.Logf("%d broker(s), %s leads, broker-1 on %s (--heartbeat-ttl %s)", o.brokers, leaderID, b.addr, heartbeatTTL)

	res := &results{
		Benchmark: "scale",
		Config: config{Hosts: o.hosts, GPUsPerHost: o.gpusPerHost, Leases: o.leases, Clients: o.clients, GrantBudget: o.grantBudget.String(), Seed: o.seed,
			Brokers: o.brokers, HeartbeatTTL: heartbeatTTL.String(), LeaseTTL: leaseTTL.String(), SliceMiB: sliceMiB, SlicePercent: slicePercent},
		Env: environment{GoVersion: runtime.Version(), OS: runtime.GOOS, Arch: runtime.GOARCH, CPUs: runtime.NumCPU()},
	}
	m := &res.Metrics

	rssStart, _ := readMemory(leader.Pid())
	m.RSSEmptyMiB = rssStart.RSSMiB

	// Hosts.
	lat, _, d, err := parallel(ctx, o.hosts, o.clients, 0, p, "registered hosts", func(ctx context.Context, i int) error {
		_, err := b.c.Agent.Register(ctx, &gpupoolv1.RegisterRequest{Host: host(i, o.gpusPerHost)})
		return err
	})
	if err != nil {
		return fail("register hosts", err)
	}
	m.RegisterSeconds, m.HostsPerSecond = d.Seconds(), float64(o.hosts)/d.Seconds()
	m.RegisterP50Ms, m.RegisterP99Ms = percentile(lat, 50), percentile(lat, 99)

	// Leases.
	ids := make([]string, o.leases)
	lat, granted, d, err := parallel(ctx, o.leases, o.clients, o.grantBudget, p, "granted leases", func(ctx context.Context, i int) error {
		resp, err := b.c.Lease.Acquire(ctx, &gpupoolv1.AcquireRequest{Request: leaseRequest(o.seed, i)})
		if err == nil {
			ids[i] = resp.Lease.Id
		}
		return err
	})
	if err != nil {
		return fail("grant leases", err)
	}
	m.LeasesGranted = granted
	m.GrantSeconds, m.LeasesPerSecond = d.Seconds(), float64(granted)/d.Seconds()
	if granted < o.leases {
		p.Logf("--grant-budget %s spent: granted %d of %d leases; at %.1f/s the rest would take %s", o.grantBudget, granted, o.leases,
			m.LeasesPerSecond, (time.Duration(float64(o.leases-granted)/m.LeasesPerSecond) * time.Second).Round(time.Second))
	}
	m.AcquireP50Ms, m.AcquireP99Ms = percentile(lat, 50), percentile(lat, 99)

	st, err := b.c.Pool.Status(ctx, &gpupoolv1.StatusRequest{})
	if err != nil {
		return fail("status", err)
	}
	if have := int(st.LeasesByState["granted"]); int(st.HostsReady) != o.hosts || int(st.Gpus) != o.hosts*o.gpusPerHost || have != granted {
		return fail("check the pool", fmt.Errorf("the broker has %d ready hosts, %d GPUs and %d granted leases (%v); want %d, %d and %d",
			st.HostsReady, st.Gpus, have, st.LeasesByState, o.hosts, o.hosts*o.gpusPerHost, granted))
	}
	m.AppliedIndex = st.AppliedIndex
	p.Logf("pool: %d ready hosts, %d GPUs, %d granted leases, applied index %d", st.HostsReady, st.Gpus, granted, st.AppliedIndex)

	runtime.GC()
	mem, err := readMemory(leader.Pid())
	if err != nil {
		return fail("read the broker's memory", err)
	}
	m.RSSLoadedMiB, m.PeakRSSMiB = mem.RSSMiB, mem.HWMMiB
	p.Logf("broker memory: VmRSS %.0f MiB, VmHWM %.0f MiB", mem.RSSMiB, mem.HWMMiB)

	// Snapshots.
	t0 := time.Now()
	n, err := snapshotSave(ctx, b.c)
	if err != nil {
		return fail("operator snapshot save", err)
	}
	m.SnapshotSaveSeconds, m.SnapshotSaveBytes = time.Since(t0).Seconds(), n
	p.Logf("operator snapshot save: %d bytes in %.2fs", n, m.SnapshotSaveSeconds)
	snapDir := filepath.Join(dir, leaderID, "raft", "snapshots")
	if o.snapshotWait > 0 {
		p.Logf("waiting up to %s for a Raft snapshot at index %d or later", o.snapshotWait, st.AppliedIndex-2048)
		_ = proc.Poll(ctx, o.snapshotWait, func(context.Context) error {
			s, err := newestSnapshot(snapDir)
			if err == nil && s.Index+2048 < st.AppliedIndex {
				err = fmt.Errorf("newest at index %d", s.Index)
			}
			return err
		})
	}
	if s, err := newestSnapshot(snapDir); err == nil {
		res.RaftSnapshot = &s
		p.Logf("newest Raft snapshot: index %d of %d, %d bytes, written in %.2fs", s.Index, st.AppliedIndex, s.Size, s.WriteSeconds)
	} else {
		p.Logf("no Raft snapshot in %s: %v", snapDir, err)
	}
	m.RaftDBBytes = fileSize(filepath.Join(dir, leaderID, "raft", "raft.db"))
	if o.brokers > 1 {
		// The restart below times one broker holding the whole log alone;
		// a cluster's member restarting rejoins a running leader instead.
		p.Logf("%d brokers: the restart is measured on a single broker only", o.brokers)
		res.ElapsedSeconds, res.LoadAverage = time.Since(start).Seconds(), loadAverage()
		return res, nil
	}

	// Restart.
	p.Logf("killing the broker (SIGKILL) and restarting it on its data dir")
	b.proc.Kill()
	t0 = time.Now()
	if err := b.proc.Start(); err != nil {
		return fail("restart", err)
	}
	probe := ids[0]
	err = proc.Poll(ctx, 10*time.Minute, func(ctx context.Context) error {
		if !b.proc.Running() {
			return proc.GiveUp{Err: fmt.Errorf("exited: %s", b.proc.ProcessState())}
		}
		_, err := b.c.Lease.Get(ctx, &gpupoolv1.GetLeaseRequest{LeaseId: probe})
		return err
	})
	if err != nil {
		return fail("restart: consistent Get", err)
	}
	m.RestartToReadSeconds = time.Since(t0).Seconds()
	cctx, cancel := context.WithTimeout(ctx, callTimeout)
	_, err = b.c.Lease.Acquire(cctx, &gpupoolv1.AcquireRequest{Request: leaseRequest(o.seed, o.leases)})
	cancel()
	if err != nil {
		return fail("restart: acquire", err)
	}
	m.RestartToAcquireSeconds = time.Since(t0).Seconds()
	p.Logf("restarted: consistent Get after %.2fs, Acquire granted after %.2fs", m.RestartToReadSeconds, m.RestartToAcquireSeconds)
	t1 := time.Now()
	cctx, cancel = context.WithTimeout(ctx, callTimeout)
	list, err := b.c.Lease.List(cctx, &gpupoolv1.ListLeasesRequest{})
	cancel()
	if err != nil {
		return fail("restart: list", err)
	}
	m.ListSeconds = time.Since(t1).Seconds()
	if len(list.Leases) != granted+1 {
		return fail("restart: list", fmt.Errorf("%d leases after the restart, want %d", len(list.Leases), granted+1))
	}
	if mem, err := readMemory(b.proc.Pid()); err == nil {
		m.RSSRestartedMiB = mem.RSSMiB
	}
	p.Logf("consistent List of %d leases in %.2fs", len(list.Leases), m.ListSeconds)
	res.ElapsedSeconds, res.LoadAverage = time.Since(start).Seconds(), loadAverage()
	return res, nil
}

// loadAverage is the machine's 1, 5 and 15 minute load averages, or "?".
func loadAverage() string {
	b, err := os.ReadFile("/proc/loadavg")
	if f := strings.Fields(string(b)); err == nil && len(f) >= 3 {
		return strings.Join(f[:3], " ")
	}
	return "?"
}

// host returns host i with gpus GPUs.
func host(i, gpus int) *gpupoolv1.Host {
	id := fmt.Sprintf("scale-%06d", i)
	h := &gpupoolv1.Host{Id: id, Backend: "bench-scale", Address: "127.0.0.1:1", AgentVersion: "bench"}
	for g := range gpus {
		h.Devices = append(h.Devices, &gpupoolv1.Device{
			Uuid: fmt.Sprintf("GPU-%s-%02d", id, g), Index: int32(g), Model: gpuModel, MemoryMib: gpuMiB, SmCount: 108,
			PcieRoot: fmt.Sprintf("pci%d", g/2), HostId: id, Health: gpupoolv1.DeviceHealth_DEVICE_HEALTH_HEALTHY,
		})
	}
	return h
}

// leaseRequest returns lease i's request: its size depends only on seed
// and i.
func leaseRequest(seed uint64, i int) *gpupoolv1.LeaseRequest {
	r := rand.New(rand.NewPCG(seed, uint64(i)))
	return &gpupoolv1.LeaseRequest{
		Count: 1, MemoryMib: sliceMiB[r.IntN(len(sliceMiB))], ComputePercent: slicePercent[r.IntN(len(slicePercent))],
		TtlMs: leaseTTL.Milliseconds(), RequestId: fmt.Sprintf("scale-s%d-%d", seed, i), Holder: holder,
	}
}

// parallel calls f(i) for i in [0, n) from workers goroutines, in order
// of i, and returns each call's latency in ms (sorted), how many calls
// were made, and the wall time. It stops at the first error and, with a
// budget above 0, makes no call once the budget is spent: the calls made
// are then those for i in [0, made).
func parallel(ctx context.Context, n, workers int, budget time.Duration, p *report.Progress, what string, f func(context.Context, int) error) ([]float64, int, time.Duration, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var (
		next, done atomic.Int64
		lastLog    atomic.Int64 // time.Duration since start of the last time-driven log
		mu         sync.Mutex
		firstErr   error
		lat        = make([]float64, n)
		wg         sync.WaitGroup
	)
	start := time.Now()
	step := max(int64(n)/10, 1)
	for range min(workers, n) {
		wg.Go(func() {
			for {
				if budget > 0 && time.Since(start) > budget {
					return
				}
				i := int(next.Add(1) - 1)
				if i >= n || ctx.Err() != nil {
					return
				}
				t := time.Now()
				cctx, ccancel := context.WithTimeout(ctx, callTimeout)
				err := f(cctx, i)
				ccancel()
				if err != nil {
					mu.Lock()
					if firstErr == nil {
						firstErr = fmt.Errorf("call %d of %d: %w", i+1, n, err)
					}
					mu.Unlock()
					cancel()
					return
				}
				lat[i] = float64(time.Since(t).Microseconds()) / 1000
				d := done.Add(1)
				el := time.Since(start)
				if last := lastLog.Load(); d%step == 0 || int(d) == n || (el-time.Duration(last) > progressEvery && lastLog.CompareAndSwap(last, int64(el))) {
					p.Logf("%s: %d of %d (%.1f/s)", what, d, n, float64(d)/el.Seconds())
				}
			}
		})
	}
	wg.Wait()
	if firstErr != nil {
		return nil, 0, 0, firstErr
	}
	if ctx.Err() != nil {
		return nil, 0, 0, ctx.Err()
	}
	d := time.Since(start)
	made := int(min(next.Load(), int64(n)))
	lat = lat[:made]
	slices.Sort(lat)
	return lat, made, d, nil
}

// percentile returns the q-th percentile (nearest rank) of sorted; 0 for
// none.
func percentile(sorted []float64, q int) float64 {
	if len(sorted) == 0 {
		return 0
	}
	i := (q*len(sorted)+99)/100 - 1
	return sorted[max(i, 0)]
}

func snapshotSave(ctx context.Context, c *client.Client) (int64, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
	defer cancel()
	s, err := c.Operator.SnapshotSave(ctx, &gpupoolv1.SnapshotSaveRequest{})
	if err != nil {
		return 0, err
	}
	var n int64
	for {
		chunk, err := s.Recv()
		if err == io.EOF {
			return n, nil
		}
		if err != nil {
			return n, err
		}
		n += int64(len(chunk.Data))
	}
}

// memory is a process's resident memory.
type memory struct {
	RSSMiB, HWMMiB float64
}

func readMemory(pid int) (memory, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return memory{}, err
	}
	defer f.Close()
	return parseStatus(f)
}

// parseStatus reads VmRSS and VmHWM from a /proc/PID/status file.
func parseStatus(r io.Reader) (memory, error) {
	var m memory
	var found int
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), ":")
		if !ok || (k != "VmRSS" && k != "VmHWM") {
			continue
		}
		fields := strings.Fields(v)
		if len(fields) != 2 || fields[1] != "kB" {
			return m, fmt.Errorf("%s: %q: want a number of kB", k, strings.TrimSpace(v))
		}
		kb, err := strconv.ParseInt(fields[0], 10, 64)
		if err != nil {
			return m, fmt.Errorf("%s: %q: %v", k, fields[0], err)
		}
		if k == "VmRSS" {
			m.RSSMiB = float64(kb) / 1024
		} else {
			m.HWMMiB = float64(kb) / 1024
		}
		found++
	}
	if err := sc.Err(); err != nil {
		return m, err
	}
	if found != 2 {
		return m, fmt.Errorf("no VmRSS and VmHWM lines: not a Linux /proc/PID/status")
	}
	return m, nil
}

// raftSnapshot is one of Raft's snapshots in the data dir.
type raftSnapshot struct {
	Name  string `json:"name"`
	Index uint64 `json:"index"`
	Term  uint64 `json:"term"`
	Size  int64  `json:"size_bytes"`
	// WriteSeconds is from the snapshot's creation (the time in its name)
	// to its meta.json's last write: persisting the FSM's state, not the
	// FSM's own Snapshot call before it.
	WriteSeconds float64 `json:"write_seconds"`
}

// newestSnapshot returns the complete snapshot in dir with the highest
// index.
func newestSnapshot(dir string) (raftSnapshot, error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return raftSnapshot{}, err
	}
	var best raftSnapshot
	for _, e := range entries {
		if !e.IsDir() || strings.HasSuffix(e.Name(), ".tmp") {
			continue
		}
		s, err := readSnapshot(filepath.Join(dir, e.Name()))
		if err != nil {
			continue // being written, or not a snapshot
		}
		if s.Index >= best.Index {
			best = s
		}
	}
	if best.Name == "" {
		return best, fmt.Errorf("no complete snapshot")
	}
	return best, nil
}

func readSnapshot(dir string) (raftSnapshot, error) {
	meta := filepath.Join(dir, "meta.json")
	b, err := os.ReadFile(meta)
	if err != nil {
		return raftSnapshot{}, err
	}
	var m struct {
		Index, Term uint64
		Size        int64
	}
	if err := json.Unmarshal(b, &m); err != nil {
		return raftSnapshot{}, err
	}
	s := raftSnapshot{Name: filepath.Base(dir), Index: m.Index, Term: m.Term, Size: m.Size}
	st, err := os.Stat(meta)
	if err != nil {
		return s, err
	}
	if created, ok := snapshotCreated(s.Name); ok {
		s.WriteSeconds = st.ModTime().Sub(created).Seconds()
	}
	return s, nil
}

// snapshotCreated reads the creation time from a snapshot's name,
// TERM-INDEX-UNIXMILLIS as hashicorp/raft's file store names them.
func snapshotCreated(name string) (time.Time, bool) {
	parts := strings.Split(name, "-")
	if len(parts) != 3 {
		return time.Time{}, false
	}
	ms, err := strconv.ParseInt(parts[2], 10, 64)
	if err != nil {
		return time.Time{}, false
	}
	return time.UnixMilli(ms), true
}

func fileSize(path string) int64 {
	st, err := os.Stat(path)
	if err != nil {
		return 0
	}
	return st.Size()
}
