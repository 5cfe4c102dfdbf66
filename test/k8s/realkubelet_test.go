package k8s

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
	"k8s.io/cri-client/pkg/fake"
)

// The real kubelet, built from k8s.io/kubernetes (the version the control
// plane has), runs as a child process against the suite's apiserver and a
// container runtime that only records what it is asked (criRecorder): no
// image is pulled and no process started, but everything above the CRI is
// the kubelet's own: node registration and status, plugin registration,
// the DRA manager's NodePrepareResources and NodeUnprepareResources with
// their retries and checkpoint, pod status, and the CDI device ids it puts
// in the containers' configs.

var (
	kubeletOnce sync.Once
	kubeletPath string
	kubeletErr  error
)

// kubeletBinary returns the path of the kubelet: $GPUPOOL_KUBELET (make
// test-k8s builds it), else built once per test binary from this module's
// k8s.io/kubernetes (a tool in go.mod; Go's build cache keeps it between
// runs).
func kubeletBinary(t testing.TB) string {
	t.Helper()
	kubeletOnce.Do(func() {
		if kubeletPath = os.Getenv("GPUPOOL_KUBELET"); kubeletPath != "" {
			return
		}
		start := time.Now()
		kubeletPath = filepath.Join(suiteDir, "kubelet")
		cmd := exec.Command("go", "build", "-o", kubeletPath, "k8s.io/kubernetes/cmd/kubelet")
		if out, err := cmd.CombinedOutput(); err != nil {
			kubeletErr = fmt.Errorf("%v\n%s", err, out)
		}
		t.Logf("built the kubelet in %s", time.Since(start).Round(time.Millisecond))
	})
	if kubeletErr != nil {
		t.Fatalf("build the kubelet: %v", kubeletErr)
	}
	return kubeletPath
}

// criRecorder is a CRI runtime and image service for the kubelet that runs
// nothing: Kubernetes' fake remote runtime (k8s.io/cri-client/pkg/fake),
// which keeps sandboxes and containers as records and says they run, plus
// a record of every CreateContainer request, whose CDI devices the fake
// does not keep. It serves on a unix socket until t ends, and outlives the
// kubelets that use it, as a node's container runtime outlives a kubelet
// restart.
type criRecorder struct {
	*fake.RemoteRuntime
	// Endpoint is the kubelet's containerRuntimeEndpoint.
	Endpoint string

	mu      sync.Mutex
	created []criCreated // guarded by mu
}

// criCreated is one CreateContainer request.
type criCreated struct {
	Namespace, Pod, Container string
	CDIDevices                []string
}

func startCRI(t testing.TB) *criRecorder {
	t.Helper()
	r := &criRecorder{RemoteRuntime: fake.NewFakeRemoteRuntime()}
	// What fake.RemoteRuntime.Start sets, on our server instead of its own
	// (which serves the fake without our CreateContainer).
	r.RuntimeService.FakeStatus = &runtimeapi.RuntimeStatus{Conditions: []*runtimeapi.RuntimeCondition{
		{Type: runtimeapi.RuntimeReady, Status: true},
		{Type: runtimeapi.NetworkReady, Status: true},
	}}
	r.RuntimeService.FakeLinuxConfiguration = &runtimeapi.LinuxRuntimeConfiguration{CgroupDriver: runtimeapi.CgroupDriver_CGROUPFS}
	// The kubelet refuses an image whose status has no size; the fake's
	// images have the size it is given, 0 unless told.
	r.ImageService.SetFakeImageSize(1 << 20)
	sock := filepath.Join(shortTempDir(t), "cri.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	runtimeapi.RegisterRuntimeServiceServer(srv, r)
	runtimeapi.RegisterImageServiceServer(srv, r)
	go srv.Serve(l)
	t.Cleanup(srv.Stop)
	r.Endpoint = "unix://" + sock
	return r
}

// CreateContainer records the request and lets the fake create the
// container.
func (r *criRecorder) CreateContainer(ctx context.Context, req *runtimeapi.CreateContainerRequest) (*runtimeapi.CreateContainerResponse, error) {
	c := criCreated{
		Namespace: req.GetSandboxConfig().GetMetadata().GetNamespace(),
		Pod:       req.GetSandboxConfig().GetMetadata().GetName(),
		Container: req.GetConfig().GetMetadata().GetName(),
	}
	for _, d := range req.GetConfig().GetCDIDevices() {
		c.CDIDevices = append(c.CDIDevices, d.GetName())
	}
	r.mu.Lock()
	r.created = append(r.created, c)
	r.mu.Unlock()
	resp, err := r.RemoteRuntime.CreateContainer(ctx, req)
	if err != nil {
		return nil, err
	}
	// A runtime reports the log path it was given; the fake reports none,
	// and the kubelet's log manager, cleaning a removed container's logs,
	// removes "<log path>*": with no path, every file in its working
	// directory.
	r.RuntimeService.Lock()
	if ctr := r.RuntimeService.Containers[resp.GetContainerId()]; ctr != nil {
		ctr.LogPath = filepath.Join(req.GetSandboxConfig().GetLogDirectory(), req.GetConfig().GetLogPath())
	}
	r.RuntimeService.Unlock()
	return resp, nil
}

// createdFor returns the CreateContainer requests for pod namespace/name.
func (r *criRecorder) createdFor(namespace, pod string) []criCreated {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []criCreated
	for _, c := range r.created {
		if c.Namespace == namespace && c.Pod == pod {
			out = append(out, c)
		}
	}
	return out
}

// sandboxStates returns the states of the sandboxes of pod namespace/name.
func (r *criRecorder) sandboxStates(namespace, pod string) []runtimeapi.PodSandboxState {
	r.RuntimeService.Lock()
	defer r.RuntimeService.Unlock()
	var out []runtimeapi.PodSandboxState
	for _, s := range r.RuntimeService.Sandboxes {
		if md := s.Metadata; md != nil && md.Namespace == namespace && md.Name == pod {
			out = append(out, s.State)
		}
	}
	return out
}

// realKubelet is one node's kubelet process, which can be killed and
// started again on the same root directory, as after a crash.
type realKubelet struct {
	// Node is the node's name (--hostname-override).
	Node string
	// RootDir is --root-dir; short, for the unix sockets in it.
	RootDir string
	// Registry is the plugin registration directory the kubelet watches;
	// a node plugin's --registrar-dir.
	Registry string
	// PluginDir is where our node plugin puts its DRA socket (its
	// --plugin-dir), as the DaemonSet's hostPath puts it.
	PluginDir string
	// Port serves the kubelet's API on 127.0.0.1, its metrics among it.
	Port int

	t      testing.TB
	args   []string
	starts int
	p      *proc
}

// kubeletSysctls are the kernel settings the kubelet wants (it sets them
// unless protectKernelDefaults, which makes it check them instead). The
// kubelet runs in a mount namespace of its own in which these files show
// the values it wants, so that it neither changes the host's nor refuses
// to start.
var kubeletSysctls = map[string]string{
	"vm/overcommit_memory":      "1",
	"vm/panic_on_oom":           "0",
	"kernel/panic":              "10",
	"kernel/panic_on_oops":      "1",
	"kernel/keys/root_maxkeys":  "1000000",
	"kernel/keys/root_maxbytes": "25000000",
}

// kubeletConfig is the KubeletConfiguration of the suite's kubelets. This
// host has cgroup v1 (failCgroupV1: false) and is shared: the kubelet
// makes no QoS cgroups (cgroupsPerQOS: false, so nothing to enforce node
// allocatable on), no iptables chains, evicts nothing and collects no
// images; it checks the kernel settings instead of setting them; its API
// is on loopback, open to anonymous requests (for its metrics).
const kubeletConfig = `apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: 127.0.0.1
port: %d
readOnlyPort: 0
healthzPort: 0
authentication:
  anonymous:
    enabled: true
  webhook:
    enabled: false
authorization:
  mode: AlwaysAllow
containerRuntimeEndpoint: %s
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupsPerQOS: false
enforceNodeAllocatable: []
failSwapOn: false
protectKernelDefaults: true
makeIPTablesUtilChains: false
evictionHard: {}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
localStorageCapacityIsolation: false
podLogsDir: %s
resolvConf: ""
`

// startRealKubelet starts the kubelet of node name on cri, acting as
// system:node:NAME (the Node authorizer's node identity), with labels as
// its --node-labels, and waits until the node is Ready. The kubelet is
// killed and the Node deleted when t ends. It needs root: it runs in a
// mount namespace of its own (see kubeletSysctls).
func startRealKubelet(t testing.TB, cp *controlPlane, cri *criRecorder, name string, labels map[string]string) *realKubelet {
	t.Helper()
	bin := kubeletBinary(t)
	root := shortTempDir(t)
	k := &realKubelet{Node: name, RootDir: root, Registry: filepath.Join(root, "plugins_registry"),
		PluginDir: filepath.Join(root, "plugins", driverName), t: t}
	for _, d := range []string{k.Registry, k.PluginDir, filepath.Join(root, "sysctl"), filepath.Join(root, "pod-logs")} {
		if err := os.MkdirAll(d, 0o750); err != nil {
			t.Fatal(err)
		}
	}
	port, err := freePort()
	if err != nil {
		t.Fatal(err)
	}
	_, p, _ := net.SplitHostPort(port)
	k.Port, _ = strconv.Atoi(p)
	config := filepath.Join(root, "config.yaml")
	if err := os.WriteFile(config, fmt.Appendf(nil, kubeletConfig, k.Port, cri.Endpoint, filepath.Join(root, "pod-logs")), 0o644); err != nil {
		t.Fatal(err)
	}
	// Mount the wanted kernel settings over /proc/sys in the kubelet's own
	// mount namespace, then become the kubelet.
	script := "set -e\n"
	for _, name := range slices.Sorted(maps.Keys(kubeletSysctls)) {
		file := filepath.Join(root, "sysctl", strings.ReplaceAll(name, "/", "."))
		if err := os.WriteFile(file, []byte(kubeletSysctls[name]+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		script += fmt.Sprintf("mount --bind %s /proc/sys/%s\n", file, name)
	}
	// An empty working directory, whatever the kubelet does with relative
	// paths.
	script += fmt.Sprintf("mkdir -p %s/cwd && cd %s/cwd\n", root, root)
	script += `exec "$@"` + "\n"
	var nodeLabels []string
	for _, l := range slices.Sorted(maps.Keys(labels)) {
		nodeLabels = append(nodeLabels, l+"="+labels[l])
	}
	kubeconfig := cp.kubeconfigFor(t, "system:node:"+name, "system:nodes", "system:authenticated")
	k.args = []string{"--mount", "--propagation", "private", "sh", "-c", script, "kubelet", bin,
		"--config", config, "--kubeconfig", kubeconfig, "--root-dir", root, "--hostname-override", name,
		"--node-labels", strings.Join(nodeLabels, ","), "--v", "2"}

	// Delete the Node after the kubelet is killed (cleanups run last first).
	t.Cleanup(func() {
		err := cp.Client.CoreV1().Nodes().Delete(context.Background(), name, metav1.DeleteOptions{})
		if err != nil && !apierrors.IsNotFound(err) {
			t.Errorf("delete node %s: %v", name, err)
		}
	})
	k.start()
	k.waitReady(cp)
	return k
}

// start starts the kubelet process.
func (k *realKubelet) start() {
	k.t.Helper()
	if k.p != nil && k.p.running() {
		k.t.Fatalf("kubelet of %s started twice", k.Node)
	}
	k.starts++
	k.p = startCommand(k.t, fmt.Sprintf("kubelet-%s-%d", k.Node, k.starts), "unshare", k.args...)
}

// kill kills the kubelet (SIGKILL: no chance to tidy up) and waits until
// it has exited.
func (k *realKubelet) kill() { k.p.stop() }

// waitReady waits until the kubelet's node is Ready, and then lifts the
// node.kubernetes.io/not-ready taint that the node was registered with, as
// the node lifecycle controller (which the suite does not run) would.
func (k *realKubelet) waitReady(cp *controlPlane) {
	k.t.Helper()
	eventually(k.t, "node "+k.Node+" registered and Ready", 5*time.Minute, func(ctx context.Context) error {
		if !k.p.running() {
			return fmt.Errorf("the kubelet exited: see %s", k.p.Log)
		}
		nodes := cp.Client.CoreV1().Nodes()
		node, err := nodes.Get(ctx, k.Node, metav1.GetOptions{})
		if err != nil {
			return err
		}
		ready := false
		for _, c := range node.Status.Conditions {
			if c.Type == corev1.NodeReady {
				if c.Status != corev1.ConditionTrue {
					return fmt.Errorf("not ready: %s: %s", c.Reason, c.Message)
				}
				ready = true
			}
		}
		if !ready {
			return errors.New("no Ready condition yet")
		}
		taints := slices.DeleteFunc(slices.Clone(node.Spec.Taints), func(t corev1.Taint) bool { return t.Key == corev1.TaintNodeNotReady })
		if len(taints) != len(node.Spec.Taints) {
			node.Spec.Taints = taints
			if _, err := nodes.Update(ctx, node, metav1.UpdateOptions{}); err != nil {
				return err
			}
		}
		if len(taints) > 0 {
			return fmt.Errorf("tainted %v", taints)
		}
		return nil
	})
}

// metric returns the value of the kubelet's metric whose line starts with
// prefix (name and labels), from its /metrics.
func (k *realKubelet) metric(ctx context.Context, prefix string) (float64, error) {
	c := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}} // its self-signed serving cert
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, fmt.Sprintf("https://127.0.0.1:%d/metrics", k.Port), nil)
	if err != nil {
		return 0, err
	}
	resp, err := c.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return 0, err
	}
	if resp.StatusCode != http.StatusOK {
		return 0, fmt.Errorf("GET /metrics: %s: %s", resp.Status, body)
	}
	for _, line := range strings.Split(string(body), "\n") {
		if rest, ok := strings.CutPrefix(line, prefix); ok {
			return strconv.ParseFloat(strings.TrimSpace(rest), 64)
		}
	}
	return 0, fmt.Errorf("no metric %s", prefix)
}
