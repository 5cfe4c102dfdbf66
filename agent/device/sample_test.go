package device

import (
	"reflect"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// newSim returns a simulated backend that is closed when the test ends.
func newSim(t *testing.T, spec string) *simBackend {
	t.Helper()
	b, err := NewSimulated(spec, "host-a")
	if err != nil {
		t.Fatalf("NewSimulated(%q): %v", spec, err)
	}
	t.Cleanup(func() {
		if err := b.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return b.(*simBackend)
}

func mustSample(t *testing.T, b Backend) []Sample {
	t.Helper()
	got, err := b.Sample()
	if err != nil {
		t.Fatalf("Sample: %v", err)
	}
	return got
}

func TestSampleSimulated(t *testing.T) {
	ids := uuids(simDevices(t, "2xA100-80GB", "host-a"))
	for _, tc := range []struct {
		name  string
		setup func(sim Simulator) error
		want  []Sample
	}{
		{
			name:  "a fresh host runs nothing and idles",
			setup: func(Simulator) error { return nil },
			want: []Sample{
				{UUID: ids[0], Index: 0, MemoryUsedMiB: 0, UtilizationPercent: 0, Processes: []Process{}},
				{UUID: ids[1], Index: 1, MemoryUsedMiB: 0, UtilizationPercent: 0, Processes: []Process{}},
			},
		},
		{
			name: "processes are sorted by pid and add up to the used memory",
			setup: func(sim Simulator) error {
				return firstErr(
					sim.SetProcess(1, 300, 1024),
					sim.SetProcess(1, 20, 4096),
					sim.SetProcess(1, 100, 81920-1024-4096),
				)
			},
			want: []Sample{
				{UUID: ids[0], Index: 0, MemoryUsedMiB: 0, UtilizationPercent: 0, Processes: []Process{}},
				{UUID: ids[1], Index: 1, MemoryUsedMiB: 81920, UtilizationPercent: 0,
					Processes: []Process{{20, 4096}, {100, 81920 - 1024 - 4096}, {300, 1024}}},
			},
		},
		{
			name: "setting a process again replaces its memory, and 0 removes it",
			setup: func(sim Simulator) error {
				return firstErr(
					sim.SetProcess(0, 7, 1000),
					sim.SetProcess(0, 8, 500),
					sim.SetProcess(0, 7, 2000),
					sim.SetProcess(0, 8, 0),
				)
			},
			want: []Sample{
				{UUID: ids[0], Index: 0, MemoryUsedMiB: 2000, UtilizationPercent: 0, Processes: []Process{{7, 2000}}},
				{UUID: ids[1], Index: 1, MemoryUsedMiB: 0, UtilizationPercent: 0, Processes: []Process{}},
			},
		},
		{
			name: "utilisation is per device",
			setup: func(sim Simulator) error {
				return firstErr(sim.SetUtilization(0, 100), sim.SetUtilization(1, 37))
			},
			want: []Sample{
				{UUID: ids[0], Index: 0, MemoryUsedMiB: 0, UtilizationPercent: 100, Processes: []Process{}},
				{UUID: ids[1], Index: 1, MemoryUsedMiB: 0, UtilizationPercent: 37, Processes: []Process{}},
			},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := newSim(t, "2xA100-80GB")
			if err := tc.setup(b); err != nil {
				t.Fatalf("setup: %v", err)
			}
			if got := mustSample(t, b); !reflect.DeepEqual(got, tc.want) {
				t.Errorf("Sample =\n%+v\nwant\n%+v", got, tc.want)
			}
		})
	}
}

func firstErr(errs ...error) error {
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}

func TestSampleSimulatedAfterLoss(t *testing.T) {
	for _, tc := range []struct {
		name      string
		readFirst func(b Backend) error
		wantUUIDs bool
	}{
		{"lost GPUs keep the UUIDs Devices read", func(b Backend) error { _, err := b.Devices(); return err }, true},
		{"lost GPUs keep the UUIDs Sample read", func(b Backend) error { _, err := b.Sample(); return err }, true},
		{"lost GPUs never read have no UUID", func(Backend) error { return nil }, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := newSim(t, "2xA100-80GB")
			if err := tc.readFirst(b); err != nil {
				t.Fatal(err)
			}
			if err := firstErr(b.SetProcess(0, 1, 10), b.SetUtilization(0, 50), b.LoseGPUs()); err != nil {
				t.Fatal(err)
			}
			ids := []string{"", ""}
			if tc.wantUUIDs {
				ids = uuids(simDevices(t, "2xA100-80GB", "host-a"))
			}
			want := []Sample{
				{UUID: ids[0], Index: 0, MemoryUsedMiB: -1, UtilizationPercent: -1, Lost: true},
				{UUID: ids[1], Index: 1, MemoryUsedMiB: -1, UtilizationPercent: -1, Lost: true},
			}
			if got := mustSample(t, b); !reflect.DeepEqual(got, want) {
				t.Errorf("Sample =\n%+v\nwant\n%+v", got, want)
			}
			if _, err := b.Devices(); err == nil {
				t.Errorf("Devices of lost GPUs succeeded, want ERROR_GPU_IS_LOST")
			}
		})
	}
}

func TestSampleAfterCloseIsRefused(t *testing.T) {
	b, err := NewSimulated("1xA100-80GB", "host-a")
	if err != nil {
		t.Fatal(err)
	}
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Sample(); err != ErrClosed {
		t.Errorf("Sample after Close error = %v, want %v", err, ErrClosed)
	}
}

func TestMergeProcesses(t *testing.T) {
	const mib = 1 << 20
	proc := func(pid uint32, usedMiB uint64) nvml.ProcessInfo {
		return nvml.ProcessInfo{Pid: pid, UsedGpuMemory: usedMiB * mib}
	}
	unknown := func(pid uint32) nvml.ProcessInfo {
		return nvml.ProcessInfo{Pid: pid, UsedGpuMemory: valueNotAvailable}
	}
	for _, tc := range []struct {
		name  string
		lists [][]nvml.ProcessInfo
		want  []Process
	}{
		{"no list gives an empty list", nil, []Process{}},
		{"processes are sorted by pid", [][]nvml.ProcessInfo{{proc(9, 1), proc(3, 2)}}, []Process{{3, 2}, {9, 1}}},
		{"a pid twice in one list (two MIG instances) adds up",
			[][]nvml.ProcessInfo{{proc(5, 100), proc(5, 200)}}, []Process{{5, 300}}},
		{"a pid in the compute and the MPS list counts once, the larger",
			[][]nvml.ProcessInfo{{proc(5, 100), proc(6, 10)}, {proc(5, 300), proc(7, 20)}}, []Process{{5, 300}, {6, 10}, {7, 20}}},
		{"unknown memory is -1", [][]nvml.ProcessInfo{{unknown(4)}}, []Process{{4, -1}}},
		{"unknown memory makes a sum unknown",
			[][]nvml.ProcessInfo{{proc(4, 100), unknown(4)}}, []Process{{4, -1}}},
		{"unknown memory loses to a known amount in another list",
			[][]nvml.ProcessInfo{{unknown(4)}, {proc(4, 100)}}, []Process{{4, 100}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := mergeProcesses(tc.lists...); !reflect.DeepEqual(got, tc.want) {
				t.Errorf("mergeProcesses = %v, want %v", got, tc.want)
			}
		})
	}
}
