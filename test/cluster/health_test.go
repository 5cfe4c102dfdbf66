package cluster_test

import (
	"fmt"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// TestAnUnhealthyGPUSurvivesAnAgentRestartUntilAnOperatorClearsIt marks
// GPU 2 unhealthy with a simulated Xid, restarts the agent (the GPU
// stays unhealthy), refuses clears of a GPU the host lacks and of a
// healthy one, clears GPU 2, and restarts the agent again (the GPU stays
// healthy).
func TestAnUnhealthyGPUSurvivesAnAgentRestartUntilAnOperatorClearsIt(t *testing.T) {
	if testing.Short() {
		t.Skip("starts real processes")
	}
	cl := newCluster(t, 1)
	addr := "--addr=" + strings.Join(cl.addrs, ",")
	healthOf := func(idx int32) *gpupoolv1.Device {
		for _, d := range cl.devices() {
			if d.Index == idx {
				return d
			}
		}
		t.Fatalf("no GPU %d", idx)
		return nil
	}
	waitHealth := func(what string, want gpupoolv1.DeviceHealth) {
		t.Helper()
		eventually(t, what, 30*time.Second, func() error {
			if d := healthOf(2); d.Health != want {
				return fmt.Errorf("GPU 2 is %v (%s)", d.Health, d.HealthReason)
			}
			return nil
		})
	}
	// restartAgent restarts the agent and waits until it registered
	// again (with the health it knows) and heartbeats.
	restartAgent := func() {
		t.Helper()
		p := cl.agents[0]
		p.signal(t, syscall.SIGTERM)
		before, err := os.ReadFile(p.log.Name())
		if err != nil {
			t.Fatal(err)
		}
		p.start(t)
		eventually(t, "the restarted agent to register", 60*time.Second, func() error {
			b, err := os.ReadFile(p.log.Name())
			if err != nil {
				return err
			}
			if !strings.Contains(string(b[len(before):]), "msg=registered") {
				return fmt.Errorf("not registered yet")
			}
			return nil
		})
		cl.waitForHosts(1)
	}

	if err := cl.sim(0).InjectXid(2, 79); err != nil {
		t.Fatal(err)
	}
	waitHealth("GPU 2 unhealthy", gpupoolv1.DeviceHealth_DEVICE_HEALTH_UNHEALTHY)
	restartAgent()
	logContains(t, cl.agents[0], "remembered from the data dir")
	if d := healthOf(2); d.Health != gpupoolv1.DeviceHealth_DEVICE_HEALTH_UNHEALTHY || d.HealthReason != "Xid 79" {
		t.Fatalf("after an agent restart: got GPU 2 %v (%s), want unhealthy (Xid 79)", d.Health, d.HealthReason)
	}

	for _, tc := range []struct {
		name     string
		args     []string
		wantCode int
		wantErr  string
	}{
		{"a GPU the host does not have", []string{"host-1", "9", "--clear"}, 1, `GPU "9": host host-1 has no such GPU (it has GPUs 0 to 7)`},
		{"a healthy GPU", []string{"host-1", "0", "--clear"}, 1, "is healthy: there is nothing to clear"},
		{"an unknown host", []string{"host-9", "2", "--clear"}, 1, `host "host-9": not found`},
		{"no --clear", []string{"host-1", "2"}, 2, "give --clear"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, stderr, code := gpupool(t, append([]string{"host", "gpu-health", addr}, tc.args...)...)
			if code != tc.wantCode || !strings.Contains(stderr, tc.wantErr) {
				t.Fatalf("got exit %d %q, want exit %d and %q", code, stderr, tc.wantCode, tc.wantErr)
			}
		})
	}

	if out, stderr, code := gpupool(t, "host", "gpu-health", addr, "host-1", "2", "--clear"); code != 0 || !strings.Contains(out, "cleared") {
		t.Fatalf("clear GPU 2: exit %d\n%s%s", code, out, stderr)
	}
	waitHealth("GPU 2 healthy after the clear", gpupoolv1.DeviceHealth_DEVICE_HEALTH_HEALTHY)
	restartAgent()
	if d := healthOf(2); d.Health != gpupoolv1.DeviceHealth_DEVICE_HEALTH_HEALTHY {
		t.Fatalf("after the clear and a restart: got GPU 2 %v (%s), want healthy", d.Health, d.HealthReason)
	}
}
