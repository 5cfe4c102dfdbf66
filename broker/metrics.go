package broker

import (
	"time"

	"github.com/hashicorp/raft"
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
	// renewVerifyFailures counts renewals refused because this server
	// could not confirm that it still leads.
	renewVerifyFailures prometheus.Counter
}

func newMetrics(s *Server) *metrics {
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
	}
	m.reg.MustRegister(m.acquires, m.latency, m.renewVerifyFailures, stateCollector{s},
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

func (m *metrics) observeAcquire(start time.Time, err error) {
	m.acquires.WithLabelValues(status.Code(err).String()).Inc()
	if err == nil {
		m.latency.Observe(time.Since(start).Seconds())
	}
}

// Metrics is the server's Prometheus registry.
func (s *Server) Metrics() *prometheus.Registry { return s.metrics.reg }

// stateCollector reads the pool's gauges from the state at scrape time.
type stateCollector struct{ s *Server }

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
	st := c.s.fsm.State()
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
	if c.s.raft.State() == raft.Leader {
		leader = 1
	}
	ch <- prometheus.MustNewConstMetric(descLeader, prometheus.GaugeValue, leader)
	ch <- prometheus.MustNewConstMetric(descApplied, prometheus.GaugeValue, float64(st.Index()))
	ch <- prometheus.MustNewConstMetric(descUnknown, prometheus.CounterValue, float64(c.s.fsm.UnknownCommands()))
	var ttl, hb, ld float64
	if ls := c.s.currentLeader(); ls != nil {
		ttl, hb, ld = float64(ls.ttl.Len()), float64(ls.heartbeat.Len()), float64(ls.lockDelay.Len())
	}
	ch <- prometheus.MustNewConstMetric(descTimerLens, prometheus.GaugeValue, ttl, "lease_ttl")
	ch <- prometheus.MustNewConstMetric(descTimerLens, prometheus.GaugeValue, hb, "heartbeat")
	ch <- prometheus.MustNewConstMetric(descTimerLens, prometheus.GaugeValue, ld, "lock_delay")
}
