package k8s

import (
	"context"
	"fmt"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
)

// driverName is our DRA driver's name, and that of its DeviceClass.
const driverName = "gpu.gpupool.dev"

// addNode creates a Ready node that no kubelet backs, with labels plus
// kubernetes.io/hostname, room for 110 pods, 32 CPUs and 128 GiB, and no
// taints; the scheduler binds pods to it. It is deleted when t ends.
func (cp *controlPlane) addNode(t testing.TB, name string, labels map[string]string) *corev1.Node {
	t.Helper()
	ctx := context.Background()
	nodes := cp.Client.CoreV1().Nodes()
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{corev1.LabelHostname: name}}}
	for k, v := range labels {
		node.Labels[k] = v
	}
	node, err := nodes.Create(ctx, node, metav1.CreateOptions{FieldValidation: "Strict"})
	if err != nil {
		t.Fatalf("create node %s: %v", name, err)
	}
	t.Cleanup(func() {
		if err := nodes.Delete(context.Background(), name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			t.Errorf("delete node %s: %v", name, err)
		}
	})
	room := corev1.ResourceList{
		corev1.ResourceCPU:    resource.MustParse("32"),
		corev1.ResourceMemory: resource.MustParse("128Gi"),
		corev1.ResourcePods:   resource.MustParse("110"),
	}
	now := metav1.Now()
	node.Status = corev1.NodeStatus{
		Capacity:    room,
		Allocatable: room,
		Phase:       corev1.NodeRunning,
		Conditions: []corev1.NodeCondition{{
			Type: corev1.NodeReady, Status: corev1.ConditionTrue, Reason: "KubeletReady",
			LastHeartbeatTime: now, LastTransitionTime: now,
		}},
	}
	if node, err = nodes.UpdateStatus(ctx, node, metav1.UpdateOptions{}); err != nil {
		t.Fatalf("make node %s ready: %v", name, err)
	}
	// The TaintNodesByCondition admission plugin gave the new node
	// node.kubernetes.io/not-ready:NoSchedule; a kubelet would lift it.
	node.Spec.Taints = nil
	if node, err = nodes.Update(ctx, node, metav1.UpdateOptions{}); err != nil {
		t.Fatalf("remove taints of node %s: %v", name, err)
	}
	return node
}

// setPodRunning does what a kubelet does once a pod's containers started:
// phase Running, Ready, a start time and a running status per container.
func (cp *controlPlane) setPodRunning(t testing.TB, namespace, name string) *corev1.Pod {
	t.Helper()
	ctx := context.Background()
	pods := cp.Client.CoreV1().Pods(namespace)
	pod, err := pods.Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		t.Fatalf("get pod %s/%s: %v", namespace, name, err)
	}
	if pod.Spec.NodeName == "" {
		t.Fatalf("pod %s/%s is not scheduled: a kubelet runs only pods bound to its node", namespace, name)
	}
	now := metav1.Now()
	pod.Status.Phase = corev1.PodRunning
	pod.Status.StartTime = &now
	pod.Status.Conditions = []corev1.PodCondition{
		{Type: corev1.PodScheduled, Status: corev1.ConditionTrue, LastTransitionTime: now},
		{Type: corev1.PodInitialized, Status: corev1.ConditionTrue, LastTransitionTime: now},
		{Type: corev1.ContainersReady, Status: corev1.ConditionTrue, LastTransitionTime: now},
		{Type: corev1.PodReady, Status: corev1.ConditionTrue, LastTransitionTime: now},
	}
	pod.Status.ContainerStatuses = nil
	for _, c := range pod.Spec.Containers {
		pod.Status.ContainerStatuses = append(pod.Status.ContainerStatuses, corev1.ContainerStatus{
			Name: c.Name, Image: c.Image, ImageID: c.Image, Ready: true, Started: ptr.To(true),
			State: corev1.ContainerState{Running: &corev1.ContainerStateRunning{StartedAt: now}},
		})
	}
	if pod, err = pods.UpdateStatus(ctx, pod, metav1.UpdateOptions{}); err != nil {
		t.Fatalf("set pod %s/%s running: %v", namespace, name, err)
	}
	return pod
}

// finishPod does what a kubelet does last for a pod on its node: delete it
// with no grace period. A pod that was deleted (or evicted) on a node stays
// Terminating until then, since no kubelet stops its containers.
func (cp *controlPlane) finishPod(t testing.TB, namespace, name string) {
	t.Helper()
	err := cp.Client.CoreV1().Pods(namespace).Delete(context.Background(), name, metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0)})
	if err != nil && !apierrors.IsNotFound(err) {
		t.Fatalf("finish pod %s/%s: %v", namespace, name, err)
	}
}

// extendedResourceName is the extended resource of the DeviceClass
// gpu.gpupool.dev, as the chart declares it.
const extendedResourceName = driverName + "/gpu"

// ensureDeviceClass creates the DeviceClass gpu.gpupool.dev (all devices of
// our driver, and the extended resource gpu.gpupool.dev/gpu) unless it
// exists. It is shared by all tests and never deleted.
func (cp *controlPlane) ensureDeviceClass(t testing.TB) {
	t.Helper()
	class := &resourceapi.DeviceClass{
		ObjectMeta: metav1.ObjectMeta{Name: driverName},
		Spec: resourceapi.DeviceClassSpec{Selectors: []resourceapi.DeviceSelector{{
			CEL: &resourceapi.CELDeviceSelector{Expression: fmt.Sprintf("device.driver == %q", driverName)},
		}}, ExtendedResourceName: ptr.To(extendedResourceName)},
	}
	_, err := cp.Client.ResourceV1().DeviceClasses().Create(context.Background(), class, metav1.CreateOptions{FieldValidation: "Strict"})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatalf("create DeviceClass %s: %v", driverName, err)
	}
}

// waitForPools waits (up to a minute) until our driver's ResourceSlices
// publish every one of pools completely: pods created before the publisher
// has published are found unschedulable and retried only after a backoff.
func (cp *controlPlane) waitForPools(t testing.TB, pools ...string) {
	t.Helper()
	eventually(t, fmt.Sprintf("ResourceSlices of pools %v", pools), time.Minute, func(ctx context.Context) error {
		list, err := cp.Client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{
			FieldSelector: resourceapi.ResourceSliceSelectorDriver + "=" + driverName,
		})
		if err != nil {
			return err
		}
		for _, pool := range pools {
			gen, count, want := int64(-1), 0, int64(0)
			for _, slice := range list.Items {
				switch p := slice.Spec.Pool; {
				case p.Name != pool || p.Generation < gen:
				case p.Generation > gen:
					gen, count, want = p.Generation, 1, p.ResourceSliceCount
				default:
					count++
				}
			}
			if gen < 0 {
				return fmt.Errorf("pool %s: no ResourceSlice yet", pool)
			}
			if int64(count) < want {
				return fmt.Errorf("pool %s generation %d: %d of %d ResourceSlices", pool, gen, count, want)
			}
		}
		return nil
	})
}

// fractionalTemplate is a ResourceClaimTemplate with one request "gpu" for
// one device of class gpu.gpupool.dev with the given memory and compute.
func fractionalTemplate(name, memory, compute string) *resourceapi.ResourceClaimTemplate {
	return &resourceapi.ResourceClaimTemplate{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: resourceapi.ResourceClaimTemplateSpec{Spec: resourceapi.ResourceClaimSpec{
			Devices: resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{{
				Name: "gpu",
				Exactly: &resourceapi.ExactDeviceRequest{
					DeviceClassName: driverName,
					Capacity: &resourceapi.CapacityRequirements{Requests: map[resourceapi.QualifiedName]resource.Quantity{
						"memory":  resource.MustParse(memory),
						"compute": resource.MustParse(compute),
					}},
				},
			}}},
		}},
	}
}

// podWithClaim is a pod whose one container uses claim "gpu", made from
// the ResourceClaimTemplate template.
func podWithClaim(name, template string) *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: corev1.PodSpec{
			Containers: []corev1.Container{{
				Name: "main", Image: "registry.k8s.io/pause:3.10",
				Resources: corev1.ResourceRequirements{Claims: []corev1.ResourceClaim{{Name: "gpu"}}},
			}},
			ResourceClaims: []corev1.PodResourceClaim{{Name: "gpu", ResourceClaimTemplateName: &template}},
		},
	}
}

// podClaim returns the ResourceClaim behind the pod's claim ref, once the
// resourceclaim controller has made it.
func (cp *controlPlane) podClaim(ctx context.Context, pod *corev1.Pod, ref string) (*resourceapi.ResourceClaim, error) {
	for _, s := range pod.Status.ResourceClaimStatuses {
		if s.Name == ref && s.ResourceClaimName != nil {
			return cp.Client.ResourceV1().ResourceClaims(pod.Namespace).Get(ctx, *s.ResourceClaimName, metav1.GetOptions{})
		}
	}
	return nil, fmt.Errorf("pod %s has no ResourceClaim for %q yet", pod.Name, ref)
}
