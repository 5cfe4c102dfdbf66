package main

import (
	"fmt"
	"os"
	"path/filepath"

	"github.com/spf13/cobra"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/gpupool/gpupool/k8s/nodeplugin"
)

type nodePluginOpts struct {
	nodeName     string
	kubeconfig   string
	stateDir     string
	cdiDir       string
	pluginDir    string
	registrarDir string
	cudaShim     string
	logLevel     string
}

func newK8sNodePluginCmd() *cobra.Command {
	var o nodePluginOpts
	cmd := &cobra.Command{
		Use:   "k8s-node-plugin [--node-name NODE] [--state-dir DIR] [--cdi-dir DIR] [--plugin-dir DIR] [--registrar-dir DIR]",
		Short: "Run the kubelet plugin of the gpu.gpupool.dev DRA driver on a Kubernetes node",
		Long: `Run the node side of the gpu.gpupool.dev DRA driver, as a DaemonSet on the nodes
whose pods use pool GPUs. It registers with the kubelet and prepares the
ResourceClaims of pods scheduled here.

For each claim it reads the leases the controller ('gpupool k8s-controller')
took for the claim's devices from the claim's status (Leased=True), keeps
them renewed from this node, and hands them to the containers through one CDI
device, gpu.gpupool.dev/claim=<claim uid>, which sets
  GPUPOOL_LEASE_ID         the claim's leases, one per device, comma-separated
  GPUPOOL_AGENT_ADDR       the data-plane address of each lease's agent
  GPUPOOL_MEMORY_MIB       the memory of each lease, in MiB
  GPUPOOL_COMPUTE_PERCENT  the compute share of each lease
  GPUPOOL_TOKEN_FILE       /var/run/gpupool/token.json
The token file lives in --state-dir (claims/<uid>/token.json), is rewritten
after every renewal and is bind-mounted read-only into the container, where
'gpupool exec -- CMD' and the SDK's client.FromEnv use it to reach the
agent without talking to the brokers. A claim whose lease is not granted yet
fails to prepare with the reason; the kubelet retries. Unpreparing stops the
renewal and removes the files; the controller releases the lease.

With --cuda-shim (gpupool's libcuda.so.1) every claim's CDI device also
bind-mounts the shim into the image's default library directories, so an
unmodified CUDA program finds it, and sets
  GPUPOOL_CUDA_SOCKET      /var/run/gpupool/cuda.sock
a socket the plugin serves for the claim: it carries the program's CUDA
calls over the data plane to the lease's GPU with the token it renews.

After a restart the plugin resumes renewing the claims it finds in
--state-dir. Every directory is the node's own path, mounted at the same path
in the plugin's container: the kubelet dials the sockets, and the container
runtime reads the CDI specs (containerd 2.0+ and CRI-O read /var/run/cdi) and
bind-mounts the token directories, by the paths the plugin writes.

It needs to get ResourceClaims; --kubeconfig defaults to the in-cluster
service account (else $KUBECONFIG or ~/.kube/config). --node-name defaults to
$NODE_NAME (set it from the downward API: spec.nodeName). The brokers are
--addr (default $GPUPOOL_ADDR), over mutual TLS with --tls-ca, --tls-cert and
--tls-key (a certificate issued with --role client). With ACL on it needs a
token, --token or $GPUPOOL_TOKEN: a client token for the controller's tenant
(it reads and renews that tenant's leases). Runs until SIGINT or SIGTERM.`,
		Example: `  # in the DaemonSet (see deploy/helm/gpupool)
  gpupool k8s-node-plugin --addr gpupool-broker-0.gpupool-broker:7641,gpupool-broker-1.gpupool-broker:7641

  # on a kubelet with another root directory
  gpupool k8s-node-plugin --node-name worker-3 \
    --plugin-dir /data/kubelet/plugins/gpu.gpupool.dev --registrar-dir /data/kubelet/plugins_registry`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error { return runNodePlugin(cmd, o) },
	}
	f := cmd.Flags()
	f.StringVar(&o.nodeName, "node-name", os.Getenv("NODE_NAME"), "name of this node (default $NODE_NAME)")
	f.StringVar(&o.kubeconfig, "kubeconfig", "", "kubeconfig file (default: in-cluster, else $KUBECONFIG or ~/.kube/config)")
	f.StringVar(&o.stateDir, "state-dir", nodeplugin.DefaultNodeStateDir, "directory of the prepared claims' token files, bind-mounted into their containers")
	f.StringVar(&o.cdiDir, "cdi-dir", nodeplugin.DefaultCDIDir, "directory the container runtime reads CDI specs from")
	f.StringVar(&o.pluginDir, "plugin-dir", nodeplugin.DefaultPluginDir, "directory of the plugin's dra.sock, which the kubelet dials")
	f.StringVar(&o.registrarDir, "registrar-dir", nodeplugin.DefaultRegistrarDir, "the kubelet's plugin registration directory (must exist)")
	f.StringVar(&o.cudaShim, "cuda-shim", "", "gpupool's CUDA shim, libcuda.so.1, to give every claim's containers with a CUDA socket (default none: no remote CUDA in pods)")
	f.StringVar(&o.logLevel, "log-level", "info", "log level: debug, info, warn or error")
	return cmd
}

func runNodePlugin(cmd *cobra.Command, o nodePluginOpts) error {
	logger, err := newLogger(o.logLevel)
	if err != nil {
		return err
	}
	if o.nodeName == "" {
		return usagef("--node-name is empty: give this node's name, or set NODE_NAME (in a pod, from the downward API: spec.nodeName)")
	}
	for _, d := range []struct{ flag, path string }{
		{"state-dir", o.stateDir}, {"cdi-dir", o.cdiDir}, {"plugin-dir", o.pluginDir}, {"registrar-dir", o.registrarDir},
	} {
		if !filepath.IsAbs(d.path) {
			return usagef("--%s %q: must be an absolute path, the same on the node and in the plugin's container", d.flag, d.path)
		}
	}
	if o.cudaShim != "" {
		if st, err := os.Stat(o.cudaShim); err != nil || !st.Mode().IsRegular() {
			return usagef("--cuda-shim %s: not a file; give gpupool's libcuda.so.1 ('make build' puts it in bin/lib)", o.cudaShim)
		}
	}
	if st, err := os.Stat(o.registrarDir); err != nil || !st.IsDir() {
		return usagef("--registrar-dir %s: no such directory; give the kubelet's plugins_registry (KUBELET_ROOT/plugins_registry), mounted at the same path", o.registrarDir)
	}
	c, err := dial()
	if err != nil {
		return err
	}
	defer c.Close()
	kubeCfg, err := loadKubeConfig(o.kubeconfig)
	if err != nil {
		return err
	}
	kubeCfg.UserAgent = "gpupool-k8s-node-plugin"
	kube, err := kubernetes.NewForConfig(kubeCfg)
	if err != nil {
		return fmt.Errorf("kubernetes client: %w", err)
	}

	ctx := cmd.Context()
	p, err := nodeplugin.Start(ctx, nodeplugin.Config{
		NodeName:     o.nodeName,
		KubeClient:   kube,
		Brokers:      nodeplugin.ClientAttacher(c),
		StateDir:     o.stateDir,
		CDIDir:       o.cdiDir,
		PluginDir:    o.pluginDir,
		RegistrarDir: o.registrarDir,
		CUDAShim:     o.cudaShim,
		Logger:       logger,
	})
	if err != nil {
		return err
	}
	defer p.Stop()
	select {
	case <-ctx.Done():
		logger.Info("stopping: the claims' leases stay granted and resume at the next start")
		return nil
	case <-p.Failed():
		return p.Err()
	}
}

// loadKubeConfig is the apiserver configuration of --kubeconfig path, or,
// for "", the in-cluster one, else $KUBECONFIG's or ~/.kube/config's, as
// kubectl finds it. A missing file or no configuration at all is a usage
// error.
func loadKubeConfig(path string) (*rest.Config, error) {
	if path != "" {
		if _, err := os.Stat(path); err != nil {
			return nil, usagef("--kubeconfig %s: %v", path, err)
		}
	}
	rules := clientcmd.NewDefaultClientConfigLoadingRules()
	rules.ExplicitPath = path
	cfg, err := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(rules, &clientcmd.ConfigOverrides{}).ClientConfig()
	if err != nil {
		if clientcmd.IsEmptyConfig(err) {
			return nil, usagef("no Kubernetes configuration: not in a pod, no $KUBECONFIG nor ~/.kube/config; give --kubeconfig")
		}
		return nil, fmt.Errorf("kubeconfig: %w", err)
	}
	return cfg, nil
}
