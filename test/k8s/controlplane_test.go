package k8s

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spf13/pflag"
	"go.etcd.io/etcd/server/v3/embed"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apiserver/pkg/storage/storagebackend"
	utilfeature "k8s.io/apiserver/pkg/util/feature"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	basecompatibility "k8s.io/component-base/compatibility"
	"k8s.io/component-base/featuregate"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"

	"k8s.io/apiserver/pkg/util/compatibility"
	apiservertesting "k8s.io/kubernetes/cmd/kube-apiserver/app/testing"
	kcmapp "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	kcmoptions "k8s.io/kubernetes/cmd/kube-controller-manager/app/options"
	schedapp "k8s.io/kubernetes/cmd/kube-scheduler/app"
	schedoptions "k8s.io/kubernetes/cmd/kube-scheduler/app/options"
	"k8s.io/kubernetes/pkg/features"
)

// apiserverFlags are the kube-apiserver's flags on top of what
// StartTestServer sets (listener, serving certs, service-account keys and
// issuer, service cluster IP range, etcd).
var apiserverFlags = []string{
	"--authorization-mode=Node,RBAC",
	// No service-account controller runs, so pods could never get a token.
	"--disable-admission-plugins=ServiceAccount",
	// There is no kubelet or kube-proxy behind 127.0.0.1 to be an endpoint.
	"--endpoint-reconciler-type=none",
	// DeviceTaintRule is beta but off by default in 1.36, and served only
	// by resource.k8s.io/v1beta2. Consumable capacity, binding conditions,
	// device taints, device status, the granular status authorization and
	// extended resources backed by DRA (DRAExtendedResource) are on by
	// default.
	"--feature-gates=DRADeviceTaintRules=true",
	"--runtime-config=resource.k8s.io/v1beta2=true",
}

// draFeatures are the DRA feature gates that our driver relies on; the
// suite refuses to start without them.
var draFeatures = []featuregate.Feature{
	features.DRAConsumableCapacity,
	features.DRADeviceBindingConditions,
	features.DRAExtendedResource,
	features.DRADeviceTaints,
	features.DRADeviceTaintRules,
	features.DRAResourceClaimDeviceStatus,
	features.DRAResourceClaimGranularStatusAuthorization,
}

// kcmControllers are the controllers the kube-controller-manager runs:
// resourceclaim-controller makes claims from templates and deallocates them;
// device-taint-eviction-controller evicts pods from NoExecute-tainted
// devices; the garbage collector deletes a deleted pod's generated claims;
// the namespace controller empties each test's namespace afterwards.
var kcmControllers = []string{
	"resourceclaim-controller",
	"device-taint-eviction-controller",
	"garbage-collector-controller",
	"namespace-controller",
}

// controlPlane is the suite's etcd, kube-apiserver, kube-scheduler and
// kube-controller-manager, all in this process.
type controlPlane struct {
	// Config is the apiserver's admin (system:masters) loopback config.
	Config *rest.Config
	// Client uses Config.
	Client kubernetes.Interface
	// Kubeconfig is a kubeconfig file for Config, for child processes.
	Kubeconfig string
}

var (
	cpOnce   sync.Once
	cpShared *controlPlane
	cpErr    error
)

// sharedControlPlane returns the test binary's control plane, starting it
// on first use (a few seconds). It lives until the test binary exits.
func sharedControlPlane(t testing.TB) *controlPlane {
	t.Helper()
	cpOnce.Do(func() {
		start := time.Now()
		cpShared, cpErr = startControlPlane()
		t.Logf("control plane started in %s (log: %s)", time.Since(start).Round(time.Millisecond), filepath.Join(suiteDir, "control-plane.log"))
	})
	if cpErr != nil {
		t.Fatalf("start control plane: %v (log: %s)", cpErr, filepath.Join(suiteDir, "control-plane.log"))
	}
	return cpShared
}

// startControlPlane starts etcd, the apiserver, the scheduler and the
// controller manager; their teardown is registered with the suite.
func startControlPlane() (cp *controlPlane, err error) {
	defer func() {
		if r := recover(); r != nil {
			f, ok := r.(suiteFatal)
			if !ok {
				panic(r)
			}
			err = errors.New(f.msg)
		}
	}()
	ctx := klog.NewContext(context.Background(), klog.Background())
	etcdURL, err := startEtcd(filepath.Join(suiteDir, "etcd"))
	if err != nil {
		return nil, fmt.Errorf("etcd: %w", err)
	}
	storage := storagebackend.NewDefaultConfig("/registry", nil)
	storage.Transport.ServerList = []string{etcdURL}
	server, err := apiservertesting.StartTestServer(suite, nil, apiserverFlags, storage)
	if err != nil {
		return nil, fmt.Errorf("kube-apiserver: %w", err)
	}
	suite.Cleanup(server.TearDownFn)

	for _, f := range draFeatures {
		if !utilfeature.DefaultFeatureGate.Enabled(f) {
			return nil, fmt.Errorf("feature gate %s is off: enable it in apiserverFlags", f)
		}
	}

	cp = &controlPlane{Config: rest.CopyConfig(server.ClientConfig)}
	if cp.Client, err = kubernetes.NewForConfig(cp.Config); err != nil {
		return nil, err
	}
	cp.Kubeconfig = filepath.Join(suiteDir, "admin.kubeconfig")
	if err := writeKubeconfig(cp.Kubeconfig, cp.Config); err != nil {
		return nil, err
	}
	if err := startScheduler(ctx, cp.Kubeconfig); err != nil {
		return nil, fmt.Errorf("kube-scheduler: %w", err)
	}
	if err := startControllerManager(ctx, cp.Kubeconfig); err != nil {
		return nil, fmt.Errorf("kube-controller-manager: %w", err)
	}
	return cp, nil
}

// startEtcd starts a single-member embedded etcd with its data in dir and
// returns its client URL. It stops with the suite.
func startEtcd(dir string) (string, error) {
	cfg := embed.NewConfig()
	cfg.Name = "test-k8s"
	cfg.Dir = dir
	cfg.LogLevel = "warn"
	cfg.LogOutputs = []string{filepath.Join(suiteDir, "etcd.log")}
	var urls [2]url.URL
	for i := range urls {
		addr, err := freePort()
		if err != nil {
			return "", err
		}
		urls[i] = url.URL{Scheme: "http", Host: addr}
	}
	cfg.ListenClientUrls, cfg.AdvertiseClientUrls = urls[:1], urls[:1]
	cfg.ListenPeerUrls, cfg.AdvertisePeerUrls = urls[1:], urls[1:]
	cfg.InitialCluster = cfg.InitialClusterFromName(cfg.Name)
	e, err := embed.StartEtcd(cfg)
	if err != nil {
		return "", err
	}
	suite.Cleanup(e.Close)
	select {
	case <-e.Server.ReadyNotify():
	case err := <-e.Err():
		return "", err
	case <-time.After(time.Minute):
		return "", errors.New("not ready after 1m")
	}
	return urls[0].String(), nil
}

// freePort asks the kernel for a free TCP port on 127.0.0.1.
func freePort() (string, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer l.Close()
	return l.Addr().String(), nil
}

// writeKubeconfig writes cfg (server, CA, bearer token, impersonation) as a
// kubeconfig file.
func writeKubeconfig(path string, cfg *rest.Config) error {
	kc := clientcmdapi.NewConfig()
	kc.Clusters["test"] = &clientcmdapi.Cluster{
		Server:                   cfg.Host,
		CertificateAuthorityData: cfg.TLSClientConfig.CAData,
		TLSServerName:            cfg.TLSClientConfig.ServerName,
	}
	kc.AuthInfos["test"] = &clientcmdapi.AuthInfo{
		Token:             cfg.BearerToken,
		Impersonate:       cfg.Impersonate.UserName,
		ImpersonateGroups: cfg.Impersonate.Groups,
	}
	kc.Contexts["test"] = &clientcmdapi.Context{Cluster: "test", AuthInfo: "test"}
	kc.CurrentContext = "test"
	return clientcmd.WriteToFile(*kc, path)
}

// newComponentGlobals returns a registry whose feature gate is a copy of the
// process-wide one, so that a component does not reset the gates that the
// apiserver's --feature-gates set.
func newComponentGlobals() (basecompatibility.ComponentGlobalsRegistry, error) {
	featureGate := utilfeature.DefaultMutableFeatureGate.DeepCopy()
	effectiveVersion := compatibility.DefaultKubeEffectiveVersionForTest()
	effectiveVersion.SetEmulationVersion(featureGate.EmulationVersion())
	effectiveVersion.SetMinCompatibilityVersion(featureGate.MinCompatibilityVersion())
	registry := basecompatibility.NewComponentGlobalsRegistry()
	if err := registry.Register(basecompatibility.DefaultKubeComponent, effectiveVersion, featureGate); err != nil {
		return nil, err
	}
	return registry, nil
}

// startScheduler runs kube-scheduler until ctx ends, as
// cmd/kube-scheduler/app/testing.StartTestServer does but with no serving
// port and no *testing.T (whose end would stop it).
func startScheduler(ctx context.Context, kubeconfig string) error {
	registry, err := newComponentGlobals()
	if err != nil {
		return err
	}
	opts := schedoptions.NewOptionsWithComponentGlobalsRegistry(registry)
	fs := pflag.NewFlagSet("kube-scheduler", pflag.ContinueOnError)
	for _, f := range opts.Flags.FlagSets {
		fs.AddFlagSet(f)
	}
	if err := fs.Parse([]string{"--kubeconfig=" + kubeconfig, "--leader-elect=false", "--secure-port=0"}); err != nil {
		return err
	}
	if err := registry.Set(); err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(klog.NewContext(ctx, klog.LoggerWithName(klog.FromContext(ctx), "kube-scheduler")))
	cc, sched, err := schedapp.Setup(ctx, opts)
	if err != nil {
		cancel()
		return err
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := schedapp.Run(ctx, cc, sched); err != nil {
			klog.FromContext(ctx).Error(err, "kube-scheduler stopped")
		}
	}()
	suite.Cleanup(func() { cancel(); <-done })
	return nil
}

// startControllerManager runs kube-controller-manager with kcmControllers
// until ctx ends, as cmd/kube-controller-manager/app/testing.StartTestServer
// does but with no serving port and no *testing.T.
func startControllerManager(ctx context.Context, kubeconfig string) error {
	registry, err := newComponentGlobals()
	if err != nil {
		return err
	}
	s, err := kcmoptions.NewKubeControllerManagerOptions()
	if err != nil {
		return err
	}
	s.ComponentGlobalsRegistry = registry
	all, disabled, aliases := kcmapp.KnownControllers(), kcmapp.ControllersDisabledByDefault(), kcmapp.ControllerAliases()
	namedFlagSets := s.Flags(all, disabled, aliases)
	fs := pflag.NewFlagSet("kube-controller-manager", pflag.ContinueOnError)
	for _, f := range namedFlagSets.FlagSets {
		fs.AddFlagSet(f)
	}
	if err := fs.Parse([]string{
		"--kubeconfig=" + kubeconfig, "--leader-elect=false", "--secure-port=0",
		"--controllers=" + strings.Join(kcmControllers, ","),
		"--kube-api-qps=200", "--kube-api-burst=400",
	}); err != nil {
		return err
	}
	s.ParsedFlags = &namedFlagSets
	if err := registry.Set(); err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(klog.NewContext(ctx, klog.LoggerWithName(klog.FromContext(ctx), "kube-controller-manager")))
	config, err := s.Config(ctx, all, disabled, aliases)
	if err != nil {
		cancel()
		return err
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := kcmapp.Run(ctx, config.Complete()); err != nil {
			klog.FromContext(ctx).Error(err, "kube-controller-manager stopped")
		}
	}()
	suite.Cleanup(func() { cancel(); <-done })
	return nil
}

// configFor returns a config that acts as user in groups, for exercising
// the RBAC of our components: the admin credentials impersonate the user,
// so every request is authorized (Node, RBAC) as that user alone. For a
// service account, user is "system:serviceaccount:NAMESPACE:NAME" and the
// groups should include "system:serviceaccounts" and
// "system:serviceaccounts:NAMESPACE".
func (cp *controlPlane) configFor(user string, groups ...string) *rest.Config {
	cfg := rest.CopyConfig(cp.Config)
	cfg.Impersonate = rest.ImpersonationConfig{UserName: user, Groups: groups}
	return cfg
}

// kubeconfigFor writes configFor(user, groups...) as a kubeconfig file in
// a temporary directory of t, for a child process's --kubeconfig.
func (cp *controlPlane) kubeconfigFor(t testing.TB, user string, groups ...string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "kubeconfig")
	if err := writeKubeconfig(path, cp.configFor(user, groups...)); err != nil {
		t.Fatal(err)
	}
	return path
}

// newNamespace creates a namespace for t (named after it) and deletes it,
// with its pods at once (no kubelet would ever finish them), when t ends.
func (cp *controlPlane) newNamespace(t testing.TB) string {
	t.Helper()
	prefix := strings.ToLower(t.Name())
	prefix = strings.Map(func(r rune) rune {
		if r >= 'a' && r <= 'z' || r >= '0' && r <= '9' {
			return r
		}
		return '-'
	}, prefix)
	prefix = strings.Trim(prefix[:min(len(prefix), 40)], "-") + "-"
	ns, err := cp.Client.CoreV1().Namespaces().Create(context.Background(),
		&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{GenerateName: prefix}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create namespace: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		pods := cp.Client.CoreV1().Pods(ns.Name)
		if err := pods.DeleteCollection(ctx, metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0)}, metav1.ListOptions{}); err != nil {
			t.Errorf("delete pods of namespace %s: %v", ns.Name, err)
		}
		err := cp.Client.CoreV1().Namespaces().Delete(ctx, ns.Name, metav1.DeleteOptions{})
		if err != nil && !apierrors.IsNotFound(err) {
			t.Errorf("delete namespace %s: %v", ns.Name, err)
		}
	})
	return ns.Name
}

// shortTempDir returns a new directory under /tmp, removed when t ends, for
// unix sockets: t.TempDir() paths can exceed the 107 bytes a socket path
// may have.
func shortTempDir(t testing.TB) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "gpk8s-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}
