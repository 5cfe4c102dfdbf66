package agent

import (
	"cmp"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// Floors of the default caps unless configured.
const (
	// DefaultCPUFloorMillicores is one core.
	DefaultCPUFloorMillicores = 1000
	// DefaultMemoryFloorMiB is 1 GiB.
	DefaultMemoryFloorMiB = 1024
)

// hostCaps are the host CPU (millicores) and memory (MiB) a lease's
// cgroup is capped at: what the lease asked for, or, for what it names
// none of, its default share (see defaultShare). Never 0: every lease's
// cgroup has both caps.
func (a *Agent) hostCaps(as *gpupoolv1.Assignment) (cpu, memMiB int64) {
	cpu, memMiB = as.GetHostCpuMillicores(), as.GetHostMemoryMib()
	if cpu > 0 && memMiB > 0 {
		return cpu, memMiB
	}
	frac := a.gpuFraction(as)
	if cpu <= 0 {
		cpu = defaultShare(a.cfg.CPUMillicores, frac, cmp.Or(a.cfg.DefaultCPUFloor, DefaultCPUFloorMillicores))
	}
	if memMiB <= 0 {
		memMiB = defaultShare(a.cfg.MemoryMiB, frac, cmp.Or(a.cfg.DefaultMemoryFloorMiB, DefaultMemoryFloorMiB))
	}
	return cpu, memMiB
}

// defaultShare is frac of offered, rounded down, at least floor, and never
// more than offered where the host offers any: a floor above what the
// host offers is cut to the offer. Where it offers none, the floor is the
// cap.
func defaultShare(offered int64, frac float64, floor int64) int64 {
	if offered <= 0 {
		return floor
	}
	return min(offered, max(floor, int64(float64(offered)*frac)))
}

// gpuFraction is the share of this host's GPUs a lease holds, from 0 to
// 1: the sum over its slices of each slice's share of its GPU, divided by
// the GPUs on the host. A slice's share of its GPU is its compute
// percentage over 100 (a whole or exclusive GPU counts 1); a slice that
// names no compute share counts its memory over the GPU's.
func (a *Agent) gpuFraction(as *gpupoolv1.Assignment) float64 {
	if len(a.byIndex) == 0 {
		return 0
	}
	var sum float64
	for _, s := range as.GetSlices() {
		switch d := a.devices[s.GetDevice()]; {
		case s.GetExclusive() || s.GetComputePercent() >= 100:
			sum++
		case s.GetComputePercent() > 0:
			sum += float64(s.GetComputePercent()) / 100
		case d != nil && d.GetMemoryMib() > 0:
			sum += min(1, float64(s.GetMemoryMib())/float64(d.GetMemoryMib()))
		}
	}
	return min(1, sum/float64(len(a.byIndex)))
}
