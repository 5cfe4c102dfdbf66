package agent

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/gpupool/gpupool/internal/clock"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// restarted returns a new agent over the same data dir as a.
func restarted(t *testing.T, cfg Config) *Agent {
	t.Helper()
	a, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := a.loadMemory(); err != nil {
		t.Fatal(err)
	}
	return a
}

func TestAnUnhealthyGPUStaysUnhealthyAcrossARestart(t *testing.T) {
	cfg := testConfig(t, "127.0.0.1:1")
	a := restarted(t, cfg)
	var uuid string
	for u := range a.devices {
		uuid = u
		break
	}
	a.markUnhealthy(uuid, "Xid 79")
	b := restarted(t, cfg)
	if h, why := b.healthOf(uuid); h != gpupoolv1.DeviceHealth_DEVICE_HEALTH_UNHEALTHY || why != "Xid 79" {
		t.Fatalf("after a restart: got %v %q, want unhealthy \"Xid 79\"", h, why)
	}
	for u := range b.devices {
		if u == uuid {
			continue
		}
		if h, _ := b.healthOf(u); h != gpupoolv1.DeviceHealth_DEVICE_HEALTH_HEALTHY {
			t.Fatalf("GPU %s: got %v, want healthy", u, h)
		}
	}
}

func TestAnUnhealthyGPUIsHealthyAgainAfterTheHealthyTime(t *testing.T) {
	cfg := testConfig(t, "127.0.0.1:1")
	cfg.HealthyAfter = time.Hour
	clk := clock.NewFake(testEpoch)
	cfg.Clock = clk
	a := restarted(t, cfg)
	var uuid string
	for u := range a.devices {
		uuid = u
		break
	}
	a.markUnhealthy(uuid, "Xid 79")
	clk.Advance(time.Hour)
	b := restarted(t, cfg)
	if h, _ := b.healthOf(uuid); h != gpupoolv1.DeviceHealth_DEVICE_HEALTH_UNHEALTHY {
		t.Fatalf("an hour after its last Xid with a healthy time of one hour: got %v, want unhealthy still", h)
	}
	clk.Advance(time.Millisecond)
	if h, why := b.healthOf(uuid); h != gpupoolv1.DeviceHealth_DEVICE_HEALTH_HEALTHY {
		t.Fatalf("past an hour after its last Xid with a healthy time of one hour: got %v %q, want healthy", h, why)
	}
	if h, why := restarted(t, cfg).healthOf(uuid); h != gpupoolv1.DeviceHealth_DEVICE_HEALTH_HEALTHY {
		t.Fatalf("after a restart once healed: got %v %q, want healthy", h, why)
	}
}

func TestUnacknowledgedEventsSurviveARestartUntilAcknowledged(t *testing.T) {
	cfg := testConfig(t, "127.0.0.1:1")
	a := restarted(t, cfg)
	a.leases.mu.Lock()
	first := a.leases.addEventLocked(gpupoolv1.AgentEventType_AGENT_EVENT_TYPE_VIOLATION, "l-1", "GPU-1", "used 9 GiB of 8 GiB", time.Now())
	second := a.leases.addEventLocked(gpupoolv1.AgentEventType_AGENT_EVENT_TYPE_VIOLATION, "l-2", "GPU-2", "used 5 GiB of 4 GiB", time.Now())
	a.leases.mu.Unlock()
	a.saveMemory()

	b := restarted(t, cfg)
	var req gpupoolv1.HeartbeatRequest
	b.leases.report(&req)
	if len(req.Events) != 2 || req.Events[0].Seq != first.Seq || req.Events[1].Message != second.Message {
		t.Fatalf("after a restart: got events %v, want the two unacknowledged ones", req.Events)
	}
	if !b.leases.ack(first.Seq) {
		t.Fatal("ack of the first event dropped nothing")
	}
	b.saveMemory()
	c := restarted(t, cfg)
	req.Reset()
	c.leases.report(&req)
	if len(req.Events) != 1 || req.Events[0].Seq != second.Seq {
		t.Fatalf("after the ack and a restart: got events %v, want only seq %d", req.Events, second.Seq)
	}
	c.leases.mu.Lock()
	next := c.leases.addEventLocked(gpupoolv1.AgentEventType_AGENT_EVENT_TYPE_VIOLATION, "l-3", "GPU-3", "x", time.Unix(0, 0))
	c.leases.mu.Unlock()
	if next.Seq <= second.Seq {
		t.Fatalf("a new event's seq %d is not above the remembered %d", next.Seq, second.Seq)
	}
}

func TestACorruptMemoryFileIsMovedAsideAndForgotten(t *testing.T) {
	cfg := testConfig(t, "127.0.0.1:1")
	if err := os.WriteFile(filepath.Join(cfg.DataDir, memoryFile), []byte("{not json"), 0o600); err != nil {
		t.Fatal(err)
	}
	a := restarted(t, cfg)
	if n := len(a.health.sick); n != 0 {
		t.Fatalf("got %d unhealthy GPUs, want 0", n)
	}
	if _, err := os.Stat(filepath.Join(cfg.DataDir, memoryFile+".corrupt")); err != nil {
		t.Fatalf("the corrupt file was not moved aside: %v", err)
	}
}

func TestAClearedGPUIsHealthyAndStaysSoAcrossARestart(t *testing.T) {
	cfg := testConfig(t, "127.0.0.1:1")
	a := restarted(t, cfg)
	var uuid string
	for u := range a.devices {
		uuid = u
		break
	}
	a.markUnhealthy(uuid, "Xid 79")
	a.clearHealth([]string{uuid, "GPU-not-here"})
	if h, why := a.healthOf(uuid); h != gpupoolv1.DeviceHealth_DEVICE_HEALTH_HEALTHY {
		t.Fatalf("after the clear: got %v %q, want healthy", h, why)
	}
	if h, _ := restarted(t, cfg).healthOf(uuid); h != gpupoolv1.DeviceHealth_DEVICE_HEALTH_HEALTHY {
		t.Fatalf("after the clear and a restart: got %v, want healthy", h)
	}
}
