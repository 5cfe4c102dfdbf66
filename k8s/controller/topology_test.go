package controller

import (
	"fmt"
	"strings"
	"testing"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"

	"github.com/gpupool/gpupool/k8s/driver"
	"github.com/gpupool/gpupool/k8s/internal/k8stest"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// topoHost is a ready host with n GPUs, perRoot of them in a row on one
// PCIe root and perLink of them in a row on one NVLink island (0: none).
func topoHost(id string, n, perRoot, perLink int32) *gpupoolv1.Host {
	h := k8stest.ReadyHost(id, n)
	for i, d := range h.Devices {
		d.PcieRoot = fmt.Sprintf("pcie-%d", int32(i)/perRoot)
		if perLink == 0 {
			continue
		}
		for j, e := range h.Devices {
			if i != j && int32(i)/perLink == int32(j)/perLink {
				d.NvlinkPeers = append(d.NvlinkPeers, e.Uuid)
			}
		}
	}
	return h
}

// alignedClaim asks for count whole GPUs that share attr.
func alignedClaim(name string, count int64, attr resourceapi.FullyQualifiedName) *resourceapi.ResourceClaim {
	c := gpuClaim(name, nil)
	c.Spec.Devices.Requests[0].Exactly.Count = count
	c.Spec.Devices.Constraints = []resourceapi.DeviceConstraint{{Requests: []string{"gpu"}, MatchAttribute: ptr.To(attr)}}
	return c
}

func TestBuildResourcesPublishesTopology(t *testing.T) {
	h := topoHost("dgx-1", 4, 2, 4)
	h.Devices[3].NvlinkPeers = nil // GPU 3 lost its links: only the others list it
	lone := topoHost("pcie-box", 2, 1, 0)
	res := BuildResources([]*gpupoolv1.Host{h, lone}, nil, PublisherConfig{NodeSelector: DefaultNodeSelector()})
	checkValid(t, res)
	got := map[string]string{}
	for pool, p := range res.Pools {
		for _, d := range p.Slices[0].Devices {
			var attrs []string
			for _, n := range []resourceapi.QualifiedName{driver.AttrPCIeRoot, driver.AttrNVLinkDomain} {
				if a, ok := d.Attributes[n]; ok {
					attrs = append(attrs, string(n)+"="+*a.StringValue)
				}
			}
			got[pool+"/"+d.Name] = strings.Join(attrs, " ")
		}
	}
	want := map[string]string{
		"dgx-1/gpu-dgx-1-0":       "resource.kubernetes.io/pcieRoot=dgx-1/pcie-0 nvlinkDomain=dgx-1/nvlink-0",
		"dgx-1/gpu-dgx-1-1":       "resource.kubernetes.io/pcieRoot=dgx-1/pcie-0 nvlinkDomain=dgx-1/nvlink-0",
		"dgx-1/gpu-dgx-1-2":       "resource.kubernetes.io/pcieRoot=dgx-1/pcie-1 nvlinkDomain=dgx-1/nvlink-0",
		"dgx-1/gpu-dgx-1-3":       "resource.kubernetes.io/pcieRoot=dgx-1/pcie-1 nvlinkDomain=dgx-1/nvlink-0",
		"pcie-box/gpu-pcie-box-0": "resource.kubernetes.io/pcieRoot=pcie-box/pcie-0",
		"pcie-box/gpu-pcie-box-1": "resource.kubernetes.io/pcieRoot=pcie-box/pcie-1",
	}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("topology attributes\n got %v\nwant %v", got, want)
	}
}

func TestNVLinkDomainsAreIslands(t *testing.T) {
	h := topoHost("h1", 6, 2, 2) // islands {0,1} {2,3} {4,5}
	h.Devices[1].NvlinkPeers = append(h.Devices[1].NvlinkPeers, h.Devices[2].Uuid)
	h.Devices[5].NvlinkPeers, h.Devices[4].NvlinkPeers = nil, []string{"GPU-elsewhere"}
	got := nvlinkDomains(h.Devices)
	want := map[string]string{"GPU-h1-0": "nvlink-0", "GPU-h1-1": "nvlink-0", "GPU-h1-2": "nvlink-0", "GPU-h1-3": "nvlink-0"}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("got %v, want %v (a link to another host's GPU makes no island)", got, want)
	}
}

// A GPU replaced at the same index is a new device: the old one, which the
// brokers keep unhealthy while a lease holds it, does not hide it.
func TestAReplacedGPUIsPublishedBesideTheOldOne(t *testing.T) {
	for _, oldFirst := range []bool{true, false} {
		t.Run(fmt.Sprintf("old device listed first: %t", oldFirst), func(t *testing.T) {
			h := k8stest.ReadyHost("h1", 1)
			old := k8stest.GPU("h1", 0)
			old.Uuid = "GPU-old"
			old.Health, old.HealthReason = gpupoolv1.DeviceHealth_DEVICE_HEALTH_UNHEALTHY, "no longer reported by the agent"
			old.AllocatedMemoryMib, old.AllocatedComputePercent, old.LeaseCount = 20480, 25, 1
			if oldFirst {
				h.Devices = append([]*gpupoolv1.Device{old}, h.Devices...)
			} else {
				h.Devices = append(h.Devices, old)
			}
			res := BuildResources([]*gpupoolv1.Host{h}, nil, PublisherConfig{NodeSelector: DefaultNodeSelector()})
			checkValid(t, res)
			var got []string
			for _, d := range res.Pools["h1"].Slices[0].Devices {
				got = append(got, fmt.Sprintf("%s uuid=%s index=%d taints=%d", d.Name, *d.Attributes[driver.AttrUUID].StringValue, *d.Attributes[driver.AttrIndex].IntValue, len(d.Taints)))
			}
			want := "[gpu-h1-0 uuid=GPU-h1-0 index=0 taints=0 gpu-old uuid=GPU-old index=0 taints=1]"
			if fmt.Sprint(got) != want {
				t.Errorf("devices %v, want %s", got, want)
			}
			if a := allocate(t, []*gpupoolv1.Host{h}, nil, gpuClaim("a", nil)); fmt.Sprint(a) != "[h1/gpu-h1-0 memory=80Gi compute=100]" {
				t.Errorf("a whole-GPU claim got %v, want the new GPU", a)
			}
		})
	}
}

func TestDeviceNames(t *testing.T) {
	for _, tc := range []struct{ uuid, want string }{
		{"GPU-8a1b2c3d-0000-1111-2222-333344445555", "gpu-8a1b2c3d-0000-1111-2222-333344445555"},
		{"MIG-8a1b2c3d-0000-1111-2222-333344445555", "mig-8a1b2c3d-0000-1111-2222-333344445555"},
		{"MIG-GPU-8a1b2c3d-0000-1111-2222-333344445555/1/0", "mig-gpu-8a1b2c3d-0000-1111-2222-333344445555-1-0"},
		{"0000:07:00.0", "gpu-0000-07-00-0"},
		{strings.Repeat("x", 70), "gpu-6e5b8b9c5e2b4ea3"},
	} {
		got := DeviceName(tc.uuid)
		if tc.uuid == strings.Repeat("x", 70) {
			// Hashed: check the shape, not the digits.
			if len(got) != len("gpu-")+16 || !strings.HasPrefix(got, "gpu-") {
				t.Errorf("DeviceName(%q) = %q, want gpu- and 16 hex digits", tc.uuid, got)
			}
			continue
		}
		if got != tc.want {
			t.Errorf("DeviceName(%q) = %q, want %q", tc.uuid, got, tc.want)
		}
	}
}

// The scheduler's allocator honours matchAttribute on the published
// topology: two GPUs on one PCIe root or one NVLink island, never across
// hosts, and nothing when no host has them.
func TestTheSchedulersAllocatorAlignsOnTopology(t *testing.T) {
	pcie := resourceapi.FullyQualifiedName(driver.AttrPCIeRoot)
	nvlink := resourceapi.FullyQualifiedName(driver.Name + "/" + string(driver.AttrNVLinkDomain))
	onePerRoot := []*gpupoolv1.Host{topoHost("a", 2, 1, 0), topoHost("b", 2, 1, 0)}
	for _, tc := range []struct {
		name  string
		hosts []*gpupoolv1.Host
		claim *resourceapi.ResourceClaim
		want  string // "" for not allocatable
	}{
		{"two GPUs on one PCIe root", []*gpupoolv1.Host{topoHost("a", 4, 2, 0)}, alignedClaim("c", 2, pcie),
			"a/gpu-a-0 memory=80Gi compute=100, a/gpu-a-1 memory=80Gi compute=100"},
		{"two GPUs on one PCIe root skip a root with one free GPU",
			[]*gpupoolv1.Host{allocated(topoHost("a", 4, 2, 0), 1, 1, false)}, alignedClaim("c", 2, pcie),
			"a/gpu-a-2 memory=80Gi compute=100, a/gpu-a-3 memory=80Gi compute=100"},
		{"two GPUs on one PCIe root on hosts with one GPU per root", onePerRoot, alignedClaim("c", 2, pcie), ""},
		{"two GPUs on one NVLink island", []*gpupoolv1.Host{topoHost("a", 4, 1, 2)}, alignedClaim("c", 2, nvlink),
			"a/gpu-a-0 memory=80Gi compute=100, a/gpu-a-1 memory=80Gi compute=100"},
		{"three GPUs on one NVLink island of two", []*gpupoolv1.Host{topoHost("a", 4, 1, 2)}, alignedClaim("c", 3, nvlink), ""},
		{"GPUs without NVLink are on no island", onePerRoot, alignedClaim("c", 1, nvlink), ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := strings.Join(allocate(t, tc.hosts, nil, tc.claim), ", ")
			if got != tc.want {
				t.Errorf("allocated %q, want %q", got, tc.want)
			}
		})
	}
}

func TestBinderPinsTheTopologyOfAMatchAttributeConstraint(t *testing.T) {
	claim := func(cs ...resourceapi.DeviceConstraint) *resourceapi.ResourceClaim {
		return &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{UID: types.UID(claimUID)},
			Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Constraints: cs}}}
	}
	match := func(attr string, requests ...string) resourceapi.DeviceConstraint {
		return resourceapi.DeviceConstraint{Requests: requests, MatchAttribute: ptr.To(resourceapi.FullyQualifiedName(attr))}
	}
	for _, tc := range []struct {
		name    string
		claim   *resourceapi.ResourceClaim
		request string
		want    gpupoolv1.Topology
	}{
		{"no constraint", claim(), "gpu", gpupoolv1.Topology_TOPOLOGY_UNSPECIFIED},
		{"the PCIe root of every request", claim(match(string(driver.AttrPCIeRoot))), "gpu", gpupoolv1.Topology_TOPOLOGY_SAME_PCIE_ROOT},
		{"the NVLink domain of this request", claim(match("gpu.gpupool.dev/nvlinkDomain", "gpu")), "gpu", gpupoolv1.Topology_TOPOLOGY_SAME_NVLINK},
		{"a subrequest under its parent's constraint", claim(match(string(driver.AttrPCIeRoot), "gpu")), "gpu/a100", gpupoolv1.Topology_TOPOLOGY_SAME_PCIE_ROOT},
		{"another request's constraint", claim(match(string(driver.AttrPCIeRoot), "nic")), "gpu", gpupoolv1.Topology_TOPOLOGY_UNSPECIFIED},
		{"a constraint on another attribute", claim(match("gpu.gpupool.dev/model")), "gpu", gpupoolv1.Topology_TOPOLOGY_UNSPECIFIED},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := pinnedTopology(tc.claim, resourceapi.DeviceRequestAllocationResult{Request: tc.request})
			if got != tc.want {
				t.Errorf("got %s, want %s", got, tc.want)
			}
		})
	}
}
