package agent

import "github.com/prometheus/client_golang/prometheus"

var (
	descConnected = prometheus.NewDesc("gpupool_agent_connected", "1 while a heartbeat stream to the brokers works.", nil, nil)
	descLeases    = prometheus.NewDesc("gpupool_agent_leases", "Leases the broker asked this host to enforce.", nil, nil)
	descDevices   = prometheus.NewDesc("gpupool_agent_devices", "GPUs the device backend reported at start.", []string{"backend"}, nil)
)

// Collector returns a Prometheus collector of the agent's state.
func (a *Agent) Collector() prometheus.Collector { return agentCollector{a} }

type agentCollector struct{ a *Agent }

func (c agentCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- descConnected
	ch <- descLeases
	ch <- descDevices
}

func (c agentCollector) Collect(ch chan<- prometheus.Metric) {
	connected := 0.0
	if c.a.connected.Load() {
		connected = 1
	}
	ch <- prometheus.MustNewConstMetric(descConnected, prometheus.GaugeValue, connected)
	ch <- prometheus.MustNewConstMetric(descLeases, prometheus.GaugeValue, float64(len(c.a.leases.enforced())))
	if devs, err := c.a.cfg.Backend.Devices(); err == nil {
		ch <- prometheus.MustNewConstMetric(descDevices, prometheus.GaugeValue, float64(len(devs)), c.a.cfg.Backend.Name())
	}
}
