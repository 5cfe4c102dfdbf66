// Package device discovers and watches the GPUs of a pool host.
//
// Every backend reads its inventory, live state and health events through
// go-nvml's nvml.Interface and the same code (enumerate, sample,
// watchHealth): the real backend (NewNVML) hands it the dlopen'ed
// libnvidia-ml, the simulated one (NewSimulated) a go-nvml mock server
// driven by a Simulator. What the simulated backend exercises is therefore
// the code that runs on real hosts.
package device

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// Backend discovers the GPUs of this host.
type Backend interface {
	// Name is "nvml" or "simulated".
	Name() string
	// Devices returns the host's GPUs in index order, with topology
	// (NVLink peers, PCIe root, NUMA node) filled in and HostId left
	// empty. Each call returns fresh objects the caller may modify. A
	// backend that can offer no GPUs returns none and no error, and
	// Note says why.
	Devices() ([]*gpupoolv1.Device, error)
	// Note says in one sentence why the backend offers no GPUs, or is
	// empty.
	Note() string
	// Sample reads every device's live state, in index order. A backend
	// that offers no GPUs returns none and no error. A device that
	// answers ERROR_GPU_IS_LOST is still listed, with Lost set.
	Sample() ([]Sample, error)
	// WatchHealth reports health events to fn until ctx ends, then
	// returns nil. It returns at once with nil when the backend offers no
	// GPUs, and never makes an NVML call when NVML failed to initialise.
	// fn is called from WatchHealth's goroutine, one event at a time; it
	// must not call Close, which waits for WatchHealth to return. Closing
	// the backend ends WatchHealth with ErrClosed.
	WatchHealth(ctx context.Context, fn func(HealthEvent)) error
	// Close releases the backend. Devices, Sample and WatchHealth return
	// ErrClosed after Close; Close waits for running WatchHealth calls to
	// return.
	Close() error
}

// enumerate reads the inventory of lib, which must be initialised. It is
// the only place that queries devices, for every backend.
//
// Per-device queries that fail (topology, NUMA node, SM count) leave the
// field unknown rather than failing the inventory: a GPU with partial
// information is still offered. Failing to list or identify a device is
// an error.
func enumerate(lib nvml.Interface) ([]*gpupoolv1.Device, error) {
	n, ret := lib.DeviceGetCount()
	if ret != nvml.SUCCESS {
		return nil, fmt.Errorf("device: count GPUs: %w", code(ret))
	}
	handles := make([]nvml.Device, n)
	out := make([]*gpupoolv1.Device, n)
	numaSupported := lib.Extensions().LookupSymbol("nvmlDeviceGetNumaNodeId") == nil
	for i := range n {
		h, ret := lib.DeviceGetHandleByIndex(i)
		if ret != nvml.SUCCESS {
			return nil, fmt.Errorf("device: GPU %d: get handle: %w", i, code(ret))
		}
		d, err := describe(h, i, numaSupported)
		if err != nil {
			return nil, err
		}
		handles[i], out[i] = h, d
	}
	linkTopology(handles, out)
	return out, nil
}

// describe reads what one device says about itself.
func describe(h nvml.Device, i int, numaSupported bool) (*gpupoolv1.Device, error) {
	uuid, ret := h.GetUUID()
	if ret != nvml.SUCCESS {
		return nil, fmt.Errorf("device: GPU %d: read UUID: %w", i, code(ret))
	}
	name, ret := h.GetName()
	if ret != nvml.SUCCESS {
		return nil, fmt.Errorf("device: GPU %d (%s): read name: %w", i, uuid, code(ret))
	}
	mem, ret := h.GetMemoryInfo()
	if ret != nvml.SUCCESS {
		return nil, fmt.Errorf("device: GPU %d (%s): read memory: %w", i, uuid, code(ret))
	}
	d := &gpupoolv1.Device{
		Uuid:      uuid,
		Index:     int32(i),
		Model:     modelName(name),
		MemoryMib: int64(mem.Total >> 20),
		NumaNode:  -1,
		Health:    gpupoolv1.DeviceHealth_DEVICE_HEALTH_HEALTHY,
	}
	if idx, ret := h.GetIndex(); ret == nvml.SUCCESS {
		d.Index = int32(idx)
	}
	d.SmCount = smCount(h, d.Model)
	if pci, ret := h.GetPciInfo(); ret == nvml.SUCCESS {
		d.PciBusId = cString(pci.BusId[:])
	}
	d.NumaNode = numaNode(h, d.PciBusId, numaSupported)
	return d, nil
}

// numaNode asks NVML for the device's NUMA node, or, on drivers without
// nvmlDeviceGetNumaNodeId, the kernel; -1 means unknown.
func numaNode(h nvml.Device, busID string, numaSupported bool) int32 {
	if numaSupported {
		if node, ret := h.GetNumaNodeId(); ret == nvml.SUCCESS {
			return int32(node)
		}
	}
	// NVML writes an 8-digit PCI domain ("00000000:07:00.0"), sysfs a
	// 4-digit one.
	if len(busID) == len("00000000:07:00.0") {
		busID = busID[4:]
	}
	if busID == "" {
		return -1
	}
	b, err := os.ReadFile(filepath.Join("/sys/bus/pci/devices", strings.ToLower(busID), "numa_node"))
	if err != nil {
		return -1
	}
	node, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		return -1
	}
	return int32(node)
}

// linkTopology fills NVLink peers and PCIe roots from pairwise queries.
// Two GPUs are NVLink peers when NVML reports NVLink P2P between them
// (directly or through an NVSwitch). Two GPUs share a PCIe root when
// their common ancestor is at most a tree of PCIe switches (PIX or PXB in
// nvidia-smi topo terms); roots are named pcie-0, pcie-1, ... in order of
// their lowest device index.
func linkTopology(handles []nvml.Device, devs []*gpupoolv1.Device) {
	root := make([]int, len(devs)) // union-find parent
	for i := range root {
		root[i] = i
	}
	find := func(i int) int {
		for root[i] != i {
			root[i] = root[root[i]]
			i = root[i]
		}
		return i
	}
	for i := range handles {
		for j := i + 1; j < len(handles); j++ {
			if st, ret := handles[i].GetP2PStatus(handles[j], nvml.P2P_CAPS_INDEX_NVLINK); ret == nvml.SUCCESS && st == nvml.P2P_STATUS_OK {
				devs[i].NvlinkPeers = append(devs[i].NvlinkPeers, devs[j].Uuid)
				devs[j].NvlinkPeers = append(devs[j].NvlinkPeers, devs[i].Uuid)
			}
			if lvl, ret := handles[i].GetTopologyCommonAncestor(handles[j]); ret == nvml.SUCCESS && lvl <= nvml.TOPOLOGY_MULTIPLE {
				if a, b := find(i), find(j); a != b {
					root[max(a, b)] = min(a, b)
				}
			}
		}
	}
	names := map[int]string{}
	for i, d := range devs {
		r := find(i)
		if _, ok := names[r]; !ok {
			names[r] = fmt.Sprintf("pcie-%d", len(names))
		}
		d.PcieRoot = names[r]
	}
}

// modelName turns the name NVML reports into the model gpupool shows and
// matches constraints against: without the vendor prefix, spaces as
// dashes. "NVIDIA A100-SXM4-80GB" is "A100-SXM4-80GB", "NVIDIA H100 80GB
// HBM3" is "H100-80GB-HBM3".
func modelName(name string) string {
	name = strings.TrimSpace(strings.TrimPrefix(name, "NVIDIA "))
	return strings.Join(strings.Fields(name), "-")
}

// smCount is the device's number of streaming multiprocessors. NVML
// reports it only for MIG devices on many drivers, so full GPUs fall back
// to a table by model; 0 means unknown.
func smCount(h nvml.Device, model string) int32 {
	if attr, ret := h.GetAttributes(); ret == nvml.SUCCESS && attr.MultiprocessorCount > 0 {
		return int32(attr.MultiprocessorCount)
	}
	for _, m := range smTable {
		if strings.Contains(model, m.model) {
			return m.sms
		}
	}
	return 0
}

// smTable lists SM counts of data-centre GPUs. Order matters: the first
// entry whose model is a substring of the device model wins, so longer
// names come before their prefixes.
var smTable = []struct {
	model string
	sms   int32
}{
	{"A100", 108},
	{"A800", 108},
	{"A30", 56},
	{"A10", 72},
	{"H100-PCIe", 114},
	{"H100", 132},
	{"H800", 132},
	{"H200", 132},
	{"B200", 148},
	{"L40", 142},
	{"L4", 58},
	{"V100", 80},
	{"T4", 40},
}

// cString converts a NUL-terminated C char array.
func cString(b []int8) string {
	var sb strings.Builder
	for _, c := range b {
		if c == 0 {
			break
		}
		sb.WriteByte(byte(c))
	}
	return sb.String()
}
