package controller

import (
	"context"
	"fmt"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/dynamic-resource-allocation/cel"
	"k8s.io/dynamic-resource-allocation/structured"

	"github.com/gpupool/gpupool/k8s/driver"
	"github.com/gpupool/gpupool/k8s/internal/k8stest"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// classes is the DeviceClass gpu.gpupool.dev, as the Helm chart installs it.
type classes struct{}

var gpuClass = &resourceapi.DeviceClass{
	ObjectMeta: metav1.ObjectMeta{Name: driver.Name},
	Spec: resourceapi.DeviceClassSpec{Selectors: []resourceapi.DeviceSelector{{
		CEL: &resourceapi.CELDeviceSelector{Expression: `device.driver == "` + driver.Name + `"`},
	}}},
}

func (classes) List() ([]*resourceapi.DeviceClass, error) {
	return []*resourceapi.DeviceClass{gpuClass}, nil
}
func (classes) Get(name string) (*resourceapi.DeviceClass, error) {
	if name != driver.Name {
		return nil, apierrors.NewNotFound(resourceapi.Resource("deviceclasses"), name)
	}
	return gpuClass, nil
}

// gpuClaim asks for one GPU with capacity requests (none: the defaults).
func gpuClaim(name string, requests map[string]string) *resourceapi.ResourceClaim {
	req := resourceapi.DeviceRequest{Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{
		DeviceClassName: driver.Name, AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 1,
	}}
	if len(requests) > 0 {
		req.Exactly.Capacity = &resourceapi.CapacityRequirements{Requests: map[resourceapi.QualifiedName]resource.Quantity{}}
		for k, v := range requests {
			req.Exactly.Capacity.Requests[resourceapi.QualifiedName(k)] = resource.MustParse(v)
		}
	}
	return &resourceapi.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Namespace: testNS, Name: name, UID: types.UID("uid-" + name)},
		Spec:       resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{req}}},
	}
}

// allocate runs the scheduler's allocator for claims, all at once, on a
// node that has the client label, over what the publisher builds of hosts
// and leases. It returns each claim's devices as "<pool>/<device> memory=..
// compute=..", or nil when the claims cannot be allocated together.
func allocate(t *testing.T, hosts []*gpupoolv1.Host, leases []*gpupoolv1.Lease, claims ...*resourceapi.ResourceClaim) []string {
	t.Helper()
	ctx := context.Background()
	var slices []*resourceapi.ResourceSlice
	for _, o := range sliceObjects(BuildResources(hosts, leases, PublisherConfig{NodeSelector: DefaultNodeSelector()})) {
		slices = append(slices, o.(*resourceapi.ResourceSlice))
	}
	features := structured.Features{ConsumableCapacity: true, DeviceBindingAndStatus: true, DeviceTaints: true}
	state := structured.AllocatedState{
		AllocatedDevices:         sets.New[structured.DeviceID](),
		AllocatedSharedDeviceIDs: sets.New[structured.SharedDeviceID](),
		AggregatedCapacity:       structured.NewConsumedCapacityCollection(),
	}
	a, err := structured.NewAllocator(ctx, features, state, classes{}, slices, cel.NewCache(10, cel.Features{EnableConsumableCapacity: true}))
	if err != nil {
		t.Fatal(err)
	}
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-1", Labels: DefaultNodeSelector()}}
	results, err := a.Allocate(ctx, node, claims)
	if err != nil {
		t.Fatalf("Allocate: %v", err)
	}
	if results == nil {
		return nil
	}
	var out []string
	for _, r := range results {
		for _, d := range r.Devices.Results {
			if d.ShareID == nil || fmt.Sprint(d.BindingConditions) != "[Leased]" || fmt.Sprint(d.BindingFailureConditions) != "[LeaseFailed]" {
				t.Errorf("result %+v: want a shareID and the binding conditions", d)
			}
			mem, compute := d.ConsumedCapacity[driver.CapacityMemory], d.ConsumedCapacity[driver.CapacityCompute]
			out = append(out, fmt.Sprintf("%s/%s memory=%s compute=%s", d.Pool, d.Device, mem.String(), compute.String()))
		}
	}
	return out
}

func TestTheSchedulersAllocatorSharesPublishedGPUs(t *testing.T) {
	oneGPU := []*gpupoolv1.Host{k8stest.ReadyHost("h1", 1)}
	frac := map[string]string{"memory": "20Gi", "compute": "25"}
	for _, tc := range []struct {
		name   string
		hosts  []*gpupoolv1.Host
		leases []*gpupoolv1.Lease
		claims []*resourceapi.ResourceClaim
		want   string // "" for not allocatable
	}{
		{"a fractional claim consumes what it asks for",
			oneGPU, nil, []*resourceapi.ResourceClaim{gpuClaim("a", frac)},
			"h1/gpu-h1-0 memory=20Gi compute=25"},
		{"two fractional claims share one 80Gi GPU",
			oneGPU, nil, []*resourceapi.ResourceClaim{gpuClaim("a", frac), gpuClaim("b", frac)},
			"h1/gpu-h1-0 memory=20Gi compute=25, h1/gpu-h1-0 memory=20Gi compute=25"},
		{"requests are rounded up to whole MiB",
			oneGPU, nil, []*resourceapi.ResourceClaim{gpuClaim("a", map[string]string{"memory": "1500000", "compute": "1"})},
			"h1/gpu-h1-0 memory=2Mi compute=1"},
		{"a claim without capacity requests takes the whole GPU",
			oneGPU, nil, []*resourceapi.ResourceClaim{gpuClaim("a", nil)},
			"h1/gpu-h1-0 memory=80Gi compute=100"},
		{"a fifth quarter does not fit",
			oneGPU, nil, []*resourceapi.ResourceClaim{gpuClaim("a", frac), gpuClaim("b", frac), gpuClaim("c", frac), gpuClaim("d", frac), gpuClaim("e", frac)},
			""},
		{"more memory than the GPU has is not allocatable",
			oneGPU, nil, []*resourceapi.ResourceClaim{gpuClaim("a", map[string]string{"memory": "100Gi", "compute": "25"})},
			""},
		{"more compute than 100 is not allocatable",
			oneGPU, nil, []*resourceapi.ResourceClaim{gpuClaim("a", map[string]string{"memory": "1Gi", "compute": "101"})},
			""},
		{"the whole GPU is not allocatable once another tenant holds a slice of it",
			oneGPU, []*gpupoolv1.Lease{lease("ml", granted, "GPU-h1-0", 20480, 25, false)}, []*resourceapi.ResourceClaim{gpuClaim("a", nil)},
			""},
		{"what other tenants leave is allocatable",
			oneGPU, []*gpupoolv1.Lease{lease("ml", granted, "GPU-h1-0", 20480, 25, false)}, []*resourceapi.ResourceClaim{gpuClaim("a", map[string]string{"memory": "60Gi", "compute": "75"})},
			"h1/gpu-h1-0 memory=60Gi compute=75"},
		{"a GPU held whole outside Kubernetes is skipped for the next",
			[]*gpupoolv1.Host{k8stest.ReadyHost("h1", 2)}, []*gpupoolv1.Lease{lease("ml", granted, "GPU-h1-0", 81920, 100, true)}, []*resourceapi.ResourceClaim{gpuClaim("a", frac)},
			"h1/gpu-h1-1 memory=20Gi compute=25"},
		{"a draining host's GPUs are not allocatable",
			[]*gpupoolv1.Host{withStatus(k8stest.ReadyHost("h1", 1), gpupoolv1.HostStatus_HOST_STATUS_DRAINING, "drain requested")}, nil, []*resourceapi.ResourceClaim{gpuClaim("a", frac)},
			""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := strings.Join(allocate(t, tc.hosts, tc.leases, tc.claims...), ", ")
			if got != tc.want {
				t.Errorf("allocated %q, want %q", got, tc.want)
			}
		})
	}
}
