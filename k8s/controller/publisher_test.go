package controller

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/dynamic-resource-allocation/resourceslice"
	"k8s.io/utils/ptr"

	"github.com/gpupool/gpupool/k8s/driver"
	"github.com/gpupool/gpupool/k8s/internal/k8stest"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// allocated sets gpu-0's allocation as the brokers report it: every
// holding lease of every tenant.
func allocated(h *gpupoolv1.Host, memMiB int64, compute int32, exclusive bool) *gpupoolv1.Host {
	d := h.Devices[0]
	d.AllocatedMemoryMib, d.AllocatedComputePercent, d.AllocatedExclusive = memMiB, compute, exclusive
	return h
}

func withStatus(h *gpupoolv1.Host, s gpupoolv1.HostStatus, reason string) *gpupoolv1.Host {
	h.Status, h.StatusReason = s, reason
	return h
}

// lease is a lease of tenant in state with one slice on device uuid.
func lease(tenant string, state gpupoolv1.LeaseState, uuid string, memMiB int64, compute int32, exclusive bool) *gpupoolv1.Lease {
	return &gpupoolv1.Lease{Id: "l-" + uuid, Tenant: tenant, State: state,
		Slices: []*gpupoolv1.Slice{{Host: "h1", Device: uuid, MemoryMib: memMiB, ComputePercent: compute, Exclusive: exclusive}}}
}

const granted = gpupoolv1.LeaseState_LEASE_STATE_GRANTED

// published is what a test reads of one device.
type published struct {
	memory, compute string // capacity values
	taints          []string
	memoryPolicy    string // "default/min/step", "" for none
}

func describe(d resourceapi.Device) published {
	p := published{memory: qstr(d.Capacity[driver.CapacityMemory].Value), compute: qstr(d.Capacity[driver.CapacityCompute].Value)}
	for _, t := range d.Taints {
		p.taints = append(p.taints, fmt.Sprintf("%s=%s:%s", t.Key, t.Value, t.Effect))
	}
	if pol := d.Capacity[driver.CapacityMemory].RequestPolicy; pol != nil {
		step := "none"
		if pol.ValidRange.Step != nil {
			step = qstr(*pol.ValidRange.Step)
		}
		p.memoryPolicy = fmt.Sprintf("%s/%s/%s", qstr(*pol.Default), qstr(*pol.ValidRange.Min), step)
	}
	return p
}

func qstr(q resource.Quantity) string { return q.String() }

func TestBuildResourcesPublishesWhatIsLeftForKubernetes(t *testing.T) {
	for _, tc := range []struct {
		name   string
		host   *gpupoolv1.Host
		leases []*gpupoolv1.Lease
		want   published // of gpu-0
	}{
		{"an idle GPU offers all of itself",
			k8stest.ReadyHost("h1", 1), nil,
			published{memory: "80Gi", compute: "100", memoryPolicy: "80Gi/1Mi/1Mi"}},
		{"a lease of another tenant takes its slice off the capacity",
			k8stest.ReadyHost("h1", 1), []*gpupoolv1.Lease{lease("ml", granted, "GPU-h1-0", 20480, 25, false)},
			published{memory: "60Gi", compute: "75", memoryPolicy: "80Gi/1Mi/1Mi"}},
		{"a releasing lease still holds its slice",
			k8stest.ReadyHost("h1", 1), []*gpupoolv1.Lease{lease("ml", gpupoolv1.LeaseState_LEASE_STATE_RELEASING, "GPU-h1-0", 20480, 25, false)},
			published{memory: "60Gi", compute: "75", memoryPolicy: "80Gi/1Mi/1Mi"}},
		{"Kubernetes' own leases stay in the capacity: the scheduler counts them",
			k8stest.ReadyHost("h1", 1), []*gpupoolv1.Lease{lease(DefaultTenant, granted, "GPU-h1-0", 20480, 25, false)},
			published{memory: "80Gi", compute: "100", memoryPolicy: "80Gi/1Mi/1Mi"}},
		{"ended and pending leases hold nothing",
			k8stest.ReadyHost("h1", 1), []*gpupoolv1.Lease{
				lease("ml", gpupoolv1.LeaseState_LEASE_STATE_RELEASED, "GPU-h1-0", 20480, 25, false),
				lease("ml", gpupoolv1.LeaseState_LEASE_STATE_PENDING, "GPU-h1-0", 20480, 25, false)},
			published{memory: "80Gi", compute: "100", memoryPolicy: "80Gi/1Mi/1Mi"}},
		{"a GPU held whole outside Kubernetes is busy",
			k8stest.ReadyHost("h1", 1), []*gpupoolv1.Lease{lease("ml", granted, "GPU-h1-0", 81920, 100, true)},
			published{memory: "0", compute: "0", taints: []string{driver.TaintBusy + "=:NoSchedule"}}},
		{"a GPU with its compute all taken is busy",
			k8stest.ReadyHost("h1", 1), []*gpupoolv1.Lease{lease("ml", granted, "GPU-h1-0", 1024, 100, false)},
			published{memory: "79Gi", compute: "0", memoryPolicy: "80Gi/1Mi/1Mi", taints: []string{driver.TaintBusy + "=:NoSchedule"}}},
		{"1 MiB left takes no step: the apiserver wants min plus a step within the capacity",
			k8stest.ReadyHost("h1", 1), []*gpupoolv1.Lease{lease("ml", granted, "GPU-h1-0", 81919, 50, false)},
			published{memory: "1Mi", compute: "50", memoryPolicy: "80Gi/1Mi/none"}},
		{"with a tenant-scoped token, other tenants' use is the allocation less Kubernetes' own leases",
			allocated(k8stest.ReadyHost("h1", 1), 30720, 40, false), []*gpupoolv1.Lease{lease(DefaultTenant, granted, "GPU-h1-0", 10240, 15, false)},
			published{memory: "60Gi", compute: "75", memoryPolicy: "80Gi/1Mi/1Mi"}},
		{"with a tenant-scoped token, a GPU allocated whole to another tenant is busy",
			allocated(k8stest.ReadyHost("h1", 1), 81920, 100, true), nil,
			published{memory: "0", compute: "0", taints: []string{driver.TaintBusy + "=:NoSchedule"}}},
		{"a GPU Kubernetes holds whole is not busy for it",
			allocated(k8stest.ReadyHost("h1", 1), 81920, 100, true), []*gpupoolv1.Lease{lease(DefaultTenant, granted, "GPU-h1-0", 81920, 100, true)},
			published{memory: "80Gi", compute: "100", memoryPolicy: "80Gi/1Mi/1Mi"}},
		{"a draining host's GPUs are tainted NoExecute with the reason",
			withStatus(k8stest.ReadyHost("h1", 1), gpupoolv1.HostStatus_HOST_STATUS_DRAINING, "drain requested"), nil,
			published{memory: "80Gi", compute: "100", memoryPolicy: "80Gi/1Mi/1Mi", taints: []string{driver.TaintDraining + "=drain-requested:NoExecute"}}},
		{"a drained host's GPUs are tainted NoExecute",
			withStatus(k8stest.ReadyHost("h1", 1), gpupoolv1.HostStatus_HOST_STATUS_DRAINED, ""), nil,
			published{memory: "80Gi", compute: "100", memoryPolicy: "80Gi/1Mi/1Mi", taints: []string{driver.TaintDrained + "=:NoExecute"}}},
		{"a down host's GPUs are tainted NoExecute with the reason",
			withStatus(k8stest.ReadyHost("h1", 1), gpupoolv1.HostStatus_HOST_STATUS_DOWN, "no heartbeat for 10s"), nil,
			published{memory: "80Gi", compute: "100", memoryPolicy: "80Gi/1Mi/1Mi", taints: []string{driver.TaintDown + "=no-heartbeat-for-10s:NoExecute"}}},
		{"an unhealthy GPU is tainted NoExecute with its reason",
			func() *gpupoolv1.Host {
				h := k8stest.ReadyHost("h1", 1)
				h.Devices[0].Health, h.Devices[0].HealthReason = gpupoolv1.DeviceHealth_DEVICE_HEALTH_UNHEALTHY, "Xid 79"
				return h
			}(), nil,
			published{memory: "80Gi", compute: "100", memoryPolicy: "80Gi/1Mi/1Mi", taints: []string{driver.TaintUnhealthy + "=Xid-79:NoExecute"}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			res := BuildResources([]*gpupoolv1.Host{tc.host}, tc.leases, PublisherConfig{NodeSelector: DefaultNodeSelector()})
			checkValid(t, res)
			pool, ok := res.Pools["h1"]
			if !ok || len(pool.Slices) != 1 || len(pool.Slices[0].Devices) != 1 {
				t.Fatalf("pools %+v, want pool h1 with one slice of one device", res.Pools)
			}
			got := describe(pool.Slices[0].Devices[0])
			if fmt.Sprint(got) != fmt.Sprint(tc.want) {
				t.Errorf("gpu-0 published as %+v, want %+v", got, tc.want)
			}
		})
	}
}

func TestBuildResourcesShapesDevicesAsTheContractSays(t *testing.T) {
	h := k8stest.ReadyHost("dgx-1", 2)
	res := BuildResources([]*gpupoolv1.Host{h}, nil, PublisherConfig{NodeSelector: map[string]string{"zone": "a", DefaultNodeSelectorLabel: "true"}})
	checkValid(t, res)
	pool := res.Pools["dgx-1"]
	wantSel := "{[{[{gpu.gpupool.dev/client In [true]} {zone In [a]}] []}]}"
	if got := fmt.Sprint(*pool.NodeSelector); got != wantSel || pool.AllNodes {
		t.Errorf("node selector %s (all nodes %t), want %s", got, pool.AllNodes, wantSel)
	}
	d := pool.Slices[0].Devices[1]
	attr := func(n resourceapi.QualifiedName) string {
		a := d.Attributes[n]
		switch {
		case a.StringValue != nil:
			return *a.StringValue
		case a.IntValue != nil:
			return fmt.Sprint(*a.IntValue)
		case a.BoolValue != nil:
			return fmt.Sprint(*a.BoolValue)
		}
		return "<none>"
	}
	for _, c := range []struct{ what, got, want string }{
		{"name", d.Name, "gpu-dgx-1-1"},
		{"model", attr(driver.AttrModel), "A100-SXM4-80GB"},
		{"uuid", attr(driver.AttrUUID), "GPU-dgx-1-1"},
		{"host", attr(driver.AttrHost), "dgx-1"},
		{"index", attr(driver.AttrIndex), "1"},
		{"mps", attr(driver.AttrMPS), "true"},
		{"allowMultipleAllocations", fmt.Sprint(*d.AllowMultipleAllocations), "true"},
		{"bindingConditions", fmt.Sprint(d.BindingConditions), "[Leased]"},
		{"bindingFailureConditions", fmt.Sprint(d.BindingFailureConditions), "[LeaseFailed]"},
		{"compute policy", policyString(d.Capacity[driver.CapacityCompute].RequestPolicy), "default 100, 1..100 step 1"},
		{"memory policy", policyString(d.Capacity[driver.CapacityMemory].RequestPolicy), "default 80Gi, 1Mi.. step 1Mi"},
	} {
		if c.got != c.want {
			t.Errorf("%s: got %s, want %s", c.what, c.got, c.want)
		}
	}
}

func policyString(p *resourceapi.CapacityRequestPolicy) string {
	if p == nil {
		return "<none>"
	}
	s := fmt.Sprintf("default %s, %s..", p.Default.String(), p.ValidRange.Min.String())
	if p.ValidRange.Max != nil {
		s += p.ValidRange.Max.String()
	}
	if p.ValidRange.Step != nil {
		s += " step " + p.ValidRange.Step.String()
	}
	return s
}

func TestBuildResourcesPoolsAndSlices(t *testing.T) {
	for _, tc := range []struct {
		name       string
		hosts      []*gpupoolv1.Host
		selector   map[string]string
		wantPools  string // pool: devices per slice
		wantAllAll bool
	}{
		{"one pool per host, named after it", []*gpupoolv1.Host{k8stest.ReadyHost("a", 2), k8stest.ReadyHost("b", 1)}, DefaultNodeSelector(), "a:[2] b:[1]", false},
		{"a host without GPUs still has its pool", []*gpupoolv1.Host{k8stest.ReadyHost("a", 0)}, DefaultNodeSelector(), "a:[0]", false},
		{"a host id that cannot name a pool is left out", []*gpupoolv1.Host{k8stest.ReadyHost("GPU_Box", 1), k8stest.ReadyHost("ok", 1)}, DefaultNodeSelector(), "ok:[1]", false},
		{"more than 64 GPUs take more slices", []*gpupoolv1.Host{k8stest.ReadyHost("big", 70)}, DefaultNodeSelector(), "big:[64 6]", false},
		{"no node selector reaches every node", []*gpupoolv1.Host{k8stest.ReadyHost("a", 1)}, nil, "a:[1]", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			res := BuildResources(tc.hosts, nil, PublisherConfig{NodeSelector: tc.selector})
			checkValid(t, res)
			var got []string
			for _, h := range tc.hosts {
				pool, ok := res.Pools[h.Id]
				if !ok {
					continue
				}
				var sizes []int
				for _, s := range pool.Slices {
					sizes = append(sizes, len(s.Devices))
				}
				got = append(got, fmt.Sprintf("%s:%v", h.Id, sizes))
				if pool.AllNodes != tc.wantAllAll || (pool.NodeSelector == nil) != tc.wantAllAll {
					t.Errorf("pool %s: all nodes %t, selector %v; want all nodes %t", h.Id, pool.AllNodes, pool.NodeSelector, tc.wantAllAll)
				}
			}
			if strings.Join(got, " ") != tc.wantPools || len(res.Pools) != len(got) {
				t.Errorf("pools %s (%d in all), want %s", strings.Join(got, " "), len(res.Pools), tc.wantPools)
			}
		})
	}
}

func TestBuildResourcesIsValidWhateverIsLeft(t *testing.T) {
	// Every split of memory and compute between Kubernetes and others.
	for _, mem := range []int64{0, 1, 2, 3, 1024, 81918, 81919, 81920, 90000} {
		for _, compute := range []int32{0, 1, 2, 50, 98, 99, 100, 120} {
			res := BuildResources([]*gpupoolv1.Host{k8stest.ReadyHost("h1", 1)},
				[]*gpupoolv1.Lease{lease("ml", granted, "GPU-h1-0", mem, compute, false)}, PublisherConfig{})
			checkValid(t, res)
		}
	}
}

func TestLabelValueMakesATaintValueOfAReason(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"drain requested", "drain-requested"},
		{"no heartbeat for 10s", "no-heartbeat-for-10s"},
		{"Xid 79", "Xid-79"},
		{"", ""},
		{"  (maintenance)  ", "maintenance"},
		{"héllo wörld", "h-llo-w-rld"},
		{strings.Repeat("a", 70), strings.Repeat("a", 63)},
		{strings.Repeat("a", 62) + " b", strings.Repeat("a", 62)},
		{"!!!", ""},
	} {
		if got := labelValue(tc.in); got != tc.want {
			t.Errorf("labelValue(%q) = %q, want %q", tc.in, got, tc.want)
		}
		if errs := validation.IsValidLabelValue(labelValue(tc.in)); len(errs) > 0 {
			t.Errorf("labelValue(%q) = %q: not a label value: %v", tc.in, labelValue(tc.in), errs)
		}
	}
}

// checkValid checks the rules of the apiserver's ResourceSlice validation
// (k8s.io/kubernetes/pkg/apis/resource/validation) that the publisher's
// choices could break. The integration suite checks all of them.
func checkValid(t *testing.T, res *resourceslice.DriverResources) {
	t.Helper()
	for name, pool := range res.Pools {
		if errs := validation.IsDNS1123Subdomain(name); len(errs) > 0 {
			t.Errorf("pool name %q: %v", name, errs)
		}
		if (pool.NodeSelector != nil) == pool.AllNodes {
			t.Errorf("pool %s: want exactly one of nodeSelector and allNodes", name)
		}
		if pool.NodeSelector != nil && len(pool.NodeSelector.NodeSelectorTerms) != 1 {
			t.Errorf("pool %s: node selector with %d terms, want 1", name, len(pool.NodeSelector.NodeSelectorTerms))
		}
		for _, s := range pool.Slices {
			if len(s.Devices) > resourceapi.ResourceSliceMaxDevicesWithAdvancedFeatures {
				t.Errorf("pool %s: slice of %d devices", name, len(s.Devices))
			}
			for _, d := range s.Devices {
				checkDeviceValid(t, name+"/"+d.Name, d)
			}
		}
	}
}

func checkDeviceValid(t *testing.T, where string, d resourceapi.Device) {
	t.Helper()
	if errs := validation.IsDNS1123Label(d.Name); len(errs) > 0 {
		t.Errorf("%s: device name: %v", where, errs)
	}
	for n, a := range d.Attributes {
		if a.StringValue != nil && len(*a.StringValue) > resourceapi.DeviceAttributeMaxValueLength {
			t.Errorf("%s: attribute %s longer than %d", where, n, resourceapi.DeviceAttributeMaxValueLength)
		}
	}
	for _, taint := range d.Taints {
		if errs := validation.IsQualifiedName(taint.Key); len(errs) > 0 {
			t.Errorf("%s: taint key %q: %v", where, taint.Key, errs)
		}
		if errs := validation.IsValidLabelValue(taint.Value); len(errs) > 0 {
			t.Errorf("%s: taint value %q: %v", where, taint.Value, errs)
		}
	}
	for n, c := range d.Capacity {
		p := c.RequestPolicy
		if p == nil {
			continue
		}
		r, v := p.ValidRange, c.Value
		fail := func(format string, args ...any) {
			t.Errorf("%s: capacity %s %s: %s", where, n, v.String(), fmt.Sprintf(format, args...))
		}
		if p.Default == nil || r == nil || r.Min == nil {
			fail("policy without default or minimum")
			continue
		}
		if r.Min.Cmp(v) > 0 {
			fail("min %s is larger than the capacity", r.Min.String())
		}
		if p.Default.Cmp(*r.Min) < 0 {
			fail("default %s is less than min", p.Default.String())
		}
		if r.Max != nil && (r.Max.Cmp(v) > 0 || r.Min.Cmp(*r.Max) > 0 || p.Default.Cmp(*r.Max) > 0) {
			fail("max %s out of order with min, default or capacity", r.Max.String())
		}
		if r.Step != nil {
			minPlusStep := r.Min.DeepCopy()
			minPlusStep.Add(*r.Step)
			if minPlusStep.Cmp(v) > 0 {
				fail("one step %s is larger than the capacity", minPlusStep.String())
			}
			if (p.Default.Value()-r.Min.Value())%r.Step.Value() != 0 {
				fail("default %s is not a step from min", p.Default.String())
			}
			if r.Max != nil && (r.Max.Value()-r.Min.Value())%r.Step.Value() != 0 {
				fail("max %s is not a step from min", r.Max.String())
			}
		}
	}
	if len(d.BindingConditions) == 0 || len(d.BindingFailureConditions) == 0 {
		t.Errorf("%s: binding conditions %v, failure conditions %v: the apiserver wants both or neither", where, d.BindingConditions, d.BindingFailureConditions)
	}
}

// sliceObjects turns what the publisher publishes into ResourceSlice
// objects, as the resourceslice controller would.
func sliceObjects(res *resourceslice.DriverResources) []runtime.Object {
	var out []runtime.Object
	for name, pool := range res.Pools {
		for i, s := range pool.Slices {
			rs := &resourceapi.ResourceSlice{
				ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("%s-%s-%d", driver.Name, name, i)},
				Spec: resourceapi.ResourceSliceSpec{
					Driver:       driver.Name,
					Pool:         resourceapi.ResourcePool{Name: name, Generation: 1, ResourceSliceCount: int64(len(pool.Slices))},
					NodeSelector: pool.NodeSelector,
					Devices:      s.Devices,
				},
			}
			if pool.AllNodes {
				rs.Spec.AllNodes = ptr.To(true)
			}
			out = append(out, rs)
		}
	}
	return out
}

// newFakeKube is a fake clientset that, like the apiserver, names objects
// created with only a generateName (the resourceslice controller's).
func newFakeKube(objs ...runtime.Object) *fake.Clientset {
	kube := fake.NewClientset(objs...)
	var n atomic.Int64
	kube.PrependReactor("create", "*", func(action k8stesting.Action) (bool, runtime.Object, error) {
		if o, ok := action.(k8stesting.CreateAction).GetObject().(metav1.Object); ok && o.GetName() == "" && o.GetGenerateName() != "" {
			o.SetName(fmt.Sprintf("%s%d", o.GetGenerateName(), n.Add(1)))
		}
		return false, nil, nil
	})
	return kube
}

func TestPublisherFollowsTheBroker(t *testing.T) {
	c := k8stest.StartBroker(t)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	register := func(h *gpupoolv1.Host) {
		t.Helper()
		rctx, rcancel := context.WithTimeout(ctx, 20*time.Second)
		defer rcancel()
		if _, err := c.Agent.Register(rctx, &gpupoolv1.RegisterRequest{Host: h}); err != nil {
			t.Fatal(err)
		}
	}
	h1 := k8stest.ReadyHost("h1", 1)
	h1.Address = "127.0.0.1:1"
	register(h1)

	kube := newFakeKube()
	p := NewPublisher(kube, PoolSource{Pool: c.Pool, Lease: c.Lease}, PublisherConfig{NodeSelector: DefaultNodeSelector(), Resync: 100 * time.Millisecond})
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})

	// device returns gpu-<i> of pool as published, in a readable form.
	device := func(pool string, i int) (bool, string) {
		list, err := kube.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, err.Error()
		}
		var seen []string
		for _, s := range list.Items {
			seen = append(seen, s.Spec.Pool.Name)
			if s.Spec.Pool.Name != pool || s.Spec.Driver != driver.Name {
				continue
			}
			for _, d := range s.Spec.Devices {
				if d.Name == DeviceName(fmt.Sprintf("GPU-%s-%d", pool, i)) {
					return true, fmt.Sprintf("%+v", describe(d))
				}
			}
		}
		return false, fmt.Sprintf("pools %v", seen)
	}
	want := func(what, pool string, i int, wantDesc string) {
		t.Helper()
		k8stest.Eventually(t, what, func() (bool, string) {
			ok, got := device(pool, i)
			return ok && got == wantDesc, got
		})
	}
	want("the host's GPU is published", "h1", 0, "{memory:80Gi compute:100 taints:[] memoryPolicy:80Gi/1Mi/1Mi}")

	// A lease outside Kubernetes shows at once (Watch), well before a resync would.
	l, err := c.Acquire(ctx, &gpupoolv1.LeaseRequest{Count: 1, MemoryMib: 20480, ComputePercent: 25, TtlMs: 60000, Tenant: "ml"})
	if err != nil {
		t.Fatal(err)
	}
	want("a lease of another tenant is taken off the capacity", "h1", 0, "{memory:60Gi compute:75 taints:[] memoryPolicy:80Gi/1Mi/1Mi}")
	if err := l.Release(ctx, "test"); err != nil {
		t.Fatal(err)
	}

	// A new host appears; a drained one gets tainted (host status has no
	// watch: the resync finds it).
	h2 := k8stest.ReadyHost("h2", 2)
	h2.Address = "127.0.0.1:2"
	register(h2)
	want("a new host gets its pool", "h2", 1, "{memory:80Gi compute:100 taints:[] memoryPolicy:80Gi/1Mi/1Mi}")
	if _, err := c.Pool.DrainHost(ctx, &gpupoolv1.DrainHostRequest{HostId: "h2"}); err != nil {
		t.Fatal(err)
	}
	// h2 holds no lease, so the drain leaves it drained at once.
	want("a drained host's GPUs are tainted", "h2", 1, "{memory:80Gi compute:100 taints:["+driver.TaintDrained+"=drain-requested:NoExecute] memoryPolicy:80Gi/1Mi/1Mi}")
}

// The leases are read before and after the hosts: a lease of the
// tenant's own granted in between is not subtracted from an allocation
// that may not hold it yet, so another tenant's use is never hidden.
func TestStableLeasesNeverHideOtherTenantsUse(t *testing.T) {
	host := func(allocMiB int64) []*gpupoolv1.Host {
		return []*gpupoolv1.Host{{Id: "h1", Devices: []*gpupoolv1.Device{{Uuid: "GPU-1", MemoryMib: 81920, AllocatedMemoryMib: allocMiB}}}}
	}
	lease := func(id, tenant string, mib int64) *gpupoolv1.Lease {
		return &gpupoolv1.Lease{Id: id, Tenant: tenant, State: gpupoolv1.LeaseState_LEASE_STATE_GRANTED,
			Slices: []*gpupoolv1.Slice{{Device: "GPU-1", MemoryMib: mib}}}
	}
	own := lease("l-own", "k8s", 40960)
	tests := []struct {
		name          string
		before, after []*gpupoolv1.Lease
		allocMiB      int64 // what the hosts read shows allocated
		want          int64 // MiB held by other tenants, at least
	}{
		{"own lease granted after the hosts were read", nil, []*gpupoolv1.Lease{own}, 40960, 40960},
		{"own lease granted before the hosts were read", nil, []*gpupoolv1.Lease{own}, 81920, 40960},
		{"own lease in both readings", []*gpupoolv1.Lease{own}, []*gpupoolv1.Lease{own}, 81920, 40960},
		{"own lease released after the hosts were read", []*gpupoolv1.Lease{own}, nil, 81920, 40960},
		{"a visible other lease released in between still counts", []*gpupoolv1.Lease{lease("l-other", "ml", 8192)}, nil, 0, 8192},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := heldOutside(host(tt.allocMiB), stableLeases(tt.before, tt.after, "k8s"), "k8s")["GPU-1"].memoryMiB
			if got < tt.want {
				t.Fatalf("others hold %d MiB by this reading, want at least %d", got, tt.want)
			}
		})
	}
}
