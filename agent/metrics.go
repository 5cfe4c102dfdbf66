package agent

import (
	"crypto/sha256"
	"encoding/hex"
	"maps"
	"slices"
	"strconv"

	"github.com/prometheus/client_golang/prometheus"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

var (
	descConnected = prometheus.NewDesc("gpupool_agent_connected", "1 while a heartbeat stream to the brokers works.", nil, nil)
	descLeases    = prometheus.NewDesc("gpupool_agent_leases", "Leases this host enforces.", nil, nil)
	descDevices   = prometheus.NewDesc("gpupool_agent_devices", "GPUs the device backend reported at start.", []string{"backend"}, nil)

	deviceLabels     = []string{"device", "index", "model"}
	descDeviceHealth = prometheus.NewDesc("gpupool_agent_device_healthy", "1 while the GPU is healthy, 0 once an Xid, a double-bit ECC error or GPU-lost made it unhealthy.", deviceLabels, nil)
	descDeviceMemory = prometheus.NewDesc("gpupool_agent_device_memory_used_bytes", "GPU memory in use, as NVML reports it.", deviceLabels, nil)
	descDeviceTotal  = prometheus.NewDesc("gpupool_agent_device_memory_total_bytes", "GPU memory.", deviceLabels, nil)
	descDeviceUtil   = prometheus.NewDesc("gpupool_agent_device_utilization_ratio", "GPU utilisation, 0 to 1.", deviceLabels, nil)

	leaseLabels       = []string{"lease", "device"}
	descLeaseMemory   = prometheus.NewDesc("gpupool_agent_lease_memory_used_bytes", "GPU memory the lease's processes use on the device.", leaseLabels, nil)
	descLeaseLimit    = prometheus.NewDesc("gpupool_agent_lease_memory_limit_bytes", "GPU memory the lease's slice allows on the device (the whole GPU for an exclusive slice).", leaseLabels, nil)
	descLeaseProcs    = prometheus.NewDesc("gpupool_agent_lease_processes", "The lease's processes on the device.", leaseLabels, nil)
	descLeaseViolated = prometheus.NewDesc("gpupool_agent_lease_violations_total", "Times the watchdog stopped the lease's processes since the agent started.", []string{"lease"}, nil)
)

// Collector returns a Prometheus collector of the agent's state. Per-lease
// series carry the lease id only with Config.MetricsLeaseIDs; otherwise
// their lease label is "h-" and 12 hex digits of a hash of the host and
// lease ids: stable for a lease, distinct between leases, and naming no
// lease to whoever can scrape the agent.
func (a *Agent) Collector() prometheus.Collector { return agentCollector{a} }

// leaseLabel is the lease label of lease id.
func (a *Agent) leaseLabel(id string) string {
	if a.cfg.MetricsLeaseIDs {
		return id
	}
	sum := sha256.Sum256([]byte(a.cfg.HostID + "\x00" + id))
	return "h-" + hex.EncodeToString(sum[:6])
}

type agentCollector struct{ a *Agent }

func (c agentCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descConnected, descLeases, descDevices, descDeviceHealth, descDeviceMemory,
		descDeviceTotal, descDeviceUtil, descLeaseMemory, descLeaseLimit, descLeaseProcs, descLeaseViolated} {
		ch <- d
	}
	c.a.limits.Collector().Describe(ch)
}

func (c agentCollector) Collect(ch chan<- prometheus.Metric) {
	a := c.a
	a.limits.Collector().Collect(ch)
	gauge := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}
	connected := 0.0
	if a.connected.Load() {
		connected = 1
	}
	gauge(descConnected, connected)
	gauge(descLeases, float64(len(a.leases.enforced())))
	gauge(descDevices, float64(len(a.devices)), a.cfg.Backend.Name())

	const mib = 1 << 20
	for _, r := range a.deviceReports() {
		d := a.devices[r.Uuid]
		labels := []string{r.Uuid, itoa32(d.GetIndex()), d.GetModel()}
		healthy := 0.0
		if r.Health == gpupoolv1.DeviceHealth_DEVICE_HEALTH_HEALTHY {
			healthy = 1
		}
		gauge(descDeviceHealth, healthy, labels...)
		gauge(descDeviceTotal, float64(d.GetMemoryMib())*mib, labels...)
		if r.UsedMemoryMib >= 0 {
			gauge(descDeviceMemory, float64(r.UsedMemoryMib)*mib, labels...)
		}
		if r.UtilizationPercent >= 0 {
			gauge(descDeviceUtil, float64(r.UtilizationPercent)/100, labels...)
		}
	}

	a.leases.mu.Lock()
	defer a.leases.mu.Unlock()
	for _, id := range slices.Sorted(maps.Keys(a.leases.entries)) {
		e := a.leases.entries[id]
		if e.phase != enforcing {
			continue
		}
		label := a.leaseLabel(id)
		ch <- prometheus.MustNewConstMetric(descLeaseViolated, prometheus.CounterValue, float64(e.violations), label)
		used := map[string]*gpupoolv1.SliceUsage{}
		for _, u := range e.usage.GetSlices() {
			used[u.Device] = u
		}
		for _, s := range e.a.GetSlices() {
			limit := s.MemoryMib
			if s.Exclusive {
				limit = a.devices[s.Device].GetMemoryMib()
			}
			gauge(descLeaseLimit, float64(limit)*mib, label, s.Device)
			if u := used[s.Device]; u != nil {
				gauge(descLeaseMemory, float64(u.MemoryUsedMib)*mib, label, s.Device)
				gauge(descLeaseProcs, float64(u.Processes), label, s.Device)
			}
		}
	}
}

func itoa32(n int32) string { return strconv.Itoa(int(n)) }
