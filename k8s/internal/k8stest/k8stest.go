// Package k8stest holds what the tests of the Kubernetes driver's
// packages share: a one-server broker and pool hosts to register with it.
package k8stest

import (
	"fmt"
	"testing"
	"time"

	"github.com/gpupool/gpupool/broker"
	"github.com/gpupool/gpupool/client"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// GPU is an 80 GiB A100 at index i of host.
func GPU(host string, i int32) *gpupoolv1.Device {
	return &gpupoolv1.Device{Uuid: fmt.Sprintf("GPU-%s-%d", host, i), Index: i, Model: "A100-SXM4-80GB", MemoryMib: 81920,
		HostId: host, Health: gpupoolv1.DeviceHealth_DEVICE_HEALTH_HEALTHY}
}

// ReadyHost is a ready host with n GPUs.
func ReadyHost(id string, n int32) *gpupoolv1.Host {
	h := &gpupoolv1.Host{Id: id, Status: gpupoolv1.HostStatus_HOST_STATUS_READY, Eligible: true, Mps: true}
	for i := range n {
		h.Devices = append(h.Devices, GPU(id, i))
	}
	return h
}

// StartBroker runs a one-server broker cluster for the test. Hosts stay
// up without heartbeats for the length of a test.
func StartBroker(t *testing.T) *client.Client {
	t.Helper()
	s, err := broker.New(broker.Config{DataDir: t.TempDir(), BindAddr: "127.0.0.1:0", RaftBindAddr: "127.0.0.1:0", BootstrapExpect: 1,
		HeartbeatTTL: 10 * time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Shutdown() })
	c, err := client.Dial([]string{s.Addr()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// Eventually polls cond until it holds or 60 s pass; it fails the test
// with what and cond's last report if it never does.
func Eventually(t *testing.T, what string, cond func() (bool, string)) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	var last string
	for time.Now().Before(deadline) {
		ok, state := cond()
		if ok {
			return
		}
		last = state
		<-tick.C
	}
	t.Fatalf("%s: not after 60s; last seen: %s", what, last)
}
