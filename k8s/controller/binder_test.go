package controller

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/cache"

	"github.com/gpupool/gpupool/client"
	"github.com/gpupool/gpupool/k8s/driver"
	"github.com/gpupool/gpupool/k8s/internal/k8stest"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
	"github.com/gpupool/gpupool/protocol"
)

// fakeBroker is a broker of one host, h1, whose GPUs GPU-h1-<i> have 80
// GiB each. Like the real one it refuses what cannot fit, and returns the
// lease an earlier Acquire with the same request id got.
type fakeBroker struct {
	mu        sync.Mutex
	devices   map[string]int64                // guarded by mu; memory MiB by UUID
	leases    map[string]*gpupoolv1.Lease     // guarded by mu; by id
	handles   map[string][]*fakeHeldLease     // guarded by mu; live handles by lease id
	failNext  []error                         // guarded by mu; returned by the next Acquires
	failFor   map[string][]error              // guarded by mu; returned by the next Acquires of a request id
	requests  []*gpupoolv1.LeaseRequest       // guarded by mu; every Acquire's request
	attached  []string                        // guarded by mu; lease ids
	released  []string                        // guarded by mu; lease ids
	tokens    map[string]*gpupoolv1.HostToken // by host
	idCounter int                             // guarded by mu
}

func newFakeBroker(gpus int) *fakeBroker {
	f := &fakeBroker{devices: map[string]int64{}, leases: map[string]*gpupoolv1.Lease{}, handles: map[string][]*fakeHeldLease{},
		tokens: map[string]*gpupoolv1.HostToken{"h1": {Host: "h1", Token: "tok", Address: "10.0.0.1:7650", CertSha256: "c3a1"}}}
	for i := range gpus {
		f.devices[fmt.Sprintf("GPU-h1-%d", i)] = 81920
	}
	return f
}

func (f *fakeBroker) Acquire(_ context.Context, req *gpupoolv1.LeaseRequest) (HeldLease, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.requests = append(f.requests, proto.CloneOf(req))
	if len(f.failNext) > 0 {
		err := f.failNext[0]
		f.failNext = f.failNext[1:]
		return nil, err
	}
	if errs := f.failFor[req.RequestId]; len(errs) > 0 {
		f.failFor[req.RequestId] = errs[1:]
		return nil, errs[0]
	}
	for _, l := range f.leases {
		if l.Tenant == req.Tenant && l.RequestId == req.RequestId {
			return f.handleLocked(l.Id), nil
		}
	}
	if !req.Exclusive && (req.ComputePercent < 1 || req.ComputePercent > 100) {
		return nil, status.Errorf(codes.InvalidArgument, "compute_percent %d: must be between 1 and 100 (percent of one GPU's SMs)", req.ComputePercent)
	}
	uuid := req.GetConstraints().GetDevices()[0]
	mem, ok := f.devices[uuid]
	if !ok {
		return nil, status.Errorf(codes.FailedPrecondition, "request can never fit this pool: no device %s", uuid)
	}
	if !req.Exclusive && req.MemoryMib > mem {
		return nil, status.Errorf(codes.FailedPrecondition, "request can never fit this pool: h1 %s: %d MiB requested, the GPU has %d MiB", uuid, req.MemoryMib, mem)
	}
	var usedMem int64
	var usedCompute int32
	for _, l := range f.leases {
		if l.State != granted {
			continue
		}
		for _, s := range l.Slices {
			if s.Device == uuid {
				usedMem += s.MemoryMib
				usedCompute += s.ComputePercent
			}
		}
	}
	slice := &gpupoolv1.Slice{Host: "h1", Device: uuid, MemoryMib: req.MemoryMib, ComputePercent: req.ComputePercent, Exclusive: req.Exclusive}
	if req.Exclusive {
		slice.MemoryMib, slice.ComputePercent = mem, 100
	}
	if usedMem+slice.MemoryMib > mem || usedCompute+slice.ComputePercent > 100 {
		return nil, status.Errorf(codes.ResourceExhausted, "no capacity now: h1 %s: %d MiB requested, %d MiB free", uuid, slice.MemoryMib, mem-usedMem)
	}
	f.idCounter++
	l := &gpupoolv1.Lease{Id: fmt.Sprintf("l-%d", f.idCounter), Tenant: req.Tenant, Holder: req.Holder, Request: proto.CloneOf(req),
		RequestId: req.RequestId, TtlMs: req.TtlMs, State: granted, Slices: []*gpupoolv1.Slice{slice}}
	f.leases[l.Id] = l
	return f.handleLocked(l.Id), nil
}

// handleLocked returns a new handle on lease id; an ended lease's handle
// is done from the start, as a client.Lease that cannot renew.
func (f *fakeBroker) handleLocked(id string) *fakeHeldLease {
	h := &fakeHeldLease{f: f, id: id, events: make(chan *gpupoolv1.LeaseEvent, 4), done: make(chan struct{})}
	if f.leases[id].State != granted {
		h.endLocked(fmt.Errorf("%w: %s", client.ErrLeaseEnded, f.leases[id].Reason))
	} else {
		f.handles[id] = append(f.handles[id], h)
	}
	return h
}

func (f *fakeBroker) Attach(_ context.Context, id string) (HeldLease, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	l := f.leases[id]
	if l == nil || l.State != granted {
		return nil, fmt.Errorf("%w: lease %s not found", client.ErrLeaseEnded, id)
	}
	f.attached = append(f.attached, id)
	return f.handleLocked(id), nil
}

func (f *fakeBroker) Leases(_ context.Context, tenant string) ([]*gpupoolv1.Lease, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []*gpupoolv1.Lease
	for _, l := range f.leases {
		if l.Tenant == tenant && l.State == granted {
			out = append(out, proto.CloneOf(l))
		}
	}
	return out, nil
}

func (f *fakeBroker) Release(_ context.Context, id, reason string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.endLocked(id, gpupoolv1.LeaseState_LEASE_STATE_RELEASED, reason)
	f.released = append(f.released, id)
	return nil
}

// endLocked ends lease id in state and stops its handles' renewal.
func (f *fakeBroker) endLocked(id string, state gpupoolv1.LeaseState, reason string) {
	l := f.leases[id]
	if l == nil || l.State != granted {
		return
	}
	l.State, l.Reason = state, reason
	for _, h := range f.handles[id] {
		h.endLocked(fmt.Errorf("%w: %s", client.ErrLeaseEnded, reason))
	}
	delete(f.handles, id)
}

// revoke ends lease id as an operator or a lost host would.
func (f *fakeBroker) revoke(id, reason string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.endLocked(id, gpupoolv1.LeaseState_LEASE_STATE_REVOKED, reason)
}

// add puts a granted lease in the broker, as an earlier binder left it.
func (f *fakeBroker) add(l *gpupoolv1.Lease) {
	f.mu.Lock()
	defer f.mu.Unlock()
	l.State = granted
	f.leases[l.Id] = l
}

func (f *fakeBroker) failWith(errs ...error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.failNext = append(f.failNext, errs...)
}

// failRequestWith makes the next Acquires of request id fail with errs.
func (f *fakeBroker) failRequestWith(id string, errs ...error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.failFor == nil {
		f.failFor = map[string][]error{}
	}
	f.failFor[id] = append(f.failFor[id], errs...)
}

func (f *fakeBroker) state(id string) gpupoolv1.LeaseState {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.leases[id].GetState()
}

func (f *fakeBroker) snapshot() (requests []*gpupoolv1.LeaseRequest, attached, released []string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.requests), slices.Clone(f.attached), slices.Clone(f.released)
}

// fakeHeldLease is one process's handle on a fake lease.
type fakeHeldLease struct {
	f      *fakeBroker
	id     string
	events chan *gpupoolv1.LeaseEvent
	done   chan struct{}
	err    error // guarded by f.mu
}

func (h *fakeHeldLease) Info() *gpupoolv1.Lease {
	h.f.mu.Lock()
	defer h.f.mu.Unlock()
	return proto.CloneOf(h.f.leases[h.id])
}

func (h *fakeHeldLease) Token(host string) (*gpupoolv1.HostToken, bool) {
	t, ok := h.f.tokens[host]
	return t, ok
}

func (h *fakeHeldLease) Events() <-chan *gpupoolv1.LeaseEvent { return h.events }
func (h *fakeHeldLease) Done() <-chan struct{}                { return h.done }

func (h *fakeHeldLease) Err() error {
	h.f.mu.Lock()
	defer h.f.mu.Unlock()
	return h.err
}

func (h *fakeHeldLease) Release(ctx context.Context, reason string) error {
	return h.f.Release(ctx, h.id, reason)
}

func (h *fakeHeldLease) Close() {
	h.f.mu.Lock()
	defer h.f.mu.Unlock()
	h.endLocked(context.Canceled)
	h.f.handles[h.id] = slices.DeleteFunc(h.f.handles[h.id], func(o *fakeHeldLease) bool { return o == h })
}

// endLocked closes done, then events, as client.Lease does.
func (h *fakeHeldLease) endLocked(err error) {
	select {
	case <-h.done:
		return
	default:
	}
	h.err = err
	close(h.done)
	close(h.events)
}

// recorder records events by object name.
type recorder struct {
	mu     sync.Mutex
	events []string // "<namespace>/<name> <type> <reason>: <message>"
}

func (r *recorder) Event(obj runtime.Object, eventtype, reason, message string) {
	ref := obj.(*corev1.ObjectReference)
	r.mu.Lock()
	defer r.mu.Unlock()
	r.events = append(r.events, fmt.Sprintf("%s/%s %s %s: %s", ref.Namespace, ref.Name, eventtype, reason, message))
}

func (r *recorder) Eventf(obj runtime.Object, eventtype, reason, format string, args ...any) {
	r.Event(obj, eventtype, reason, fmt.Sprintf(format, args...))
}

func (r *recorder) AnnotatedEventf(obj runtime.Object, _ map[string]string, eventtype, reason, format string, args ...any) {
	r.Eventf(obj, eventtype, reason, format, args...)
}

func (r *recorder) all() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.events)
}

// binderEnv is a binder on a fake clientset that holds the ResourceSlices
// of host h1 (4 GPUs), and a broker.
type binderEnv struct {
	kube   *fake.Clientset
	broker Broker
	rec    *recorder
}

const testNS = "team-a"

// startBinder runs a binder until the test ends, on a clientset holding
// objs besides h1's slices. The broker is set up before the binder starts.
func startBinder(t *testing.T, broker Broker, objs ...runtime.Object) *binderEnv {
	t.Helper()
	e := newBinderEnv(broker, objs...)
	e.start(t)
	return e
}

func newBinderEnv(broker Broker, objs ...runtime.Object) *binderEnv {
	res := BuildResources([]*gpupoolv1.Host{k8stest.ReadyHost("h1", 4)}, nil, PublisherConfig{NodeSelector: DefaultNodeSelector()})
	return &binderEnv{kube: newFakeKube(append(sliceObjects(res), objs...)...), broker: broker, rec: &recorder{}}
}

func (e *binderEnv) start(t *testing.T) {
	t.Helper()
	b := NewBinder(e.kube, e.broker, BinderConfig{Recorder: e.rec, LeaseTTL: 30 * time.Second})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- b.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
}

// testShare is one device allocated to a claim.
type testShare struct {
	device  string // gpu-h1-<i> of pool h1
	shareID string
	memory  string // consumed; "" for none
	compute string
}

// allocatedClaim is claim name with uid allocated the shares, reserved for
// pods.
func allocatedClaim(name, uid string, shares []testShare, pods ...string) *resourceapi.ResourceClaim {
	c := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Namespace: testNS, Name: name, UID: types.UID(uid), Generation: 1}}
	setAllocation(c, shares)
	for _, p := range pods {
		c.Status.ReservedFor = append(c.Status.ReservedFor, resourceapi.ResourceClaimConsumerReference{Resource: "pods", Name: p, UID: types.UID("uid-" + p)})
	}
	return c
}

func setAllocation(c *resourceapi.ResourceClaim, shares []testShare) {
	c.Status.Allocation = &resourceapi.AllocationResult{}
	for _, s := range shares {
		r := resourceapi.DeviceRequestAllocationResult{Request: "gpu", Driver: driver.Name, Pool: "h1", Device: s.device,
			BindingConditions: []string{driver.ConditionLeased}, BindingFailureConditions: []string{driver.ConditionLeaseFailed}}
		if s.shareID != "" {
			r.ShareID = (*types.UID)(&s.shareID)
		}
		if s.memory != "" {
			r.ConsumedCapacity = map[resourceapi.QualifiedName]resource.Quantity{
				driver.CapacityMemory: resource.MustParse(s.memory), driver.CapacityCompute: resource.MustParse(s.compute)}
		}
		c.Status.Allocation.Devices.Results = append(c.Status.Allocation.Devices.Results, r)
	}
}

const (
	claimUID = "0b7e0f2c-5a4e-4d6b-9a43-1f0c2e9d8a11"
	shareA   = "5d0e4c8a-1b2c-4d3e-8f9a-0b1c2d3e4f50"
	shareB   = "7a6b5c4d-3e2f-4a1b-9c8d-7e6f5a4b3c21"
)

// claimStatus reads a claim's devices as "<device>: <conditions> <data>".
func (e *binderEnv) claimStatus(name string) (*resourceapi.ResourceClaim, string) {
	c, err := e.kube.ResourceV1().ResourceClaims(testNS).Get(context.Background(), name, metav1.GetOptions{})
	if err != nil {
		return nil, err.Error()
	}
	var parts []string
	for _, d := range c.Status.Devices {
		var conds []string
		for _, cond := range d.Conditions {
			conds = append(conds, fmt.Sprintf("%s=%s(%s)", cond.Type, cond.Status, cond.Reason))
		}
		data := ""
		if d.Data != nil {
			data = " " + string(d.Data.Raw)
		}
		parts = append(parts, fmt.Sprintf("%s: %s%s", d.Device, strings.Join(conds, ","), data))
	}
	return c, strings.Join(parts, "; ")
}

// waitDevice waits until device of claim name has condition cond true,
// and returns its status.
func (e *binderEnv) waitDevice(t *testing.T, name, device, cond string) resourceapi.AllocatedDeviceStatus {
	t.Helper()
	var got resourceapi.AllocatedDeviceStatus
	k8stest.Eventually(t, fmt.Sprintf("claim %s device %s %s=True", name, device, cond), func() (bool, string) {
		c, desc := e.claimStatus(name)
		if c == nil {
			return false, desc
		}
		for _, d := range c.Status.Devices {
			if d.Device == device && meta.IsStatusConditionTrue(d.Conditions, cond) {
				got = d
				return true, desc
			}
		}
		return false, desc
	})
	return got
}

func TestBinderLeasesExactlyTheAllocatedDevice(t *testing.T) {
	for _, tc := range []struct {
		name string
		s    testShare
		want *gpupoolv1.LeaseRequest // Count, Tenant, TtlMs and Holder are checked for all
		data driver.DeviceStatusData
	}{
		{"a fractional share asks for its memory and compute on that GPU",
			testShare{device: "gpu-h1-2", shareID: shareA, memory: "20Gi", compute: "25"},
			&gpupoolv1.LeaseRequest{MemoryMib: 20480, ComputePercent: 25, RequestId: claimUID + "/" + shareA,
				Constraints: &gpupoolv1.Constraints{Host: "h1", Devices: []string{"GPU-h1-2"}}},
			driver.DeviceStatusData{Host: "h1", AgentAddress: "10.0.0.1:7650", CertSHA256: "c3a1", MemoryMiB: 20480, ComputePercent: 25}},
		{"memory that is not whole MiB is rounded up",
			testShare{device: "gpu-h1-0", shareID: shareA, memory: "1500000", compute: "1"},
			&gpupoolv1.LeaseRequest{MemoryMib: 2, ComputePercent: 1, RequestId: claimUID + "/" + shareA,
				Constraints: &gpupoolv1.Constraints{Host: "h1", Devices: []string{"GPU-h1-0"}}},
			driver.DeviceStatusData{Host: "h1", AgentAddress: "10.0.0.1:7650", CertSHA256: "c3a1", MemoryMiB: 2, ComputePercent: 1}},
		{"a share of the whole GPU is exclusive",
			testShare{device: "gpu-h1-1", shareID: shareA, memory: "80Gi", compute: "100"},
			&gpupoolv1.LeaseRequest{Exclusive: true, RequestId: claimUID + "/" + shareA,
				Constraints: &gpupoolv1.Constraints{Host: "h1", Devices: []string{"GPU-h1-1"}}},
			driver.DeviceStatusData{Host: "h1", AgentAddress: "10.0.0.1:7650", CertSHA256: "c3a1", MemoryMiB: 81920, ComputePercent: 100}},
		{"a device without shareID or consumed capacity is whole, named by its pool and device",
			testShare{device: "gpu-h1-3"},
			&gpupoolv1.LeaseRequest{Exclusive: true, RequestId: claimUID + "/h1/gpu-h1-3",
				Constraints: &gpupoolv1.Constraints{Host: "h1", Devices: []string{"GPU-h1-3"}}},
			driver.DeviceStatusData{Host: "h1", AgentAddress: "10.0.0.1:7650", CertSHA256: "c3a1", MemoryMiB: 81920, ComputePercent: 100}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := newFakeBroker(4)
			e := startBinder(t, b, allocatedClaim("train", claimUID, []testShare{tc.s}))
			ds := e.waitDevice(t, "train", tc.s.device, driver.ConditionLeased)

			reqs, _, _ := b.snapshot()
			want := proto.CloneOf(tc.want)
			want.Count, want.Tenant, want.TtlMs, want.Holder = 1, DefaultTenant, 30000, testNS+"/train "+claimUID
			if len(reqs) == 0 || !proto.Equal(reqs[0], want) {
				t.Fatalf("broker got %v, want %v", reqs, want)
			}
			var data driver.DeviceStatusData
			if err := json.Unmarshal(ds.Data.Raw, &data); err != nil {
				t.Fatalf("status data %s: %v", ds.Data.Raw, err)
			}
			tc.data.LeaseID = "l-1"
			if data != tc.data {
				t.Errorf("status data %+v, want %+v", data, tc.data)
			}
			if meta.FindStatusCondition(ds.Conditions, driver.ConditionLeaseFailed) != nil || (tc.s.shareID != "" && (ds.ShareID == nil || *ds.ShareID != tc.s.shareID)) {
				t.Errorf("device status %+v: want Leased only, for share %q", ds, tc.s.shareID)
			}
			if b.state("l-1") != granted {
				t.Errorf("lease l-1 is %v, want granted while the claim is allocated", b.state("l-1"))
			}
		})
	}
}

func TestBinderRetriesWithTheSameRequestIDAndOnePerShare(t *testing.T) {
	b := newFakeBroker(1)
	b.failWith(status.Error(codes.Unavailable, "no leader"))
	e := startBinder(t, b, allocatedClaim("two", claimUID, []testShare{
		{device: "gpu-h1-0", shareID: shareA, memory: "20Gi", compute: "25"},
		{device: "gpu-h1-0", shareID: shareB, memory: "20Gi", compute: "25"},
	}))
	k8stest.Eventually(t, "both shares leased", func() (bool, string) {
		c, desc := e.claimStatus("two")
		return c != nil && len(c.Status.Devices) == 2 &&
			meta.IsStatusConditionTrue(c.Status.Devices[0].Conditions, driver.ConditionLeased) &&
			meta.IsStatusConditionTrue(c.Status.Devices[1].Conditions, driver.ConditionLeased), desc
	})
	reqs, _, _ := b.snapshot()
	var ids []string
	for _, r := range reqs {
		ids = append(ids, r.RequestId)
	}
	a, bb := claimUID+"/"+shareA, claimUID+"/"+shareB
	if fmt.Sprint(ids) != fmt.Sprint([]string{a, bb, a}) || !proto.Equal(reqs[0], reqs[2]) {
		t.Errorf("request ids %v, want %v with the retry the same request", ids, []string{a, bb, a})
	}
	b.mu.Lock()
	n := len(b.leases)
	b.mu.Unlock()
	if n != 2 {
		t.Errorf("%d leases granted, want 2", n)
	}
}

func TestBinderReportsRefusalsAsLeaseFailed(t *testing.T) {
	for _, tc := range []struct {
		name        string
		s           testShare
		prep        func(*fakeBroker)
		wantReason  string
		wantMessage string
	}{
		{"a full GPU", testShare{device: "gpu-h1-0", shareID: shareA, memory: "20Gi", compute: "25"},
			func(b *fakeBroker) {
				b.add(&gpupoolv1.Lease{Id: "l-ml", Tenant: "ml", Slices: []*gpupoolv1.Slice{{Host: "h1", Device: "GPU-h1-0", MemoryMib: 81920, ComputePercent: 100, Exclusive: true}}})
			},
			"ResourceExhausted", "no capacity now: h1 GPU-h1-0: 20480 MiB requested, 0 MiB free"},
		{"more memory than the GPU has", testShare{device: "gpu-h1-0", shareID: shareA, memory: "100Gi", compute: "25"}, nil,
			"FailedPrecondition", "request can never fit this pool: h1 GPU-h1-0: 102400 MiB requested, the GPU has 81920 MiB"},
		{"more compute than there is", testShare{device: "gpu-h1-0", shareID: shareA, memory: "20Gi", compute: "150"}, nil,
			"InvalidArgument", "compute_percent 150: must be between 1 and 100 (percent of one GPU's SMs)"},
		{"a device no slice has", testShare{device: "gpu-h1-9", shareID: shareA, memory: "20Gi", compute: "25"}, nil,
			ReasonDeviceNotPublished, "device gpu-h1-9 of pool h1 is not published by gpu.gpupool.dev any more; its host may have left the pool"},
		{"no permission", testShare{device: "gpu-h1-0", shareID: shareA, memory: "20Gi", compute: "25"},
			func(b *fakeBroker) {
				b.failWith(status.Error(codes.PermissionDenied, "tenant k8s may not acquire leases"))
			},
			"PermissionDenied", "tenant k8s may not acquire leases"},
		{"bad credentials", testShare{device: "gpu-h1-0", shareID: shareA, memory: "20Gi", compute: "25"},
			func(b *fakeBroker) { b.failWith(status.Error(codes.Unauthenticated, "token expired")) },
			"Unauthenticated", "token expired"},
		{"a broker without the call", testShare{device: "gpu-h1-0", shareID: shareA, memory: "20Gi", compute: "25"},
			func(b *fakeBroker) { b.failWith(status.Error(codes.Unimplemented, "unknown method Acquire")) },
			"Unimplemented", "unknown method Acquire"},
		{"a request id whose lease ended", testShare{device: "gpu-h1-0", shareID: shareA, memory: "20Gi", compute: "25"},
			func(b *fakeBroker) {
				b.add(&gpupoolv1.Lease{Id: "l-old", Tenant: DefaultTenant, RequestId: claimUID + "/" + shareA,
					Slices: []*gpupoolv1.Slice{{Host: "h1", Device: "GPU-h1-0", MemoryMib: 20480, ComputePercent: 25}}})
				b.revoke("l-old", "not renewed within its TTL of 30s")
			},
			ReasonLeaseEnded, "lease l-old is revoked: not renewed within its TTL of 30s"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := newFakeBroker(1)
			if tc.prep != nil {
				tc.prep(b)
			}
			e := startBinder(t, b, allocatedClaim("c", claimUID, []testShare{tc.s}, "pod-1"))
			ds := e.waitDevice(t, "c", tc.s.device, driver.ConditionLeaseFailed)
			failed := meta.FindStatusCondition(ds.Conditions, driver.ConditionLeaseFailed)
			if failed.Reason != tc.wantReason || failed.Message != tc.wantMessage {
				t.Errorf("LeaseFailed %s: %q, want %s: %q", failed.Reason, failed.Message, tc.wantReason, tc.wantMessage)
			}
			if meta.IsStatusConditionTrue(ds.Conditions, driver.ConditionLeased) {
				t.Errorf("Leased is true next to LeaseFailed: %+v", ds.Conditions)
			}
			if evs := e.rec.all(); len(evs) != 0 {
				t.Errorf("events %q, want none: the pod never had the lease", evs)
			}
		})
	}
}

func TestBinderRetriesUnavailableBrokersWithoutFailingTheClaim(t *testing.T) {
	b := newFakeBroker(1)
	b.failWith(status.Error(codes.Unavailable, "no leader"), status.Error(codes.DeadlineExceeded, "timed out"), status.Error(codes.Aborted, "retry"))
	kubeWrites := make(chan string, 100)
	e := newBinderEnv(b, allocatedClaim("c", claimUID, []testShare{{device: "gpu-h1-0", shareID: shareA, memory: "1Gi", compute: "10"}}))
	e.kube.PrependReactor("update", "resourceclaims", func(action k8stesting.Action) (bool, runtime.Object, error) {
		c := action.(k8stesting.UpdateAction).GetObject().(*resourceapi.ResourceClaim)
		for _, d := range c.Status.Devices {
			for _, cond := range d.Conditions {
				kubeWrites <- fmt.Sprintf("%s=%s", cond.Type, cond.Status)
			}
		}
		return false, nil, nil
	})
	e.start(t)
	e.waitDevice(t, "c", "gpu-h1-0", driver.ConditionLeased)
	close(kubeWrites)
	for w := range kubeWrites {
		if w == driver.ConditionLeaseFailed+"=True" {
			t.Errorf("the binder wrote %s while the brokers were unavailable", w)
		}
	}
	if reqs, _, _ := b.snapshot(); len(reqs) != 4 {
		t.Errorf("%d acquires, want 3 failed and 1 granted", len(reqs))
	}
}

func TestBinderReleasesWhenTheClaimIsDeallocatedOrDeleted(t *testing.T) {
	for _, tc := range []struct {
		name string
		end  func(e *binderEnv, c *resourceapi.ResourceClaim) error
	}{
		{"deallocated", func(e *binderEnv, c *resourceapi.ResourceClaim) error {
			c.Status.Allocation, c.Status.Devices, c.Status.ReservedFor = nil, nil, nil
			_, err := e.kube.ResourceV1().ResourceClaims(testNS).UpdateStatus(context.Background(), c, metav1.UpdateOptions{})
			return err
		}},
		{"deleted", func(e *binderEnv, c *resourceapi.ResourceClaim) error {
			return e.kube.ResourceV1().ResourceClaims(testNS).Delete(context.Background(), c.Name, metav1.DeleteOptions{})
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := newFakeBroker(1)
			e := startBinder(t, b, allocatedClaim("c", claimUID, []testShare{{device: "gpu-h1-0", shareID: shareA, memory: "1Gi", compute: "10"}}))
			e.waitDevice(t, "c", "gpu-h1-0", driver.ConditionLeased)
			c, _ := e.claimStatus("c")
			if err := tc.end(e, c); err != nil {
				t.Fatal(err)
			}
			k8stest.Eventually(t, "lease l-1 released", func() (bool, string) {
				return b.state("l-1") == gpupoolv1.LeaseState_LEASE_STATE_RELEASED, b.state("l-1").String()
			})
		})
	}
}

func TestBinderHandlesANewAllocationAfresh(t *testing.T) {
	b := newFakeBroker(2)
	b.add(&gpupoolv1.Lease{Id: "l-ml", Tenant: "ml", Slices: []*gpupoolv1.Slice{{Host: "h1", Device: "GPU-h1-0", MemoryMib: 81920, ComputePercent: 100, Exclusive: true}}})
	e := startBinder(t, b, allocatedClaim("c", claimUID, []testShare{{device: "gpu-h1-0", shareID: shareA, memory: "20Gi", compute: "25"}}))
	e.waitDevice(t, "c", "gpu-h1-0", driver.ConditionLeaseFailed)

	// The scheduler gives the allocation up and allocates another GPU.
	c, _ := e.claimStatus("c")
	c.Status.Allocation, c.Status.Devices = nil, nil
	c, err := e.kube.ResourceV1().ResourceClaims(testNS).UpdateStatus(context.Background(), c, metav1.UpdateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	setAllocation(c, []testShare{{device: "gpu-h1-1", shareID: shareB, memory: "20Gi", compute: "25"}})
	if _, err := e.kube.ResourceV1().ResourceClaims(testNS).UpdateStatus(context.Background(), c, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	ds := e.waitDevice(t, "c", "gpu-h1-1", driver.ConditionLeased)
	if *ds.ShareID != shareB {
		t.Errorf("status for share %s, want %s", *ds.ShareID, shareB)
	}
	if c, desc := e.claimStatus("c"); len(c.Status.Devices) != 1 {
		t.Errorf("status devices %s, want only gpu-1's", desc)
	}
}

func TestBinderReportsALeaseEndingUnderARunningPod(t *testing.T) {
	b := newFakeBroker(1)
	e := startBinder(t, b, allocatedClaim("c", claimUID, []testShare{{device: "gpu-h1-0", shareID: shareA, memory: "20Gi", compute: "25"}}, "web-0", "web-1"))
	e.waitDevice(t, "c", "gpu-h1-0", driver.ConditionLeased)

	b.revoke("l-1", "revoked by an operator")
	ds := e.waitDevice(t, "c", "gpu-h1-0", driver.ConditionLeaseFailed)
	leased := meta.FindStatusCondition(ds.Conditions, driver.ConditionLeased)
	if leased.Status != metav1.ConditionFalse || leased.Reason != ReasonLeaseEnded || !strings.Contains(leased.Message, "revoked by an operator") {
		t.Errorf("Leased %s %s %q, want False %s with the reason", leased.Status, leased.Reason, leased.Message, ReasonLeaseEnded)
	}
	k8stest.Eventually(t, "an event on each pod", func() (bool, string) {
		evs := e.rec.all()
		return len(evs) == 2, fmt.Sprint(evs)
	})
	for i, ev := range e.rec.all() {
		want := fmt.Sprintf("%s/web-%d Warning %s: ", testNS, i, ReasonLeaseEnded)
		if !strings.HasPrefix(ev, want) || !strings.Contains(ev, "revoked by an operator") {
			t.Errorf("event %q, want %q... with the reason", ev, want)
		}
	}
	// A sync that read the claim before its status said LeaseFailed may
	// acquire again, with the same request id: that returns the ended
	// lease. No other lease may be granted under the running pod.
	reqs, _, _ := b.snapshot()
	for _, r := range reqs {
		if r.RequestId != reqs[0].RequestId {
			t.Errorf("acquire with request id %s after %s: an ended lease is replaced under a running pod", r.RequestId, reqs[0].RequestId)
		}
	}
	b.mu.Lock()
	n := len(b.leases)
	b.mu.Unlock()
	if n != 1 || b.state("l-1") != gpupoolv1.LeaseState_LEASE_STATE_REVOKED {
		t.Errorf("%d leases, l-1 %v; want only l-1, revoked", n, b.state("l-1"))
	}
}

func TestBinderTakesOverAndReleasesOrphansAtStart(t *testing.T) {
	b := newFakeBroker(2)
	slice := []*gpupoolv1.Slice{{Host: "h1", Device: "GPU-h1-0", MemoryMib: 1024, ComputePercent: 10}}
	const goneUID = "9f8e7d6c-5b4a-4392-8170-6f5e4d3c2b1a"
	b.add(&gpupoolv1.Lease{Id: "l-live", Tenant: DefaultTenant, RequestId: claimUID + "/" + shareA, Slices: slice})
	b.add(&gpupoolv1.Lease{Id: "l-old-share", Tenant: DefaultTenant, RequestId: claimUID + "/" + shareB, Slices: slice})
	b.add(&gpupoolv1.Lease{Id: "l-gone", Tenant: DefaultTenant, RequestId: goneUID + "/" + shareA, Slices: slice})
	b.add(&gpupoolv1.Lease{Id: "l-hand", Tenant: DefaultTenant, RequestId: "made-by-hand", Slices: slice})
	b.add(&gpupoolv1.Lease{Id: "l-other", Tenant: "ml", RequestId: goneUID + "/" + shareA, Slices: slice})

	e := startBinder(t, b, allocatedClaim("c", claimUID, []testShare{{device: "gpu-h1-0", shareID: shareA, memory: "1Gi", compute: "10"}}))
	ds := e.waitDevice(t, "c", "gpu-h1-0", driver.ConditionLeased)

	var data driver.DeviceStatusData
	if err := json.Unmarshal(ds.Data.Raw, &data); err != nil || data.LeaseID != "l-live" {
		t.Errorf("status data %s, want the taken-over lease l-live", ds.Data.Raw)
	}
	reqs, attached, released := b.snapshot()
	slices.Sort(released)
	if len(reqs) != 0 || fmt.Sprint(attached) != "[l-live]" || fmt.Sprint(released) != "[l-gone l-old-share]" {
		t.Errorf("acquired %d, attached %v, released %v; want none, [l-live], [l-gone l-old-share]", len(reqs), attached, released)
	}
	for id, want := range map[string]gpupoolv1.LeaseState{"l-live": granted, "l-hand": granted, "l-other": granted} {
		if got := b.state(id); got != want {
			t.Errorf("lease %s is %v, want %v", id, got, want)
		}
	}
}

// dropHandles stops the renewal of every handle on lease id, as a process
// cut off from the brokers for longer than the TTL would see it, while the
// lease stays granted (someone else renews it).
func (f *fakeBroker) dropHandles(id string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, h := range f.handles[id] {
		h.endLocked(fmt.Errorf("%w: could not renew it before it expired", client.ErrLeaseEnded))
	}
	delete(f.handles, id)
}

func TestBinderRenewsAgainALeaseItLostTouchWith(t *testing.T) {
	b := newFakeBroker(1)
	e := startBinder(t, b, allocatedClaim("c", claimUID, []testShare{{device: "gpu-h1-0", shareID: shareA, memory: "20Gi", compute: "25"}}, "web-0"))
	e.waitDevice(t, "c", "gpu-h1-0", driver.ConditionLeased)

	b.dropHandles("l-1")
	k8stest.Eventually(t, "the binder to attach to l-1 again", func() (bool, string) {
		_, attached, _ := b.snapshot()
		return fmt.Sprint(attached) == "[l-1]", fmt.Sprint(attached)
	})
	ds := e.waitDevice(t, "c", "gpu-h1-0", driver.ConditionLeased)
	if meta.FindStatusCondition(ds.Conditions, driver.ConditionLeaseFailed) != nil || len(e.rec.all()) != 0 {
		t.Errorf("conditions %+v, events %q: want Leased alone and no event, the lease never ended", ds.Conditions, e.rec.all())
	}
	if reqs, _, _ := b.snapshot(); len(reqs) != 1 || b.state("l-1") != granted {
		t.Errorf("%d acquires, lease %v; want the one lease, still granted", len(reqs), b.state("l-1"))
	}
}

func TestHolderFitsTheBrokersLimit(t *testing.T) {
	for _, tc := range []struct {
		name, ns, claim string
		want            string
	}{
		{"a short name as it is", "team-a", "train", "team-a/train " + claimUID},
		{"the longest names cut short", strings.Repeat("n", 63), strings.Repeat("c", 253),
			strings.Repeat("n", 63) + "/" + strings.Repeat("c", 256-63-36-2-3) + "... " + claimUID},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := holder(&resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Namespace: tc.ns, Name: tc.claim, UID: claimUID}})
			if got != tc.want || len(got) > protocol.MaxHolderLen {
				t.Errorf("holder = %q (%d bytes), want %q", got, len(got), tc.want)
			}
		})
	}
}

func TestBinderLeasesFromARealBroker(t *testing.T) {
	c := k8stest.StartBroker(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	h := k8stest.ReadyHost("h1", 4)
	h.Address = "127.0.0.1:1"
	if _, err := c.Agent.Register(ctx, &gpupoolv1.RegisterRequest{Host: h}); err != nil {
		t.Fatal(err)
	}
	e := startBinder(t, BrokerClient(c),
		allocatedClaim("frac", claimUID, []testShare{{device: "gpu-h1-2", shareID: shareA, memory: "20Gi", compute: "25"}}),
		allocatedClaim("huge", "3c2b1a09-8f7e-4d6c-9b5a-4e3d2c1b0a99", []testShare{{device: "gpu-h1-3", shareID: shareB, memory: "100Gi", compute: "25"}}))

	ds := e.waitDevice(t, "frac", "gpu-h1-2", driver.ConditionLeased)
	var data driver.DeviceStatusData
	if err := json.Unmarshal(ds.Data.Raw, &data); err != nil {
		t.Fatal(err)
	}
	got, err := c.Lease.Get(ctx, &gpupoolv1.GetLeaseRequest{LeaseId: data.LeaseID})
	if err != nil {
		t.Fatal(err)
	}
	l := got.Lease
	if s := l.GetSlices(); l.Tenant != DefaultTenant || l.RequestId != claimUID+"/"+shareA || len(s) != 1 ||
		s[0].Device != "GPU-h1-2" || s[0].MemoryMib != 20480 || s[0].ComputePercent != 25 || data.AgentAddress != "127.0.0.1:1" {
		t.Errorf("lease %v with data %+v: want 20480 MiB and 25%% of GPU-h1-2 for tenant k8s and request %s/%s", l, data, claimUID, shareA)
	}

	ds = e.waitDevice(t, "huge", "gpu-h1-3", driver.ConditionLeaseFailed)
	if f := meta.FindStatusCondition(ds.Conditions, driver.ConditionLeaseFailed); f.Reason != "FailedPrecondition" || !strings.Contains(f.Message, "102400 MiB") {
		t.Errorf("LeaseFailed %s: %q, want the brokers' reason for 100Gi on an 80Gi GPU", f.Reason, f.Message)
	}

	if err := e.kube.ResourceV1().ResourceClaims(testNS).Delete(ctx, "frac", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	k8stest.Eventually(t, "the lease released", func() (bool, string) {
		got, err := c.Lease.Get(ctx, &gpupoolv1.GetLeaseRequest{LeaseId: data.LeaseID})
		return err == nil && got.Lease.State != granted, fmt.Sprint(got.GetLease().GetState(), err)
	})
}

// The scheduler reads the first status entry of a pool and device for
// every share of that device, so a failed share must be listed first.
func TestBinderListsAFailedShareOfAGPUBeforeALeasedOne(t *testing.T) {
	b := newFakeBroker(1)
	// 60 GiB held elsewhere: the first 20 GiB share fits, the second does not.
	b.add(&gpupoolv1.Lease{Id: "l-ml", Tenant: "ml", Slices: []*gpupoolv1.Slice{{Host: "h1", Device: "GPU-h1-0", MemoryMib: 61440, ComputePercent: 50}}})
	e := startBinder(t, b, allocatedClaim("c", claimUID, []testShare{
		{device: "gpu-h1-0", shareID: shareA, memory: "20Gi", compute: "25"},
		{device: "gpu-h1-0", shareID: shareB, memory: "20Gi", compute: "25"},
	}, "pod-1"))
	e.waitDevice(t, "c", "gpu-h1-0", driver.ConditionLeaseFailed)
	k8stest.Eventually(t, "both shares reported", func() (bool, string) {
		c, desc := e.claimStatus("c")
		return c != nil && len(c.Status.Devices) == 2, desc
	})
	c, desc := e.claimStatus("c")
	if !meta.IsStatusConditionTrue(c.Status.Devices[0].Conditions, driver.ConditionLeaseFailed) ||
		!meta.IsStatusConditionTrue(c.Status.Devices[1].Conditions, driver.ConditionLeased) {
		t.Fatalf("status.devices: %s; want the failed share first, then the leased one", desc)
	}
}

// statusWrites records status.devices[] of every claim update the clientset
// sees from now on; call it before the binder starts.
func (e *binderEnv) statusWrites() func() [][]resourceapi.AllocatedDeviceStatus {
	var mu sync.Mutex
	var writes [][]resourceapi.AllocatedDeviceStatus
	e.kube.PrependReactor("update", "resourceclaims", func(action k8stesting.Action) (bool, runtime.Object, error) {
		c := action.(k8stesting.UpdateAction).GetObject().(*resourceapi.ResourceClaim)
		mu.Lock()
		defer mu.Unlock()
		writes = append(writes, c.DeepCopy().Status.Devices)
		return false, nil, nil
	})
	return func() [][]resourceapi.AllocatedDeviceStatus {
		mu.Lock()
		defer mu.Unlock()
		return slices.Clone(writes)
	}
}

func describeDevices(devs []resourceapi.AllocatedDeviceStatus) string {
	var parts []string
	for _, d := range devs {
		var conds []string
		for _, c := range d.Conditions {
			conds = append(conds, fmt.Sprintf("%s=%s(%s)", c.Type, c.Status, c.Reason))
		}
		share := ""
		if d.ShareID != nil {
			share = "#" + (*d.ShareID)[:4]
		}
		parts = append(parts, fmt.Sprintf("%s%s: %s", d.Device, share, strings.Join(conds, ",")))
	}
	return strings.Join(parts, "; ")
}

// The scheduler reads the first status entry of a pool and device for
// every share of it, so no share may say Leased=True while another share
// of the same GPU has no outcome yet, whatever order they come in.
func TestBinderWaitsForEveryShareOfAGPUBeforeLeased(t *testing.T) {
	for _, tc := range []struct {
		name    string
		failing string // the share whose first Acquire fails
		err     error
	}{
		{"the second share's broker is unavailable once", shareB, status.Error(codes.Unavailable, "no leader")},
		{"the first share's broker is unavailable once", shareA, status.Error(codes.Unavailable, "no leader")},
		{"the second share gets an internal error once", shareB, status.Error(codes.Internal, "boom")},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := newFakeBroker(1)
			b.failRequestWith(claimUID+"/"+tc.failing, tc.err)
			e := newBinderEnv(b, allocatedClaim("c", claimUID, []testShare{
				{device: "gpu-h1-0", shareID: shareA, memory: "20Gi", compute: "25"},
				{device: "gpu-h1-0", shareID: shareB, memory: "20Gi", compute: "25"},
			}, "pod-1"))
			writes := e.statusWrites()
			e.start(t)
			k8stest.Eventually(t, "both shares leased", func() (bool, string) {
				c, desc := e.claimStatus("c")
				return c != nil && len(c.Status.Devices) == 2 &&
					meta.IsStatusConditionTrue(c.Status.Devices[0].Conditions, driver.ConditionLeased) &&
					meta.IsStatusConditionTrue(c.Status.Devices[1].Conditions, driver.ConditionLeased), desc
			})

			waited := false
			for i, devs := range writes() {
				leased, settled := 0, 0
				for _, d := range devs {
					switch {
					case meta.IsStatusConditionTrue(d.Conditions, driver.ConditionLeased):
						leased++
						settled++
					case meta.IsStatusConditionTrue(d.Conditions, driver.ConditionLeaseFailed):
						settled++
					}
					if c := meta.FindStatusCondition(d.Conditions, driver.ConditionLeased); c != nil && c.Reason == ReasonWaitingForOtherShares {
						waited = c.Status == metav1.ConditionFalse || waited
					}
				}
				if leased > 0 && settled < 2 {
					t.Errorf("write %d: %s: Leased=True while the other share of gpu-0 has no outcome", i, describeDevices(devs))
				}
			}
			if !waited {
				t.Errorf("no write said %s: the failing share never left the other one waiting", ReasonWaitingForOtherShares)
			}
			var ids []string
			reqs, _, _ := b.snapshot()
			for _, r := range reqs {
				ids = append(ids, r.RequestId)
			}
			if n := strings.Count(strings.Join(ids, " "), tc.failing); n != 2 {
				t.Errorf("acquires %v: want the failing share twice", ids)
			}
		})
	}
}

// Broker errors that are neither refusals nor unavailability are retried
// with backoff too, and after brokerErrorReports of them in a row the
// device says so, without failing the claim.
func TestBinderReportsRepeatedBrokerErrorsWithoutFailingTheClaim(t *testing.T) {
	for _, tc := range []struct {
		name        string
		err         error
		times       int
		wantMessage string // of Leased=False BrokerError; "" for none written
	}{
		{"internal errors", status.Error(codes.Internal, "raft: apply failed"), brokerErrorReports,
			"the brokers keep failing the lease request; retrying: Internal: raft: apply failed"},
		{"not found", status.Error(codes.NotFound, "no such service"), brokerErrorReports,
			"the brokers keep failing the lease request; retrying: NotFound: no such service"},
		{"fewer errors than reported", status.Error(codes.Internal, "raft: apply failed"), brokerErrorReports - 1, ""},
		{"unavailability is never reported", status.Error(codes.Unavailable, "no leader"), brokerErrorReports, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			b := newFakeBroker(1)
			errs := make([]error, tc.times)
			for i := range errs {
				errs[i] = tc.err
			}
			b.failWith(errs...)
			e := newBinderEnv(b, allocatedClaim("c", claimUID, []testShare{{device: "gpu-h1-0", shareID: shareA, memory: "1Gi", compute: "10"}}, "pod-1"))
			writes := e.statusWrites()
			e.start(t)
			e.waitDevice(t, "c", "gpu-h1-0", driver.ConditionLeased)

			var got []string
			for i, devs := range writes() {
				for _, d := range devs {
					if meta.FindStatusCondition(d.Conditions, driver.ConditionLeaseFailed) != nil {
						t.Errorf("write %d: %s: LeaseFailed for an error that is no refusal", i, describeDevices(devs))
					}
					if c := meta.FindStatusCondition(d.Conditions, driver.ConditionLeased); c != nil && c.Reason == ReasonBrokerError {
						if c.Status != metav1.ConditionFalse {
							t.Errorf("write %d: Leased=%s with reason %s", i, c.Status, c.Reason)
						}
						got = append(got, c.Message)
					}
				}
			}
			switch {
			case tc.wantMessage == "" && len(got) > 0:
				t.Errorf("%s written %q, want none", ReasonBrokerError, got)
			case tc.wantMessage != "" && (len(got) == 0 || got[0] != tc.wantMessage):
				t.Errorf("%s written %q, want %q", ReasonBrokerError, got, tc.wantMessage)
			}
			if reqs, _, _ := b.snapshot(); len(reqs) != tc.times+1 {
				t.Errorf("%d acquires, want %d failed and 1 granted", len(reqs), tc.times)
			}
			if evs := e.rec.all(); len(evs) != 0 {
				t.Errorf("events %q, want none", evs)
			}
		})
	}
}

func TestRequestIDIsUniqueInTheClaim(t *testing.T) {
	share := types.UID(shareA)
	for _, tc := range []struct {
		name string
		r    resourceapi.DeviceRequestAllocationResult
		want string
	}{
		{"a share by its id", resourceapi.DeviceRequestAllocationResult{Pool: "h1", Device: "gpu-0", ShareID: &share}, claimUID + "/" + shareA},
		{"a device without share by pool and device", resourceapi.DeviceRequestAllocationResult{Pool: "h1", Device: "gpu-0"}, claimUID + "/h1/gpu-0"},
		{"the same device name in another pool", resourceapi.DeviceRequestAllocationResult{Pool: "h2", Device: "gpu-0"}, claimUID + "/h2/gpu-0"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := RequestID(claimUID, tc.r)
			if got != tc.want {
				t.Errorf("RequestID = %q, want %q", got, tc.want)
			}
			if uid, _, _ := strings.Cut(got, "/"); uid != claimUID {
				t.Errorf("request id %q: claim UID %q before the first '/', want %q", got, uid, claimUID)
			}
		})
	}
}

// A restarted binder takes over the lease of a device allocated without
// shareID, whose request id names its pool, and releases one that names
// another pool's device of the same name.
func TestBinderTakesOverALeaseOfAWholeDevice(t *testing.T) {
	b := newFakeBroker(1)
	slice := []*gpupoolv1.Slice{{Host: "h1", Device: "GPU-h1-0", MemoryMib: 81920, ComputePercent: 100, Exclusive: true}}
	b.add(&gpupoolv1.Lease{Id: "l-live", Tenant: DefaultTenant, RequestId: claimUID + "/h1/gpu-h1-0", Slices: slice})
	b.add(&gpupoolv1.Lease{Id: "l-h2", Tenant: DefaultTenant, RequestId: claimUID + "/h2/gpu-h1-0", Slices: slice})
	e := startBinder(t, b, allocatedClaim("c", claimUID, []testShare{{device: "gpu-h1-0"}}))
	ds := e.waitDevice(t, "c", "gpu-h1-0", driver.ConditionLeased)

	var data driver.DeviceStatusData
	if err := json.Unmarshal(ds.Data.Raw, &data); err != nil || data.LeaseID != "l-live" {
		t.Errorf("status data %s, want the taken-over lease l-live", ds.Data.Raw)
	}
	k8stest.Eventually(t, "l-h2 released", func() (bool, string) {
		return b.state("l-h2") == gpupoolv1.LeaseState_LEASE_STATE_RELEASED, b.state("l-h2").String()
	})
	if reqs, attached, _ := b.snapshot(); len(reqs) != 0 || fmt.Sprint(attached) != "[l-live]" {
		t.Errorf("acquired %d, attached %v; want none and [l-live]", len(reqs), attached)
	}
}

// syncBinder is a binder whose informers run but whose workers do not:
// the test calls sync itself.
func syncBinder(t *testing.T, e *binderEnv) *Binder {
	t.Helper()
	b := NewBinder(e.kube, e.broker, BinderConfig{Recorder: e.rec, LeaseTTL: 30 * time.Second})
	ctx, cancel := context.WithCancel(context.Background())
	b.claimFactory.Start(ctx.Done())
	b.sliceFactory.Start(ctx.Done())
	t.Cleanup(func() {
		cancel()
		b.queue.ShutDown()
		b.claimFactory.Shutdown()
		b.sliceFactory.Shutdown()
		b.closeAll()
	})
	if !cache.WaitForCacheSync(ctx.Done(), b.claimsSynced, b.slicesSynced) {
		t.Fatal("informers did not sync")
	}
	return b
}

// A device no slice has is reported after unpublishedRetries tries of
// that device, however often the claim was retried for other reasons.
func TestBinderCountsUnpublishedDevicesByRequest(t *testing.T) {
	for _, tc := range []struct {
		name         string
		otherRetries int // the claim's requeues before, for other failures
	}{
		{"a fresh claim", 0},
		{"a claim retried often for other reasons", 10},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newBinderEnv(newFakeBroker(4), allocatedClaim("c", claimUID, []testShare{{device: "gpu-9", shareID: shareA, memory: "1Gi", compute: "10"}}))
			b := syncBinder(t, e)
			key := testNS + "/c"
			for range tc.otherRetries {
				b.queue.AddRateLimited(key)
			}
			ctx := context.Background()
			for i := range unpublishedRetries {
				if err := b.sync(ctx, key); err == nil || !strings.Contains(err.Error(), "not published") {
					t.Fatalf("sync %d: %v, want the device not published yet", i+1, err)
				}
				if c, desc := e.claimStatus("c"); len(c.Status.Devices) != 0 {
					t.Fatalf("sync %d wrote %s; want nothing before %d tries of the device", i+1, desc, unpublishedRetries+1)
				}
			}
			if err := b.sync(ctx, key); err != nil {
				t.Fatalf("sync %d: %v", unpublishedRetries+1, err)
			}
			c, desc := e.claimStatus("c")
			if len(c.Status.Devices) != 1 {
				t.Fatalf("status %s, want gpu-9 LeaseFailed", desc)
			}
			if f := meta.FindStatusCondition(c.Status.Devices[0].Conditions, driver.ConditionLeaseFailed); f == nil || f.Reason != ReasonDeviceNotPublished {
				t.Errorf("status %s, want LeaseFailed %s", desc, ReasonDeviceNotPublished)
			}
		})
	}
}
