package device

import (
	"fmt"
	"slices"
	"strings"
	"testing"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

func TestParseSpec(t *testing.T) {
	for _, tc := range []struct {
		name    string
		spec    string
		want    []SimGroup
		wantErr string
	}{
		{name: "one group of eight", spec: "8xA100-80GB", want: []SimGroup{{8, "A100-80GB", 8, 2}}},
		{name: "two groups of different models", spec: "4xA100-80GB,4xH100-80GB", want: []SimGroup{{4, "A100-80GB", 8, 2}, {4, "H100-80GB", 8, 2}}},
		{name: "spaces and lower case are accepted", spec: " 2xa100-40gb , 1Xh100-80GB ", want: []SimGroup{{2, "A100-40GB", 8, 2}, {1, "H100-80GB", 8, 2}}},
		{name: "the largest count is accepted", spec: "64xA100-40GB", want: []SimGroup{{64, "A100-40GB", 8, 2}}},
		{name: "topology options", spec: "8xA100-40GB:nvlink=4:pcie=4,2xH100-80GB:nvlink=0", want: []SimGroup{{8, "A100-40GB", 4, 4}, {2, "H100-80GB", 0, 2}}},
		{name: "an empty spec is refused", spec: "", wantErr: `"": want NxMODEL[:nvlink=K][:pcie=P][,...], e.g. 8xA100-80GB`},
		{name: "an unknown option is refused", spec: "8xA100-80GB:nvswitch=1", wantErr: `"8xA100-80GB:nvswitch=1": option "nvswitch=1": must be nvlink=K or pcie=P`},
		{name: "a negative NVLink domain is refused", spec: "8xA100-80GB:nvlink=-1", wantErr: `"8xA100-80GB:nvlink=-1": nvlink=-1: must be GPUs per NVLink domain, 0 (none) to 64`},
		{name: "a PCIe root of no GPUs is refused", spec: "8xA100-80GB:pcie=0", wantErr: `"8xA100-80GB:pcie=0": pcie=0: must be GPUs per PCIe root, 1 to 64`},
		{name: "a zero count is refused", spec: "0xA100-80GB", wantErr: `"0xA100-80GB": count 0 must be between 1 and 64`},
		{name: "a count above 64 is refused", spec: "8xA100-80GB,65xH100-80GB", wantErr: `"65xH100-80GB": count 65 must be between 1 and 64`},
		{name: "an unknown model is refused", spec: "8xB200", wantErr: `"8xB200": model "B200": must be one of A100-40GB, A100-80GB, H100-80GB`},
		{name: "a count that is no number is refused", spec: "eightxA100-80GB", wantErr: `"eightxA100-80GB": count "eight" is not a number`},
		{name: "a negative count is refused", spec: "-1xA100-80GB", wantErr: `"-1xA100-80GB": count -1 must be between 1 and 64`},
		{name: "a part without a count is refused", spec: "A100-80GB", wantErr: `"A100-80GB": want NxMODEL, e.g. 8xA100-80GB`},
		{name: "a part without a model is refused", spec: "8x", wantErr: `"8x": want NxMODEL, e.g. 8xA100-80GB`},
		{name: "a trailing comma is refused", spec: "8xA100-80GB,", wantErr: `"": want NxMODEL, e.g. 8xA100-80GB`},
		{name: "a count with junk is refused", spec: "8ixA100-80GB", wantErr: `"8ixA100-80GB": count "8i" is not a number`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := ParseSpec(tc.spec)
			if tc.wantErr != "" {
				if err == nil || err.Error() != tc.wantErr {
					t.Fatalf("ParseSpec(%q) error = %v, want %s", tc.spec, err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatalf("ParseSpec(%q): %v", tc.spec, err)
			}
			if !slices.Equal(got, tc.want) {
				t.Fatalf("ParseSpec(%q) = %v, want %v", tc.spec, got, tc.want)
			}
		})
	}
}

func simDevices(t *testing.T, spec, hostID string) []*gpupoolv1.Device {
	t.Helper()
	b, err := NewSimulated(spec, hostID)
	if err != nil {
		t.Fatalf("NewSimulated(%q, %q): %v", spec, hostID, err)
	}
	t.Cleanup(func() {
		if err := b.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	if b.Name() != "simulated" || b.Note() != "" {
		t.Errorf("Name, Note = %q, %q, want simulated and no note", b.Name(), b.Note())
	}
	devs, err := b.Devices()
	if err != nil {
		t.Fatalf("Devices: %v", err)
	}
	return devs
}

func uuids(devs []*gpupoolv1.Device) []string {
	var out []string
	for _, d := range devs {
		out = append(out, d.GetUuid())
	}
	return out
}

func TestSimulatedDGXA100(t *testing.T) {
	devs := simDevices(t, "8xA100-80GB", "host-a")
	if len(devs) != 8 {
		t.Fatalf("got %d devices, want 8", len(devs))
	}
	ids := uuids(devs)
	for i, d := range devs {
		wantPeers := slices.Delete(slices.Clone(ids), i, i+1)
		for _, c := range []struct {
			field     string
			got, want any
		}{
			{"index", d.GetIndex(), int32(i)},
			{"model", d.GetModel(), "A100-SXM4-80GB"},
			{"memory", d.GetMemoryMib(), int64(81920)},
			{"SM count", d.GetSmCount(), int32(108)},
			{"NUMA node", d.GetNumaNode(), int32(i / 4)},
			{"PCIe root", d.GetPcieRoot(), []string{"pcie-0", "pcie-1", "pcie-2", "pcie-3"}[i/2]},
			{"NVLink peers", strings.Join(d.GetNvlinkPeers(), ","), strings.Join(wantPeers, ",")},
			{"health", d.GetHealth(), gpupoolv1.DeviceHealth_DEVICE_HEALTH_HEALTHY},
			{"host id", d.GetHostId(), ""},
		} {
			if c.got != c.want {
				t.Errorf("GPU %d %s = %v, want %v", i, c.field, c.got, c.want)
			}
		}
		if !strings.HasPrefix(d.GetUuid(), "GPU-") || len(d.GetUuid()) != len("GPU-")+36 {
			t.Errorf("GPU %d UUID = %q, want GPU- and a UUID", i, d.GetUuid())
		}
		if d.GetPciBusId() == "" {
			t.Errorf("GPU %d has no PCI bus id", i)
		}
	}
	if n := len(slices.Compact(slices.Sorted(slices.Values(ids)))); n != 8 {
		t.Errorf("got %d distinct UUIDs, want 8: %v", n, ids)
	}
}

func TestSimulatedUUIDsAreStablePerHost(t *testing.T) {
	first := uuids(simDevices(t, "8xA100-80GB", "host-a"))
	again := uuids(simDevices(t, "8xA100-80GB", "host-a"))
	other := uuids(simDevices(t, "8xA100-80GB", "host-b"))
	if !slices.Equal(first, again) {
		t.Errorf("two constructions for host-a gave %v and %v, want the same UUIDs", first, again)
	}
	for _, id := range other {
		if slices.Contains(first, id) {
			t.Errorf("host-b reuses host-a's UUID %s", id)
		}
	}
}

func TestSimulatedModels(t *testing.T) {
	for _, tc := range []struct {
		spec   string
		model  string
		memory int64
		sms    int32
	}{
		{"1xA100-40GB", "A100-SXM4-40GB", 40960, 108},
		{"1xA100-80GB", "A100-SXM4-80GB", 81920, 108},
		{"1xH100-80GB", "H100-80GB-HBM3", 81920, 132},
	} {
		t.Run(tc.spec, func(t *testing.T) {
			d := simDevices(t, tc.spec, "host-a")[0]
			if d.GetModel() != tc.model || d.GetMemoryMib() != tc.memory || d.GetSmCount() != tc.sms {
				t.Errorf("got %s %d MiB %d SMs, want %s %d MiB %d SMs",
					d.GetModel(), d.GetMemoryMib(), d.GetSmCount(), tc.model, tc.memory, tc.sms)
			}
		})
	}
}

func TestSimulatedNVLinkStaysWithinGroupsOfEight(t *testing.T) {
	devs := simDevices(t, "12xA100-80GB,2xH100-80GB", "host-a")
	if len(devs) != 14 {
		t.Fatalf("got %d devices, want 14", len(devs))
	}
	for _, tc := range []struct {
		name  string
		index int
		peers int
	}{
		{"a GPU of the first A100 board links to the other 7", 0, 7},
		{"a GPU of the second A100 board links to the other 3", 9, 3},
		{"an H100 links only to the other H100", 13, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := len(devs[tc.index].GetNvlinkPeers()); got != tc.peers {
				t.Errorf("GPU %d has %d NVLink peers, want %d", tc.index, got, tc.peers)
			}
		})
	}
	if got := devs[13].GetNvlinkPeers(); len(got) != 1 || got[0] != devs[12].GetUuid() {
		t.Errorf("GPU 13 peers = %v, want [%s]", got, devs[12].GetUuid())
	}
	if devs[0].GetNumaNode() != 0 || devs[6].GetNumaNode() != 0 || devs[7].GetNumaNode() != 1 || devs[13].GetNumaNode() != 1 {
		t.Errorf("NUMA nodes of GPUs 0, 6, 7, 13 = %d %d %d %d, want 0 0 1 1",
			devs[0].GetNumaNode(), devs[6].GetNumaNode(), devs[7].GetNumaNode(), devs[13].GetNumaNode())
	}
	if devs[13].GetPcieRoot() != "pcie-6" {
		t.Errorf("GPU 13 PCIe root = %q, want pcie-6", devs[13].GetPcieRoot())
	}
}

func TestSimulatedTopologyFollowsTheSpec(t *testing.T) {
	devs := simDevices(t, "8xA100-40GB:nvlink=4:pcie=4,2xH100-80GB:nvlink=0:pcie=1", "host-a")
	peers := func(i int) int { return len(devs[i].GetNvlinkPeers()) }
	for _, tc := range []struct {
		name      string
		got, want any
	}{
		{"GPU 0 links to the 3 others of its domain", peers(0), 3},
		{"GPU 4 is in the second domain", slices.Contains(devs[4].GetNvlinkPeers(), devs[0].GetUuid()), false},
		{"an H100 without NVLink", peers(8), 0},
		{"GPUs 0-3 share a PCIe root", devs[3].GetPcieRoot(), devs[0].GetPcieRoot()},
		{"GPU 4 starts the next root", devs[4].GetPcieRoot() == devs[3].GetPcieRoot(), false},
		{"each H100 has a root of its own", devs[8].GetPcieRoot() == devs[9].GetPcieRoot(), false},
	} {
		if fmt.Sprint(tc.got) != fmt.Sprint(tc.want) {
			t.Errorf("%s: got %v, want %v", tc.name, tc.got, tc.want)
		}
	}
}

func TestNewSimulatedRefusesBadInput(t *testing.T) {
	for _, tc := range []struct {
		name, spec, hostID, wantErr string
	}{
		{"a bad spec", "0xA100-80GB", "host-a", "count 0 must be between 1 and 64"},
		{"an empty host id", "8xA100-80GB", "", "need a host id"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := NewSimulated(tc.spec, tc.hostID)
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Fatalf("NewSimulated(%q, %q) error = %v, want one containing %q", tc.spec, tc.hostID, err, tc.wantErr)
			}
		})
	}
}

func TestClosedBackendRefusesDevices(t *testing.T) {
	b, err := NewSimulated("1xA100-80GB", "host-a")
	if err != nil {
		t.Fatal(err)
	}
	if err := b.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if _, err := b.Devices(); err != ErrClosed {
		t.Fatalf("Devices after Close error = %v, want %v", err, ErrClosed)
	}
}
