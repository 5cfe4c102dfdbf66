package broker

import (
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"google.golang.org/grpc/status"

	"github.com/gpupool/gpupool/broker/fsm"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// metrics are one server's Prometheus metrics, in a registry of its own
// so that several servers can live in one process (tests).
type metrics struct {
	reg      *prometheus.Registry
	acquires *prometheus.CounterVec
	latency  prometheus.Histogram

	// Fed by countLeaseEvents from this server's change feed, and by
	// proposals on the leader.
	leaseEvents *prometheus.CounterVec
	leaseEnds   *prometheus.CounterVec
	queueWait   prometheus.Histogram
	apply       prometheus.Histogram
	nd          *node
	// renewVerifyFailures counts renewals refused because this server
	// could not confirm that it still leads.
	renewVerifyFailures prometheus.Counter
	// collectedLeases counts the ended leases this server's collections
	// removed as leader.
	collectedLeases prometheus.Counter
	// logWrite times the Raft log's writes (fsync included), and
	// slowDiskTransfers counts the leaderships handed over for them.
	logWrite          prometheus.Histogram
	slowDiskTransfers prometheus.Counter
	// fullDiskTransfers counts the leaderships handed over for a full
	// data dir.
	fullDiskTransfers prometheus.Counter
}

// newMetrics registers one server's metrics. The collectors read the
// state through nd, the leader's timers through lm, and whether Raft
// says this server leads through role, at each scrape.
func newMetrics(nd *node, lm leaderMemory, role raftRole, limits *limiters) *metrics {
	m := &metrics{
		reg: prometheus.NewRegistry(),
		acquires: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "gpupool_acquire_total", Help: "Acquire calls served by this server as leader, by gRPC code.",
		}, []string{"code"}),
		latency: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "gpupool_acquire_seconds", Help: "Time to place and commit a grant on the leader.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 14),
		}),
		renewVerifyFailures: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "gpupool_renewals_unconfirmed_total", Help: "Renewals refused because this server could not confirm that it still leads.",
		}),
		collectedLeases: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "gpupool_ended_leases_collected_total", Help: "Ended leases removed from the state by this server's collections as leader (see --ended-lease-retention, --ended-leases-max).",
		}),
	}
	m.nd = nd
	m.logWrite = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name: "gpupool_raft_log_write_seconds", Help: "Time to write (and fsync) a batch of entries to this server's Raft log.",
		Buckets: prometheus.ExponentialBuckets(0.0005, 2, 14),
	})
	m.slowDiskTransfers = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "gpupool_slow_disk_leadership_transfers_total", Help: "Times this server handed leadership to a follower because its own Raft log writes were slow.",
	})
	m.fullDiskTransfers = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "gpupool_full_disk_leadership_transfers_total", Help: "Times this server handed leadership to a follower because its data dir was full.",
	})
	m.leaseEvents = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "gpupool_lease_events_total", Help: "Lease changes this server applied, by event type (granted, releasing, ended, lost, violation, ...).",
	}, []string{"type"})
	m.leaseEnds = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "gpupool_leases_ended_total", Help: "Leases this server saw end (capacity freed), by end state: released, expired or revoked.",
	}, []string{"state"})
	m.queueWait = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name: "gpupool_queue_wait_seconds", Help: "How long leases granted from the pending queue waited in it.",
		Buckets: prometheus.ExponentialBuckets(0.1, 2, 16),
	})
	m.apply = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name: "gpupool_raft_apply_seconds", Help: "On the leader: time from proposing a command to Raft to its being applied.",
		Buckets: prometheus.ExponentialBuckets(0.0005, 2, 14),
	})
	for v, name := range gpupoolv1.LeaseEventType_name {
		if v != 0 && gpupoolv1.LeaseEventType(v) != gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_SNAPSHOT {
			m.leaseEvents.WithLabelValues(eventTypeLabel(name))
		}
	}
	for _, st := range []gpupoolv1.LeaseState{gpupoolv1.LeaseState_LEASE_STATE_RELEASED, gpupoolv1.LeaseState_LEASE_STATE_EXPIRED, gpupoolv1.LeaseState_LEASE_STATE_REVOKED} {
		m.leaseEnds.WithLabelValues(stateName(st))
	}
	m.reg.MustRegister(m.leaseEvents, m.leaseEnds, m.queueWait, m.apply, poolCollector{nd: nd, leadership: lm})
	m.reg.MustRegister(m.acquires, m.latency, m.renewVerifyFailures, m.collectedLeases, stateCollector{nd: nd, leadership: lm, role: role}, limits.set.Collector(), m.logWrite, m.slowDiskTransfers, m.fullDiskTransfers,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

func (m *metrics) observeAcquire(start time.Time, err error) {
	m.acquires.WithLabelValues(status.Code(err).String()).Inc()
	if err == nil {
		m.latency.Observe(time.Since(start).Seconds())
	}
}

func (m *metrics) observeLogWrite(d time.Duration) { m.logWrite.Observe(d.Seconds()) }

// eventTypeLabel is LEASE_EVENT_TYPE_DRAIN_NOTICE as "drain_notice".
func eventTypeLabel(name string) string {
	return strings.ToLower(strings.TrimPrefix(name, "LEASE_EVENT_TYPE_"))
}

// countLeaseEvents counts the lease changes this server applies, until it
// shuts down. A subscription that falls behind is renewed: what it missed
// is not counted.
func (m *metrics) countLeaseEvents() {
	for {
		events, cancel := m.nd.fsm.Subscribe()
		for open := true; open; {
			select {
			case <-m.nd.ctx.Done():
				cancel()
				return
			case ev, ok := <-events:
				if !ok {
					open = false
					break
				}
				m.observeLeaseEvent(ev)
			}
		}
		cancel()
	}
}

func (m *metrics) observeLeaseEvent(ev fsm.Event) {
	if ev.Reset || ev.Lease == nil || ev.Type == gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_SNAPSHOT {
		return
	}
	m.leaseEvents.WithLabelValues(eventTypeLabel(ev.Type.String())).Inc()
	l := ev.Lease
	switch ev.Type {
	case gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_ENDED:
		m.leaseEnds.WithLabelValues(stateName(l.State)).Inc()
	case gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_GRANTED:
		// A grant from the queue keeps the pending lease's arrival.
		if l.CreateIndex != l.FencingToken && l.StateChangedAtMs >= l.CreatedAtMs {
			m.queueWait.Observe(float64(l.StateChangedAtMs-l.CreatedAtMs) / 1000)
		}
	}
}

// observeApply records a proposal's time to apply.
func (m *metrics) observeApply(d time.Duration) { m.apply.Observe(d.Seconds()) }

// poolCollector reads per-host and queue gauges from the state at scrape
// time.
type poolCollector struct {
	nd         *node
	leadership leaderMemory
}

var (
	descHostReady     = prometheus.NewDesc("gpupool_host_ready", "1 if the host is ready (status ready and eligible), else 0.", []string{"host", "status"}, nil)
	descHostUnhealthy = prometheus.NewDesc("gpupool_host_gpus_unhealthy", "The host's unhealthy GPUs.", []string{"host"}, nil)
	descHostGPUs      = prometheus.NewDesc("gpupool_host_gpus", "The host's GPUs.", []string{"host"}, nil)
	descHostAllocated = prometheus.NewDesc("gpupool_host_compute_allocated_ratio", "Compute allocated on the host's GPUs, 0 to 1.", []string{"host"}, nil)
	descHostHeartbeat = prometheus.NewDesc("gpupool_host_heartbeat_age_seconds", "Time since the leader last heard the host's agent (leader only).", []string{"host"}, nil)
	descQueuePending  = prometheus.NewDesc("gpupool_queue_pending", "Leases waiting in the pending queue.", nil, nil)
	descQueueOldest   = prometheus.NewDesc("gpupool_queue_oldest_wait_seconds", "How long the oldest pending lease has waited (0 when none waits).", nil, nil)
)

func (c poolCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descHostReady, descHostUnhealthy, descHostGPUs, descHostAllocated, descHostHeartbeat, descQueuePending, descQueueOldest} {
		ch <- d
	}
}

func (c poolCollector) Collect(ch chan<- prometheus.Metric) {
	st := c.nd.fsm.State()
	gauge := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}
	ages := map[string]time.Duration{}
	if ls := c.leadership.currentLeader(); ls != nil {
		now := c.nd.cfg.Clock.Now()
		ls.mu.Lock()
		for id, t := range ls.lastSeen {
			ages[id] = now.Sub(t)
		}
		ls.mu.Unlock()
	}
	byHost := map[string][]*gpupoolv1.Device{}
	for _, d := range st.Devices() {
		byHost[d.HostId] = append(byHost[d.HostId], d)
	}
	for _, h := range st.Hosts() {
		ready := 0.0
		if h.Status == gpupoolv1.HostStatus_HOST_STATUS_READY && h.Eligible {
			ready = 1
		}
		gauge(descHostReady, ready, h.Id, fsm.HostStatusName(h.Status))
		var bad, alloc float64
		devs := byHost[h.Id]
		for _, d := range devs {
			if d.Health == gpupoolv1.DeviceHealth_DEVICE_HEALTH_UNHEALTHY {
				bad++
			}
			if d.AllocatedExclusive {
				alloc += 100
			} else {
				alloc += float64(d.AllocatedComputePercent)
			}
		}
		gauge(descHostUnhealthy, bad, h.Id)
		gauge(descHostGPUs, float64(len(devs)), h.Id)
		ratio := 0.0
		if len(devs) > 0 {
			ratio = alloc / float64(100*len(devs))
		}
		gauge(descHostAllocated, ratio, h.Id)
		if age, ok := ages[h.Id]; ok {
			gauge(descHostHeartbeat, age.Seconds(), h.Id)
		}
	}
	pending, oldest := 0, int64(0)
	now := c.nd.cfg.Clock.Now().UnixMilli()
	for _, l := range st.Leases() {
		if l.State == gpupoolv1.LeaseState_LEASE_STATE_PENDING {
			pending++
			oldest = max(oldest, now-l.CreatedAtMs)
		}
	}
	gauge(descQueuePending, float64(pending))
	gauge(descQueueOldest, float64(oldest)/1000)
}

// Metrics is the server's Prometheus registry.
func (s *Server) Metrics() *prometheus.Registry { return s.metrics.reg }

// stateCollector reads the pool's gauges from the state at scrape time.
type stateCollector struct {
	nd         *node
	leadership leaderMemory
	role       raftRole
}

// raftRole tells what Raft says of this server. It is implemented by
// membership.
type raftRole interface {
	// isLeader reports whether Raft says this server leads now: true as
	// soon as it is elected, before its leader duties start.
	isLeader() bool
}

var (
	descHosts     = prometheus.NewDesc("gpupool_hosts", "Pool hosts by status.", []string{"status"}, nil)
	descGPUs      = prometheus.NewDesc("gpupool_gpus", "GPUs by model.", []string{"model"}, nil)
	descMemory    = prometheus.NewDesc("gpupool_gpu_memory_mib", "GPU memory by model, total and allocated.", []string{"model", "kind"}, nil)
	descCompute   = prometheus.NewDesc("gpupool_gpu_compute_percent", "GPU compute by model, total and allocated, in percent of one GPU.", []string{"model", "kind"}, nil)
	descLeases    = prometheus.NewDesc("gpupool_leases", "Leases by state.", []string{"state"}, nil)
	descLeader    = prometheus.NewDesc("gpupool_raft_leader", "1 if this server is the Raft leader.", nil, nil)
	descApplied   = prometheus.NewDesc("gpupool_raft_applied_index", "Raft index of the last applied command.", nil, nil)
	descUnknown   = prometheus.NewDesc("gpupool_fsm_unknown_commands_total", "Log entries of command types this server's binary does not know, which it did not apply (upgrade it).", nil, nil)
	descTimerLens = prometheus.NewDesc("gpupool_leader_timers", "Deadlines the leader tracks, by kind (0 on followers).", []string{"kind"}, nil)
)

func (c stateCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descHosts, descGPUs, descMemory, descCompute, descLeases, descLeader, descApplied, descUnknown, descTimerLens} {
		ch <- d
	}
}

func (c stateCollector) Collect(ch chan<- prometheus.Metric) {
	st := c.nd.fsm.State()
	hosts := map[string]float64{}
	for _, v := range gpupoolv1.HostStatus_value {
		if v != 0 {
			hosts[fsm.HostStatusName(gpupoolv1.HostStatus(v))] = 0
		}
	}
	for _, h := range st.Hosts() {
		hosts[fsm.HostStatusName(h.Status)]++
	}
	for k, v := range hosts {
		ch <- prometheus.MustNewConstMetric(descHosts, prometheus.GaugeValue, v, k)
	}
	type agg struct{ gpus, mem, memAlloc, comp, compAlloc float64 }
	models := map[string]*agg{}
	for _, d := range st.Devices() {
		a := models[d.Model]
		if a == nil {
			a = &agg{}
			models[d.Model] = a
		}
		a.gpus++
		a.mem += float64(d.MemoryMib)
		a.memAlloc += float64(d.AllocatedMemoryMib)
		a.comp += 100
		a.compAlloc += float64(d.AllocatedComputePercent)
	}
	for model, a := range models {
		ch <- prometheus.MustNewConstMetric(descGPUs, prometheus.GaugeValue, a.gpus, model)
		ch <- prometheus.MustNewConstMetric(descMemory, prometheus.GaugeValue, a.mem, model, "total")
		ch <- prometheus.MustNewConstMetric(descMemory, prometheus.GaugeValue, a.memAlloc, model, "allocated")
		ch <- prometheus.MustNewConstMetric(descCompute, prometheus.GaugeValue, a.comp, model, "total")
		ch <- prometheus.MustNewConstMetric(descCompute, prometheus.GaugeValue, a.compAlloc, model, "allocated")
	}
	leases := map[string]float64{}
	for _, l := range st.Leases() {
		leases[stateName(l.State)]++
	}
	for k, v := range leases {
		ch <- prometheus.MustNewConstMetric(descLeases, prometheus.GaugeValue, v, k)
	}
	leader := 0.0
	if c.role.isLeader() {
		leader = 1
	}
	ch <- prometheus.MustNewConstMetric(descLeader, prometheus.GaugeValue, leader)
	ch <- prometheus.MustNewConstMetric(descApplied, prometheus.GaugeValue, float64(st.Index()))
	ch <- prometheus.MustNewConstMetric(descUnknown, prometheus.CounterValue, float64(c.nd.fsm.UnknownCommands()))
	var ttl, hb, ld float64
	if ls := c.leadership.currentLeader(); ls != nil {
		ttl, hb, ld = float64(ls.ttl.Len()), float64(ls.heartbeat.Len()), float64(ls.lockDelay.Len())
	}
	ch <- prometheus.MustNewConstMetric(descTimerLens, prometheus.GaugeValue, ttl, "lease_ttl")
	ch <- prometheus.MustNewConstMetric(descTimerLens, prometheus.GaugeValue, hb, "heartbeat")
	ch <- prometheus.MustNewConstMetric(descTimerLens, prometheus.GaugeValue, ld, "lock_delay")
}
