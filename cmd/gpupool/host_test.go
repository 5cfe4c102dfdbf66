package main

import (
	"bytes"
	"fmt"
	"strings"
	"testing"
	"time"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

func TestHostCommandsRefuseBadInput(t *testing.T) {
	checkUsageErrors(t, []usageCase{
		{"ls with a positional argument", []string{"host", "ls", "h1"}, []string{"accepts 0 arg(s), received 1", "gpupool host ls"}},
		{"ls with a bad -o", []string{"host", "ls", "-o", "yaml"}, []string{`--output "yaml"`, "json or name"}},
		{"get without a host", []string{"host", "get"}, []string{"accepts 1 arg(s), received 0", "gpupool host get HOST_ID"}},
		{"get with two hosts", []string{"host", "get", "h1", "h2"}, []string{"accepts 1 arg(s), received 2"}},
		{"get with an unknown flag", []string{"host", "get", "h1", "--fresh"}, []string{"--fresh"}},
		{"drain without a host", []string{"host", "drain"}, []string{"accepts 1 arg(s), received 0", "gpupool host drain HOST_ID"}},
		{"drain with a bad cancel value", []string{"host", "drain", "h1", "--cancel=maybe"}, []string{"--cancel"}},
	})
}

// sampleHost is a ready host with two A100s, one of them sliced.
func sampleHost() *gpupoolv1.Host {
	return &gpupoolv1.Host{
		Id: "host-1", Address: "10.0.0.7:7650", Status: gpupoolv1.HostStatus_HOST_STATUS_READY, Eligible: true,
		LastHeartbeatAgeMs: 1500, Labels: map[string]string{"zone": "eu-1", "rack": "r2"}, Backend: "simulated",
		Devices: []*gpupoolv1.Device{
			{Uuid: "GPU-aaaa", Index: 0, Model: "A100-SXM4-80GB", MemoryMib: 81920, Health: gpupoolv1.DeviceHealth_DEVICE_HEALTH_HEALTHY,
				AllocatedMemoryMib: 20480, AllocatedComputePercent: 25, LeaseCount: 1,
				NumaNode: 0, PcieRoot: "pcie-0", NvlinkPeers: []string{"GPU-bbbb"}, UsedMemoryMib: 12288, UtilizationPercent: 40},
			{Uuid: "GPU-bbbb", Index: 1, Model: "A100-SXM4-80GB", MemoryMib: 81920, Health: gpupoolv1.DeviceHealth_DEVICE_HEALTH_UNHEALTHY,
				HealthReason: "Xid 79", NumaNode: -1, PcieRoot: "pcie-0", NvlinkPeers: []string{"GPU-aaaa"}, UsedMemoryMib: -1, UtilizationPercent: -1},
		},
	}
}

func TestPrintHosts(t *testing.T) {
	down := &gpupoolv1.Host{Id: "host-2", Status: gpupoolv1.HostStatus_HOST_STATUS_DOWN, LastHeartbeatAgeMs: -1,
		BackendNote: "NVML library libnvidia-ml.so.1 not found"}
	var buf bytes.Buffer
	if err := printHosts(&buf, []*gpupoolv1.Host{sampleHost(), down}); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	if len(lines) != 3 {
		t.Fatalf("got %d lines, want a header and 2 rows:\n%s", len(lines), buf.String())
	}
	for i, want := range [][]string{
		{"HOST", "STATUS", "ELIGIBLE", "GPUS", "MODELS", "MEMORY", "COMPUTE", "SLICES", "TOPOLOGY", "HEALTH", "HEARTBEAT", "ADDRESS"},
		{"host-1", "ready", "yes", "2 (1 unhealthy)", "A100-SXM4-80GB", "20 GiB/160 GiB", "25%/200%", "1", "nvlink 2, pcie 1", "1 unhealthy: Xid 79", "1s", "10.0.0.7:7650"},
		{"host-2", "down", "no", "0 MiB/0 MiB", "no GPUs: NVML library libnvidia-ml.so.1 not found"},
	} {
		for _, w := range want {
			if !strings.Contains(lines[i], w) {
				t.Errorf("line %d = %q, want it to contain %q", i, lines[i], w)
			}
		}
	}
	if f := strings.Fields(lines[2]); f[len(f)-2] != "-" || f[len(f)-1] != "-" {
		t.Errorf("row of a host with unknown heartbeat = %q, want HEARTBEAT and ADDRESS shown as -", lines[2])
	}
}

func TestTopologySummaryAndIndexRanges(t *testing.T) {
	devs := func(groups ...[]int) []*gpupoolv1.Device {
		var out []*gpupoolv1.Device
		for _, g := range groups {
			for _, i := range g {
				d := &gpupoolv1.Device{Uuid: fmt.Sprintf("GPU-%d", i), Index: int32(i), PcieRoot: fmt.Sprintf("pcie-%d", i/2)}
				for _, j := range g {
					if j != i && len(g) > 1 {
						d.NvlinkPeers = append(d.NvlinkPeers, fmt.Sprintf("GPU-%d", j))
					}
				}
				out = append(out, d)
			}
		}
		return out
	}
	for _, tc := range []struct {
		name string
		devs []*gpupoolv1.Device
		want string
	}{
		{"one NVLink domain of 8", devs([]int{0, 1, 2, 3, 4, 5, 6, 7}), "nvlink 8, pcie 4"},
		{"two domains of 4", devs([]int{0, 1, 2, 3}, []int{4, 5, 6, 7}), "nvlink 4+4, pcie 4"},
		{"PCIe only", devs([]int{0}, []int{1}), "nvlink none, pcie 1"},
		{"no GPUs", nil, "-"},
	} {
		if got := topologySummary(tc.devs); got != tc.want {
			t.Errorf("%s: got %q, want %q", tc.name, got, tc.want)
		}
	}
	if got := indexRanges([]int32{0, 1, 2, 3, 6, 8, 9}); got != "0-3,6,8-9" {
		t.Errorf("indexRanges: got %q, want 0-3,6,8-9", got)
	}
}

func TestPrintHostDetail(t *testing.T) {
	now := time.Date(2026, 1, 1, 12, 5, 0, 0, time.UTC)
	var buf bytes.Buffer
	resp := &gpupoolv1.GetHostResponse{Host: sampleHost(), Leases: []*gpupoolv1.Lease{sampleLease()}}
	if err := printHostDetail(&buf, resp, now); err != nil {
		t.Fatal(err)
	}
	out := buf.String()
	for _, want := range []string{
		"HOST       host-1", "STATUS     ready", "LABELS     rack=r2,zone=eu-1", "BACKEND    simulated",
		"INDEX  DEVICE    MODEL           HEALTH              MEMORY         COMPUTE  EXCLUSIVE  SLICES  USED    UTIL  NUMA  PCIE    NVLINK",
		"0      GPU-aaaa  A100-SXM4-80GB  healthy             20 GiB/80 GiB  25%      no         1       12 GiB  40%   0     pcie-0  1",
		"1      GPU-bbbb  A100-SXM4-80GB  unhealthy (Xid 79)  0 MiB/80 GiB   0%       no         0       -       -     -     pcie-0  0",
		"l-123", "host-1/0 20GiB 25%",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("printHostDetail output lacks %q:\n%s", want, out)
		}
	}
}
