package k8s

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	utilfeature "k8s.io/apiserver/pkg/util/feature"
	"k8s.io/kubernetes/pkg/features"
	"k8s.io/utils/ptr"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// secondCluster is the bad input "a second cluster with the same tenant":
// a controller that names itself another cluster (--cluster-id), on the
// tenant the running controller claimed, stops with an error that names
// the cluster holding the tenant, and touches no lease.
func (e *scenarioEnv) secondCluster(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	claim, refusal := e.b.Client.Lease.ClaimTenant(ctx, &gpupoolv1.ClaimTenantRequest{Tenant: scnTenant, ClusterId: "probe"})
	if status.Code(refusal) != codes.AlreadyExists || !strings.Contains(refusal.Error(), "is claimed by Kubernetes cluster") {
		t.Fatalf("a claim on tenant %s by another cluster: got %v %v, want AlreadyExists naming the running controller's cluster", scnTenant, claim, refusal)
	}
	ns, err := e.cp.Client.CoreV1().Namespaces().Get(ctx, metav1.NamespaceSystem, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(refusal.Error(), string(ns.UID)) {
		t.Errorf("refusal %q does not name this cluster (kube-system UID %s)", refusal, ns.UID)
	}
	p := startGpupool(t, "controller-second-cluster", "k8s-controller",
		"--addr", e.b.Addrs, "--kubeconfig", e.ctrlKubeconfig, "--leader-elect=false",
		"--cluster-id", "second-cluster", "--node-selector", scnNodeLabel+"=true")
	select {
	case <-p.done:
	case <-ctx.Done():
		t.Fatal("a controller of a second cluster on the same tenant is still running")
	}
	if code := p.cmd.ProcessState.ExitCode(); code != 1 {
		t.Errorf("exit code %d, want 1", code)
	}
	b, _ := os.ReadFile(p.Log)
	for _, want := range []string{`tenant "k8s" is claimed by Kubernetes cluster ` + string(ns.UID), "--take-over-tenant"} {
		if !strings.Contains(string(b), want) {
			t.Errorf("controller output does not say %q:\n%s", want, b)
		}
	}
}

// The topology the driver publishes (docs/architecture.md, "Kubernetes").
const (
	ftPCIeRoot     = "resource.kubernetes.io/pcieRoot"
	ftNVLinkDomain = driverName + "/nvlinkDomain"
)

// The simulated pool hosts of TestLegacyPodsAndTopology: one whose two GPUs
// share a PCIe root and an NVLink island (a DGX board's pair), and one with
// a PCIe root per GPU and no NVLink.
const (
	ftPairedGPUs = agentGPUs // 2 per PCIe root and 8 per NVLink domain by default
	ftLoneGPUs   = "2xA100-80GB:pcie=1:nvlink=0"
)

// TestLegacyPodsAndTopology runs, against the real binaries as
// TestScenarios does, what goes beyond a claim for one GPU: a pod written
// for a device plugin (gpu.gpupool.dev/gpu in its limits, no claim) gets a
// whole leased GPU through CDI; a claim for two GPUs on one PCIe root gets
// them, with leases that record the topology; and the bad inputs, an
// extended resource larger than the pool and a topology no host has, stay
// pending with the scheduler's reason.
func TestLegacyPodsAndTopology(t *testing.T) {
	if !utilfeature.DefaultFeatureGate.Enabled(features.DRAExtendedResource) {
		t.Fatalf("feature gate %s is off in the test control plane; it is beta and on by default in Kubernetes 1.36", features.DRAExtendedResource)
	}
	e := newScenarioEnvWith(t, ftPairedGPUs, ftLoneGPUs)
	paired, lone := e.b.HostIDs[0], e.b.HostIDs[1]
	for _, sc := range []struct {
		name string
		run  func(t *testing.T)
	}{
		{"legacy_pod_gets_a_whole_leased_gpu", e.legacyPod},
		{"bad_input_extended_resource_larger_than_the_pool_stays_pending", e.legacyPodTooBig},
		{"two_gpus_on_one_pcie_root", func(t *testing.T) { e.alignedPair(t, ftPCIeRoot, paired) }},
		{"two_gpus_on_one_nvlink_island", func(t *testing.T) { e.alignedPair(t, ftNVLinkDomain, paired) }},
		{"bad_input_one_pcie_root_on_hosts_with_one_gpu_per_root_stays_pending", func(t *testing.T) { e.contradictoryTopology(t, lone) }},
		{"bad_input_a_second_cluster_with_the_same_tenant_is_refused", e.secondCluster},
	} {
		t.Run(sc.name, func(t *testing.T) {
			sc.run(t)
			e.checkNoOverallocation(t)
		})
	}
}

// legacyPodSpec is a pod whose one container asks for n of the extended
// resource gpu.gpupool.dev/gpu and has no claim.
func legacyPodSpec(name string, n int64) *corev1.Pod {
	q := *resource.NewQuantity(n, resource.DecimalSI)
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{
			Name: "main", Image: "registry.k8s.io/pause:3.10",
			Resources: corev1.ResourceRequirements{Limits: corev1.ResourceList{extendedResourceName: q}},
		}}},
	}
}

// ftLeased is a bound pod's claim whose devices of our driver are all
// Leased=True, with their leases.
type ftLeased struct {
	pod     *corev1.Pod
	claim   *resourceapi.ResourceClaim
	results []resourceapi.DeviceRequestAllocationResult
	leases  []*gpupoolv1.Lease // by result
}

// waitAllLeased waits until pod name is bound and every device of ours in
// the claim that claimOf finds for it is Leased=True.
func (e *scenarioEnv) waitAllLeased(t *testing.T, name string, claimOf func(context.Context, *corev1.Pod) (*resourceapi.ResourceClaim, error)) *ftLeased {
	t.Helper()
	var out *ftLeased
	eventually(t, "pod "+name+" bound with every device leased", scnBind, func(ctx context.Context) error {
		pod, err := e.cp.Client.CoreV1().Pods(e.ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		claim, err := claimOf(ctx, pod)
		if err != nil {
			return fmt.Errorf("%w; pod conditions %v", err, pod.Status.Conditions)
		}
		if claim.Status.Allocation == nil {
			return fmt.Errorf("claim %s not allocated; pod conditions %v", claim.Name, pod.Status.Conditions)
		}
		lp := &ftLeased{pod: pod, claim: claim}
		var ids []string
		for _, r := range claim.Status.Allocation.Devices.Results {
			if r.Driver != driverName {
				continue
			}
			ds := scnDeviceStatus(claim, r)
			if ds == nil || !meta.IsStatusConditionTrue(ds.Conditions, scnConditionLeased) || ds.Data == nil {
				return fmt.Errorf("claim %s: device %s/%s not leased yet", claim.Name, r.Pool, r.Device)
			}
			var data scnLeaseData
			if err := json.Unmarshal(ds.Data.Raw, &data); err != nil {
				return fmt.Errorf("claim %s: status.devices data %s: %v", claim.Name, ds.Data.Raw, err)
			}
			lp.results = append(lp.results, r)
			ids = append(ids, data.LeaseID)
		}
		if len(lp.results) == 0 {
			return fmt.Errorf("claim %s has no device of %s", claim.Name, driverName)
		}
		if pod.Spec.NodeName == "" {
			return fmt.Errorf("claim %s leased, pod %s not bound yet", claim.Name, name)
		}
		for _, id := range ids {
			lp.leases = append(lp.leases, e.getLease(t, id))
		}
		out = lp
		return nil
	})
	if e.nodes[out.pod.Spec.NodeName] == nil {
		t.Fatalf("pod %s bound to node %s, not one of the test's nodes", name, out.pod.Spec.NodeName)
	}
	return out
}

// extendedClaim is the claim the scheduler made for pod's extended
// resources.
func (e *scenarioEnv) extendedClaim(ctx context.Context, pod *corev1.Pod) (*resourceapi.ResourceClaim, error) {
	s := pod.Status.ExtendedResourceClaimStatus
	if s == nil || s.ResourceClaimName == "" {
		return nil, fmt.Errorf("pod %s has no claim for its extended resources yet", pod.Name)
	}
	return e.cp.Client.ResourceV1().ResourceClaims(pod.Namespace).Get(ctx, s.ResourceClaimName, metav1.GetOptions{})
}

// legacyPod: a pod with gpu.gpupool.dev/gpu: 1 in its limits and no claim
// is bound once the claim the scheduler made for it is leased; the lease
// holds one whole GPU (exclusive); the node plugin prepares that claim
// into a CDI device whose spec carries the lease, as for any claim.
func (e *scenarioEnv) legacyPod(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := e.cp.Client.CoreV1().Pods(e.ns).Create(ctx, legacyPodSpec("legacy", 1), metav1.CreateOptions{FieldValidation: "Strict"}); err != nil {
		t.Fatal(err)
	}
	lp := e.waitAllLeased(t, "legacy", e.extendedClaim)
	if len(lp.results) != 1 {
		t.Fatalf("claim %s: %d devices, want 1: %+v", lp.claim.Name, len(lp.results), lp.results)
	}
	r, l := lp.results[0], lp.leases[0]
	t.Logf("pod legacy on node %s: claim %s (made by the scheduler), device %s/%s, lease %s", lp.pod.Spec.NodeName, lp.claim.Name, r.Pool, r.Device, l.GetId())
	if ss := l.GetSlices(); len(ss) != 1 || !ss[0].GetExclusive() || ss[0].GetMemoryMib() != 81920 || l.GetTenant() != scnTenant {
		t.Errorf("lease %s of tenant %s slices %v, want one whole (exclusive) 81920 MiB GPU of tenant %s", l.GetId(), l.GetTenant(), ss, scnTenant)
	}
	if want := scnRequestID(lp.claim.UID, r); l.GetRequest().GetRequestId() != want {
		t.Errorf("lease %s: request id %q, want %q", l.GetId(), l.GetRequest().GetRequestId(), want)
	}

	n := e.nodes[lp.pod.Spec.NodeName]
	resp, err := n.kubelet.prepare(ctx, lp.claim)
	if err != nil {
		t.Fatalf("NodePrepareResources: %v", err)
	}
	got := resp.Claims[string(lp.claim.UID)]
	wantCDI := driverName + "/claim=" + string(lp.claim.UID)
	if got == nil || got.Error != "" || len(got.Devices) != 1 || !slices.Equal(got.Devices[0].CdiDeviceIds, []string{wantCDI}) {
		t.Fatalf("prepare claim %s: %+v, want one device with CDI id %s", lp.claim.Name, got, wantCDI)
	}
	spec, err := scnReadCDISpec(n.cdiSpecPath(lp.claim.UID))
	if err != nil {
		t.Fatal(err)
	}
	if len(spec.Devices) != 1 || !slices.Contains(spec.Devices[0].ContainerEdits.Env, "GPUPOOL_LEASE_ID="+l.GetId()) {
		t.Errorf("CDI spec devices %+v, want one that sets GPUPOOL_LEASE_ID=%s", spec.Devices, l.GetId())
	}
	if _, err := n.kubelet.unprepare(ctx, lp.claim); err != nil {
		t.Errorf("NodeUnprepareResources: %v", err)
	}
	e.deletePodAndClaim(t, lp.pod.Name, lp.claim.Name)
	e.waitLeaseEnded(t, l.GetId())
}

// legacyPodTooBig is the bad input "an extended resource larger than any
// host": five GPUs, when the two pool hosts have two each (a pod may get
// GPUs of several pool hosts, so only more than all of them can never be
// had). The pod stays unscheduled with the scheduler's reason, and no
// claim of it is left allocated.
func (e *scenarioEnv) legacyPodTooBig(t *testing.T) {
	ctx := context.Background()
	if _, err := e.cp.Client.CoreV1().Pods(e.ns).Create(ctx, legacyPodSpec("legacy-too-big", 5), metav1.CreateOptions{FieldValidation: "Strict"}); err != nil {
		t.Fatal(err)
	}
	cond := e.waitUnschedulable(t, "legacy-too-big")
	t.Logf("pod legacy-too-big: %s: %s", cond.Reason, cond.Message)
	pod, err := e.cp.Client.CoreV1().Pods(e.ns).Get(ctx, "legacy-too-big", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if s := pod.Status.ExtendedResourceClaimStatus; s != nil {
		t.Errorf("pod legacy-too-big refers to claim %s, want none", s.ResourceClaimName)
	}
	e.cp.finishPod(t, e.ns, "legacy-too-big")
}

// waitUnschedulable waits until pod name says PodScheduled=False, reason
// Unschedulable, because claims cannot be allocated, and checks that it
// stays unbound.
func (e *scenarioEnv) waitUnschedulable(t *testing.T, name string) *corev1.PodCondition {
	t.Helper()
	var cond *corev1.PodCondition
	eventually(t, "pod "+name+" unschedulable, with the scheduler's reason", time.Minute, func(ctx context.Context) error {
		pod, err := e.cp.Client.CoreV1().Pods(e.ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		if pod.Spec.NodeName != "" {
			t.Fatalf("pod %s bound to %s", name, pod.Spec.NodeName)
		}
		cond = scnPodCondition(pod, corev1.PodScheduled)
		if cond == nil || cond.Status != corev1.ConditionFalse || cond.Reason != corev1.PodReasonUnschedulable || !strings.Contains(cond.Message, "cannot allocate all claims") {
			return fmt.Errorf("PodScheduled %+v, want False %s saying the claims cannot be allocated", cond, corev1.PodReasonUnschedulable)
		}
		return nil
	})
	return cond
}

// alignedTemplate asks for two whole GPUs with equal attr, on pool host
// when it is not empty.
func alignedTemplate(name, attr, host string) *resourceapi.ResourceClaimTemplate {
	req := resourceapi.ExactDeviceRequest{DeviceClassName: driverName, AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 2}
	if host != "" {
		req.Selectors = []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{
			Expression: fmt.Sprintf("device.attributes[%q].?host.orValue(\"\") == %q", driverName, host)}}}
	}
	return &resourceapi.ResourceClaimTemplate{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: resourceapi.ResourceClaimTemplateSpec{Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{
			Requests:    []resourceapi.DeviceRequest{{Name: "gpu", Exactly: &req}},
			Constraints: []resourceapi.DeviceConstraint{{Requests: []string{"gpu"}, MatchAttribute: ptr.To(resourceapi.FullyQualifiedName(attr))}},
		}}},
	}
}

// alignedPair: a claim for two GPUs with equal attr gets the two of the
// one host that has them (host), published with equal attr; each is
// leased whole, pinned to its device, with the topology of attr.
func (e *scenarioEnv) alignedPair(t *testing.T, attr, host string) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	name := "pair-" + strings.ToLower(attr[strings.LastIndex(attr, "/")+1:])
	if _, err := e.cp.Client.ResourceV1().ResourceClaimTemplates(e.ns).Create(ctx, alignedTemplate(name, attr, ""), metav1.CreateOptions{FieldValidation: "Strict"}); err != nil {
		t.Fatal(err)
	}
	e.createPod(t, name, name)
	lp := e.waitAllLeased(t, name, func(ctx context.Context, pod *corev1.Pod) (*resourceapi.ResourceClaim, error) {
		return e.cp.podClaim(ctx, pod, "gpu")
	})
	if len(lp.results) != 2 {
		t.Fatalf("claim %s: %d devices, want 2", lp.claim.Name, len(lp.results))
	}
	devs, err := e.poolDevices(ctx, host)
	if err != nil {
		t.Fatal(err)
	}
	// The driver's own attributes are published without its domain.
	key := resourceapi.QualifiedName(strings.TrimPrefix(attr, driverName+"/"))
	var values []string
	wantTopo := map[string]gpupoolv1.Topology{ftPCIeRoot: gpupoolv1.Topology_TOPOLOGY_SAME_PCIE_ROOT, ftNVLinkDomain: gpupoolv1.Topology_TOPOLOGY_SAME_NVLINK}[attr]
	for i, r := range lp.results {
		d, ok := devs[r.Device]
		if r.Pool != host || !ok {
			t.Fatalf("device %s/%s allocated, want a device of %s (the only host with two GPUs that share %s)", r.Pool, r.Device, host, attr)
		}
		a := d.Attributes[key]
		if a.StringValue == nil {
			t.Fatalf("device %s/%s has no %s: %v", r.Pool, r.Device, attr, d.Attributes)
		}
		values = append(values, *a.StringValue)
		l := lp.leases[i]
		if ss := l.GetSlices(); len(ss) != 1 || !ss[0].GetExclusive() || ss[0].GetDevice() != *d.Attributes["uuid"].StringValue {
			t.Errorf("lease %s slices %v, want device %s whole", l.GetId(), ss, *d.Attributes["uuid"].StringValue)
		}
		if got := l.GetRequest().GetTopology(); got != wantTopo {
			t.Errorf("lease %s topology %s, want %s", l.GetId(), got, wantTopo)
		}
	}
	if values[0] != values[1] || !strings.HasPrefix(values[0], host+"/") {
		t.Errorf("%s of the two devices: %v, want equal, of host %s", attr, values, host)
	}
	t.Logf("claim %s: %s/%s and %s/%s, %s %s, leases %s and %s", lp.claim.Name, lp.results[0].Pool, lp.results[0].Device,
		lp.results[1].Pool, lp.results[1].Device, attr, values[0], lp.leases[0].GetId(), lp.leases[1].GetId())
	e.deletePodAndClaim(t, lp.pod.Name, lp.claim.Name)
	for _, l := range lp.leases {
		e.waitLeaseEnded(t, l.GetId())
	}
}

// contradictoryTopology is the bad input "two GPUs on one PCIe root, on
// hosts with one GPU per root": the claim is never allocated, and its pod
// says why.
func (e *scenarioEnv) contradictoryTopology(t *testing.T, host string) {
	ctx := context.Background()
	tmpl := alignedTemplate("contradictory", ftPCIeRoot, host)
	if _, err := e.cp.Client.ResourceV1().ResourceClaimTemplates(e.ns).Create(ctx, tmpl, metav1.CreateOptions{FieldValidation: "Strict"}); err != nil {
		t.Fatal(err)
	}
	e.createPod(t, "contradictory", tmpl.Name)
	cond := e.waitUnschedulable(t, "contradictory")
	t.Logf("pod contradictory: %s: %s", cond.Reason, cond.Message)
	pod, claim, err := e.podAndClaim(ctx, "contradictory")
	if err != nil {
		t.Fatal(err)
	}
	if claim.Status.Allocation != nil {
		t.Errorf("claim %s allocated %+v", claim.Name, claim.Status.Allocation.Devices.Results)
	}
	e.cp.finishPod(t, e.ns, pod.Name)
	if err := e.cp.Client.ResourceV1().ResourceClaims(e.ns).Delete(ctx, claim.Name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		t.Error(err)
	}
}
