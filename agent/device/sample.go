package device

import (
	"fmt"
	"math"
	"slices"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// Sample is one reading of a device's live state. A field NVML cannot
// report (ERROR_NOT_SUPPORTED, or any other failure but a lost GPU) is
// unknown: -1 for numbers, nil for Processes.
type Sample struct {
	UUID  string
	Index int
	// MemoryUsedMiB is the device's used memory as NVML reports it for
	// the whole device, which includes memory no process owns.
	MemoryUsedMiB int64
	// UtilizationPercent is the GPU's utilisation over NVML's last sample
	// period, 0 to 100.
	UtilizationPercent int32
	// Processes lists the compute processes, MPS clients included, one
	// entry per pid, sorted by pid. It is empty, not nil, when NVML lists
	// none.
	Processes []Process
	// Lost says the device answered ERROR_GPU_IS_LOST: it fell off the
	// bus or otherwise stopped answering, and the fields read after that
	// answer are unknown.
	Lost bool
}

// Process is one process using a device.
type Process struct {
	PID int
	// UsedMiB is the device memory the process uses; -1 when NVML cannot
	// say (it reports no per-process memory inside some containers).
	UsedMiB int64
}

// valueNotAvailable is NVML_VALUE_NOT_AVAILABLE as an unsigned long long,
// what NVML reports as a process's memory when it cannot say.
const valueNotAvailable = math.MaxUint64

// sample reads the live state of every device of lib, which must be
// initialised. It is the only place that samples devices, for every
// backend. known holds the UUIDs of the device indexes as last read, for
// naming lost devices.
//
// Failing to count the devices or to identify one that is not lost is an
// error; any other failure leaves a field unknown.
func sample(lib nvml.Interface, known []string) ([]Sample, error) {
	n, ret := lib.DeviceGetCount()
	if ret != nvml.SUCCESS {
		return nil, fmt.Errorf("device: count GPUs: %w", code(ret))
	}
	out := make([]Sample, n)
	for i := range n {
		s, err := sampleDevice(lib, i)
		if err != nil {
			return nil, err
		}
		if s.UUID == "" && i < len(known) {
			s.UUID = known[i]
		}
		out[i] = s
	}
	return out, nil
}

// sampleDevice reads device i, stopping at the first query that says the
// GPU is lost.
func sampleDevice(lib nvml.Interface, i int) (Sample, error) {
	s := Sample{Index: i, MemoryUsedMiB: -1, UtilizationPercent: -1}
	lost := func(ret nvml.Return) bool {
		s.Lost = ret == nvml.ERROR_GPU_IS_LOST
		return s.Lost
	}
	h, ret := lib.DeviceGetHandleByIndex(i)
	if lost(ret) {
		return s, nil
	}
	if ret != nvml.SUCCESS {
		return Sample{}, fmt.Errorf("device: GPU %d: get handle: %w", i, code(ret))
	}
	if s.UUID, ret = h.GetUUID(); lost(ret) {
		s.UUID = ""
		return s, nil
	} else if ret != nvml.SUCCESS {
		return Sample{}, fmt.Errorf("device: GPU %d: read UUID: %w", i, code(ret))
	}
	if mem, ret := h.GetMemoryInfo(); ret == nvml.SUCCESS {
		s.MemoryUsedMiB = int64(mem.Used >> 20)
	} else if lost(ret) {
		return s, nil
	}
	if u, ret := h.GetUtilizationRates(); ret == nvml.SUCCESS {
		s.UtilizationPercent = int32(min(u.Gpu, 100))
	} else if lost(ret) {
		return s, nil
	}
	var lists [][]nvml.ProcessInfo
	for _, list := range []func() ([]nvml.ProcessInfo, nvml.Return){h.GetComputeRunningProcesses, h.GetMPSComputeRunningProcesses} {
		procs, ret := list()
		if lost(ret) {
			return s, nil
		}
		if ret == nvml.SUCCESS {
			lists = append(lists, procs)
		}
	}
	if len(lists) > 0 {
		s.Processes = mergeProcesses(lists...)
	}
	return s, nil
}

// mergeProcesses turns NVML's process lists into one entry per pid,
// sorted by pid. Within one list a pid's entries add up: NVML lists a
// process once per MIG instance it uses. Across lists the largest wins: a
// pid both the compute and the MPS list name is one process, an MPS
// client, and its two entries count the same memory. Unknown memory
// (-1) makes a sum unknown and loses to any known amount.
func mergeProcesses(lists ...[]nvml.ProcessInfo) []Process {
	merged := map[int]int64{}
	for _, list := range lists {
		inList := map[int]int64{}
		for _, p := range list {
			pid, used := int(p.Pid), int64(-1)
			if p.UsedGpuMemory != valueNotAvailable {
				used = int64(p.UsedGpuMemory >> 20)
			}
			if prev, ok := inList[pid]; ok && (prev < 0 || used < 0) {
				used = -1
			} else if ok {
				used += prev
			}
			inList[pid] = used
		}
		for pid, used := range inList {
			if prev, ok := merged[pid]; !ok || used > prev {
				merged[pid] = used
			}
		}
	}
	out := make([]Process, 0, len(merged))
	for pid, used := range merged {
		out = append(out, Process{PID: pid, UsedMiB: used})
	}
	slices.SortFunc(out, func(a, b Process) int { return a.PID - b.PID })
	return out
}
