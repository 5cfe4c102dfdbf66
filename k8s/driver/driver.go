// Package driver is the contract of gpupool's Kubernetes DRA driver,
// gpu.gpupool.dev: what the controller (k8s/controller) writes and the
// node plugin (k8s/nodeplugin) reads, and what users' DeviceClasses and
// CEL selectors see. It holds the driver name, the device attributes,
// capacities and taints, the binding conditions and the data of a leased
// device in a claim's status; nothing here talks to an apiserver or a
// broker.
//
// The controller's Publisher mirrors each pool host into a ResourceSlice
// pool and its Binder turns each allocated device of a ResourceClaim into
// a broker lease reported in the claim's status; the node plugin hands
// the lease to the container as a CDI device. docs/architecture.md
// ("Kubernetes") describes how they fit together.
package driver

import (
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/types"
)

// Name is the DRA driver and DeviceClass name of gpupool.
const Name = "gpu.gpupool.dev"

// The binding conditions of every published device: the scheduler binds a
// pod once the binder has set Leased on each of its devices, and gives the
// allocation up when it has set LeaseFailed.
const (
	ConditionLeased      = "Leased"
	ConditionLeaseFailed = "LeaseFailed"
)

// Device taints. The NoExecute ones keep the scheduler off a device and
// let the device-taint eviction controller evict the pods that use it; busy
// (NoSchedule) only keeps new pods off.
const (
	TaintUnhealthy = Name + "/unhealthy"
	TaintDraining  = Name + "/draining"
	TaintDrained   = Name + "/drained"
	TaintDown      = Name + "/down"
	TaintBusy      = Name + "/busy"
)

// Device attribute and capacity names, in the driver's domain.
const (
	AttrModel resourceapi.QualifiedName = "model"
	AttrUUID  resourceapi.QualifiedName = "uuid"
	AttrHost  resourceapi.QualifiedName = "host"
	AttrIndex resourceapi.QualifiedName = "index"
	AttrMPS   resourceapi.QualifiedName = "mps"
	// AttrNVLinkDomain names the NVLink island of a GPU: "<host>/nvlink-<k>",
	// the same for every GPU of the host that it is linked to, directly or
	// through others. A GPU without NVLink peers has none.
	AttrNVLinkDomain resourceapi.QualifiedName = "nvlinkDomain"
	CapacityMemory   resourceapi.QualifiedName = "memory"
	CapacityCompute  resourceapi.QualifiedName = "compute"
)

// AttrPCIeRoot is Kubernetes' standard attribute for the PCIe root
// complex of a device, outside the driver's domain. Its value is
// "<host>/<root>" (for example "dgx-1/pcie-0"), not the pci<domain>:<bus>
// of a local device: a remote GPU never shares a root with a device of
// the node its pod runs on, and two hosts' roots must not compare
// equal.
const AttrPCIeRoot resourceapi.QualifiedName = "resource.kubernetes.io/pcieRoot"

// DeviceStatusData is the data of a leased device in a claim's
// status.devices[]: what the node plugin needs to hand the lease to the
// container.
type DeviceStatusData struct {
	LeaseID        string `json:"leaseId"`
	Host           string `json:"host"`
	AgentAddress   string `json:"agentAddress"`
	CertSHA256     string `json:"certSHA256"`
	MemoryMiB      int64  `json:"memoryMiB"`
	ComputePercent int32  `json:"computePercent"`
}

// Results are the allocation results of claim for this driver.
func Results(claim *resourceapi.ResourceClaim) []resourceapi.DeviceRequestAllocationResult {
	if claim.Status.Allocation == nil {
		return nil
	}
	var out []resourceapi.DeviceRequestAllocationResult
	for _, r := range claim.Status.Allocation.Devices.Results {
		if r.Driver == Name {
			out = append(out, r)
		}
	}
	return out
}

// DeviceStatus is the status.devices[] entry of result r, or nil.
func DeviceStatus(claim *resourceapi.ResourceClaim, r resourceapi.DeviceRequestAllocationResult) *resourceapi.AllocatedDeviceStatus {
	for i, d := range claim.Status.Devices {
		if d.Driver == r.Driver && d.Pool == r.Pool && d.Device == r.Device && sameShare(d.ShareID, r.ShareID) {
			return &claim.Status.Devices[i]
		}
	}
	return nil
}

func sameShare(a *string, b *types.UID) bool {
	if a == nil || b == nil {
		return a == nil && b == nil
	}
	return *a == string(*b)
}
