package k8s

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// TestSmoke checks the harness itself, without our controller or node
// plugin: two pods whose claims ask for a quarter of one hand-published
// device both land on a fake node and share the device; a kubelet stand-in
// prepares and unprepares their claims through a minimal kubeletplugin
// driver; and the dev broker cluster comes up with its hosts.
func TestSmoke(t *testing.T) {
	cp := sharedControlPlane(t)
	ns := cp.newNamespace(t)
	cp.ensureDeviceClass(t)
	ctx := context.Background()

	const nodeLabel = "smoke.gpupool.dev/node"
	node := cp.addNode(t, "smoke-node", map[string]string{nodeLabel: "true"})
	slice := deviceSlice("smoke-p1", "p1", nodeLabel)
	if _, err := cp.Client.ResourceV1().ResourceSlices().Create(ctx, slice, metav1.CreateOptions{FieldValidation: "Strict"}); err != nil {
		t.Fatalf("create ResourceSlice: %v", err)
	}
	t.Cleanup(func() {
		if err := cp.Client.ResourceV1().ResourceSlices().Delete(context.Background(), slice.Name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			t.Errorf("delete ResourceSlice %s: %v", slice.Name, err)
		}
	})
	tmpl := fractionalTemplate("quarter", "20Gi", "25")
	if _, err := cp.Client.ResourceV1().ResourceClaimTemplates(ns).Create(ctx, tmpl, metav1.CreateOptions{FieldValidation: "Strict"}); err != nil {
		t.Fatalf("create ResourceClaimTemplate: %v", err)
	}
	for _, name := range []string{"pod-a", "pod-b"} {
		if _, err := cp.Client.CoreV1().Pods(ns).Create(ctx, podWithClaim(name, tmpl.Name), metav1.CreateOptions{FieldValidation: "Strict"}); err != nil {
			t.Fatalf("create pod %s: %v", name, err)
		}
	}

	claims := map[string]*resourceapi.ResourceClaim{}
	eventually(t, "both pods scheduled with allocated claims", time.Minute, func(ctx context.Context) error {
		for _, name := range []string{"pod-a", "pod-b"} {
			pod, err := cp.Client.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
			if err != nil {
				return err
			}
			if pod.Spec.NodeName == "" {
				return fmt.Errorf("pod %s not scheduled: %v", name, pod.Status.Conditions)
			}
			claim, err := cp.podClaim(ctx, pod, "gpu")
			if err != nil {
				return err
			}
			if claim.Status.Allocation == nil {
				return fmt.Errorf("claim %s of pod %s not allocated", claim.Name, name)
			}
			claims[name] = claim
		}
		return nil
	})

	var shares []types.UID
	for name, claim := range claims {
		pod, err := cp.Client.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if pod.Spec.NodeName != node.Name {
			t.Errorf("pod %s on node %q, want %q", name, pod.Spec.NodeName, node.Name)
		}
		results := claim.Status.Allocation.Devices.Results
		if len(results) != 1 {
			t.Fatalf("claim %s: %d allocated devices, want 1: %+v", claim.Name, len(results), results)
		}
		r := results[0]
		if r.Driver != driverName || r.Pool != "p1" || r.Device != "gpu-0" {
			t.Errorf("claim %s got %s/%s/%s, want %s/p1/gpu-0", claim.Name, r.Driver, r.Pool, r.Device, driverName)
		}
		for capName, want := range map[resourceapi.QualifiedName]string{"memory": "20Gi", "compute": "25"} {
			if got := r.ConsumedCapacity[capName]; got.Cmp(resource.MustParse(want)) != 0 {
				t.Errorf("claim %s consumes %s %s, want %s", claim.Name, got.String(), capName, want)
			}
		}
		if r.ShareID == nil {
			t.Errorf("claim %s has no share id on a device that allows multiple allocations", claim.Name)
		} else {
			shares = append(shares, *r.ShareID)
		}
	}
	if len(shares) == 2 && shares[0] == shares[1] {
		t.Errorf("both claims got share id %s, want distinct shares", shares[0])
	}

	t.Run("kubelet stand-in prepares through kubeletplugin", func(t *testing.T) {
		// kubeletplugin creates its sockets but not their directories.
		registry, pluginDir := kubeletDirs(t)
		plugin, err := kubeletplugin.Start(klog.NewContext(context.Background(), klog.Background()), cdiPlugin{},
			kubeletplugin.DriverName(driverName), kubeletplugin.KubeClient(cp.Client), kubeletplugin.NodeName(node.Name),
			kubeletplugin.RegistrarDirectoryPath(registry), kubeletplugin.PluginDataDirectoryPath(pluginDir))
		if err != nil {
			t.Fatalf("start kubeletplugin: %v", err)
		}
		t.Cleanup(plugin.Stop)
		k := newKubelet(t, node.Name, registry)

		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		resp, err := k.prepare(ctx, claims["pod-a"], claims["pod-b"])
		if err != nil {
			t.Fatalf("NodePrepareResources: %v", err)
		}
		for _, claim := range claims {
			got := resp.Claims[string(claim.UID)]
			if got == nil || got.Error != "" || len(got.Devices) != 1 {
				t.Fatalf("prepare %s: got %+v, want one device", claim.Name, got)
			}
			want := []string{cdiDeviceID(claim.UID)}
			if d := got.Devices[0]; d.PoolName != "p1" || d.DeviceName != "gpu-0" || !slices.Equal(d.CdiDeviceIds, want) {
				t.Errorf("prepare %s: got device %s/%s CDI %v, want p1/gpu-0 CDI %v", claim.Name, d.PoolName, d.DeviceName, d.CdiDeviceIds, want)
			}
		}
		for range 2 {
			resp, err := k.unprepare(ctx, claims["pod-a"], claims["pod-b"])
			if err != nil {
				t.Fatalf("NodeUnprepareResources: %v", err)
			}
			for _, claim := range claims {
				if got := resp.Claims[string(claim.UID)]; got == nil || got.Error != "" {
					t.Errorf("unprepare %s: got %+v, want success", claim.Name, got)
				}
			}
		}
	})

	t.Run("configFor is held to RBAC", func(t *testing.T) {
		const user = "system:serviceaccount:smoke:reader"
		reader, err := kubernetes.NewForConfig(cp.configFor(user, "system:serviceaccounts", "system:serviceaccounts:smoke"))
		if err != nil {
			t.Fatal(err)
		}
		ctx := context.Background()
		if _, err := reader.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{}); !apierrors.IsForbidden(err) {
			t.Fatalf("list ResourceSlices as %s with no role: got %v, want Forbidden", user, err)
		}
		role := &rbacv1.ClusterRole{
			ObjectMeta: metav1.ObjectMeta{Name: "smoke-slice-reader"},
			Rules:      []rbacv1.PolicyRule{{APIGroups: []string{"resource.k8s.io"}, Resources: []string{"resourceslices"}, Verbs: []string{"list"}}},
		}
		binding := &rbacv1.ClusterRoleBinding{
			ObjectMeta: metav1.ObjectMeta{Name: "smoke-slice-reader"},
			RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: role.Name},
			Subjects:   []rbacv1.Subject{{Kind: rbacv1.ServiceAccountKind, Namespace: "smoke", Name: "reader"}},
		}
		if _, err := cp.Client.RbacV1().ClusterRoles().Create(ctx, role, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			cp.Client.RbacV1().ClusterRoles().Delete(context.Background(), role.Name, metav1.DeleteOptions{})
		})
		if _, err := cp.Client.RbacV1().ClusterRoleBindings().Create(ctx, binding, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			cp.Client.RbacV1().ClusterRoleBindings().Delete(context.Background(), binding.Name, metav1.DeleteOptions{})
		})
		eventually(t, "list ResourceSlices as "+user+" once bound", 30*time.Second, func(ctx context.Context) error {
			_, err := reader.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{})
			return err
		})
	})

	t.Run("broker cluster comes up", func(t *testing.T) {
		b := startBrokers(t, 2)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		resp, err := b.Client.Pool.ListHosts(ctx, &gpupoolv1.ListHostsRequest{})
		if err != nil {
			t.Fatal(err)
		}
		var ids []string
		for _, h := range resp.Hosts {
			ids = append(ids, h.Id)
			if len(h.Devices) != 2 {
				t.Errorf("host %s has %d devices, want 2 (%s)", h.Id, len(h.Devices), agentGPUs)
			}
		}
		slices.Sort(ids)
		if !slices.Equal(ids, b.HostIDs) {
			t.Errorf("hosts %v, want %v", ids, b.HostIDs)
		}
	})
}

// deviceSlice is a ResourceSlice of our driver with one pool of one device
// shaped as the publisher shapes a simulated A100 80GB (but without binding
// conditions, since no binder runs), reachable from nodes labelled
// nodeLabel=true.
func deviceSlice(name, pool, nodeLabel string) *resourceapi.ResourceSlice {
	return &resourceapi.ResourceSlice{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: resourceapi.ResourceSliceSpec{
			Driver: driverName,
			Pool:   resourceapi.ResourcePool{Name: pool, Generation: 1, ResourceSliceCount: 1},
			NodeSelector: &corev1.NodeSelector{NodeSelectorTerms: []corev1.NodeSelectorTerm{{
				MatchExpressions: []corev1.NodeSelectorRequirement{{Key: nodeLabel, Operator: corev1.NodeSelectorOpIn, Values: []string{"true"}}},
			}}},
			Devices: []resourceapi.Device{{
				Name: "gpu-0",
				Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
					"model": {StringValue: ptr.To("A100-80GB")},
					"uuid":  {StringValue: ptr.To("GPU-00000000-0000-0000-0000-000000000000")},
					"host":  {StringValue: ptr.To(pool)},
				},
				Capacity: map[resourceapi.QualifiedName]resourceapi.DeviceCapacity{
					"memory": {Value: resource.MustParse("80Gi"), RequestPolicy: &resourceapi.CapacityRequestPolicy{
						Default:    ptr.To(resource.MustParse("80Gi")),
						ValidRange: &resourceapi.CapacityRequestPolicyRange{Min: ptr.To(resource.MustParse("1Mi")), Step: ptr.To(resource.MustParse("1Mi"))},
					}},
					"compute": {Value: resource.MustParse("100"), RequestPolicy: &resourceapi.CapacityRequestPolicy{
						Default:    ptr.To(resource.MustParse("100")),
						ValidRange: &resourceapi.CapacityRequestPolicyRange{Min: ptr.To(resource.MustParse("1")), Max: ptr.To(resource.MustParse("100")), Step: ptr.To(resource.MustParse("1"))},
					}},
				},
				AllowMultipleAllocations: ptr.To(true),
			}},
		},
	}
}

// cdiPlugin is the least kubeletplugin driver: each allocated device of
// ours becomes CDI device gpu.gpupool.dev/claim=<claim uid>.
type cdiPlugin struct{}

func cdiDeviceID(uid types.UID) string { return driverName + "/claim=" + string(uid) }

func (cdiPlugin) PrepareResourceClaims(ctx context.Context, claims []*resourceapi.ResourceClaim) (map[types.UID]kubeletplugin.PrepareResult, error) {
	out := map[types.UID]kubeletplugin.PrepareResult{}
	for _, c := range claims {
		var res kubeletplugin.PrepareResult
		for _, r := range c.Status.Allocation.Devices.Results {
			if r.Driver != driverName {
				continue
			}
			res.Devices = append(res.Devices, kubeletplugin.Device{
				Requests: []string{r.Request}, PoolName: r.Pool, DeviceName: r.Device, ShareID: r.ShareID,
				CDIDeviceIDs: []string{cdiDeviceID(c.UID)},
			})
		}
		out[c.UID] = res
	}
	return out, nil
}

func (cdiPlugin) UnprepareResourceClaims(ctx context.Context, claims []kubeletplugin.NamespacedObject) (map[types.UID]error, error) {
	out := map[types.UID]error{}
	for _, c := range claims {
		out[c.UID] = nil
	}
	return out, nil
}

func (cdiPlugin) HandleError(ctx context.Context, err error, msg string) {
	klog.FromContext(ctx).Error(err, msg)
}
