// Package k8s attaches gpupool leases to Kubernetes pods through Dynamic
// Resource Allocation (DRA), under the driver name gpu.gpupool.dev.
//
// The Publisher mirrors each pool host into a ResourceSlice pool, the
// Binder turns each allocated device of a ResourceClaim into a broker lease
// and reports it in the claim's status, and the NodePlugin hands the lease
// to the container as a CDI device. docs/architecture.md ("Kubernetes")
// describes how they fit together.
package k8s

import (
	// Pinned here until the code that uses them lands.
	_ "k8s.io/dynamic-resource-allocation/kubeletplugin"
	_ "k8s.io/kubelet/pkg/apis/dra/v1"
	_ "tags.cncf.io/container-device-interface/pkg/cdi"
	_ "tags.cncf.io/container-device-interface/specs-go"
)
