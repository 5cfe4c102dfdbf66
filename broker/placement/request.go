package placement

import (
	"path"
	"strings"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
	"github.com/gpupool/gpupool/protocol"
)

// request is a validated LeaseRequest with the rules that follow from it spelled out.
type request struct {
	count     int
	exclusive bool
	mem       int64 // per slice; 0 when exclusive
	compute   int32 // per slice; 0 when exclusive
	hostCPU   int64 // per lease, on the one host
	hostMem   int64 // per lease, on the one host
	topo      gpupoolv1.Topology
	cons      *gpupoolv1.Constraints // never nil
	binpack   bool
	opts      *Options // never nil
	models    []string // the model constraint's alternatives; nil when unset
	class     string   // Class of the request

	// oneHost: every slice on one host. distinct: every slice on its own device.
	oneHost, distinct bool

	// devices is the device-UUID constraint as a set; nil when unset.
	devices map[string]bool

	// lastModel and lastModelOK memoize the model glob: hosts rarely mix models.
	lastModel   string
	lastModelOK bool
}

// newRequest validates req. It returns a reason when req can never be placed whatever the pool.
func newRequest(req *gpupoolv1.LeaseRequest, opts *Options) (*request, string) {
	rq := &request{
		count:     int(req.GetCount()),
		exclusive: req.GetExclusive(),
		hostCPU:   req.GetHostCpuMillicores(),
		hostMem:   req.GetHostMemoryMib(),
		topo:      req.GetTopology(),
		cons:      req.GetConstraints(),
		binpack:   opts.Policy == Binpack || scoredPolicy(opts.Policy),
		opts:      opts,
		class:     Class(req),
	}
	if rq.cons == nil {
		rq.cons = &gpupoolv1.Constraints{}
	}
	if ds := rq.cons.GetDevices(); len(ds) > 0 {
		rq.devices = make(map[string]bool, len(ds))
		for _, d := range ds {
			rq.devices[d] = true
		}
	}
	if !rq.exclusive {
		rq.mem, rq.compute = req.GetMemoryMib(), req.GetComputePercent()
	}
	// The request's shape and model follow the protocol's rules; a request
	// that breaks them can never be placed.
	if err := protocol.ValidateShape(req); err != nil {
		return nil, err.Error()
	}
	if err := protocol.ValidateModel(rq.cons.GetModel()); err != nil {
		return nil, err.Error()
	}
	if m := rq.cons.GetModel(); m != "" {
		rq.models = strings.Split(m, "|")
	}
	rq.oneHost = rq.hostCPU > 0 || rq.hostMem > 0 || rq.topo == gpupoolv1.Topology_TOPOLOGY_SAME_HOST ||
		rq.topo == gpupoolv1.Topology_TOPOLOGY_SAME_NVLINK || rq.topo == gpupoolv1.Topology_TOPOLOGY_SAME_PCIE_ROOT
	rq.distinct = rq.exclusive || (rq.topo != gpupoolv1.Topology_TOPOLOGY_UNSPECIFIED &&
		rq.topo != gpupoolv1.Topology_TOPOLOGY_SAME_HOST)
	return rq, ""
}

// topologyName is the CLI spelling of t, "" for an unknown value.
func topologyName(t gpupoolv1.Topology) string {
	switch t {
	case gpupoolv1.Topology_TOPOLOGY_UNSPECIFIED:
		return "any"
	case gpupoolv1.Topology_TOPOLOGY_SAME_HOST:
		return "same-host"
	case gpupoolv1.Topology_TOPOLOGY_DISTINCT_GPUS:
		return "distinct-gpus"
	case gpupoolv1.Topology_TOPOLOGY_SAME_NVLINK:
		return "same-nvlink"
	case gpupoolv1.Topology_TOPOLOGY_SAME_PCIE_ROOT:
		return "same-pcie-root"
	}
	return ""
}

// hostRes reports whether the request asks for host CPU or memory.
func (rq *request) hostRes() bool { return rq.hostCPU > 0 || rq.hostMem > 0 }

// sharing reports whether two slices of the request may share a device.
func (rq *request) sharing() bool { return !rq.distinct }

// sliceMem is the memory one slice takes on d.
func (rq *request) sliceMem(d *gpupoolv1.Device) int64 {
	if rq.exclusive {
		return d.GetMemoryMib()
	}
	return rq.mem
}

// sliceCompute is the compute one slice takes.
func (rq *request) sliceCompute() int32 {
	if rq.exclusive {
		return 100
	}
	return rq.compute
}

// hostMatches reports whether h passes the host and label constraints.
func (rq *request) hostMatches(h *gpupoolv1.Host) bool {
	if want := rq.cons.GetHost(); want != "" && h.GetId() != want {
		return false
	}
	labels := h.GetLabels()
	for k, v := range rq.cons.GetLabels() {
		if got, ok := labels[k]; !ok || got != v {
			return false
		}
	}
	return true
}

// deviceMatches reports whether d passes the model and minimum-memory constraints.
func (rq *request) deviceMatches(d *gpupoolv1.Device) bool {
	if d.GetMemoryMib() < rq.cons.GetMinMemoryMib() {
		return false
	}
	if rq.devices != nil && !rq.devices[d.GetUuid()] {
		return false
	}
	if rq.models == nil {
		return true
	}
	if m := d.GetModel(); m != rq.lastModel || rq.lastModel == "" {
		rq.lastModel, rq.lastModelOK = m, modelMatches(rq.models, m)
	}
	return rq.lastModelOK
}

// modelMatches reports whether model matches one of the glob patterns alts, which were
// validated.
func modelMatches(alts []string, model string) bool {
	for _, alt := range alts {
		if ok, _ := path.Match(alt, model); ok {
			return true
		}
	}
	return false
}

// view selects how the pool is read.
type view int

const (
	// viewNow reads the pool as it is.
	viewNow view = iota
	// viewEmpty reads the pool as if every lease were released and every host and GPU were up:
	// what can never fit does not fit here.
	viewEmpty
)

func (v view) hostUsable(h *gpupoolv1.Host) bool {
	return v == viewEmpty || (h.GetStatus() == gpupoolv1.HostStatus_HOST_STATUS_READY && h.GetEligible())
}

func (v view) deviceUsable(d *gpupoolv1.Device) bool {
	return v == viewEmpty || d.GetHealth() != gpupoolv1.DeviceHealth_DEVICE_HEALTH_UNHEALTHY
}

// idle reports whether nothing is allocated on d.
func (v view) idle(d *gpupoolv1.Device) bool {
	return v == viewEmpty || (d.GetLeaseCount() == 0 && !d.GetAllocatedExclusive() &&
		d.GetAllocatedMemoryMib() == 0 && d.GetAllocatedComputePercent() == 0)
}

func (v view) heldExclusive(d *gpupoolv1.Device) bool {
	return v == viewNow && d.GetAllocatedExclusive()
}

func (v view) freeMem(d *gpupoolv1.Device) int64 {
	if v == viewEmpty {
		return d.GetMemoryMib()
	}
	if d.GetAllocatedExclusive() {
		return 0
	}
	return max(0, d.GetMemoryMib()-d.GetAllocatedMemoryMib())
}

func (v view) freeCompute(d *gpupoolv1.Device) int32 {
	if v == viewEmpty {
		return 100
	}
	if d.GetAllocatedExclusive() {
		return 0
	}
	return max(0, 100-d.GetAllocatedComputePercent())
}

func (v view) hostFreeCPU(h *gpupoolv1.Host) int64 {
	if v == viewEmpty {
		return h.GetCpuMillicores()
	}
	return h.GetCpuMillicores() - h.GetAllocatedCpuMillicores()
}

func (v view) hostFreeMem(h *gpupoolv1.Host) int64 {
	if v == viewEmpty {
		return h.GetMemoryMib()
	}
	return h.GetMemoryMib() - h.GetAllocatedMemoryMib()
}

// fitsOne reports whether one slice of rq fits on d under v.
func (rq *request) fitsOne(v view, d *gpupoolv1.Device) bool {
	if rq.exclusive {
		return v.idle(d)
	}
	return !v.heldExclusive(d) && v.freeMem(d) >= rq.mem && v.freeCompute(d) >= rq.compute
}

// hostRoomy reports whether h has the host CPU and memory rq asks for under v.
func (rq *request) hostRoomy(v view, h *gpupoolv1.Host) bool {
	return (rq.hostCPU == 0 || v.hostFreeCPU(h) >= rq.hostCPU) &&
		(rq.hostMem == 0 || v.hostFreeMem(h) >= rq.hostMem)
}
