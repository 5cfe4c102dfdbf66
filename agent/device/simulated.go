package device

import (
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/gpus"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"
	"github.com/google/uuid"
)

// MaxSimCount is the largest N of one NxMODEL part of a simulation spec.
const MaxSimCount = 64

// nvlinkDomain is how many GPUs of a group share one NVSwitch fabric, as
// in a DGX.
const nvlinkDomain = 8

// simModels maps the models a spec may name to the go-nvml mock GPU that
// simulates them. Names are those real NVML reports for the part.
var simModels = map[string]gpus.Config{
	"A100-40GB": withName(gpus.A100_SXM4_40GB, "NVIDIA A100-SXM4-40GB"), // the mock calls it "Mock NVIDIA A100-SXM4-40GB"
	"A100-80GB": gpus.A100_SXM4_80GB,
	"H100-80GB": gpus.H100_SXM5_80GB,
}

func withName(c gpus.Config, name string) gpus.Config {
	c.Name = name
	return c
}

// SimModels lists the models a simulation spec may name, sorted.
func SimModels() []string {
	out := make([]string, 0, len(simModels))
	for m := range simModels {
		out = append(out, m)
	}
	slices.Sort(out)
	return out
}

// SimGroup is one NxMODEL part of a simulation spec.
type SimGroup struct {
	Count int    // 1..MaxSimCount
	Model string // one of SimModels, in its canonical spelling
	// NVLink is how many consecutive GPUs of the part share an NVLink
	// domain (0: none, PCIe only); PCIe how many share a PCIe root.
	NVLink, PCIe int
}

// Defaults of a spec part's topology: a DGX board.
const (
	defaultSimNVLink = nvlinkDomain
	defaultSimPCIe   = 2
)

// ParseSpec parses a simulation spec: comma-separated parts
// NxMODEL[:nvlink=K][:pcie=P] such as "8xA100-80GB",
// "4xA100-80GB,4xH100-80GB" or "8xA100-40GB:nvlink=4:pcie=4". K GPUs in a
// row share an NVLink domain (default 8; 0 for none), P GPUs in a row a
// PCIe root (default 2). Models are matched without regard to case. An
// error names the offending part and what is allowed, e.g.
// `"0xA100-80GB": count 0 must be between 1 and 64`.
func ParseSpec(spec string) ([]SimGroup, error) {
	if strings.TrimSpace(spec) == "" {
		return nil, fmt.Errorf("%q: want NxMODEL[:nvlink=K][:pcie=P][,...], e.g. 8xA100-80GB", spec)
	}
	var out []SimGroup
	for part := range strings.SplitSeq(spec, ",") {
		part = strings.TrimSpace(part)
		grp := SimGroup{NVLink: defaultSimNVLink, PCIe: defaultSimPCIe}
		opts := strings.Split(part, ":")
		for _, o := range opts[1:] {
			k, v, _ := strings.Cut(o, "=")
			n, err := strconv.Atoi(v)
			switch {
			case k == "nvlink" && err == nil && n >= 0 && n <= MaxSimCount:
				grp.NVLink = n
			case k == "pcie" && err == nil && n >= 1 && n <= MaxSimCount:
				grp.PCIe = n
			case k == "nvlink":
				return nil, fmt.Errorf("%q: nvlink=%s: must be GPUs per NVLink domain, 0 (none) to %d", part, v, MaxSimCount)
			case k == "pcie":
				return nil, fmt.Errorf("%q: pcie=%s: must be GPUs per PCIe root, 1 to %d", part, v, MaxSimCount)
			default:
				return nil, fmt.Errorf("%q: option %q: must be nvlink=K or pcie=P", part, o)
			}
		}
		part = opts[0]
		x := strings.IndexAny(part, "xX")
		if x <= 0 || x == len(part)-1 {
			return nil, fmt.Errorf("%q: want NxMODEL, e.g. 8xA100-80GB", part)
		}
		n, model := part[:x], part[x+1:]
		count, err := strconv.Atoi(n)
		if err != nil {
			return nil, fmt.Errorf("%q: count %q is not a number", part, n)
		}
		if count < 1 || count > MaxSimCount {
			return nil, fmt.Errorf("%q: count %d must be between 1 and %d", part, count, MaxSimCount)
		}
		i := slices.IndexFunc(SimModels(), func(m string) bool { return strings.EqualFold(m, model) })
		if i < 0 {
			return nil, fmt.Errorf("%q: model %q: must be one of %s", part, model, strings.Join(SimModels(), ", "))
		}
		grp.Count, grp.Model = count, SimModels()[i]
		out = append(out, grp)
	}
	return out, nil
}

// NewSimulated returns a backend of simulated GPUs described by spec (see
// ParseSpec), built on go-nvml's mock servers. It also implements
// Simulator, through which tests set the GPUs' live state and inject
// health events. The host looks like a row of DGX boards:
//   - UUIDs derive from hostID and the device index, so they are the same
//     on every run for the same host and differ between hosts;
//   - GPUs of the same spec part are NVLink peers in groups of its
//     nvlink= (8 by default), and share PCIe roots in groups of its pcie=
//     (2 by default; pcie-0, pcie-1, ... in index order);
//   - the first half of the GPUs is on NUMA node 0, the rest on node 1;
//   - no process runs, utilisation is 0 and the GPUs are healthy.
func NewSimulated(spec, hostID string, opts ...SimOption) (Backend, error) {
	groups, err := ParseSpec(spec)
	if err != nil {
		return nil, err
	}
	if hostID == "" {
		return nil, errors.New("device: simulated GPUs need a host id: their UUIDs derive from it")
	}
	var (
		configs []gpus.Config
		domains []int // NVLink domain of each device; -1 for none
		roots   []int // PCIe root of each device
	)
	for g, grp := range groups {
		for k := range grp.Count {
			configs = append(configs, simModels[grp.Model])
			dom := -1
			if grp.NVLink > 0 {
				dom = g*MaxSimCount + k/grp.NVLink
			}
			domains = append(domains, dom)
			roots = append(roots, g*MaxSimCount+k/grp.PCIe)
		}
	}
	srv, err := server.New(
		server.WithGPUs(configs...),
		server.WithDriverVersion("550.54.15"),
		server.WithNVMLVersion("12.550.54.15"),
		server.WithCUDADriverVersion(12040),
	)
	if err != nil {
		return nil, fmt.Errorf("device: build mock NVML server: %w", err)
	}

	index := make(map[nvml.Device]int, len(srv.Devices))
	for i, h := range srv.Devices {
		index[h] = i
	}
	total := len(srv.Devices)
	numa := func(i int) int { return i / ((total + 1) / 2) }
	for i, h := range srv.Devices {
		d := h.(*server.Device)
		d.UUID = simUUID(hostID, i)
		d.PciBusID = fmt.Sprintf("%08X:%02X:00.0", i/32, 0x07+(i%32)*8)
		pci := nvml.PciInfo{Domain: uint32(i / 32), Bus: uint32(0x07 + (i%32)*8), PciDeviceId: d.Config.PciDeviceId}
		copyCString(pci.BusId[:], d.PciBusID)
		copyCString(pci.BusIdLegacy[:], d.PciBusID[4:])
		d.GetPciInfoFunc = func() (nvml.PciInfo, nvml.Return) { return pci, nvml.SUCCESS }
		d.GetNumaNodeIdFunc = func() (int, nvml.Return) { return numa(i), nvml.SUCCESS }
		// Like real NVML on a full (non-MIG) GPU.
		d.GetAttributesFunc = func() (nvml.DeviceAttributes, nvml.Return) {
			return nvml.DeviceAttributes{}, nvml.ERROR_NOT_SUPPORTED
		}
		d.GetP2PStatusFunc = func(other nvml.Device, caps nvml.GpuP2PCapsIndex) (nvml.GpuP2PStatus, nvml.Return) {
			j, ok := index[other]
			if !ok {
				return nvml.P2P_STATUS_UNKNOWN, nvml.ERROR_INVALID_ARGUMENT
			}
			if caps == nvml.P2P_CAPS_INDEX_NVLINK && (i == j || domains[i] < 0 || domains[i] != domains[j]) {
				return nvml.P2P_STATUS_NOT_SUPPORTED, nvml.SUCCESS
			}
			return nvml.P2P_STATUS_OK, nvml.SUCCESS
		}
		d.GetTopologyCommonAncestorFunc = func(other nvml.Device) (nvml.GpuTopologyLevel, nvml.Return) {
			j, ok := index[other]
			switch {
			case !ok:
				return 0, nvml.ERROR_INVALID_ARGUMENT
			case i == j:
				return nvml.TOPOLOGY_INTERNAL, nvml.SUCCESS
			case roots[i] == roots[j]:
				return nvml.TOPOLOGY_MULTIPLE, nvml.SUCCESS
			case numa(i) == numa(j):
				return nvml.TOPOLOGY_NODE, nvml.SUCCESS
			default:
				return nvml.TOPOLOGY_SYSTEM, nvml.SUCCESS
			}
		}
	}
	sim := newSimulator(srv)
	for _, o := range opts {
		o(sim)
	}
	ret := srv.Init()
	if ret != nvml.SUCCESS {
		return nil, fmt.Errorf("device: init mock NVML: %w", ret)
	}
	return &simBackend{newSession(srv, "mock NVML", ret), sim}, nil
}

// simUUID is the stable UUID of device i of host hostID.
func simUUID(hostID string, i int) string {
	return "GPU-" + uuid.NewSHA1(uuid.NameSpaceURL, []byte("gpupool-sim://"+hostID+"/gpu/"+strconv.Itoa(i))).String()
}

func copyCString(dst []int8, s string) {
	for i := 0; i < len(s) && i < len(dst)-1; i++ {
		dst[i] = int8(s[i])
	}
}

// simBackend is the backend of simulated GPUs; its session does the work
// of a Backend, its simulator that of a Simulator.
type simBackend struct {
	*session
	*simulator
}

var (
	_ Backend   = (*simBackend)(nil)
	_ Simulator = (*simBackend)(nil)
)

func (b *simBackend) Name() string { return "simulated" }
