package agent

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// cgroupCaps reads a lease's CPU quota (millicores) and memory limit
// (MiB) from its cgroup files, as the kernel holds them; -1 for none.
func cgroupCaps(t *testing.T, lease string) (cpu, memMiB int64) {
	t.Helper()
	parent := testCgroupParent + "/host-a"
	read := func(file string) string {
		t.Helper()
		b, err := os.ReadFile(file)
		if err != nil {
			t.Fatalf("reading the lease's cgroup: %v", err)
		}
		return strings.TrimSpace(string(b))
	}
	num := func(s string) int64 {
		t.Helper()
		n, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			t.Fatalf("cgroup value %q: %v", s, err)
		}
		return n
	}
	switch testBox().Report().Cgroup {
	case "v1":
		quota := num(read(filepath.Join("/sys/fs/cgroup/cpu", parent, lease, "cpu.cfs_quota_us")))
		period := num(read(filepath.Join("/sys/fs/cgroup/cpu", parent, lease, "cpu.cfs_period_us")))
		cpu = -1
		if quota > 0 {
			cpu = quota * 1000 / period
		}
		memMiB = num(read(filepath.Join("/sys/fs/cgroup/memory", parent, lease, "memory.limit_in_bytes"))) >> 20
	case "v2":
		quota, period, _ := strings.Cut(read(filepath.Join("/sys/fs/cgroup", parent, lease, "cpu.max")), " ")
		cpu = -1
		if quota != "max" {
			cpu = num(quota) * 1000 / num(period)
		}
		memMiB = -1
		if m := read(filepath.Join("/sys/fs/cgroup", parent, lease, "memory.max")); m != "max" {
			memMiB = num(m) >> 20
		}
	default:
		t.Skip("no cgroups on this host: the sandbox caps nothing")
	}
	return cpu, memMiB
}

func TestALeaseWithoutHostCapsGetsItsGPUShareOfTheOffer(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("cgroups need root")
	}
	// testConfig offers 16000 millicores and 65536 MiB with 8 GPUs of
	// 81920 MiB.
	devs, err := simBackend(t, "8xA100-80GB", "host-a").Devices()
	if err != nil {
		t.Fatal(err)
	}
	whole := func(i int) *gpupoolv1.Slice {
		return &gpupoolv1.Slice{Device: devs[i].Uuid, MemoryMib: 81920, ComputePercent: 100, Exclusive: true}
	}
	part := func(compute int32, memMiB int64) *gpupoolv1.Slice {
		return &gpupoolv1.Slice{Device: devs[0].Uuid, MemoryMib: memMiB, ComputePercent: compute}
	}
	for _, tc := range []struct {
		name                string
		slices              []*gpupoolv1.Slice
		cpuAsked, memAsked  int64
		cpuFloor, memFloor  int64
		wantCPU, wantMemMiB int64
	}{
		{name: "two of eight GPUs get a quarter of the offer", slices: []*gpupoolv1.Slice{whole(0), whole(1)},
			wantCPU: 4000, wantMemMiB: 16384},
		{name: "a 25% slice of one of eight GPUs gets 1/32, with floors under it", slices: []*gpupoolv1.Slice{part(25, 8192)},
			cpuFloor: 100, memFloor: 256, wantCPU: 500, wantMemMiB: 2048},
		{name: "the default floors lift a small share", slices: []*gpupoolv1.Slice{part(5, 1024)},
			wantCPU: DefaultCPUFloorMillicores, wantMemMiB: DefaultMemoryFloorMiB},
		{name: "configured floors lift a small share", slices: []*gpupoolv1.Slice{part(5, 1024)},
			cpuFloor: 3000, memFloor: 6000, wantCPU: 3000, wantMemMiB: 6000},
		{name: "a slice without a compute share counts its memory", slices: []*gpupoolv1.Slice{part(0, 40960)},
			cpuFloor: 100, memFloor: 256, wantCPU: 1000, wantMemMiB: 4096},
		{name: "an explicit request wins over the share and the floor", slices: []*gpupoolv1.Slice{whole(0), whole(1)},
			cpuAsked: 300, memAsked: 500, cpuFloor: 1000, memFloor: 1024, wantCPU: 300, wantMemMiB: 500},
		{name: "an explicit CPU request leaves memory to the default", slices: []*gpupoolv1.Slice{whole(0), whole(1)},
			cpuAsked: 7000, wantCPU: 7000, wantMemMiB: 16384},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := testConfig(t, "127.0.0.1:1")
			cfg.DefaultCPUFloor, cfg.DefaultMemoryFloorMiB = tc.cpuFloor, tc.memFloor
			a, err := New(cfg)
			if err != nil {
				t.Fatal(err)
			}
			as := &gpupoolv1.Assignment{LeaseId: "caps-1", Slices: tc.slices, HostCpuMillicores: tc.cpuAsked, HostMemoryMib: tc.memAsked}
			if err := a.prepareSandbox(as); err != nil {
				t.Fatalf("prepareSandbox: %v", err)
			}
			t.Cleanup(func() { _ = a.box.Remove(as.LeaseId) })
			cpu, mem := cgroupCaps(t, as.LeaseId)
			if cpu != tc.wantCPU || mem != tc.wantMemMiB {
				t.Errorf("cgroup caps: got %d millicores and %d MiB, want %d and %d", cpu, mem, tc.wantCPU, tc.wantMemMiB)
			}
		})
	}
}

func TestAResumedLeaseKeepsTheCapsItsRunningCgroupHas(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("cgroups need root")
	}
	devs, err := simBackend(t, "8xA100-80GB", "host-a").Devices()
	if err != nil {
		t.Fatal(err)
	}
	as := &gpupoolv1.Assignment{LeaseId: "caps-resume", Slices: []*gpupoolv1.Slice{{Device: devs[0].Uuid, MemoryMib: 1024, ComputePercent: 5}}}
	agentWithFloors := func(cpuFloor, memFloor int64) *Agent {
		t.Helper()
		cfg := testConfig(t, "127.0.0.1:1")
		cfg.DefaultCPUFloor, cfg.DefaultMemoryFloorMiB = cpuFloor, memFloor
		a, err := New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		return a
	}
	// The earlier agent capped the lease at its floors, 3000 millicores
	// and 6000 MiB, and the lease's process runs in its cgroup.
	before := agentWithFloors(3000, 6000)
	if err := before.prepareSandbox(as); err != nil {
		t.Fatalf("prepareSandbox: %v", err)
	}
	t.Cleanup(func() { _ = before.box.Remove(as.LeaseId) })
	w := startWorkload(t, as.LeaseId)

	// The restarted agent's defaults would cap it lower.
	after := agentWithFloors(100, 256)
	if err := after.prepareSandbox(as); err != nil {
		t.Fatalf("prepareSandbox of the resumed lease: %v", err)
	}
	if cpu, mem := cgroupCaps(t, as.LeaseId); cpu != 3000 || mem != 6000 {
		t.Errorf("cgroup caps after the resume: got %d millicores and %d MiB, want the running lease's 3000 and 6000", cpu, mem)
	}
	if !w.running() {
		t.Error("the resumed lease's process was killed")
	}
}

func TestADefaultShareNeverExceedsTheOffer(t *testing.T) {
	for _, tc := range []struct {
		name                 string
		offered, floor, want int64
		frac                 float64
	}{
		{"the share of a large offer", 16000, 1000, 4000, 0.25},
		{"a floor above the offer is cut to it", 500, 1000, 500, 0.25},
		{"a host that offers none caps at the floor", 0, 1000, 1000, 0.25},
		{"a share under the floor", 16000, 1000, 1000, 0.01},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := defaultShare(tc.offered, tc.frac, tc.floor); got != tc.want {
				t.Errorf("defaultShare(%d, %g, %d): got %d, want %d", tc.offered, tc.frac, tc.floor, got, tc.want)
			}
		})
	}
}
