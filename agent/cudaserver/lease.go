package cudaserver

import (
	"fmt"
	"log/slog"
	"os"
	"slices"
	"strings"

	"github.com/google/uuid"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// LeaseDevices are the devices of lease on host hostID, in the order of
// its slices, from the host's inventory (what device.Backend.Devices
// returns): a whole device or an exclusive slice shows the whole device's
// memory, a fractional slice its own.
func LeaseDevices(lease *gpupoolv1.Lease, hostID string, inventory []*gpupoolv1.Device) ([]Device, error) {
	byUUID := map[string]*gpupoolv1.Device{}
	for _, d := range inventory {
		byUUID[d.GetUuid()] = d
	}
	var out []Device
	for i, s := range lease.GetSlices() {
		if s.GetHost() != hostID {
			continue
		}
		d, ok := byUUID[s.GetDevice()]
		if !ok {
			return nil, fmt.Errorf("cudaserver: lease %s: slice %d: device %s is not on host %s", lease.GetId(), i, s.GetDevice(), hostID)
		}
		if s.GetMemoryMib() <= 0 {
			return nil, fmt.Errorf("cudaserver: lease %s: slice %d: memory %d MiB: must be positive", lease.GetId(), i, s.GetMemoryMib())
		}
		var mem uint64
		if !s.GetExclusive() && s.GetMemoryMib() < d.GetMemoryMib() {
			mem = uint64(s.GetMemoryMib()) << 20
		}
		out = append(out, Device{Index: int(d.GetIndex()), MemoryBytes: mem})
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("cudaserver: lease %s holds no device on host %s", lease.GetId(), hostID)
	}
	return out, nil
}

// SimDevices are the simulated backend's devices for a simulated host's
// inventory, in index order: its names, UUIDs, memory and SM counts, with
// the compute capability of the model (8.0 for A100, 9.0 for H100).
func SimDevices(inventory []*gpupoolv1.Device) ([]SimDevice, error) {
	out := make([]SimDevice, len(inventory))
	for i, d := range inventory {
		if int(d.GetIndex()) != i {
			return nil, fmt.Errorf("cudaserver: inventory: device %d has index %d; want them in index order", i, d.GetIndex())
		}
		u, err := uuid.Parse(strings.TrimPrefix(d.GetUuid(), "GPU-"))
		if err != nil {
			return nil, fmt.Errorf("cudaserver: inventory: device %d: UUID %q: %v", i, d.GetUuid(), err)
		}
		major, minor := int32(8), int32(0)
		if strings.Contains(d.GetModel(), "H100") {
			major = 9
		}
		name := d.GetModel()
		if !strings.HasPrefix(name, "NVIDIA") {
			name = "NVIDIA " + name
		}
		out[i] = SimDevice{Name: name, UUID: u, MemoryBytes: uint64(d.GetMemoryMib()) << 20, SMs: d.GetSmCount(), Major: major, Minor: minor}
	}
	return out, nil
}

// driverOrdinals renumbers devs, the lease's devices on hostID by host
// index, as the real driver numbers them in a process whose
// CUDA_VISIBLE_DEVICES is visible (as the agent sets it for every process
// of a lease: the lease's device UUIDs): by position in that list. An
// empty visible leaves the host's numbering.
func driverOrdinals(lease *gpupoolv1.Lease, hostID string, devs []Device, visible string) ([]Device, error) {
	if visible == "" {
		return devs, nil
	}
	order := strings.Split(visible, ",")
	out := make([]Device, 0, len(devs))
	i := 0
	for _, s := range lease.GetSlices() {
		if s.GetHost() != hostID {
			continue
		}
		ord := slices.Index(order, s.GetDevice())
		if ord < 0 {
			return nil, fmt.Errorf("cudaserver: lease %s: device %s is not in CUDA_VISIBLE_DEVICES %q", lease.GetId(), s.GetDevice(), visible)
		}
		d := devs[i]
		d.Index = ord
		out = append(out, d)
		i++
	}
	return out, nil
}

// Backend names a LeaseServer may run on.
const (
	BackendReal      = "real"
	BackendSimulated = "simulated"
)

// LeaseServer is what the per-lease server process needs to serve a lease:
// the workload the agent starts in the lease's sandbox (docs/remote-cuda.md,
// How the agent runs the server).
type LeaseServer struct {
	// Lease and HostID pick the lease's slices on this host.
	Lease  *gpupoolv1.Lease
	HostID string
	// Inventory is the host's devices, as the agent's device backend
	// reports them.
	Inventory []*gpupoolv1.Device
	// Backend is BackendReal (the driver at DriverPath, default
	// libcuda.so.1) or BackendSimulated (the inventory's devices).
	Backend    string
	DriverPath string
	Logger     *slog.Logger
	// Limits is Config.Limits: what each session may hold.
	Limits *SessionLimits
	// OnSessions is Config.OnSessions.
	OnSessions func(open int)
}

// NewServer checks ls and returns the lease's server.
func (ls LeaseServer) NewServer() (*Server, error) {
	devs, err := LeaseDevices(ls.Lease, ls.HostID, ls.Inventory)
	if err != nil {
		return nil, err
	}
	cfg := Config{Devices: devs, Logger: ls.Logger, Limits: ls.Limits, OnSessions: ls.OnSessions}
	switch ls.Backend {
	case BackendReal:
		if cfg.Devices, err = driverOrdinals(ls.Lease, ls.HostID, devs, os.Getenv("CUDA_VISIBLE_DEVICES")); err != nil {
			return nil, err
		}
		path := ls.DriverPath
		if path == "" {
			path = "libcuda.so.1"
		}
		drv, err := OpenRealDriver(path)
		if err != nil {
			return nil, err
		}
		cfg.NewBackend = drv.NewBackend
	case BackendSimulated:
		sims, err := SimDevices(ls.Inventory)
		if err != nil {
			return nil, err
		}
		cfg.NewBackend = func() (Backend, error) { return NewSimBackend(sims, nil), nil }
	default:
		return nil, fmt.Errorf("cudaserver: backend %q: must be %q or %q", ls.Backend, BackendReal, BackendSimulated)
	}
	return New(cfg)
}
