package k8s

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"
)

// The benchmark's knobs, from the environment (make bench-k8s sets the
// first).
const (
	benchEnableEnv = "GPUPOOL_BENCH_K8S"  // "1" runs TestBenchK8s
	benchPodsEnv   = "GPUPOOL_BENCH_PODS" // pods per side, default 200
	benchOutEnv    = "GPUPOOL_BENCH_OUT"  // output directory, default ../../bench/results
)

// The benchmark's shape. Each pod claims 8Gi and 10 % of one GPU, so ten
// pods share an A100 80GB exactly (memory and compute both run out at the
// tenth); with two GPUs per simulated pool host that is 20 pods a host,
// and the pool gets 20 % more hosts than the pods need, so that the
// scheduler never has to fill the last slot. The pods spread over client
// nodes of at most 50 pods each (a fake node takes 110).
const (
	benchMemory       = "8Gi"
	benchCompute      = "10"
	benchPodsPerGPU   = 10
	benchGPUsPerHost  = 2 // agentGPUs
	benchHeadroom     = 1.2
	benchPodsPerNode  = 50
	benchCreators     = 20 // goroutines creating the pods, with no client-side rate limit
	benchPrepWorkers  = 8  // concurrent NodePrepareResources calls per kubelet stand-in
	benchPhaseTimeout = 10 * time.Minute
	benchProgress     = 5 * time.Second
	// benchKubeVersion is the control plane's (test/k8s/go.mod).
	benchKubeVersion = "v1.36.3"
)

// benchPollNote explains the floor under "bound" and "prepared".
const benchPollNote = "kube-scheduler waits for a claim's binding conditions (Leased) in PreBind by polling every 5 s " +
	"(wait.PollUntilContextTimeout(ctx, 5*time.Second, bindingTimeout, true, ...) in " +
	"pkg/scheduler/framework/plugins/dynamicresources/dynamicresources.go, Kubernetes " + benchKubeVersion + "): " +
	"the first check runs right after the allocation is written, before any lease can be granted, " +
	"so our pods are bound no sooner than about 5 s after their claim was allocated, however fast the lease. " +
	"\"Leased\" is not subject to that floor; the baseline has no binding conditions and no wait."

// TestBenchK8s is the Kubernetes benchmark: for GPUPOOL_BENCH_PODS (200) pods,
// each with a fractional claim from a ResourceClaimTemplate, the time from
// the pod's creation to its claim's Leased=True, to the pod's binding and
// to the kubelet stand-in's NodePrepareResources returning for it, as
// p50, p99 and max, with the wall time and pods/s. Two sides run one after
// the other on the shared control plane:
//
//   - gpupool: the dev broker cluster with simulated pool hosts, the real
//     `gpupool k8s-controller` (publisher and binder) and, per client
//     node, the real `gpupool k8s-node-plugin` and a kubelet stand-in;
//   - baseline: plain DRA allocation of the same devices from
//     hand-written ResourceSlices without binding conditions, no binder,
//     and per node the trivial in-process kubeletplugin driver of
//     TestSmoke, with the same kubelet stand-in.
//
// The kubelet stand-in prepares a pod's claim as soon as an informer sees
// the pod bound to its node, and retries a failed prepare every 200ms. The
// pods are created at once (benchCreators goroutines without a
// client-side rate limit) after the pools are published; every time is
// taken in this process, from an informer's event or a call's return,
// against the moment the pod's create request was sent.
//
// It writes k8s.md and k8s.json to GPUPOOL_BENCH_OUT. `make bench-k8s`
// runs it; it skips otherwise.
func TestBenchK8s(t *testing.T) {
	if os.Getenv(benchEnableEnv) != "1" {
		t.Skipf("a benchmark: set %s=1 to run it (make bench-k8s)", benchEnableEnv)
	}
	n := 200
	if s := os.Getenv(benchPodsEnv); s != "" {
		var err error
		if n, err = strconv.Atoi(s); err != nil || n < 1 {
			t.Fatalf("%s=%q: want a positive number of pods", benchPodsEnv, s)
		}
	}
	out := os.Getenv(benchOutEnv)
	if out == "" {
		out = filepath.Join("..", "..", "bench", "results")
	}
	cfg := benchConfig{
		Pods:        n,
		Hosts:       max(1, int(math.Ceil(float64(n)*benchHeadroom/(benchPodsPerGPU*benchGPUsPerHost)))),
		GPUsPerHost: benchGPUsPerHost,
		GPU:         "A100-80GB (simulated)",
		Nodes:       max(1, (n+benchPodsPerNode-1)/benchPodsPerNode),
		Memory:      benchMemory,
		Compute:     benchCompute,
		Creation:    fmt.Sprintf("all at once: %d goroutines, no client-side rate limit, after the pools are published", benchCreators),
		Kubelet:     fmt.Sprintf("one stand-in per node: NodePrepareResources for a pod as soon as it is bound to the node, %d calls at a time, retried every 200ms on error", benchPrepWorkers),
	}
	t.Logf("benchmark: %d pods, %s + %s%% of a GPU each; %d pool hosts x %d GPUs; %d client nodes", cfg.Pods, cfg.Memory, cfg.Compute, cfg.Hosts, cfg.GPUsPerHost, cfg.Nodes)

	cp := sharedControlPlane(t)
	cp.ensureDeviceClass(t)
	gpupoolBinary(t) // not inside the measurement
	start := time.Now()
	var sides []*benchSide
	for _, side := range []struct {
		name string
		run  func(*testing.T, *controlPlane, benchConfig) *benchSide
	}{{"gpupool", benchGpupool}, {"baseline", benchBaseline}} {
		var res *benchSide
		var ns string
		ok := t.Run(side.name, func(t *testing.T) {
			res = side.run(t, cp, cfg)
			ns = res.namespace
		})
		if !ok || res == nil {
			t.FailNow()
		}
		sides = append(sides, res)
		benchWaitNamespaceGone(t, cp, ns)
	}

	rep := newBenchReport(cfg, sides, time.Since(start))
	md := rep.markdown()
	t.Logf("\n%s", md)
	if err := os.MkdirAll(out, 0o755); err != nil {
		t.Fatal(err)
	}
	js, err := json.MarshalIndent(rep, "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	for name, data := range map[string][]byte{"k8s.md": []byte(md), "k8s.json": append(js, '\n')} {
		if err := os.WriteFile(filepath.Join(out, name), data, 0o644); err != nil {
			t.Fatal(err)
		}
		t.Logf("wrote %s", filepath.Join(out, name))
	}
}

type benchConfig struct {
	Pods        int    `json:"pods"`
	Hosts       int    `json:"pool_hosts"`
	GPUsPerHost int    `json:"gpus_per_host"`
	GPU         string `json:"gpu"`
	Nodes       int    `json:"client_nodes"`
	Memory      string `json:"claim_memory"`
	Compute     string `json:"claim_compute_percent"`
	Creation    string `json:"creation"`
	Kubelet     string `json:"kubelet"`
}

// benchGpupool runs the gpupool side: brokers and simulated pool hosts,
// the real controller, and per node the real node plugin.
func benchGpupool(t *testing.T, cp *controlPlane, cfg benchConfig) *benchSide {
	const label = "bench.gpupool.dev/gpupool"
	setup := time.Now()
	b := startBrokers(t, cfg.Hosts)
	// Registered before the controller starts, so that it runs after the
	// controller is stopped: the publisher's slices outlive it.
	t.Cleanup(func() { benchDeleteSlices(t, cp, b.HostIDs) })
	startGpupool(t, "k8s-controller", "k8s-controller", "--addr", b.Addrs, "--kubeconfig", cp.Kubeconfig,
		"--leader-elect=false", "--node-selector", label+"=true")
	kubelets := map[string]*kubelet{}
	for i := range cfg.Nodes {
		node := fmt.Sprintf("bench-gpupool-%d", i+1)
		cp.addNode(t, node, map[string]string{label: "true"})
		registry, pluginDir := kubeletDirs(t)
		state := shortTempDir(t)
		startGpupool(t, "node-plugin-"+node, "k8s-node-plugin", "--addr", b.Addrs, "--node-name", node,
			"--kubeconfig", cp.Kubeconfig, "--state-dir", filepath.Join(state, "state"), "--cdi-dir", filepath.Join(state, "cdi"),
			"--plugin-dir", pluginDir, "--registrar-dir", registry)
		kubelets[node] = newKubelet(t, node, registry)
	}
	cp.waitForPools(t, b.HostIDs...)
	t.Logf("gpupool: %d brokers, %d pool hosts, controller, %d nodes with node plugins: set up in %s",
		len(b.Brokers), len(b.HostIDs), len(kubelets), time.Since(setup).Round(time.Millisecond))
	side := benchMeasure(t, cp, "gpupool", cfg.Pods, kubelets, true)
	side.Does = fmt.Sprintf("gpupool k8s-controller publishes %d pools (one per simulated pool host, %d GPUs each) with "+
		"bindingConditions [Leased]; for each allocated claim its binder takes a broker lease (3 brokers, Raft) and writes Leased=True; "+
		"the scheduler then binds the pod; gpupool k8s-node-plugin (one process per node) prepares the claim: it attaches to the lease, "+
		"writes the token file and the CDI spec", cfg.Hosts, cfg.GPUsPerHost)
	return side
}

// benchBaseline runs the baseline side: the same devices in hand-written
// ResourceSlices without binding conditions, no binder, and per node the
// trivial kubeletplugin driver of TestSmoke, each with its own client at
// client-go's default rate limit like each node plugin's.
func benchBaseline(t *testing.T, cp *controlPlane, cfg benchConfig) *benchSide {
	const label = "bench.gpupool.dev/baseline"
	setup := time.Now()
	var pools []string
	for i := range cfg.Hosts {
		pool := fmt.Sprintf("bench-baseline-host-%d", i+1)
		pools = append(pools, pool)
		slice := deviceSlice(pool, pool, label)
		for g := 1; g < cfg.GPUsPerHost; g++ {
			d := slice.Spec.Devices[0].DeepCopy()
			d.Name = fmt.Sprintf("gpu-%d", g)
			d.Attributes["uuid"] = resourceapi.DeviceAttribute{StringValue: ptr.To(fmt.Sprintf("GPU-00000000-0000-0000-0000-%012d", g))}
			slice.Spec.Devices = append(slice.Spec.Devices, *d)
		}
		if _, err := cp.Client.ResourceV1().ResourceSlices().Create(context.Background(), slice, metav1.CreateOptions{FieldValidation: "Strict"}); err != nil {
			t.Fatalf("create ResourceSlice %s: %v", slice.Name, err)
		}
	}
	t.Cleanup(func() { benchDeleteSlices(t, cp, pools) })
	kubelets := map[string]*kubelet{}
	for i := range cfg.Nodes {
		node := fmt.Sprintf("bench-baseline-%d", i+1)
		// Each plugin has its own client with client-go's default rate
		// limit (5 QPS, burst 10), as each node plugin process has.
		pluginCfg := rest.CopyConfig(cp.Config)
		pluginCfg.QPS, pluginCfg.Burst = 0, 0
		pluginClient, err := kubernetes.NewForConfig(pluginCfg)
		if err != nil {
			t.Fatal(err)
		}
		cp.addNode(t, node, map[string]string{label: "true"})
		registry, pluginDir := kubeletDirs(t)
		plugin, err := kubeletplugin.Start(klog.NewContext(context.Background(), klog.Background()), cdiPlugin{},
			kubeletplugin.DriverName(driverName), kubeletplugin.KubeClient(pluginClient), kubeletplugin.NodeName(node),
			kubeletplugin.RegistrarDirectoryPath(registry), kubeletplugin.PluginDataDirectoryPath(pluginDir))
		if err != nil {
			t.Fatalf("start kubeletplugin for %s: %v", node, err)
		}
		t.Cleanup(plugin.Stop)
		kubelets[node] = newKubelet(t, node, registry)
	}
	cp.waitForPools(t, pools...)
	t.Logf("baseline: %d ResourceSlices, %d nodes with in-process kubeletplugin drivers: set up in %s",
		len(pools), len(kubelets), time.Since(setup).Round(time.Millisecond))
	side := benchMeasure(t, cp, "baseline", cfg.Pods, kubelets, false)
	side.Does = fmt.Sprintf("plain DRA: %d hand-written ResourceSlices of the same shape (%d GPUs each, consumable capacity, "+
		"no binding conditions), no binder and no brokers; the scheduler binds the pod as soon as the claim is allocated; "+
		"a trivial kubeletplugin driver (in the test process, one per node) answers NodePrepareResources with a CDI device id", cfg.Hosts, cfg.GPUsPerHost)
	return side
}

// benchDeleteSlices deletes the ResourceSlices of our driver in pools.
func benchDeleteSlices(t *testing.T, cp *controlPlane, pools []string) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	list, err := cp.Client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{
		FieldSelector: resourceapi.ResourceSliceSelectorDriver + "=" + driverName,
	})
	if err != nil {
		t.Errorf("list ResourceSlices: %v", err)
		return
	}
	for _, s := range list.Items {
		if !slices.Contains(pools, s.Spec.Pool.Name) {
			continue
		}
		if err := cp.Client.ResourceV1().ResourceSlices().Delete(ctx, s.Name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			t.Errorf("delete ResourceSlice %s: %v", s.Name, err)
		}
	}
}

// benchWaitNamespaceGone waits (up to 3 minutes) until the namespace of
// the last side is gone, so that its teardown does not load the control
// plane during the next side's measurement.
func benchWaitNamespaceGone(t *testing.T, cp *controlPlane, ns string) {
	start := time.Now()
	for time.Since(start) < 3*time.Minute {
		_, err := cp.Client.CoreV1().Namespaces().Get(context.Background(), ns, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			t.Logf("namespace %s gone after %s", ns, time.Since(start).Round(time.Millisecond))
			return
		}
		time.Sleep(500 * time.Millisecond)
	}
	t.Logf("namespace %s still there after %s; going on", ns, time.Since(start).Round(time.Millisecond))
}

// benchPod is what the benchmark records of one pod; zero times did not
// happen (yet).
type benchPod struct {
	name      string
	created   time.Time // the create request was sent
	allocated time.Time // its claim has status.allocation
	leased    time.Time // its claim has Leased=True on every allocated device
	bound     time.Time // spec.nodeName is set
	prepared  time.Time // NodePrepareResources returned success for its claim
	node      string
	failed    bool // its claim had LeaseFailed=True at some point
	attempts  int  // NodePrepareResources calls
}

// benchSide is one side's measurement.
type benchSide struct {
	Name          string  `json:"name"`
	Does          string  `json:"does"`
	Pods          int     `json:"pods"`
	WallSeconds   float64 `json:"wall_seconds"`
	PodsPerSecond float64 `json:"pods_per_second"`
	CreateSeconds float64 `json:"create_seconds"`
	// Stages are the latencies from pod creation, by stage name.
	Stages map[string]*benchStats `json:"stages"`
	// LeaseFailed counts the claims that saw LeaseFailed=True.
	LeaseFailed int `json:"lease_failed_claims"`
	// PrepareRetries counts the NodePrepareResources calls that failed.
	PrepareRetries int `json:"prepare_retries"`

	namespace string
}

// benchStats are latencies in seconds (nearest-rank percentiles).
type benchStats struct {
	N   int     `json:"n"`
	P50 float64 `json:"p50_s"`
	P99 float64 `json:"p99_s"`
	Max float64 `json:"max_s"`
}

// benchStages are the stages, in order, with what they mean.
var benchStages = []struct{ key, label string }{
	{"allocated", "claim allocated (scheduler)"},
	{"leased", "claim `Leased=True` (binder)"},
	{"bound", "pod bound (`spec.nodeName`)"},
	{"prepared", "claim prepared (`NodePrepareResources` returned)"},
}

// benchRecorder collects benchPods from informers and the kubelet
// stand-ins.
type benchRecorder struct {
	mu   sync.Mutex
	pods map[string]*benchPod // by pod name
}

func (r *benchRecorder) update(name string, f func(p *benchPod)) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if p := r.pods[name]; p != nil {
		f(p)
	}
}

// counts returns how many pods reached each stage.
func (r *benchRecorder) counts() map[string]int {
	r.mu.Lock()
	defer r.mu.Unlock()
	c := map[string]int{}
	for _, p := range r.pods {
		for k, v := range map[string]time.Time{"created": p.created, "allocated": p.allocated, "leased": p.leased, "bound": p.bound, "prepared": p.prepared} {
			if !v.IsZero() {
				c[k]++
			}
		}
	}
	return c
}

// benchMeasure creates cfg.Pods pods with a fractional claim each in a new
// namespace and records their progress until every one is prepared.
// withLease says whether claims get Leased (the gpupool side).
func benchMeasure(t *testing.T, cp *controlPlane, name string, n int, kubelets map[string]*kubelet, withLease bool) *benchSide {
	ns := cp.newNamespace(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	fast := rest.CopyConfig(cp.Config)
	fast.QPS, fast.Burst = -1, 0 // no client-side rate limit: the apiserver is what we measure
	client, err := kubernetes.NewForConfig(fast)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := fractionalTemplate("bench-slice", benchMemory, benchCompute)
	if _, err := client.ResourceV1().ResourceClaimTemplates(ns).Create(ctx, tmpl, metav1.CreateOptions{FieldValidation: "Strict"}); err != nil {
		t.Fatalf("create ResourceClaimTemplate: %v", err)
	}

	rec := &benchRecorder{pods: map[string]*benchPod{}}
	var names []string
	for i := range n {
		name := fmt.Sprintf("bench-%04d", i)
		names = append(names, name)
		rec.pods[name] = &benchPod{name: name}
	}

	// Every pod bound to one of our nodes goes to that node's kubelet
	// stand-in, once.
	work := map[string]chan string{}
	for node := range kubelets {
		work[node] = make(chan string, n)
	}
	factory := informers.NewSharedInformerFactoryWithOptions(client, 0, informers.WithNamespace(ns))
	podInf := factory.Core().V1().Pods()
	claimInf := factory.Resource().V1().ResourceClaims()
	var strays []string // pods bound to another node
	_, err = podInf.Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { benchOnPod(rec, work, &strays, obj) },
		UpdateFunc: func(_, obj any) { benchOnPod(rec, work, &strays, obj) },
	})
	if err != nil {
		t.Fatal(err)
	}
	_, err = claimInf.Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { benchOnClaim(rec, obj) },
		UpdateFunc: func(_, obj any) { benchOnClaim(rec, obj) },
	})
	if err != nil {
		t.Fatal(err)
	}
	factory.Start(ctx.Done())
	defer factory.Shutdown()
	for typ, ok := range factory.WaitForCacheSync(ctx.Done()) {
		if !ok {
			t.Fatalf("informer for %v did not sync", typ)
		}
	}

	var prepErrs benchErrors
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	for node, k := range kubelets {
		for range benchPrepWorkers {
			wg.Go(func() {
				benchKubelet(ctx, k, work[node], rec, podInf.Lister().Pods(ns), claimInf.Lister().ResourceClaims(ns), &prepErrs)
			})
		}
	}

	// Create all pods at once.
	start := time.Now()
	todo := make(chan string, n)
	for _, name := range names {
		todo <- name
	}
	close(todo)
	var createErrs benchErrors
	var cwg sync.WaitGroup
	for range benchCreators {
		cwg.Go(func() {
			for name := range todo {
				rec.update(name, func(p *benchPod) { p.created = time.Now() })
				if _, err := client.CoreV1().Pods(ns).Create(ctx, podWithClaim(name, tmpl.Name), metav1.CreateOptions{}); err != nil {
					createErrs.add(fmt.Errorf("create pod %s: %w", name, err))
				}
			}
		})
	}
	cwg.Wait()
	createTime := time.Since(start)
	if err := createErrs.first(); err != nil {
		t.Fatalf("%d pods not created; first: %v", createErrs.count(), err)
	}
	t.Logf("%s: created %d pods in %s", name, n, createTime.Round(time.Millisecond))

	// Wait for all, with progress.
	progress := func() (string, bool) {
		c := rec.counts()
		parts := []string{fmt.Sprintf("allocated %d/%d", c["allocated"], n)}
		if withLease {
			parts = append(parts, fmt.Sprintf("leased %d/%d", c["leased"], n))
		}
		parts = append(parts, fmt.Sprintf("bound %d/%d", c["bound"], n), fmt.Sprintf("prepared %d/%d", c["prepared"], n))
		return fmt.Sprintf("%s %5.1fs: %s", name, time.Since(start).Seconds(), strings.Join(parts, ", ")), c["prepared"] == n
	}
	tick := time.NewTicker(benchProgress)
	defer tick.Stop()
	deadline := time.After(benchPhaseTimeout)
	poll := time.NewTicker(50 * time.Millisecond)
	defer poll.Stop()
wait:
	for {
		select {
		case <-poll.C:
			if _, done := progress(); done {
				break wait
			}
		case <-tick.C:
			line, _ := progress()
			t.Log(line)
		case <-deadline:
			line, _ := progress()
			benchDiagnose(t, cp, ns, rec)
			t.Fatalf("not every pod prepared within %s: %s; prepare errors: %d, first: %v", benchPhaseTimeout, line, prepErrs.count(), prepErrs.first())
		}
	}
	line, _ := progress()
	t.Log(line)
	rec.mu.Lock()
	stray := slices.Clone(strays)
	rec.mu.Unlock()
	if len(stray) > 0 {
		t.Fatalf("pods bound to nodes of no kubelet stand-in: %v", stray)
	}

	side := &benchSide{Name: name, Pods: n, CreateSeconds: createTime.Seconds(), Stages: map[string]*benchStats{}, namespace: ns, PrepareRetries: prepErrs.count()}
	rec.mu.Lock()
	defer rec.mu.Unlock()
	var last time.Time
	lat := map[string][]time.Duration{}
	perNode := map[string]int{}
	for _, p := range rec.pods {
		perNode[p.node]++
		if p.failed {
			side.LeaseFailed++
		}
		if p.prepared.After(last) {
			last = p.prepared
		}
		for key, at := range map[string]time.Time{"allocated": p.allocated, "leased": p.leased, "bound": p.bound, "prepared": p.prepared} {
			if !at.IsZero() {
				lat[key] = append(lat[key], at.Sub(p.created))
			}
		}
	}
	for key, ds := range lat {
		side.Stages[key] = benchStatsOf(ds)
	}
	wall := last.Sub(start)
	side.WallSeconds = wall.Seconds()
	side.PodsPerSecond = float64(n) / wall.Seconds()
	t.Logf("%s: pods per node %v; %d claims saw LeaseFailed; %d prepare calls failed (first: %v)", name, perNode, side.LeaseFailed, prepErrs.count(), prepErrs.first())
	return side
}

// benchOnPod records a pod's binding and hands it to its node's kubelet
// stand-in.
func benchOnPod(rec *benchRecorder, work map[string]chan string, strays *[]string, obj any) {
	pod, ok := obj.(*corev1.Pod)
	if !ok || pod.Spec.NodeName == "" {
		return
	}
	now := time.Now()
	rec.update(pod.Name, func(p *benchPod) {
		if !p.bound.IsZero() {
			return
		}
		p.bound, p.node = now, pod.Spec.NodeName
		if ch := work[pod.Spec.NodeName]; ch != nil {
			ch <- pod.Name // buffered for every pod
		} else {
			*strays = append(*strays, pod.Name+" on "+pod.Spec.NodeName)
		}
	})
}

// benchOnClaim records a claim's allocation, Leased=True and LeaseFailed,
// for the pod that owns it.
func benchOnClaim(rec *benchRecorder, obj any) {
	claim, ok := obj.(*resourceapi.ResourceClaim)
	if !ok {
		return
	}
	owner := metav1.GetControllerOf(claim)
	if owner == nil || owner.Kind != "Pod" {
		return
	}
	now := time.Now()
	var results int
	if claim.Status.Allocation != nil {
		results = len(claim.Status.Allocation.Devices.Results)
	}
	leased, failed := 0, false
	for _, d := range claim.Status.Devices {
		if meta.IsStatusConditionTrue(d.Conditions, "Leased") {
			leased++
		}
		if meta.IsStatusConditionTrue(d.Conditions, "LeaseFailed") {
			failed = true
		}
	}
	rec.update(owner.Name, func(p *benchPod) {
		if results > 0 && p.allocated.IsZero() {
			p.allocated = now
		}
		if results > 0 && leased >= results && p.leased.IsZero() {
			p.leased = now
		}
		p.failed = p.failed || failed
	})
}

// benchKubelet is one worker of a kubelet stand-in: it prepares the claim
// of each pod from work, retrying until it succeeds or ctx ends.
func benchKubelet(ctx context.Context, k *kubelet, work <-chan string, rec *benchRecorder,
	pods interface {
		Get(string) (*corev1.Pod, error)
	}, claims interface {
		Get(string) (*resourceapi.ResourceClaim, error)
	}, errs *benchErrors) {
	for {
		var name string
		select {
		case <-ctx.Done():
			return
		case name = <-work:
		}
		for ctx.Err() == nil {
			err := benchPrepare(ctx, k, name, rec, pods, claims)
			if err == nil {
				break
			}
			errs.add(fmt.Errorf("node %s, pod %s: %w", k.Node, name, err))
			select {
			case <-ctx.Done():
			case <-time.After(200 * time.Millisecond):
			}
		}
	}
}

// benchPrepare calls NodePrepareResources for the claim of pod name, as the
// informers know it, and records when it succeeded.
func benchPrepare(ctx context.Context, k *kubelet, name string, rec *benchRecorder,
	pods interface {
		Get(string) (*corev1.Pod, error)
	}, claims interface {
		Get(string) (*resourceapi.ResourceClaim, error)
	}) error {
	pod, err := pods.Get(name)
	if err != nil {
		return err
	}
	var claimName string
	for _, s := range pod.Status.ResourceClaimStatuses {
		if s.Name == "gpu" && s.ResourceClaimName != nil {
			claimName = *s.ResourceClaimName
		}
	}
	if claimName == "" {
		return fmt.Errorf("no ResourceClaim in the pod's status yet")
	}
	claim, err := claims.Get(claimName)
	if err != nil {
		return err
	}
	rec.update(name, func(p *benchPod) { p.attempts++ })
	callCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	resp, err := k.prepare(callCtx, claim)
	if err != nil {
		return err
	}
	now := time.Now()
	got := resp.Claims[string(claim.UID)]
	switch {
	case got == nil:
		return fmt.Errorf("no result for claim %s", claim.Name)
	case got.Error != "":
		return fmt.Errorf("claim %s: %s", claim.Name, got.Error)
	case len(got.Devices) == 0:
		return fmt.Errorf("claim %s: no devices prepared", claim.Name)
	}
	rec.update(name, func(p *benchPod) {
		if p.prepared.IsZero() {
			p.prepared = now
		}
	})
	return nil
}

// benchDiagnose logs what a few pods that were never prepared look like.
func benchDiagnose(t *testing.T, cp *controlPlane, ns string, rec *benchRecorder) {
	rec.mu.Lock()
	var stuck []string
	for name, p := range rec.pods {
		if p.prepared.IsZero() {
			stuck = append(stuck, name)
		}
	}
	rec.mu.Unlock()
	slices.Sort(stuck)
	ctx := context.Background()
	for _, name := range stuck[:min(len(stuck), 5)] {
		pod, err := cp.Client.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			t.Logf("pod %s: %v", name, err)
			continue
		}
		t.Logf("pod %s: node %q, conditions %+v", name, pod.Spec.NodeName, pod.Status.Conditions)
		if claim, err := cp.podClaim(ctx, pod, "gpu"); err != nil {
			t.Logf("  claim: %v", err)
		} else {
			t.Logf("  claim %s: allocation %v, devices %+v", claim.Name, claim.Status.Allocation != nil, claim.Status.Devices)
		}
	}
}

// benchErrors counts errors and keeps the first.
type benchErrors struct {
	mu  sync.Mutex
	n   int
	err error
}

func (e *benchErrors) add(err error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.n++
	if e.err == nil {
		e.err = err
	}
}

func (e *benchErrors) count() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.n
}

func (e *benchErrors) first() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.err
}

// benchStatsOf returns the nearest-rank p50 and p99 and the max of ds.
func benchStatsOf(ds []time.Duration) *benchStats {
	slices.Sort(ds)
	rank := func(p float64) float64 {
		i := int(math.Ceil(p*float64(len(ds)))) - 1
		return ds[max(0, min(i, len(ds)-1))].Seconds()
	}
	return &benchStats{N: len(ds), P50: rank(0.50), P99: rank(0.99), Max: ds[len(ds)-1].Seconds()}
}

// benchReport is k8s.json; markdown renders k8s.md.
type benchReport struct {
	Benchmark      string         `json:"benchmark"`
	Date           string         `json:"date"`
	Config         benchConfig    `json:"config"`
	Env            map[string]any `json:"env"`
	Sides          []*benchSide   `json:"sides"`
	Metrics        []benchMetric  `json:"metrics"`
	Notes          []string       `json:"notes"`
	ElapsedSeconds float64        `json:"elapsed_seconds"`
}

// benchMetric compares one number of both sides; ratio is gpupool/baseline.
type benchMetric struct {
	Name     string   `json:"name"`
	Label    string   `json:"label"`
	Unit     string   `json:"unit"`
	Better   string   `json:"better"`
	Gpupool  float64  `json:"gpupool"`
	Baseline *float64 `json:"baseline"`
	Ratio    *float64 `json:"ratio"`
}

func newBenchReport(cfg benchConfig, sides []*benchSide, elapsed time.Duration) *benchReport {
	r := &benchReport{
		Benchmark: "k8s",
		Date:      time.Now().UTC().Format(time.RFC3339),
		Config:    cfg,
		Env: map[string]any{
			"go_version": runtime.Version(), "os": runtime.GOOS, "arch": runtime.GOARCH, "cpus": runtime.NumCPU(),
			"kubernetes": benchKubeVersion + " (kube-apiserver, kube-scheduler, kube-controller-manager in the test process, embedded etcd)",
		},
		Sides:          sides,
		ElapsedSeconds: elapsed.Seconds(),
		Notes: []string{
			benchPollNote,
			"Times are measured in the test process: the creation time is when the pod's create request was sent; " +
				"allocated, Leased and bound are when an informer saw the change; prepared is when the kubelet stand-in's " +
				"NodePrepareResources call returned success. Percentiles are nearest-rank.",
			"gpupool k8s-controller talks to the apiserver at --kube-api-qps 50, burst 100 (its defaults; the binder writes one " +
				"status update per claim); the node plugins, like the baseline's, keep client-go's default of 5 requests/s.",
			"Everything shares one machine: control plane, etcd, brokers, simulated agents, controller, node plugins and the stand-ins. " +
				"The gpupool side ran first, then the baseline, each with its own nodes, pools and namespace.",
		},
	}
	gp, bl := sides[0], sides[1]
	for _, st := range benchStages {
		g := gp.Stages[st.key]
		if g == nil {
			continue
		}
		b := bl.Stages[st.key]
		for _, q := range []struct {
			name string
			get  func(*benchStats) float64
		}{{"p50", func(s *benchStats) float64 { return s.P50 }}, {"p99", func(s *benchStats) float64 { return s.P99 }}, {"max", func(s *benchStats) float64 { return s.Max }}} {
			m := benchMetric{Name: st.key + "_" + q.name, Label: "pod creation → " + st.label + ", " + q.name, Unit: "s", Better: "lower", Gpupool: q.get(g)}
			if b != nil {
				m.Baseline, m.Ratio = ptr.To(q.get(b)), ptr.To(q.get(g)/q.get(b))
			}
			r.Metrics = append(r.Metrics, m)
		}
	}
	r.Metrics = append(r.Metrics,
		benchMetric{Name: "wall", Label: "wall time, first create → last prepared", Unit: "s", Better: "lower",
			Gpupool: gp.WallSeconds, Baseline: ptr.To(bl.WallSeconds), Ratio: ptr.To(gp.WallSeconds / bl.WallSeconds)},
		benchMetric{Name: "throughput", Label: "pods prepared per second", Unit: "pods/s", Better: "higher",
			Gpupool: gp.PodsPerSecond, Baseline: ptr.To(bl.PodsPerSecond), Ratio: ptr.To(gp.PodsPerSecond / bl.PodsPerSecond)})
	return r
}

func (r *benchReport) markdown() string {
	gp, bl := r.Sides[0], r.Sides[1]
	var b strings.Builder
	fmt.Fprintf(&b, "# k8s benchmark: %d pods with fractional claims\n\n", r.Config.Pods)
	fmt.Fprintf(&b, "`make bench-k8s` (test/k8s TestBenchK8s), %s; Kubernetes %s; %s/%s, %d CPUs, %s.\n\n",
		r.Date, benchKubeVersion, r.Env["os"], r.Env["arch"], r.Env["cpus"], r.Env["go_version"])
	fmt.Fprintf(&b, "Each pod has one claim from a ResourceClaimTemplate: %s and %s %% of one `gpu.gpupool.dev` GPU (%d pods fill a GPU). "+
		"%d pool hosts × %d %s; %d client nodes. Pods created %s. Kubelet: %s.\n\n",
		r.Config.Memory, r.Config.Compute, benchPodsPerGPU, r.Config.Hosts, r.Config.GPUsPerHost, r.Config.GPU, r.Config.Nodes, r.Config.Creation, r.Config.Kubelet)
	fmt.Fprintf(&b, "| from pod creation to | gpupool p50 | p99 | max | baseline p50 | p99 | max | ratio p50 | ratio p99 |\n")
	fmt.Fprintf(&b, "|---|--:|--:|--:|--:|--:|--:|--:|--:|\n")
	sec := func(v float64) string { return fmt.Sprintf("%.2f s", v) }
	for _, st := range benchStages {
		g := gp.Stages[st.key]
		if g == nil {
			continue
		}
		fmt.Fprintf(&b, "| %s | %s | %s | %s |", st.label, sec(g.P50), sec(g.P99), sec(g.Max))
		if bs := bl.Stages[st.key]; bs != nil {
			fmt.Fprintf(&b, " %s | %s | %s | %.2f | %.2f |\n", sec(bs.P50), sec(bs.P99), sec(bs.Max), g.P50/bs.P50, g.P99/bs.P99)
		} else {
			fmt.Fprintf(&b, " — | — | — | — | — |\n")
		}
	}
	fmt.Fprintf(&b, "\n| | gpupool | baseline | ratio |\n|---|--:|--:|--:|\n")
	fmt.Fprintf(&b, "| wall time, first create → last prepared | %s | %s | %.2f |\n", sec(gp.WallSeconds), sec(bl.WallSeconds), gp.WallSeconds/bl.WallSeconds)
	fmt.Fprintf(&b, "| pods prepared per second | %.1f | %.1f | %.2f |\n", gp.PodsPerSecond, bl.PodsPerSecond, gp.PodsPerSecond/bl.PodsPerSecond)
	fmt.Fprintf(&b, "| creating the %d pods | %s | %s | |\n", r.Config.Pods, sec(gp.CreateSeconds), sec(bl.CreateSeconds))
	fmt.Fprintf(&b, "| claims that saw `LeaseFailed` | %d | — | |\n", gp.LeaseFailed)
	fmt.Fprintf(&b, "| failed `NodePrepareResources` calls (retried) | %d | %d | |\n", gp.PrepareRetries, bl.PrepareRetries)
	fmt.Fprintf(&b, "\nRatios are gpupool / baseline (lower is better for times).\n\n")
	fmt.Fprintf(&b, "- **gpupool**: %s.\n- **baseline**: %s.\n\n", gp.Does, bl.Does)
	for _, n := range r.Notes {
		fmt.Fprintf(&b, "- %s\n", n)
	}
	return b.String()
}
