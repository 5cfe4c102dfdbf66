package k8s

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	authorizationv1 "k8s.io/api/authorization/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"

	"github.com/gpupool/gpupool/client"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// What the scenarios rely on of the driver's contract
// (docs/architecture.md, "Kubernetes"), spelled out as the
// contract says them: the scenarios check the binaries against it, and
// importing the k8s package would also add its CDI module to this module's
// requirements.
const (
	scnConditionLeased      = "Leased"
	scnConditionLeaseFailed = "LeaseFailed"
	scnReasonLeaseEnded     = "LeaseEnded"
	scnTaintDraining        = driverName + "/draining"
	scnTaintBusy            = driverName + "/busy"
	scnContainerDir         = "/var/run/gpupool"
	scnContainerTokenFile   = scnContainerDir + "/token.json"
	// scnTenant is the controller's default broker tenant.
	scnTenant = "k8s"
	// scnOtherTenant holds the leases taken outside Kubernetes.
	scnOtherTenant = "batch"
	// scnNodeLabel marks the scenarios' nodes, and is the controller's
	// --node-selector, so that no other test's pools reach them.
	scnNodeLabel = "scenarios.gpupool.dev/node"
	// scnServiceAccountNS is the namespace of the service accounts the
	// controller and node plugins act as (through impersonation).
	scnServiceAccountNS = "gpupool-scenarios"
	// scnBind is how long a pod may take from creation to being bound: the
	// scheduler polls binding conditions every 5s, and a LeaseFailed means
	// another round.
	scnBind = 2 * time.Minute
)

// TestScenarios runs the Kubernetes scenarios against the real binaries: the
// dev broker cluster with 2 simulated pool hosts (2 A100 80GB each),
// `gpupool k8s-controller` acting as a service account bound to the
// chart's controller ClusterRole, and on each of 2 fake nodes
// `gpupool k8s-node-plugin` (acting as the node plugin's service account)
// with a kubelet stand-in on the real DRA gRPC API. The scenarios share
// this setup and run in order: (e) and (c) work on (a)'s pod; every other
// scenario removes its pods, claims and broker leases, so that the next
// one starts from an idle pool. A capacity monitor samples the brokers'
// leases throughout, and each scenario ends by checking that no GPU was
// ever over-allocated.
func TestScenarios(t *testing.T) {
	start := time.Now()
	e := newScenarioEnv(t)
	t.Logf("scenario setup ready in %s", time.Since(start).Round(time.Millisecond))

	for _, sc := range []struct {
		name string
		run  func(t *testing.T)
	}{
		{"a_fractional_claim_leased_and_prepared", e.fractionalClaim},
		{"e_unprepare_twice", e.unprepareTwice},
		{"c_delete_pod_and_claim_releases_lease", e.deleteReleases},
		{"b_lease_failed_reschedules_to_other_host", e.leaseFailedReschedules},
		{"b_all_hosts_exhausted_pod_stays_pending", e.allHostsExhausted},
		{"bad_input_lease_deleted_under_running_pod", e.leaseDeletedUnderPod},
		{"d_drain_taints_devices_and_evicts_pod", e.drainEvicts},
		{"bad_input_too_much_memory_stays_pending", e.tooMuchMemory},
	} {
		t.Run(sc.name, func(t *testing.T) {
			start := time.Now()
			defer func() { t.Logf("%s took %s", sc.name, time.Since(start).Round(time.Millisecond)) }()
			sc.run(t)
			e.checkNoOverallocation(t)
		})
	}
}

// scenarioEnv is the setup the scenarios share.
type scenarioEnv struct {
	t  *testing.T // TestScenarios itself: owns the processes
	cp *controlPlane
	ns string
	b  *brokers

	ctrlKubeconfig string
	ctrl           *proc
	ctrlStarts     int

	nodes map[string]*scnNode // by node name

	// frac is the pod of scenario (a), for (e) and (c); nil when (a) did
	// not get that far.
	frac *scnLeasedPod
	// tooBig is the pod of the memory bad input, created at setup so that
	// it stays pending through every other scenario.
	tooBig string

	monitor *scnCapacityMonitor
}

// scnNode is one fake node with its node plugin and kubelet stand-in.
type scnNode struct {
	name     string
	registry string // the kubelet's plugins_registry
	stateDir string
	cdiDir   string
	plugin   *proc
	kubelet  *kubelet
}

// scnLeasedPod is a pod bound with a leased claim.
type scnLeasedPod struct {
	pod    *corev1.Pod
	claim  *resourceapi.ResourceClaim
	result resourceapi.DeviceRequestAllocationResult
	data   scnLeaseData
}

// scnLeaseData is the binder's data of a leased device in
// status.devices[].
type scnLeaseData struct {
	LeaseID        string `json:"leaseId"`
	Host           string `json:"host"`
	AgentAddress   string `json:"agentAddress"`
	CertSHA256     string `json:"certSHA256"`
	MemoryMiB      int64  `json:"memoryMiB"`
	ComputePercent int32  `json:"computePercent"`
}

const (
	scnQuarterTemplate = "quarter"  // 20Gi and 25% compute: a quarter-ish slice
	scnTooMuchTemplate = "too-much" // 100Gi: more than an A100 80GB has
	scnControllerSA    = "controller"
	scnNodePluginSA    = "node-plugin"
)

func scnServiceAccount(name string) (user string, groups []string) {
	return "system:serviceaccount:" + scnServiceAccountNS + ":" + name,
		[]string{"system:serviceaccounts", "system:serviceaccounts:" + scnServiceAccountNS, "system:authenticated"}
}

func newScenarioEnv(t *testing.T) *scenarioEnv {
	return newScenarioEnvWith(t, agentGPUs, agentGPUs)
}

// newScenarioEnvWith is newScenarioEnv with one pool host per spec of
// simulated GPUs (see startBrokersWith).
func newScenarioEnvWith(t *testing.T, specs ...string) *scenarioEnv {
	cp := sharedControlPlane(t)
	cp.ensureDeviceClass(t)
	gpupoolBinary(t)
	e := &scenarioEnv{t: t, cp: cp, ns: cp.newNamespace(t), nodes: map[string]*scnNode{}}
	ctx := context.Background()

	e.b = startBrokersWith(t, specs...)
	e.monitor = scnStartCapacityMonitor(t, e.b.Client)

	// The controller and node plugins act as service accounts bound to the
	// chart's ClusterRoles (deploy/helm/gpupool/templates/rbac.yaml).
	ctrlUser, ctrlGroups := scnServiceAccount(scnControllerSA)
	pluginUser, pluginGroups := scnServiceAccount(scnNodePluginSA)
	e.createClusterRole(t, "gpupool-scenarios-controller", scnControllerSA, []rbacv1.PolicyRule{
		{APIGroups: []string{"resource.k8s.io"}, Resources: []string{"resourceclaims"}, Verbs: []string{"get", "list", "watch"}},
		{APIGroups: []string{"resource.k8s.io"}, Resources: []string{"resourceclaims/status"}, Verbs: []string{"update", "patch"}},
		{APIGroups: []string{"resource.k8s.io"}, Resources: []string{"resourceclaims/driver"}, ResourceNames: []string{driverName},
			Verbs: []string{"arbitrary-node:update", "arbitrary-node:patch"}},
		{APIGroups: []string{"resource.k8s.io"}, Resources: []string{"resourceslices"},
			Verbs: []string{"get", "list", "watch", "create", "update", "patch", "delete", "deletecollection"}},
		{APIGroups: []string{""}, Resources: []string{"pods"}, Verbs: []string{"get", "list", "watch"}},
		{APIGroups: []string{"", "events.k8s.io"}, Resources: []string{"events"}, Verbs: []string{"create", "patch", "update"}},
		{APIGroups: []string{""}, Resources: []string{"namespaces"}, ResourceNames: []string{"kube-system"}, Verbs: []string{"get"}},
	})
	e.createClusterRole(t, "gpupool-scenarios-node-plugin", scnNodePluginSA, []rbacv1.PolicyRule{
		{APIGroups: []string{"resource.k8s.io"}, Resources: []string{"resourceclaims"}, Verbs: []string{"get"}},
		{APIGroups: []string{"resource.k8s.io"}, Resources: []string{"resourceslices"}, Verbs: []string{"get", "list", "watch"}},
	})
	e.waitAllowed(t, ctrlUser, ctrlGroups, authorizationv1.ResourceAttributes{
		Group: "resource.k8s.io", Resource: "resourceclaims", Subresource: "driver", Name: driverName, Verb: "arbitrary-node:update"})
	e.waitAllowed(t, ctrlUser, ctrlGroups, authorizationv1.ResourceAttributes{Group: "resource.k8s.io", Resource: "resourceslices", Verb: "create"})
	e.waitAllowed(t, pluginUser, pluginGroups, authorizationv1.ResourceAttributes{Group: "resource.k8s.io", Resource: "resourceclaims", Verb: "get"})
	e.ctrlKubeconfig = cp.kubeconfigFor(t, ctrlUser, ctrlGroups...)
	pluginKubeconfig := cp.kubeconfigFor(t, pluginUser, pluginGroups...)

	// The controller leaves its ResourceSlices behind when it stops; this
	// cleanup runs after it was killed.
	t.Cleanup(func() { e.deleteSlices(t) })

	for i := range 2 {
		name := fmt.Sprintf("scn-node-%d", i+1)
		cp.addNode(t, name, map[string]string{scnNodeLabel: "true"})
		registry, pluginDir := kubeletDirs(t)
		n := &scnNode{name: name, registry: registry, stateDir: filepath.Join(t.TempDir(), "state"), cdiDir: filepath.Join(t.TempDir(), "cdi")}
		n.plugin = startGpupool(t, "node-plugin-"+name, "k8s-node-plugin",
			"--addr", e.b.Addrs, "--node-name", name, "--kubeconfig", pluginKubeconfig,
			"--state-dir", n.stateDir, "--cdi-dir", n.cdiDir, "--plugin-dir", pluginDir, "--registrar-dir", registry,
			"--log-level", "debug")
		e.nodes[name] = n
	}
	for _, n := range e.nodes {
		n.kubelet = newKubelet(t, n.name, n.registry)
	}

	e.startController(t)
	cp.waitForPools(t, e.b.HostIDs...)

	for _, tmpl := range []*resourceapi.ResourceClaimTemplate{
		fractionalTemplate(scnQuarterTemplate, "20Gi", "25"),
		fractionalTemplate(scnTooMuchTemplate, "100Gi", "25"),
	} {
		if _, err := cp.Client.ResourceV1().ResourceClaimTemplates(e.ns).Create(ctx, tmpl, metav1.CreateOptions{FieldValidation: "Strict"}); err != nil {
			t.Fatalf("create ResourceClaimTemplate %s: %v", tmpl.Name, err)
		}
	}
	e.tooBig = "too-big"
	e.createPod(t, e.tooBig, scnTooMuchTemplate)
	return e
}

// scnOwned is a subtest's t for failures, whose cleanups and logs go to
// owner instead: for a process started in a subtest that must outlive it.
type scnOwned struct {
	testing.TB // the subtest
	owner      testing.TB
}

func (o scnOwned) Cleanup(f func())                { o.owner.Cleanup(f) }
func (o scnOwned) Failed() bool                    { return o.owner.Failed() }
func (o scnOwned) Log(args ...any)                 { o.owner.Log(args...) }
func (o scnOwned) Logf(format string, args ...any) { o.owner.Logf(format, args...) }
func (o scnOwned) Name() string                    { return o.owner.Name() }
func (o scnOwned) TempDir() string                 { return o.owner.TempDir() }

// startController starts `gpupool k8s-controller` as the controller's
// service account, for the rest of TestScenarios.
func (e *scenarioEnv) startController(t testing.TB) {
	t.Helper()
	var tb testing.TB = e.t
	if t != testing.TB(e.t) {
		tb = scnOwned{TB: t, owner: e.t}
	}
	e.ctrlStarts++
	e.ctrl = startGpupool(tb, fmt.Sprintf("controller-%d", e.ctrlStarts), "k8s-controller",
		"--addr", e.b.Addrs, "--kubeconfig", e.ctrlKubeconfig, "--leader-elect=false",
		"--node-selector", scnNodeLabel+"=true", "--log-level", "debug")
}

// createClusterRole creates a ClusterRole with rules, bound to the service
// account sa of scnServiceAccountNS; both go when t ends.
func (e *scenarioEnv) createClusterRole(t testing.TB, name, sa string, rules []rbacv1.PolicyRule) {
	t.Helper()
	ctx := context.Background()
	rbac := e.cp.Client.RbacV1()
	role := &rbacv1.ClusterRole{ObjectMeta: metav1.ObjectMeta{Name: name}, Rules: rules}
	if _, err := rbac.ClusterRoles().Create(ctx, role, metav1.CreateOptions{FieldValidation: "Strict"}); err != nil {
		t.Fatalf("create ClusterRole %s: %v", name, err)
	}
	t.Cleanup(func() { rbac.ClusterRoles().Delete(context.Background(), name, metav1.DeleteOptions{}) })
	binding := &rbacv1.ClusterRoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: name},
		Subjects:   []rbacv1.Subject{{Kind: rbacv1.ServiceAccountKind, Namespace: scnServiceAccountNS, Name: sa}},
	}
	if _, err := rbac.ClusterRoleBindings().Create(ctx, binding, metav1.CreateOptions{FieldValidation: "Strict"}); err != nil {
		t.Fatalf("create ClusterRoleBinding %s: %v", name, err)
	}
	t.Cleanup(func() { rbac.ClusterRoleBindings().Delete(context.Background(), name, metav1.DeleteOptions{}) })
}

// waitAllowed waits until the apiserver authorizes user for attrs: RBAC
// sees new bindings through an informer.
func (e *scenarioEnv) waitAllowed(t testing.TB, user string, groups []string, attrs authorizationv1.ResourceAttributes) {
	t.Helper()
	what := fmt.Sprintf("%s may %s %s/%s %s", user, attrs.Verb, attrs.Resource, attrs.Subresource, attrs.Name)
	eventually(t, what, 30*time.Second, func(ctx context.Context) error {
		sar, err := e.cp.Client.AuthorizationV1().SubjectAccessReviews().Create(ctx, &authorizationv1.SubjectAccessReview{
			Spec: authorizationv1.SubjectAccessReviewSpec{User: user, Groups: groups, ResourceAttributes: &attrs},
		}, metav1.CreateOptions{})
		if err != nil {
			return err
		}
		if !sar.Status.Allowed {
			return fmt.Errorf("denied: %s %s", sar.Status.Reason, sar.Status.EvaluationError)
		}
		return nil
	})
}

// deleteSlices deletes the ResourceSlices of the scenarios' pools.
func (e *scenarioEnv) deleteSlices(t testing.TB) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	slices, err := e.slices(ctx)
	if err != nil {
		t.Errorf("list ResourceSlices: %v", err)
		return
	}
	for _, s := range slices {
		err := e.cp.Client.ResourceV1().ResourceSlices().Delete(ctx, s.Name, metav1.DeleteOptions{})
		if err != nil && !apierrors.IsNotFound(err) {
			t.Errorf("delete ResourceSlice %s: %v", s.Name, err)
		}
	}
}

// slices lists our driver's ResourceSlices of the scenarios' pools.
func (e *scenarioEnv) slices(ctx context.Context) ([]resourceapi.ResourceSlice, error) {
	list, err := e.cp.Client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{
		FieldSelector: resourceapi.ResourceSliceSelectorDriver + "=" + driverName,
	})
	if err != nil {
		return nil, err
	}
	var out []resourceapi.ResourceSlice
	for _, s := range list.Items {
		if slices.Contains(e.b.HostIDs, s.Spec.Pool.Name) {
			out = append(out, s)
		}
	}
	return out, nil
}

// poolDevices is every published device of pool, by name, from the
// pool's newest generation.
func (e *scenarioEnv) poolDevices(ctx context.Context, pool string) (map[string]resourceapi.Device, error) {
	all, err := e.slices(ctx)
	if err != nil {
		return nil, err
	}
	gen := int64(-1)
	for _, s := range all {
		if s.Spec.Pool.Name == pool {
			gen = max(gen, s.Spec.Pool.Generation)
		}
	}
	out := map[string]resourceapi.Device{}
	for _, s := range all {
		if s.Spec.Pool.Name == pool && s.Spec.Pool.Generation == gen {
			for _, d := range s.Spec.Devices {
				out[d.Name] = d
			}
		}
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("pool %s has no published device", pool)
	}
	return out, nil
}

// createPod creates pod name, whose claim "gpu" comes from template.
func (e *scenarioEnv) createPod(t testing.TB, name, template string) {
	t.Helper()
	_, err := e.cp.Client.CoreV1().Pods(e.ns).Create(context.Background(), podWithClaim(name, template), metav1.CreateOptions{FieldValidation: "Strict"})
	if err != nil {
		t.Fatalf("create pod %s: %v", name, err)
	}
}

// podAndClaim gets pod name and its claim "gpu".
func (e *scenarioEnv) podAndClaim(ctx context.Context, name string) (*corev1.Pod, *resourceapi.ResourceClaim, error) {
	pod, err := e.cp.Client.CoreV1().Pods(e.ns).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return nil, nil, err
	}
	claim, err := e.cp.podClaim(ctx, pod, "gpu")
	if err != nil {
		return pod, nil, err
	}
	return pod, claim, nil
}

// scnOurResult is the one result of claim's allocation from our driver.
func scnOurResult(claim *resourceapi.ResourceClaim) (resourceapi.DeviceRequestAllocationResult, error) {
	if claim.Status.Allocation == nil {
		return resourceapi.DeviceRequestAllocationResult{}, fmt.Errorf("claim %s is not allocated", claim.Name)
	}
	var out []resourceapi.DeviceRequestAllocationResult
	for _, r := range claim.Status.Allocation.Devices.Results {
		if r.Driver == driverName {
			out = append(out, r)
		}
	}
	if len(out) != 1 {
		return resourceapi.DeviceRequestAllocationResult{}, fmt.Errorf("claim %s has %d devices of %s allocated, want 1: %+v", claim.Name, len(out), driverName, out)
	}
	return out[0], nil
}

// scnDeviceStatus is the status.devices[] entry of result r, or nil.
func scnDeviceStatus(claim *resourceapi.ResourceClaim, r resourceapi.DeviceRequestAllocationResult) *resourceapi.AllocatedDeviceStatus {
	for i, d := range claim.Status.Devices {
		sameShare := d.ShareID == nil && r.ShareID == nil || d.ShareID != nil && r.ShareID != nil && *d.ShareID == string(*r.ShareID)
		if d.Driver == r.Driver && d.Pool == r.Pool && d.Device == r.Device && sameShare {
			return &claim.Status.Devices[i]
		}
	}
	return nil
}

// scnRequestID is the binder's request id of the lease for result r of the
// claim with uid.
func scnRequestID(uid types.UID, r resourceapi.DeviceRequestAllocationResult) string {
	if r.ShareID != nil {
		return string(uid) + "/" + string(*r.ShareID)
	}
	return string(uid) + "/" + r.Pool + "/" + r.Device
}

// waitLeased waits until pod name is bound and its claim's one device is
// Leased=True, and returns them with the lease's data.
func (e *scenarioEnv) waitLeased(t testing.TB, name string) *scnLeasedPod {
	t.Helper()
	var lp *scnLeasedPod
	eventually(t, "pod "+name+" bound with a leased claim", scnBind, func(ctx context.Context) error {
		pod, claim, err := e.podAndClaim(ctx, name)
		if err != nil {
			return err
		}
		r, err := scnOurResult(claim)
		if err != nil {
			return fmt.Errorf("%w; pod conditions %v", err, pod.Status.Conditions)
		}
		ds := scnDeviceStatus(claim, r)
		if ds == nil {
			return fmt.Errorf("claim %s: device %s/%s allocated, no status yet", claim.Name, r.Pool, r.Device)
		}
		if c := meta.FindStatusCondition(ds.Conditions, scnConditionLeased); c == nil || c.Status != metav1.ConditionTrue {
			return fmt.Errorf("claim %s: device %s/%s not leased: %v", claim.Name, r.Pool, r.Device, ds.Conditions)
		}
		if pod.Spec.NodeName == "" {
			return fmt.Errorf("claim %s leased, pod %s not bound yet", claim.Name, name)
		}
		var data scnLeaseData
		if ds.Data == nil {
			return fmt.Errorf("claim %s: Leased=True without data", claim.Name)
		}
		if err := json.Unmarshal(ds.Data.Raw, &data); err != nil {
			return fmt.Errorf("claim %s: status.devices data %s: %v", claim.Name, ds.Data.Raw, err)
		}
		lp = &scnLeasedPod{pod: pod, claim: claim, result: r, data: data}
		return nil
	})
	if e.nodes[lp.pod.Spec.NodeName] == nil {
		t.Fatalf("pod %s bound to node %s, not one of the scenarios' nodes", name, lp.pod.Spec.NodeName)
	}
	return lp
}

// deletePodAndClaim deletes the pod (as its kubelet finally does) and its
// claim, and waits until both are gone.
func (e *scenarioEnv) deletePodAndClaim(t testing.TB, pod, claim string) {
	t.Helper()
	e.cp.finishPod(t, e.ns, pod)
	claims := e.cp.Client.ResourceV1().ResourceClaims(e.ns)
	if err := claims.Delete(context.Background(), claim, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		t.Fatalf("delete claim %s: %v", claim, err)
	}
	eventually(t, fmt.Sprintf("pod %s and claim %s gone", pod, claim), time.Minute, func(ctx context.Context) error {
		if _, err := e.cp.Client.CoreV1().Pods(e.ns).Get(ctx, pod, metav1.GetOptions{}); !apierrors.IsNotFound(err) {
			return fmt.Errorf("pod %s: %v", pod, err)
		}
		c, err := claims.Get(ctx, claim, metav1.GetOptions{})
		if !apierrors.IsNotFound(err) {
			if err == nil {
				err = fmt.Errorf("still there: finalizers %v, reserved for %v, allocated %t", c.Finalizers, c.Status.ReservedFor, c.Status.Allocation != nil)
			}
			return fmt.Errorf("claim %s: %v", claim, err)
		}
		return nil
	})
}

// getLease asks the brokers for lease id.
func (e *scenarioEnv) getLease(t testing.TB, id string) *gpupoolv1.Lease {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp, err := e.b.Client.Lease.Get(ctx, &gpupoolv1.GetLeaseRequest{LeaseId: id})
	if err != nil {
		t.Fatalf("get lease %s: %v", id, err)
	}
	return resp.GetLease()
}

func scnEnded(s gpupoolv1.LeaseState) bool {
	switch s {
	case gpupoolv1.LeaseState_LEASE_STATE_RELEASED, gpupoolv1.LeaseState_LEASE_STATE_EXPIRED, gpupoolv1.LeaseState_LEASE_STATE_REVOKED:
		return true
	}
	return false
}

// waitLeaseEnded waits until the brokers say lease id ended, and returns
// it as they last described it.
func (e *scenarioEnv) waitLeaseEnded(t testing.TB, id string) *gpupoolv1.Lease {
	t.Helper()
	var l *gpupoolv1.Lease
	eventually(t, "lease "+id+" ended", time.Minute, func(ctx context.Context) error {
		ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		resp, err := e.b.Client.Lease.Get(ctx, &gpupoolv1.GetLeaseRequest{LeaseId: id})
		if err != nil {
			return err
		}
		l = resp.GetLease()
		if !scnEnded(l.GetState()) {
			return fmt.Errorf("lease %s is %s", id, l.GetState())
		}
		return nil
	})
	return l
}

// takeRest takes, as another tenant than Kubernetes', whatever is left of
// every GPU of host, and returns the leases; they are released when t
// ends, if not before.
func (e *scenarioEnv) takeRest(t testing.TB, host string) []string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	devs, err := e.b.Client.Pool.ListDevices(ctx, &gpupoolv1.ListDevicesRequest{HostId: host})
	if err != nil {
		t.Fatalf("list devices of %s: %v", host, err)
	}
	var ids []string
	t.Cleanup(func() { e.releaseLeases(t, ids...) })
	for _, d := range devs.GetDevices() {
		req := &gpupoolv1.LeaseRequest{
			Count:       1,
			Constraints: &gpupoolv1.Constraints{Host: host, Devices: []string{d.GetUuid()}},
			TtlMs:       (15 * time.Minute).Milliseconds(),
			Tenant:      scnOtherTenant,
			Holder:      "gpupool k8s scenarios: " + t.Name(),
		}
		switch mem, compute := d.GetMemoryMib()-d.GetAllocatedMemoryMib(), 100-d.GetAllocatedComputePercent(); {
		case d.GetAllocatedExclusive() || mem < 1 || compute < 1:
			continue // nothing left
		case d.GetLeaseCount() == 0:
			req.Exclusive = true
		default:
			req.MemoryMib, req.ComputePercent = mem, compute
		}
		resp, err := e.b.Client.Lease.Acquire(ctx, &gpupoolv1.AcquireRequest{Request: req})
		if err != nil {
			t.Fatalf("take the rest of device %s of %s: %v", d.GetUuid(), host, err)
		}
		ids = append(ids, resp.GetLease().GetId())
	}
	t.Logf("took the rest of host %s outside Kubernetes: leases %v", host, ids)
	return ids
}

// releaseLeases releases leases at the brokers; unknown or ended ones are
// fine.
func (e *scenarioEnv) releaseLeases(t testing.TB, ids ...string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, id := range ids {
		_, err := e.b.Client.Lease.Release(ctx, &gpupoolv1.ReleaseRequest{LeaseId: id, Reason: "gpupool k8s scenarios: done"})
		if err != nil && status.Code(err) != codes.NotFound && status.Code(err) != codes.FailedPrecondition {
			t.Errorf("release lease %s: %v", id, err)
		}
	}
}

// host is pool host id as the brokers describe it.
func (e *scenarioEnv) host(t testing.TB, host string) *gpupoolv1.Host {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp, err := e.b.Client.Pool.GetHost(ctx, &gpupoolv1.GetHostRequest{HostId: host})
	if err != nil {
		t.Fatalf("get host %s: %v", host, err)
	}
	return resp.GetHost()
}

// checkNoOverallocation fails t if the capacity monitor saw a GPU with
// more leased than it has, or sees one now.
func (e *scenarioEnv) checkNoOverallocation(t testing.TB) {
	t.Helper()
	eventually(t, "a capacity check at the brokers", 30*time.Second, func(context.Context) error { return e.monitor.check() })
	samples, violations := e.monitor.take()
	for _, v := range violations {
		t.Errorf("over-allocated: %s", v)
	}
	t.Logf("capacity monitor: %d samples of the brokers' leases, no GPU over-allocated: %t", samples, len(violations) == 0)
}

// scnCapacityMonitor samples the brokers' leases every 250ms and records
// every GPU that leases hold more memory or compute of than it has.
type scnCapacityMonitor struct {
	c    *client.Client
	stop chan struct{}
	done chan struct{}

	mu         sync.Mutex
	capacity   map[string]int64 // guarded by mu; device uuid -> memory MiB
	samples    int              // guarded by mu; since the last take
	violations []string         // guarded by mu; since the last take
}

func scnStartCapacityMonitor(t testing.TB, c *client.Client) *scnCapacityMonitor {
	m := &scnCapacityMonitor{c: c, stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(m.done)
		tick := time.NewTicker(250 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-m.stop:
				return
			case <-tick.C:
				m.check() // a failed sample is no finding
			}
		}
	}()
	t.Cleanup(func() { close(m.stop); <-m.done })
	return m
}

// check takes one sample.
func (m *scnCapacityMonitor) check() error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	m.mu.Lock()
	capacity := m.capacity
	m.mu.Unlock()
	if capacity == nil {
		devs, err := m.c.Pool.ListDevices(ctx, &gpupoolv1.ListDevicesRequest{})
		if err != nil {
			return err
		}
		capacity = map[string]int64{}
		for _, d := range devs.GetDevices() {
			capacity[d.GetUuid()] = d.GetMemoryMib()
		}
		m.mu.Lock()
		m.capacity = capacity
		m.mu.Unlock()
	}
	// One List is one state of the brokers: no lease can be counted
	// twice or missed in it.
	leases, err := m.c.Lease.List(ctx, &gpupoolv1.ListLeasesRequest{
		States: []gpupoolv1.LeaseState{gpupoolv1.LeaseState_LEASE_STATE_GRANTED, gpupoolv1.LeaseState_LEASE_STATE_RELEASING},
	})
	if err != nil {
		return err
	}
	type use struct {
		memory, compute int64
		leases          []string
	}
	used := map[string]*use{}
	for _, l := range leases.GetLeases() {
		for _, s := range l.GetSlices() {
			u := used[s.GetDevice()]
			if u == nil {
				u = &use{}
				used[s.GetDevice()] = u
			}
			if s.GetExclusive() {
				u.memory += capacity[s.GetDevice()]
				u.compute += 100
			} else {
				u.memory += s.GetMemoryMib()
				u.compute += int64(s.GetComputePercent())
			}
			u.leases = append(u.leases, fmt.Sprintf("%s (%s, %s)", l.GetId(), l.GetTenant(), l.GetState()))
		}
	}
	var found []string
	for dev, u := range used {
		if mem, ok := capacity[dev]; ok && (u.memory > mem || u.compute > 100) {
			found = append(found, fmt.Sprintf("device %s (%d MiB): leases hold %d MiB and %d%% compute: %v", dev, mem, u.memory, u.compute, u.leases))
		}
	}
	m.mu.Lock()
	m.samples++
	m.violations = append(m.violations, found...)
	m.mu.Unlock()
	return nil
}

// take returns and forgets what the monitor found since the last take.
func (m *scnCapacityMonitor) take() (samples int, violations []string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	samples, violations = m.samples, m.violations
	m.samples, m.violations = 0, nil
	return samples, violations
}

// scnCDISpec is what the scenarios read of a CDI spec file: the fields of
// tags.cncf.io/container-device-interface/specs-go's Spec that the node
// plugin writes. (That module is not a requirement of this one; its JSON
// field names are the CDI specification's.)
type scnCDISpec struct {
	Version string `json:"cdiVersion"`
	Kind    string `json:"kind"`
	Devices []struct {
		Name           string      `json:"name"`
		ContainerEdits scnCDIEdits `json:"containerEdits"`
	} `json:"devices"`
	ContainerEdits scnCDIEdits `json:"containerEdits"`
}

type scnCDIEdits struct {
	Env    []string `json:"env"`
	Mounts []struct {
		HostPath      string   `json:"hostPath"`
		ContainerPath string   `json:"containerPath"`
		Options       []string `json:"options"`
	} `json:"mounts"`
}

func scnReadCDISpec(path string) (*scnCDISpec, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var spec scnCDISpec
	if err := json.Unmarshal(b, &spec); err != nil {
		return nil, fmt.Errorf("CDI spec %s: %w", path, err)
	}
	return &spec, nil
}

// scnPodCondition is pod's condition of type ct, or nil.
func scnPodCondition(pod *corev1.Pod, ct corev1.PodConditionType) *corev1.PodCondition {
	for i := range pod.Status.Conditions {
		if pod.Status.Conditions[i].Type == ct {
			return &pod.Status.Conditions[i]
		}
	}
	return nil
}

// cdiSpecPath and claimStateDir are where node n's plugin keeps the
// claim with uid (docs/architecture.md: "Node plugin").
func (n *scnNode) cdiSpecPath(uid types.UID) string {
	return filepath.Join(n.cdiDir, driverName+"-"+string(uid)+".json")
}

func (n *scnNode) claimStateDir(uid types.UID) string {
	return filepath.Join(n.stateDir, "claims", string(uid))
}

// fractionalClaim is scenario (a): a pod with a 20Gi, 25% compute claim is
// bound once its claim is Leased=True; the brokers hold a lease of tenant
// k8s for exactly the allocated GPU (the uuid its ResourceSlice publishes),
// 20480 MiB and 25%; the kubelet stand-in prepares the claim, and the CDI
// spec and token file carry that lease.
func (e *scenarioEnv) fractionalClaim(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	e.createPod(t, "frac", scnQuarterTemplate)
	lp := e.waitLeased(t, "frac")
	r, claim, data := lp.result, lp.claim, lp.data
	t.Logf("pod frac on node %s, claim %s: device %s/%s share %v, lease %s", lp.pod.Spec.NodeName, claim.Name, r.Pool, r.Device, scnPtrString(r.ShareID), data.LeaseID)

	for name, want := range map[resourceapi.QualifiedName]string{"memory": "20Gi", "compute": "25"} {
		if got, ok := r.ConsumedCapacity[name]; !ok || got.String() != want {
			t.Errorf("allocation consumes %s %v, want %s", name, got.String(), want)
		}
	}
	devs, err := e.poolDevices(ctx, r.Pool)
	if err != nil {
		t.Fatal(err)
	}
	dev, ok := devs[r.Device]
	if !ok {
		t.Fatalf("device %s is not published in pool %s", r.Device, r.Pool)
	}
	uuid, host := dev.Attributes["uuid"].StringValue, dev.Attributes["host"].StringValue
	if uuid == nil || host == nil || *host != r.Pool {
		t.Fatalf("device %s/%s attributes %v: want uuid, and host %s", r.Pool, r.Device, dev.Attributes, r.Pool)
	}

	l := e.getLease(t, data.LeaseID)
	if l.GetState() != gpupoolv1.LeaseState_LEASE_STATE_GRANTED || l.GetTenant() != scnTenant {
		t.Errorf("lease %s: %s of tenant %q, want granted of %q", l.GetId(), l.GetState(), l.GetTenant(), scnTenant)
	}
	if want := scnRequestID(claim.UID, r); l.GetRequest().GetRequestId() != want {
		t.Errorf("lease %s: request id %q, want %q", l.GetId(), l.GetRequest().GetRequestId(), want)
	}
	if want := fmt.Sprintf("%s/%s %s", claim.Namespace, claim.Name, claim.UID); l.GetHolder() != want {
		t.Errorf("lease %s: holder %q, want %q", l.GetId(), l.GetHolder(), want)
	}
	if ss := l.GetSlices(); len(ss) != 1 {
		t.Errorf("lease %s has %d slices, want 1: %v", l.GetId(), len(ss), ss)
	} else if s := ss[0]; s.GetHost() != r.Pool || s.GetDevice() != *uuid || s.GetMemoryMib() != 20480 || s.GetComputePercent() != 25 || s.GetExclusive() {
		t.Errorf("lease %s slice: host %s device %s %d MiB %d%% exclusive=%t; want host %s device %s (published uuid of %s) 20480 MiB 25%% shared",
			l.GetId(), s.GetHost(), s.GetDevice(), s.GetMemoryMib(), s.GetComputePercent(), s.GetExclusive(), r.Pool, *uuid, r.Device)
	}
	agentHost := e.host(t, r.Pool)
	agent := agentHost.GetAddress()
	if want := (scnLeaseData{LeaseID: l.GetId(), Host: r.Pool, AgentAddress: agent, CertSHA256: agentHost.GetCertSha256(), MemoryMiB: 20480, ComputePercent: 25}); data != want || agent == "" {
		t.Errorf("status.devices data %+v, want %+v", data, want)
	}

	n := e.nodes[lp.pod.Spec.NodeName]
	resp, err := n.kubelet.prepare(ctx, claim)
	if err != nil {
		t.Fatalf("NodePrepareResources: %v", err)
	}
	got := resp.Claims[string(claim.UID)]
	if got == nil || got.Error != "" || len(got.Devices) != 1 {
		t.Fatalf("prepare claim %s: %+v, want one device", claim.Name, got)
	}
	wantCDI := driverName + "/claim=" + string(claim.UID)
	if d := got.Devices[0]; d.PoolName != r.Pool || d.DeviceName != r.Device || !slices.Equal(d.CdiDeviceIds, []string{wantCDI}) || !slices.Equal(d.RequestNames, []string{"gpu"}) {
		t.Errorf("prepared device %s/%s CDI %v requests %v, want %s/%s CDI [%s] requests [gpu]", d.PoolName, d.DeviceName, d.CdiDeviceIds, d.RequestNames, r.Pool, r.Device, wantCDI)
	}

	spec, err := scnReadCDISpec(n.cdiSpecPath(claim.UID))
	if err != nil {
		t.Fatal(err)
	}
	if spec.Version == "" || spec.Kind != driverName+"/claim" || len(spec.Devices) != 1 || spec.Devices[0].Name != string(claim.UID) {
		t.Fatalf("CDI spec: version %q kind %q devices %+v; want kind %s/claim with one device %s", spec.Version, spec.Kind, spec.Devices, driverName, claim.UID)
	}
	edits := spec.Devices[0].ContainerEdits
	env := map[string]string{}
	for _, kv := range edits.Env {
		k, v, _ := strings.Cut(kv, "=")
		env[k] = v
	}
	for k, want := range map[string]string{
		"GPUPOOL_LEASE_ID":        l.GetId(),
		"GPUPOOL_AGENT_ADDR":      agent,
		"GPUPOOL_MEMORY_MIB":      "20480",
		"GPUPOOL_COMPUTE_PERCENT": "25",
		client.TokenFileEnv:       scnContainerTokenFile,
	} {
		if env[k] != want {
			t.Errorf("CDI spec sets %s=%q, want %q (env %v)", k, env[k], want, edits.Env)
		}
	}
	dir := n.claimStateDir(claim.UID)
	if len(edits.Mounts) != 1 || edits.Mounts[0].HostPath != dir || edits.Mounts[0].ContainerPath != scnContainerDir || !slices.Contains(edits.Mounts[0].Options, "ro") {
		t.Errorf("CDI spec mounts %+v, want %s read-only at %s", edits.Mounts, dir, scnContainerDir)
	}
	tf, err := client.ReadTokenFile(filepath.Join(dir, filepath.Base(scnContainerTokenFile)))
	if err != nil {
		t.Fatalf("token file: %v", err)
	}
	if len(tf.Leases) != 1 || tf.Leases[0].LeaseID != l.GetId() || tf.Leases[0].MemoryMiB != 20480 || tf.Leases[0].ComputePercent != 25 {
		t.Errorf("token file leases %+v, want lease %s with 20480 MiB and 25%%", tf.Leases, l.GetId())
	} else if tok := tf.Leases[0].Tokens; len(tok) != 1 || tok[0].GetHost() != r.Pool || tok[0].GetAddress() != agent || tok[0].GetToken() == "" {
		t.Errorf("token file tokens %v, want one token for host %s at %s", tok, r.Pool, agent)
	}
	e.cp.setPodRunning(t, e.ns, lp.pod.Name)
	e.frac = lp
}

func scnPtrString[T ~string](p *T) string {
	if p == nil {
		return "<nil>"
	}
	return string(*p)
}

// unprepareTwice is scenario (e): unpreparing scenario (a)'s claim twice
// succeeds both times, removes the CDI spec and the token directory, and
// leaves the lease to the binder.
func (e *scenarioEnv) unprepareTwice(t *testing.T) {
	if e.frac == nil {
		t.Skip("needs the prepared claim of scenario a")
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	claim := e.frac.claim
	n := e.nodes[e.frac.pod.Spec.NodeName]
	for i := range 2 {
		resp, err := n.kubelet.unprepare(ctx, claim)
		if err != nil {
			t.Fatalf("NodeUnprepareResources #%d: %v", i+1, err)
		}
		if got := resp.Claims[string(claim.UID)]; got == nil || got.Error != "" {
			t.Errorf("unprepare #%d of claim %s: %+v, want success", i+1, claim.Name, got)
		}
		for _, path := range []string{n.cdiSpecPath(claim.UID), n.claimStateDir(claim.UID)} {
			if _, err := os.Stat(path); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("after unprepare #%d: %s: %v, want it gone", i+1, path, err)
			}
		}
	}
	if l := e.getLease(t, e.frac.data.LeaseID); l.GetState() != gpupoolv1.LeaseState_LEASE_STATE_GRANTED {
		t.Errorf("after unprepare the lease %s is %s: the node plugin must leave it to the binder", l.GetId(), l.GetState())
	}
}

// deleteReleases is scenario (c): deleting scenario (a)'s pod and claim
// releases its lease.
func (e *scenarioEnv) deleteReleases(t *testing.T) {
	if e.frac == nil {
		t.Skip("needs the pod of scenario a")
	}
	lp := e.frac
	e.frac = nil
	e.deletePodAndClaim(t, lp.pod.Name, lp.claim.Name)
	l := e.waitLeaseEnded(t, lp.data.LeaseID)
	if l.GetState() != gpupoolv1.LeaseState_LEASE_STATE_RELEASED {
		t.Errorf("lease %s is %s (%s), want released by the binder", l.GetId(), l.GetState(), l.GetReason())
	}
	t.Logf("lease %s %s: %s", l.GetId(), l.GetState(), l.GetReason())
}

// leaseFailedReschedules is scenario (b) with a refused lease: the
// scheduler allocates a claim while the controller is down; the allocated
// host is then exhausted by leases outside Kubernetes; the restarted
// controller's acquire is refused, so the claim shows LeaseFailed with the
// brokers' reason, and the scheduler allocates the other host, where the
// pod gets its lease. The claim never holds a lease on the exhausted
// host, and no GPU is ever over-allocated.
func (e *scenarioEnv) leaseFailedReschedules(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	e.ctrl.stop()
	restarted := false
	defer func() {
		if !restarted {
			e.startController(t)
		}
	}()

	e.createPod(t, "resched", scnQuarterTemplate)
	var claim *resourceapi.ResourceClaim
	var first resourceapi.DeviceRequestAllocationResult
	eventually(t, "claim of pod resched allocated (the binder is down)", scnBind, func(ctx context.Context) error {
		pod, c, err := e.podAndClaim(ctx, "resched")
		if err != nil {
			return err
		}
		if pod.Spec.NodeName != "" {
			return fmt.Errorf("pod bound to %s without a lease", pod.Spec.NodeName)
		}
		if first, err = scnOurResult(c); err != nil {
			return err
		}
		claim = c
		return nil
	})
	exhausted := first.Pool
	t.Logf("claim %s allocated %s/%s share %s while the controller is down", claim.Name, exhausted, first.Device, scnPtrString(first.ShareID))
	w, err := e.cp.Client.ResourceV1().ResourceClaims(e.ns).Watch(ctx, metav1.ListOptions{
		FieldSelector: fields.OneTermEqualSelector("metadata.name", claim.Name).String(), ResourceVersion: claim.ResourceVersion,
	})
	if err != nil {
		t.Fatalf("watch claim %s: %v", claim.Name, err)
	}
	defer w.Stop()

	taken := e.takeRest(t, exhausted)
	// What the brokers say to the binder's request now.
	devs, err := e.poolDevices(ctx, exhausted)
	if err != nil {
		t.Fatal(err)
	}
	uuid := *devs[first.Device].Attributes["uuid"].StringValue
	_, err = e.b.Client.Lease.Acquire(ctx, &gpupoolv1.AcquireRequest{Request: &gpupoolv1.LeaseRequest{
		Count: 1, MemoryMib: 20480, ComputePercent: 25, TtlMs: time.Minute.Milliseconds(),
		Constraints: &gpupoolv1.Constraints{Host: exhausted, Devices: []string{uuid}}, Tenant: scnOtherTenant, Holder: "probe",
	}})
	if status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("a 20480 MiB 25%% lease on exhausted device %s: %v, want ResourceExhausted", uuid, err)
	}
	brokerSays := status.Convert(err).Message()

	e.startController(t)
	restarted = true
	failed := scnWaitClaimCondition(t, w, first, scnConditionLeaseFailed, time.Minute)
	t.Logf("claim %s: LeaseFailed %s: %s", claim.Name, failed.Reason, failed.Message)
	if failed.Reason != codes.ResourceExhausted.String() || failed.Message != brokerSays {
		t.Errorf("LeaseFailed %s: %q; want %s: %q (the brokers' refusal)", failed.Reason, failed.Message, codes.ResourceExhausted, brokerSays)
	}

	lp := e.waitLeased(t, "resched")
	if lp.result.Pool == exhausted {
		t.Errorf("pod rescheduled onto exhausted host %s again", exhausted)
	}
	if l := e.getLease(t, lp.data.LeaseID); len(l.GetSlices()) != 1 || l.GetSlices()[0].GetHost() != lp.result.Pool || l.GetSlices()[0].GetHost() == exhausted {
		t.Errorf("lease %s slices %v, want one on host %s", l.GetId(), l.GetSlices(), lp.result.Pool)
	}
	// Every lease ever made for the claim, ended ones included: only the
	// one on the other host.
	all, err := e.b.Client.Lease.List(ctx, &gpupoolv1.ListLeasesRequest{Tenant: scnTenant, IncludeEnded: true})
	if err != nil {
		t.Fatal(err)
	}
	var mine []string
	for _, l := range all.GetLeases() {
		if strings.HasPrefix(l.GetRequest().GetRequestId(), string(claim.UID)+"/") {
			mine = append(mine, fmt.Sprintf("%s (%s on %v)", l.GetId(), l.GetState(), l.GetSlices()))
		}
	}
	if len(mine) != 1 || !strings.HasPrefix(mine[0], lp.data.LeaseID+" ") {
		t.Errorf("leases of claim %s: %v, want only %s", claim.Name, mine, lp.data.LeaseID)
	}
	t.Logf("pod resched rescheduled onto host %s: lease %s", lp.result.Pool, lp.data.LeaseID)

	e.releaseLeases(t, taken...)
	e.deletePodAndClaim(t, lp.pod.Name, lp.claim.Name)
	e.waitLeaseEnded(t, lp.data.LeaseID)
}

// scnWaitClaimCondition follows the claim watch w until the status of
// result r has condition ct True, and returns it.
func scnWaitClaimCondition(t testing.TB, w watch.Interface, r resourceapi.DeviceRequestAllocationResult, ct string, timeout time.Duration) *metav1.Condition {
	t.Helper()
	deadline := time.After(timeout)
	var seen []string
	for {
		select {
		case <-deadline:
			t.Fatalf("no %s=True on device %s/%s within %s; saw %v", ct, r.Pool, r.Device, timeout, seen)
		case ev, ok := <-w.ResultChan():
			if !ok {
				t.Fatalf("claim watch closed before %s=True on device %s/%s; saw %v", ct, r.Pool, r.Device, seen)
			}
			claim, ok := ev.Object.(*resourceapi.ResourceClaim)
			if !ok {
				t.Fatalf("claim watch: %s %v", ev.Type, ev.Object)
			}
			ds := scnDeviceStatus(claim, r)
			if ds == nil {
				seen = append(seen, fmt.Sprintf("%s allocated=%t", ev.Type, claim.Status.Allocation != nil))
				continue
			}
			if c := meta.FindStatusCondition(ds.Conditions, ct); c != nil && c.Status == metav1.ConditionTrue {
				return c
			}
			seen = append(seen, fmt.Sprintf("%s %v", ev.Type, ds.Conditions))
		}
	}
}

// allHostsExhausted is scenario (b) with nothing left anywhere: once the
// published capacity shows every GPU held outside Kubernetes, a new pod
// stays pending with the scheduler's reason; when the other tenant lets
// go, it is bound and leased.
func (e *scenarioEnv) allHostsExhausted(t *testing.T) {
	var taken []string
	for _, h := range e.b.HostIDs {
		taken = append(taken, e.takeRest(t, h)...)
	}
	eventually(t, "every published GPU busy, with no memory left", 30*time.Second, func(ctx context.Context) error {
		for _, pool := range e.b.HostIDs {
			devs, err := e.poolDevices(ctx, pool)
			if err != nil {
				return err
			}
			for name, d := range devs {
				busy := slices.ContainsFunc(d.Taints, func(t resourceapi.DeviceTaint) bool {
					return t.Key == scnTaintBusy && t.Effect == resourceapi.DeviceTaintEffectNoSchedule
				})
				if mem := d.Capacity["memory"].Value; !busy || !mem.IsZero() {
					return fmt.Errorf("device %s/%s: memory %s, taints %v", pool, name, mem.String(), d.Taints)
				}
			}
		}
		return nil
	})

	e.createPod(t, "starved", scnQuarterTemplate)
	var cond *corev1.PodCondition
	eventually(t, "pod starved unschedulable, with the scheduler's reason", time.Minute, func(ctx context.Context) error {
		pod, claim, err := e.podAndClaim(ctx, "starved")
		if err != nil {
			return err
		}
		if pod.Spec.NodeName != "" {
			t.Fatalf("pod starved bound to %s with every GPU taken", pod.Spec.NodeName)
		}
		// Were the scheduler to allocate from a stale view of the slices,
		// the binder's refusal would deallocate the claim again.
		if claim.Status.Allocation != nil {
			return fmt.Errorf("claim %s allocated %+v, devices status %+v", claim.Name, claim.Status.Allocation.Devices.Results, claim.Status.Devices)
		}
		cond = scnPodCondition(pod, corev1.PodScheduled)
		if cond == nil || cond.Status != corev1.ConditionFalse || cond.Reason != corev1.PodReasonUnschedulable || !strings.Contains(cond.Message, "cannot allocate all claims") {
			return fmt.Errorf("PodScheduled %+v, want False %s saying the claim cannot be allocated", cond, corev1.PodReasonUnschedulable)
		}
		return nil
	})
	t.Logf("pod starved: %s: %s", cond.Reason, cond.Message)

	e.releaseLeases(t, taken...)
	lp := e.waitLeased(t, "starved")
	t.Logf("once the other tenant let go, pod starved got lease %s on %s/%s", lp.data.LeaseID, lp.result.Pool, lp.result.Device)
	e.deletePodAndClaim(t, lp.pod.Name, lp.claim.Name)
	e.waitLeaseEnded(t, lp.data.LeaseID)
}

// leaseDeletedUnderPod is the bad input "a deleted lease under a running
// pod": the lease of a running, prepared pod is released at the brokers
// behind Kubernetes' back. The claim gets Leased=False reason LeaseEnded,
// the pod a Warning event LeaseEnded, and the node plugin no longer
// prepares the claim.
func (e *scenarioEnv) leaseDeletedUnderPod(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	e.createPod(t, "orphaned", scnQuarterTemplate)
	lp := e.waitLeased(t, "orphaned")
	n := e.nodes[lp.pod.Spec.NodeName]
	if resp, err := n.kubelet.prepare(ctx, lp.claim); err != nil || resp.Claims[string(lp.claim.UID)].GetError() != "" {
		t.Fatalf("prepare claim %s: %v %v", lp.claim.Name, err, resp)
	}
	e.cp.setPodRunning(t, e.ns, lp.pod.Name)

	id := lp.data.LeaseID
	if _, err := e.b.Client.Lease.Release(ctx, &gpupoolv1.ReleaseRequest{LeaseId: id, Reason: "released at the brokers by the scenario"}); err != nil {
		t.Fatalf("release lease %s: %v", id, err)
	}
	var leased *metav1.Condition
	eventually(t, "claim "+lp.claim.Name+" Leased=False LeaseEnded", time.Minute, func(ctx context.Context) error {
		claim, err := e.cp.Client.ResourceV1().ResourceClaims(e.ns).Get(ctx, lp.claim.Name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		ds := scnDeviceStatus(claim, lp.result)
		if ds == nil {
			return errors.New("no device status")
		}
		leased = meta.FindStatusCondition(ds.Conditions, scnConditionLeased)
		if leased == nil || leased.Status != metav1.ConditionFalse || leased.Reason != scnReasonLeaseEnded {
			return fmt.Errorf("conditions %v", ds.Conditions)
		}
		return nil
	})
	t.Logf("claim %s: Leased=False %s: %s", lp.claim.Name, leased.Reason, leased.Message)
	if !strings.Contains(leased.Message, id) {
		t.Errorf("Leased=False message %q does not name lease %s", leased.Message, id)
	}
	var ev corev1.Event
	eventually(t, "a Warning event LeaseEnded on pod orphaned", time.Minute, func(ctx context.Context) error {
		list, err := e.cp.Client.CoreV1().Events(e.ns).List(ctx, metav1.ListOptions{FieldSelector: fields.Set{
			"involvedObject.kind": "Pod", "involvedObject.name": lp.pod.Name, "reason": scnReasonLeaseEnded,
		}.String()})
		if err != nil {
			return err
		}
		for _, item := range list.Items {
			if item.Type == corev1.EventTypeWarning && item.InvolvedObject.UID == lp.pod.UID {
				ev = item
				return nil
			}
		}
		return fmt.Errorf("%d LeaseEnded events, none a Warning for this pod", len(list.Items))
	})
	t.Logf("event on pod orphaned: %s %s: %s", ev.Type, ev.Reason, ev.Message)
	if !strings.Contains(ev.Message, id) {
		t.Errorf("event message %q does not name lease %s", ev.Message, id)
	}
	// A kubelet restarting the pod would now be told why it cannot.
	claim, err := e.cp.Client.ResourceV1().ResourceClaims(e.ns).Get(ctx, lp.claim.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	resp, err := n.kubelet.prepare(ctx, claim)
	if err != nil {
		t.Fatalf("NodePrepareResources: %v", err)
	}
	if got := resp.Claims[string(claim.UID)]; got == nil || !strings.Contains(got.Error, scnReasonLeaseEnded) {
		t.Errorf("prepare after the lease ended: %+v, want an error saying %s", got, scnReasonLeaseEnded)
	}

	if resp, err := n.kubelet.unprepare(ctx, claim); err != nil || resp.Claims[string(claim.UID)].GetError() != "" {
		t.Errorf("unprepare claim %s: %v %v", claim.Name, err, resp)
	}
	e.deletePodAndClaim(t, lp.pod.Name, lp.claim.Name)
}

// drainEvicts is scenario (d): of two running pods, one pinned (by a CEL
// selector on the host attribute) to each pool host, `gpupool host drain`
// of the first one's host taints that host's devices NoExecute
// gpu.gpupool.dev/draining, and no other host's; the device-taint-eviction
// controller evicts the pod there and leaves the other one alone.
func (e *scenarioEnv) drainEvicts(t *testing.T) {
	ctx := context.Background()
	host, other := e.b.HostIDs[0], e.b.HostIDs[1]
	for pod, pool := range map[string]string{"drained": host, "bystander": other} {
		tmpl := scnPinnedTemplate("quarter-on-"+pool, pool)
		if _, err := e.cp.Client.ResourceV1().ResourceClaimTemplates(e.ns).Create(ctx, tmpl, metav1.CreateOptions{FieldValidation: "Strict"}); err != nil {
			t.Fatalf("create ResourceClaimTemplate %s: %v", tmpl.Name, err)
		}
		e.createPod(t, pod, tmpl.Name)
	}
	lp := e.waitLeased(t, "drained")
	bystander := e.waitLeased(t, "bystander")
	if lp.result.Pool != host || bystander.result.Pool != other {
		t.Fatalf("pods on %s and %s, want %s and %s as their claims' selectors say", lp.result.Pool, bystander.result.Pool, host, other)
	}
	for _, p := range []*scnLeasedPod{lp, bystander} {
		e.cp.setPodRunning(t, e.ns, p.pod.Name)
	}

	gpupool := func(args ...string) string {
		cmd := exec.Command(gpupoolBinary(t), append(args, "--addr", e.b.Addrs)...)
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("gpupool %s: %v\n%s", strings.Join(args, " "), err, out)
		}
		return strings.TrimSpace(string(out))
	}
	t.Logf("gpupool host drain: %s", gpupool("host", "drain", host, "--reason", "scenario d"))
	t.Cleanup(func() { gpupool("host", "drain", host, "--cancel") })

	eventually(t, "devices of host "+host+" tainted NoExecute "+scnTaintDraining, time.Minute, func(ctx context.Context) error {
		for _, pool := range e.b.HostIDs {
			devs, err := e.poolDevices(ctx, pool)
			if err != nil {
				return err
			}
			for name, d := range devs {
				draining := slices.ContainsFunc(d.Taints, func(t resourceapi.DeviceTaint) bool {
					return t.Key == scnTaintDraining && t.Effect == resourceapi.DeviceTaintEffectNoExecute
				})
				if draining != (pool == host) {
					return fmt.Errorf("device %s/%s taints %v", pool, name, d.Taints)
				}
			}
		}
		return nil
	})
	var evicted *corev1.PodCondition
	eventually(t, "pod drained evicted", time.Minute, func(ctx context.Context) error {
		pod, err := e.cp.Client.CoreV1().Pods(e.ns).Get(ctx, lp.pod.Name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		evicted = scnPodCondition(pod, corev1.DisruptionTarget)
		if pod.DeletionTimestamp == nil || evicted == nil || evicted.Status != corev1.ConditionTrue {
			return fmt.Errorf("deletionTimestamp %v, DisruptionTarget %+v", pod.DeletionTimestamp, evicted)
		}
		return nil
	})
	t.Logf("pod drained: DisruptionTarget %s: %s", evicted.Reason, evicted.Message)
	// The eviction controller has handled the taints: the pod on the
	// other host stays.
	pod, err := e.cp.Client.CoreV1().Pods(e.ns).Get(ctx, bystander.pod.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if pod.DeletionTimestamp != nil || scnPodCondition(pod, corev1.DisruptionTarget) != nil {
		t.Errorf("pod bystander on host %s, which is not draining, is being evicted: %v", other, pod.Status.Conditions)
	}

	for _, p := range []*scnLeasedPod{lp, bystander} {
		e.deletePodAndClaim(t, p.pod.Name, p.claim.Name)
		e.waitLeaseEnded(t, p.data.LeaseID)
	}
}

// scnPinnedTemplate is fractionalTemplate(name, "20Gi", "25") restricted to
// the GPUs of pool host.
func scnPinnedTemplate(name, host string) *resourceapi.ResourceClaimTemplate {
	tmpl := fractionalTemplate(name, "20Gi", "25")
	tmpl.Spec.Spec.Devices.Requests[0].Exactly.Selectors = []resourceapi.DeviceSelector{{
		CEL: &resourceapi.CELDeviceSelector{Expression: fmt.Sprintf("device.attributes[%q].host == %q", driverName, host)},
	}}
	return tmpl
}

// tooMuchMemory is the bad input "more than a device has": the pod asking
// for 100Gi of an 80GB GPU, created at setup, was never bound through all
// the other scenarios, its claim never allocated, and its PodScheduled
// condition says why.
func (e *scenarioEnv) tooMuchMemory(t *testing.T) {
	var cond *corev1.PodCondition
	eventually(t, "pod "+e.tooBig+" unschedulable, with a reason", time.Minute, func(ctx context.Context) error {
		pod, claim, err := e.podAndClaim(ctx, e.tooBig)
		if err != nil {
			return err
		}
		if pod.Spec.NodeName != "" || claim.Status.Allocation != nil {
			t.Fatalf("pod bound to %q, claim allocated %v: a 100Gi claim fits no 80GB GPU", pod.Spec.NodeName, claim.Status.Allocation)
		}
		cond = scnPodCondition(pod, corev1.PodScheduled)
		if cond == nil || cond.Status != corev1.ConditionFalse || cond.Reason != corev1.PodReasonUnschedulable || cond.Message == "" {
			return fmt.Errorf("PodScheduled: %+v", cond)
		}
		return nil
	})
	t.Logf("pod %s: %s: %s", e.tooBig, cond.Reason, cond.Message)
	if !strings.Contains(cond.Message, "cannot allocate all claims") {
		t.Errorf("PodScheduled message %q does not say the claim cannot be allocated", cond.Message)
	}
}
