package cudaserver

import (
	"reflect"
	"strings"
	"testing"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

var inventory = []*gpupoolv1.Device{
	{Uuid: "GPU-0b9c2f4e-5a1d-4c3b-9e8f-7a6b5c4d3e2f", Index: 0, Model: "A100-SXM4-40GB", MemoryMib: 40960, SmCount: 108},
	{Uuid: "GPU-1b9c2f4e-5a1d-4c3b-9e8f-7a6b5c4d3e2f", Index: 1, Model: "NVIDIA H100 80GB HBM3", MemoryMib: 81920, SmCount: 132},
}

func TestLeaseDevicesShowEachSlicesMemory(t *testing.T) {
	lease := &gpupoolv1.Lease{Id: "l-1", Slices: []*gpupoolv1.Slice{
		{Host: "h1", Device: inventory[1].Uuid, MemoryMib: 8192},
		{Host: "h2", Device: "GPU-elsewhere", MemoryMib: 8192},
		{Host: "h1", Device: inventory[0].Uuid, MemoryMib: 40960, Exclusive: true},
	}}
	got, err := LeaseDevices(lease, "h1", inventory)
	if err != nil {
		t.Fatal(err)
	}
	if want := []Device{{Index: 1, MemoryBytes: 8 << 30}, {Index: 0}}; !reflect.DeepEqual(got, want) {
		t.Errorf("got %v, want %v", got, want)
	}
}

func TestLeaseDevicesRefuseWhatTheHostDoesNotHave(t *testing.T) {
	for _, tc := range []struct {
		name   string
		slices []*gpupoolv1.Slice
		want   string
	}{
		{"no slice on the host", []*gpupoolv1.Slice{{Host: "h2", Device: inventory[0].Uuid, MemoryMib: 1}}, "holds no device on host h1"},
		{"a device the host does not have", []*gpupoolv1.Slice{{Host: "h1", Device: "GPU-nope", MemoryMib: 1}}, "device GPU-nope is not on host h1"},
		{"a slice without memory", []*gpupoolv1.Slice{{Host: "h1", Device: inventory[0].Uuid}}, "memory 0 MiB: must be positive"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := LeaseDevices(&gpupoolv1.Lease{Id: "l-1", Slices: tc.slices}, "h1", inventory)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("got %v, want an error containing %q", err, tc.want)
			}
		})
	}
}

func TestSimDevicesFollowTheInventory(t *testing.T) {
	got, err := SimDevices(inventory)
	if err != nil {
		t.Fatal(err)
	}
	if got[0].Name != "NVIDIA A100-SXM4-40GB" || got[0].MemoryBytes != 40<<30 || got[0].Major != 8 || got[0].UUID[0] != 0x0b {
		t.Errorf("device 0: got %+v", got[0])
	}
	if got[1].Name != "NVIDIA H100 80GB HBM3" || got[1].SMs != 132 || got[1].Major != 9 {
		t.Errorf("device 1: got %+v", got[1])
	}
	if _, err := SimDevices([]*gpupoolv1.Device{{Uuid: "GPU-x", Index: 0}}); err == nil || !strings.Contains(err.Error(), `UUID "GPU-x"`) {
		t.Errorf("a bad UUID: got %v, want it named", err)
	}
	if _, err := SimDevices([]*gpupoolv1.Device{{Uuid: inventory[0].Uuid, Index: 3}}); err == nil || !strings.Contains(err.Error(), "index order") {
		t.Errorf("out of order: got %v, want index order asked for", err)
	}
}

func TestLeaseServerRefusesBadInput(t *testing.T) {
	lease := &gpupoolv1.Lease{Id: "l-1", Slices: []*gpupoolv1.Slice{{Host: "h1", Device: inventory[0].Uuid, MemoryMib: 8192}}}
	for _, tc := range []struct {
		name string
		ls   LeaseServer
		want string
	}{
		{"an unknown backend", LeaseServer{Lease: lease, HostID: "h1", Inventory: inventory, Backend: "mock"}, `backend "mock": must be "real" or "simulated"`},
		{"a driver that is not there", LeaseServer{Lease: lease, HostID: "h1", Inventory: inventory, Backend: BackendReal, DriverPath: "/nonexistent/libcuda.so.1"}, "loading /nonexistent/libcuda.so.1"},
		{"another host's lease", LeaseServer{Lease: lease, HostID: "h9", Inventory: inventory, Backend: BackendSimulated}, "holds no device on host h9"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := tc.ls.NewServer(); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("got %v, want an error containing %q", err, tc.want)
			}
		})
	}
}

func TestASimulatedLeaseServerShowsTheSlice(t *testing.T) {
	lease := &gpupoolv1.Lease{Id: "l-1", Slices: []*gpupoolv1.Slice{{Host: "h1", Device: inventory[1].Uuid, MemoryMib: 8192}}}
	srv, err := LeaseServer{Lease: lease, HostID: "h1", Inventory: inventory, Backend: BackendSimulated}.NewServer()
	if err != nil {
		t.Fatal(err)
	}
	tc := dial(t, srv)
	tc.call(opCuInit, uint32(0))
	if r, d := tc.call(opCuDeviceTotalMemV2, int32(0)); r != Success || d.U64() != 8<<30 {
		t.Errorf("cuDeviceTotalMem: got %v, want 8 GiB", r)
	}
	r, d := tc.call(opCuDeviceGetName, int32(64), int32(0))
	if name := string(d.Bytes()); r != Success || !strings.HasPrefix(name, "NVIDIA H100 80GB HBM3\x00") {
		t.Errorf("cuDeviceGetName: got %q (%v), want the H100 the slice is on", name, r)
	}
}

func TestALeaseServerSurvivesItsCommandLine(t *testing.T) {
	inv := []*gpupoolv1.Device{{Uuid: "GPU-00000000-0000-0000-0000-000000000001", Index: 0, Model: "A100-SXM4-80GB", MemoryMib: 81920, SmCount: 108}}
	ls := LeaseServer{
		Lease:     &gpupoolv1.Lease{Id: "l-1", Slices: []*gpupoolv1.Slice{{Host: "h1", Device: inv[0].Uuid, MemoryMib: 8192, ComputePercent: 25}}},
		HostID:    "h1",
		Inventory: inv,
		Backend:   BackendSimulated,
		Limits:    &SessionLimits{Contexts: 2, Streams: 3, Events: 4, Modules: 5, Functions: 6},
	}
	arg, err := ls.Arg()
	if err != nil {
		t.Fatal(err)
	}
	got, err := ParseArg(arg)
	if err != nil {
		t.Fatal(err)
	}
	if got.Lease.GetSlices()[0].GetMemoryMib() != 8192 || got.HostID != "h1" || got.Backend != BackendSimulated || got.Inventory[0].GetSmCount() != 108 {
		t.Errorf("got %+v, want %+v", got, ls)
	}
	if got.Limits == nil || *got.Limits != *ls.Limits {
		t.Errorf("limits: got %+v, want %+v", got.Limits, *ls.Limits)
	}
	for _, tc := range []struct{ name, arg, want string }{
		{"not JSON", "{", "the lease's description"},
		{"an unknown backend", `{"lease":{"id":"l","slices":[{"host":"h1","device":"GPU-00000000-0000-0000-0000-000000000001","memoryMib":1}]},"host_id":"h1","inventory":[{"uuid":"GPU-00000000-0000-0000-0000-000000000001"}],"backend":"gpu"}`, `backend "gpu"`},
		{"a slice of another host's device", `{"lease":{"id":"l","slices":[{"host":"h1","device":"GPU-x","memoryMib":1}]},"host_id":"h1","inventory":[],"backend":"simulated"}`, "is not on host h1"},
		{"a session limit out of range", `{"lease":{"id":"l","slices":[{"host":"h1","device":"GPU-00000000-0000-0000-0000-000000000001","memoryMib":1}]},"host_id":"h1","inventory":[{"uuid":"GPU-00000000-0000-0000-0000-000000000001"}],"backend":"simulated","limits":{"contexts":16,"streams":0,"events":1,"modules":1,"functions":1}}`, "--" + FlagSessionStreams + " 0"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := ParseArg(tc.arg); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("got %v, want an error containing %q", err, tc.want)
			}
		})
	}
}

func TestTheRealDriverNumbersTheLeasesDevicesAsCUDAVisibleDevicesLists(t *testing.T) {
	lease := &gpupoolv1.Lease{Id: "l-1", Slices: []*gpupoolv1.Slice{
		{Host: "h1", Device: inventory[1].Uuid, MemoryMib: 8192},
		{Host: "h2", Device: "GPU-elsewhere", MemoryMib: 8192},
		{Host: "h1", Device: inventory[0].Uuid, MemoryMib: 4096},
	}}
	devs, err := LeaseDevices(lease, "h1", inventory)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, visible string
		want          []int
		err           string
	}{
		{"no CUDA_VISIBLE_DEVICES keeps the host's numbering", "", []int{1, 0}, ""},
		{"the agent's list numbers them in its order", inventory[1].Uuid + "," + inventory[0].Uuid, []int{0, 1}, ""},
		{"a list in the other order", inventory[0].Uuid + "," + inventory[1].Uuid, []int{1, 0}, ""},
		{"a list without one of the lease's devices", inventory[1].Uuid, nil, "is not in CUDA_VISIBLE_DEVICES"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := driverOrdinals(lease, "h1", devs, tc.visible)
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("got %v, want an error containing %q", err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			var ords []int
			for _, d := range got {
				ords = append(ords, d.Index)
			}
			if !reflect.DeepEqual(ords, tc.want) || got[0].MemoryBytes != 8192<<20 {
				t.Errorf("got ordinals %v (memory %d), want %v with the first slice's memory", ords, got[0].MemoryBytes, tc.want)
			}
		})
	}
}

// FuzzParseArg: whatever the argument, ParseArg returns a LeaseServer
// whose lease has devices on its host and a known backend, or an error;
// it never panics.
func FuzzParseArg(f *testing.F) {
	arg, err := LeaseServer{
		Lease:     &gpupoolv1.Lease{Id: "l-1", Slices: []*gpupoolv1.Slice{{Host: "h1", Device: inventory[0].Uuid, MemoryMib: 8192}}},
		HostID:    "h1",
		Inventory: inventory,
		Backend:   BackendSimulated,
	}.Arg()
	if err != nil {
		f.Fatal(err)
	}
	f.Add(arg)
	f.Fuzz(func(t *testing.T, s string) {
		ls, err := ParseArg(s)
		if err != nil {
			return
		}
		if _, err := LeaseDevices(ls.Lease, ls.HostID, ls.Inventory); err != nil {
			t.Errorf("ParseArg accepted a lease with no device on its host: %v", err)
		}
		if ls.Backend != BackendReal && ls.Backend != BackendSimulated {
			t.Errorf("ParseArg accepted backend %q", ls.Backend)
		}
	})
}
