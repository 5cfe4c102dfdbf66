package broker

import (
	"testing"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

func TestMetricsCountLeaseChurnAndShowHostsAndTheQueue(t *testing.T) {
	ts := startServer(t)
	ts.registerHost(t, "h1", 2, 81920)
	resp, err := ts.c.Lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: slice(8192, 10)})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ts.c.Lease.Release(ctx(t), &gpupoolv1.ReleaseRequest{LeaseId: resp.Lease.Id}); err != nil {
		t.Fatal(err)
	}
	// The feed is counted in the background: wait for what it must reach.
	waitFor(t, "one grant and one releasing counted", func() bool {
		return metricValue(t, ts.s, "gpupool_lease_events_total", "type", "granted") == 1 &&
			metricValue(t, ts.s, "gpupool_lease_events_total", "type", "releasing") == 1
	})
	for _, tc := range []struct {
		name, metric, label, value string
		want                       float64
	}{
		{"a lease type that never happened is there at 0", "gpupool_lease_events_total", "type", "violation", 0},
		{"no lease ended yet (the agent did not confirm)", "gpupool_leases_ended_total", "state", "released", 0},
		{"a registered host is ready", "gpupool_host_ready", "host", "h1", 1},
		{"the host's GPUs are counted", "gpupool_host_gpus", "host", "h1", 2},
		{"no GPU of the host is unhealthy", "gpupool_host_gpus_unhealthy", "host", "h1", 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := metricValue(t, ts.s, tc.metric, tc.label, tc.value); got != tc.want {
				t.Errorf("%s{%s=%q}: got %v, want %v", tc.metric, tc.label, tc.value, got, tc.want)
			}
		})
	}
	families, err := ts.s.Metrics().Gather()
	if err != nil {
		t.Fatal(err)
	}
	found := map[string]bool{}
	for _, f := range families {
		found[f.GetName()] = true
		if f.GetName() == "gpupool_raft_apply_seconds" && f.GetMetric()[0].GetHistogram().GetSampleCount() == 0 {
			t.Errorf("gpupool_raft_apply_seconds: no sample after an acquire and a release")
		}
		if f.GetName() == "gpupool_queue_pending" && f.GetMetric()[0].GetGauge().GetValue() != 0 {
			t.Errorf("gpupool_queue_pending: got %v, want 0", f.GetMetric()[0].GetGauge().GetValue())
		}
	}
	for _, name := range []string{"gpupool_raft_apply_seconds", "gpupool_queue_wait_seconds", "gpupool_queue_pending", "gpupool_queue_oldest_wait_seconds", "gpupool_host_heartbeat_age_seconds"} {
		if !found[name] {
			t.Errorf("%s is not exposed", name)
		}
	}
}
