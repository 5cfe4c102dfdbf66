package k8s

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/types"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
)

const (
	// rkNodeLabel marks the real kubelet's node (its --node-labels), and is
	// the controller's --node-selector.
	rkNodeLabel = "realkubelet.gpupool.dev/node"
	// rkFailedPrepare is the reason of the kubelet's event when
	// NodePrepareResources failed.
	rkFailedPrepare = "FailedPrepareDynamicResources"
)

// TestRealKubelet runs our node plugin under the real kubelet: the dev
// broker cluster with one simulated pool host, `gpupool k8s-controller`,
// and one node whose kubelet (built from k8s.io/kubernetes) runs on
// criRecorder, with `gpupool k8s-node-plugin` registered to it through its
// plugin registration directory. The subtests run in order on that node:
//
//   - registration: the kubelet's plugin manager registers the plugin;
//   - prepare: a pod with a fractional claim runs; the kubelet called
//     NodePrepareResources and gave the container runtime the claim's CDI
//     device id; the plugin wrote the CDI spec;
//   - unprepare: deleting the pod makes the kubelet stop it, call
//     NodeUnprepareResources (spec and state gone) and only then delete the
//     pod; the lease is released once the claim is;
//   - prepare retried across a kubelet restart: with the plugin down, the
//     kubelet fails to prepare a new pod's claim and retries; it is killed
//     in that state (the claim in its checkpoint, not prepared), the plugin
//     comes back, the kubelet starts again and prepares the claim: the pod
//     runs with its CDI device;
//   - unprepare retried: with the plugin down, a deleted pod's containers
//     stop but the pod stays until the plugin is back and its claim
//     unprepared.
func TestRealKubelet(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("the real kubelet needs root (a mount namespace of its own, cgroups, its root directory); run as root")
	}
	start := time.Now()
	cp := sharedControlPlane(t)
	cp.ensureDeviceClass(t)
	gpupoolBinary(t)
	kubeletBinary(t)
	ctx := context.Background()
	e := &scenarioEnv{t: t, cp: cp, ns: cp.newNamespace(t), nodes: map[string]*scnNode{}}
	e.b = startBrokers(t, 1)
	t.Cleanup(func() { e.deleteSlices(t) })
	startGpupool(t, "controller", "k8s-controller", "--addr", e.b.Addrs, "--kubeconfig", cp.Kubeconfig,
		"--leader-elect=false", "--node-selector", rkNodeLabel+"=true", "--log-level", "debug")

	cri := startCRI(t)
	k := startRealKubelet(t, cp, cri, "rk-node-1", map[string]string{rkNodeLabel: "true"})
	n := &scnNode{name: k.Node, registry: k.Registry, stateDir: filepath.Join(t.TempDir(), "state"), cdiDir: filepath.Join(t.TempDir(), "cdi")}
	e.nodes[n.name] = n
	pluginStarts := 0
	startPlugin := func() {
		pluginStarts++
		n.plugin = startGpupool(t, fmt.Sprintf("node-plugin-%d", pluginStarts), "k8s-node-plugin",
			"--addr", e.b.Addrs, "--node-name", n.name, "--kubeconfig", cp.Kubeconfig,
			"--state-dir", n.stateDir, "--cdi-dir", n.cdiDir, "--plugin-dir", k.PluginDir, "--registrar-dir", k.Registry,
			"--log-level", "debug")
	}
	startPlugin()
	cp.waitForPools(t, e.b.HostIDs...)
	if _, err := cp.Client.ResourceV1().ResourceClaimTemplates(e.ns).Create(ctx, fractionalTemplate(scnQuarterTemplate, "20Gi", "25"), metav1.CreateOptions{FieldValidation: "Strict"}); err != nil {
		t.Fatalf("create ResourceClaimTemplate: %v", err)
	}
	t.Logf("real kubelet setup ready in %s", time.Since(start).Round(time.Millisecond))

	// registered is the kubelet's count of our plugin's registration
	// socket in its actual state.
	regMetric := fmt.Sprintf(`plugin_manager_total_plugins{socket_path=%q,state="actual_state_of_world"}`,
		filepath.Join(k.Registry, driverName+"-reg.sock"))
	waitRegistered := func(t *testing.T) {
		t.Helper()
		eventually(t, "the kubelet registers the node plugin", time.Minute, func(ctx context.Context) error {
			v, err := k.metric(ctx, regMetric)
			if err == nil && v != 1 {
				err = fmt.Errorf("%s %g, want 1", regMetric, v)
			}
			return err
		})
	}

	var claimA *resourceapi.ResourceClaim
	var leaseA string
	for _, sc := range []struct {
		name string
		run  func(t *testing.T)
	}{
		{"registration", waitRegistered},
		{"prepare_passes_CDI_ids_to_the_runtime", func(t *testing.T) {
			e.createPod(t, "pod-a", scnQuarterTemplate)
			lp := e.waitLeased(t, "pod-a")
			claimA, leaseA = lp.claim, lp.data.LeaseID
			e.rkWaitRunning(t, k, "pod-a")
			rkCheckCreated(t, cri, e.ns, "pod-a", claimA.UID)
			if _, err := os.Stat(n.cdiSpecPath(claimA.UID)); err != nil {
				t.Errorf("CDI spec of claim %s: %v", claimA.Name, err)
			}
			if _, err := os.Stat(filepath.Join(n.claimStateDir(claimA.UID), "token.json")); err != nil {
				t.Errorf("token file of claim %s: %v", claimA.Name, err)
			}
		}},
		{"delete_pod_unprepares", func(t *testing.T) {
			if claimA == nil {
				t.Skip("no pod from the prepare subtest")
			}
			e.rkDeleteAndWaitGone(t, "pod-a")
			rkCheckUnprepared(t, n, claimA.UID)
			// The resourceclaim controller deletes the pod's generated
			// claim; the binder then releases the lease.
			e.waitLeaseEnded(t, leaseA)
		}},
		{"prepare_retried_across_a_kubelet_restart", func(t *testing.T) {
			n.plugin.stop()
			e.createPod(t, "pod-b", scnQuarterTemplate)
			lp := e.waitLeased(t, "pod-b")
			// The kubelet tries, fails (the plugin does not answer) and
			// tries again.
			e.rkWaitFailedPrepares(t, "pod-b", 2)
			if c := cri.createdFor(e.ns, "pod-b"); len(c) > 0 {
				t.Fatalf("containers of pod-b created without their claim prepared: %+v", c)
			}
			k.kill()
			startPlugin()
			k.start()
			waitRegistered(t)
			e.rkWaitRunning(t, k, "pod-b")
			rkCheckCreated(t, cri, e.ns, "pod-b", lp.claim.UID)
			if _, err := os.Stat(n.cdiSpecPath(lp.claim.UID)); err != nil {
				t.Errorf("CDI spec of claim %s: %v", lp.claim.Name, err)
			}
		}},
		{"unprepare_retried_until_the_plugin_is_back", func(t *testing.T) {
			_, claim, err := e.podAndClaim(ctx, "pod-b")
			if err != nil {
				t.Fatalf("pod-b of the previous subtest: %v", err)
			}
			n.plugin.stop()
			if err := cp.Client.CoreV1().Pods(e.ns).Delete(ctx, "pod-b", metav1.DeleteOptions{}); err != nil {
				t.Fatal(err)
			}
			// The kubelet stops the pod, then fails to unprepare its claim.
			eventually(t, "pod-b's sandbox stopped", time.Minute, func(context.Context) error {
				states := cri.sandboxStates(e.ns, "pod-b")
				if len(states) == 0 || slices.Contains(states, runtimeapi.PodSandboxState_SANDBOX_READY) {
					return fmt.Errorf("sandboxes %v", states)
				}
				return nil
			})
			if _, err := cp.Client.CoreV1().Pods(e.ns).Get(ctx, "pod-b", metav1.GetOptions{}); err != nil {
				t.Fatalf("pod-b with its claim not unprepared: %v, want it still there", err)
			}
			if _, err := os.Stat(n.cdiSpecPath(claim.UID)); err != nil {
				t.Errorf("CDI spec of claim %s: %v, want it there until unprepared", claim.Name, err)
			}
			startPlugin()
			eventually(t, "pod-b gone once its claim is unprepared", 2*time.Minute, func(ctx context.Context) error {
				_, err := cp.Client.CoreV1().Pods(e.ns).Get(ctx, "pod-b", metav1.GetOptions{})
				if apierrors.IsNotFound(err) {
					return nil
				}
				if err == nil {
					err = errors.New("still there")
				}
				return err
			})
			rkCheckUnprepared(t, n, claim.UID)
		}},
	} {
		t.Run(sc.name, func(t *testing.T) {
			start := time.Now()
			defer func() { t.Logf("%s took %s", sc.name, time.Since(start).Round(time.Millisecond)) }()
			sc.run(t)
		})
	}
}

// rkWaitRunning waits until pod name is Running with its containers
// ready, as the kubelet k reports it.
func (e *scenarioEnv) rkWaitRunning(t testing.TB, k *realKubelet, name string) {
	t.Helper()
	eventually(t, "pod "+name+" running on "+k.Node, 4*time.Minute, func(ctx context.Context) error {
		if !k.p.running() {
			return fmt.Errorf("the kubelet exited: see %s", k.p.Log)
		}
		pod, err := e.cp.Client.CoreV1().Pods(e.ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		if pod.Spec.NodeName != k.Node {
			return fmt.Errorf("on node %q, want %s", pod.Spec.NodeName, k.Node)
		}
		if pod.Status.Phase != corev1.PodRunning {
			return fmt.Errorf("phase %s, conditions %v, containers %v", pod.Status.Phase, pod.Status.Conditions, pod.Status.ContainerStatuses)
		}
		return nil
	})
}

// rkCheckCreated checks that the kubelet created pod's one container with
// the CDI device of the claim with uid, and only that.
func rkCheckCreated(t testing.TB, cri *criRecorder, namespace, pod string, uid types.UID) {
	t.Helper()
	created := cri.createdFor(namespace, pod)
	if len(created) == 0 {
		t.Fatalf("no CreateContainer for pod %s", pod)
	}
	want := []string{cdiDeviceID(uid)}
	for _, c := range created {
		if !slices.Equal(c.CDIDevices, want) {
			t.Errorf("CreateContainer %s of pod %s: CDI devices %v, want %v", c.Container, pod, c.CDIDevices, want)
		}
	}
}

// rkCheckUnprepared checks that node n's plugin removed the CDI spec and
// the state of the claim with uid.
func rkCheckUnprepared(t testing.TB, n *scnNode, uid types.UID) {
	t.Helper()
	for _, path := range []string{n.cdiSpecPath(uid), n.claimStateDir(uid)} {
		if _, err := os.Stat(path); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s after unprepare: %v, want it gone", path, err)
		}
	}
}

// rkDeleteAndWaitGone deletes pod name with its grace period and waits
// until the kubelet has stopped it and deleted it.
func (e *scenarioEnv) rkDeleteAndWaitGone(t testing.TB, name string) {
	t.Helper()
	pods := e.cp.Client.CoreV1().Pods(e.ns)
	if err := pods.Delete(context.Background(), name, metav1.DeleteOptions{}); err != nil {
		t.Fatalf("delete pod %s: %v", name, err)
	}
	eventually(t, "pod "+name+" stopped and deleted by the kubelet", 2*time.Minute, func(ctx context.Context) error {
		_, err := pods.Get(ctx, name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return nil
		}
		if err == nil {
			err = errors.New("still there")
		}
		return err
	})
}

// rkWaitFailedPrepares waits until the kubelet has reported at least n
// failed NodePrepareResources for pod name.
func (e *scenarioEnv) rkWaitFailedPrepares(t testing.TB, name string, n int32) {
	t.Helper()
	eventually(t, fmt.Sprintf("%d failed prepares of pod %s", n, name), 2*time.Minute, func(ctx context.Context) error {
		list, err := e.cp.Client.CoreV1().Events(e.ns).List(ctx, metav1.ListOptions{FieldSelector: fields.Set{
			"involvedObject.name": name, "reason": rkFailedPrepare,
		}.String()})
		if err != nil {
			return err
		}
		var count int32
		var last string
		for _, ev := range list.Items {
			count += max(ev.Count, 1)
			last = ev.Message
		}
		if count < n {
			return fmt.Errorf("%d %s events (last: %q)", count, rkFailedPrepare, last)
		}
		return nil
	})
}
