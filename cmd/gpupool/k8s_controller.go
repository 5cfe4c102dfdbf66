package main

import (
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/spf13/cobra"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/klog/v2"

	"github.com/gpupool/gpupool/client"
	"github.com/gpupool/gpupool/k8s/controller"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
	"github.com/gpupool/gpupool/protocol"
)

type controllerOpts struct {
	kubeconfig   string
	tenant       string
	clusterID    string
	takeOver     bool
	nodeSelector string
	leaderElect  bool
	namespace    string
	leaseTTL     time.Duration
	metrics      string
	logLevel     string
	qps          float32
	burst        int
}

func newK8sControllerCmd() *cobra.Command {
	var o controllerOpts
	cmd := &cobra.Command{
		Use:   "k8s-controller [--tenant NAME] [--node-selector KEY=VALUE[,KEY=VALUE]] [--leader-elect=false]",
		Short: "Run the controller of the gpu.gpupool.dev DRA driver: publish the pool, lease claimed GPUs",
		Long: `Run the cluster side of the gpu.gpupool.dev DRA driver, as a Deployment. It does
two things while it leads (one replica acts; the others stand by):

Publisher. Every pool host becomes a ResourceSlice pool named after the host,
usable from the nodes --node-selector matches (where the node plugin runs). Each
GPU is a device named after its UUID (GPU-8a1b... is gpu-8a1b...) with
attributes model, uuid, host, index, mps, nvlinkDomain (<host>/nvlink-<k>, for
GPUs with NVLink) and resource.kubernetes.io/pcieRoot (<host>/<root>), and
consumable capacity: memory (bytes, in steps of 1Mi) and compute (1-100).
A claim that requests no capacity takes the whole GPU. What leases of other
tenants than --tenant hold is taken off the capacity; a GPU with nothing left
is tainted gpu.gpupool.dev/busy (NoSchedule), the GPUs of draining, drained or
down hosts and unhealthy GPUs gpu.gpupool.dev/<draining|drained|down|unhealthy>
(NoExecute: their pods are evicted). The slices follow the brokers' lease
events and are read again every 10s for host and GPU status.

Binder. For every device the scheduler allocates from a ResourceClaim, it asks
the brokers for a lease on exactly that GPU and the memory and compute the
claim consumes (the whole GPU: an exclusive lease), with the tenant --tenant and
the request id <claim uid>/<share id>, and reports it in the claim's
status.devices: Leased=True with the lease id and agent address, which the
scheduler waits for before it binds the pod; or LeaseFailed=True with the
brokers' reason, and the scheduler allocates again. Brokers that cannot be
reached are retried, never reported as failed. A lease that ends under a
running pod sets Leased=False (reason LeaseEnded) and a Warning event on the
pod. Leases are renewed, and released when the claim is deallocated or
deleted; a new leader takes over the leases of the last one and releases those
whose claim is gone.

One cluster per tenant: before it touches the tenant's leases, the leader
claims --tenant at the brokers for this cluster (--cluster-id, by default the
UID of namespace kube-system). A controller of another cluster with the same
--tenant stops with an error naming the cluster that holds it; give it another
--tenant, or, when the first cluster is gone for good, start it once with
--take-over-tenant.

The brokers are --addr (default $GPUPOOL_ADDR), over mutual TLS with
--tls-ca, --tls-cert and --tls-key (a certificate issued with --role client;
reloaded when the files change). With ACL on (the brokers' default) it needs
its own token, --token or $GPUPOOL_TOKEN: a client token for --tenant
('gpupool operator acl token create --kind client --tenant k8s'), which lets
it manage that tenant's leases and read the pool, and nothing else. It then
sees other tenants' use of a GPU only as the GPU's allocation. --kubeconfig
defaults to the in-cluster service account, else $KUBECONFIG or
~/.kube/config. It needs RBAC
for resourceslices (get, list, watch, create, update, delete), resourceclaims
(get, list, watch), resourceclaims/status (update), resourceclaims/driver
(arbitrary-node:update and arbitrary-node:patch, resourceNames gpu.gpupool.dev),
leases in the leader election namespace (get, create, update), events
(create, patch) and, without --cluster-id, namespaces/kube-system (get). Runs
until SIGINT or SIGTERM; exits with code 1 when it loses leadership.`,
		Example: `  # in the Deployment (see deploy/helm/gpupool)
  gpupool k8s-controller --addr gpupool-broker-0.gpupool-broker:7641,gpupool-broker-1.gpupool-broker:7641

  # pools reachable only from labelled nodes of one zone
  gpupool k8s-controller --node-selector gpu.gpupool.dev/client=true,topology.kubernetes.io/zone=eu-1a

  # a single replica against a dev cluster, from a workstation
  gpupool k8s-controller --kubeconfig ~/.kube/config --leader-elect=false`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error { return runK8sController(cmd, o) },
	}
	f := cmd.Flags()
	f.StringVar(&o.kubeconfig, "kubeconfig", "", "kubeconfig file (default: in-cluster, else $KUBECONFIG or ~/.kube/config)")
	f.StringVar(&o.tenant, "tenant", controller.DefaultTenant, "broker tenant of the leases taken for claims; other tenants' leases are taken off the published capacity. One tenant per cluster: the controller releases leases of its tenant that no claim of its cluster holds")
	f.StringVar(&o.clusterID, "cluster-id", "", "identity of this cluster in the brokers' claim on --tenant (default: the UID of namespace kube-system); a second cluster with the same --tenant is refused")
	f.BoolVar(&o.takeOver, "take-over-tenant", false, "take --tenant over from the cluster that claimed it: only when that cluster is gone, or both would release each other's leases")
	f.StringVar(&o.nodeSelector, "node-selector", controller.DefaultNodeSelectorLabel+"=true", "labels of the nodes that can reach the pool hosts, as KEY=VALUE[,KEY=VALUE]; empty means every node")
	f.BoolVar(&o.leaderElect, "leader-elect", true, "act only while holding the Lease "+controller.LeaderLeaseName+", so that replicas can stand by")
	f.StringVar(&o.namespace, "leader-elect-namespace", "", "namespace of the leader election Lease (default: the pod's own, else default)")
	f.DurationVar(&o.leaseTTL, "lease-ttl", controller.DefaultLeaseTTL, "TTL of the leases taken for claims (renewed by the controller and the node plugin); longer than a leader failover (~15s)")
	f.StringVar(&o.metrics, "metrics-bind", "", "serve Prometheus metrics at http://ADDR/metrics; empty serves none")
	f.StringVar(&o.logLevel, "log-level", "info", "log level: debug, info, warn or error")
	f.Float32Var(&o.qps, "kube-api-qps", 50, "requests per second to the apiserver (each bound claim takes one status write)")
	f.IntVar(&o.burst, "kube-api-burst", 100, "requests to the apiserver in a burst above --kube-api-qps")
	return cmd
}

func runK8sController(cmd *cobra.Command, o controllerOpts) error {
	logger, err := newLogger(o.logLevel)
	if err != nil {
		return err
	}
	addrs := client.ParseAddrs(global.addr)
	if len(addrs) == 0 {
		return usagef("--addr is empty: give one or more broker addresses, e.g. 127.0.0.1:7641")
	}
	if err := checkTenantAndTTL(o.tenant, o.leaseTTL); err != nil {
		return err
	}
	// A new leader takes over the leases of claims still being bound; they
	// must outlive the old leader's lock and the takeover.
	if min := controller.MinLeaseTTLWithLeaderElection; o.leaderElect && o.leaseTTL < min {
		return usagef("--lease-ttl %s: must be at least %s with --leader-elect, so that leases outlive a leader failover", o.leaseTTL, min)
	}
	selector, err := parseNodeSelector(o.nodeSelector)
	if err != nil {
		return err
	}
	if len(o.clusterID) > 128 || strings.TrimSpace(o.clusterID) != o.clusterID {
		return usagef("--cluster-id %q: must be at most 128 characters without surrounding spaces, or empty for the UID of namespace kube-system", o.clusterID)
	}
	if o.namespace != "" {
		if !o.leaderElect {
			return usagef("--leader-elect-namespace needs --leader-elect: without leader election there is no Lease")
		}
		if errs := validation.IsDNS1123Label(o.namespace); len(errs) > 0 {
			return usagef("--leader-elect-namespace %q: must be a namespace name: %s", o.namespace, strings.Join(errs, "; "))
		}
	}
	if o.qps <= 0 || o.burst < 1 {
		return usagef("--kube-api-qps %g and --kube-api-burst %d: must be above 0 and at least 1", o.qps, o.burst)
	}
	tc, err := global.tls.clientTLS(logger)
	if err != nil {
		return err
	}
	kubeCfg, err := loadKubeConfig(o.kubeconfig)
	if err != nil {
		return err
	}
	kubeCfg.QPS, kubeCfg.Burst = o.qps, o.burst

	klog.SetSlogLogger(logger)
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	if err := serveMetrics(cmd.Context(), o.metrics, reg, nil, logger); err != nil {
		return err
	}
	err = controller.Run(cmd.Context(), controller.Config{
		Brokers:        addrs,
		Token:          globalToken(),
		TLS:            tc,
		Kube:           kubeCfg,
		Tenant:         o.tenant,
		ClusterID:      o.clusterID,
		TakeOverTenant: o.takeOver,
		NodeSelector:   selector,
		LeaseTTL:       o.leaseTTL,
		LeaderElect:    o.leaderElect,
		Namespace:      o.namespace,
		Logger:         logger,
	})
	if errors.Is(err, controller.ErrLostLeadership) {
		return fmt.Errorf("%w: another replica took over; exiting so that this one restarts as a standby", err)
	}
	return err
}

// checkTenantAndTTL checks --tenant and --lease-ttl by the brokers' own
// rules for a lease request.
func checkTenantAndTTL(tenant string, ttl time.Duration) error {
	if ttl < protocol.MinTTL || ttl > protocol.MaxTTL {
		return usagef("--lease-ttl %s: must be between %s and %s", ttl, protocol.MinTTL, protocol.MaxTTL)
	}
	if tenant == "" {
		return usagef("--tenant is empty: give the broker tenant of the controller's leases, e.g. %s", controller.DefaultTenant)
	}
	err := protocol.Validate(&gpupoolv1.LeaseRequest{Count: 1, Exclusive: true, TtlMs: ttl.Milliseconds(), Tenant: tenant})
	if err != nil {
		return usagef("--%v", err)
	}
	return nil
}

// parseNodeSelector parses KEY=VALUE[,KEY=VALUE] into labels; "" is no
// selector.
func parseNodeSelector(s string) (map[string]string, error) {
	if strings.TrimSpace(s) == "" {
		return nil, nil
	}
	out := map[string]string{}
	for _, p := range strings.Split(s, ",") {
		k, v, ok := strings.Cut(strings.TrimSpace(p), "=")
		if !ok || k == "" {
			return nil, usagef("--node-selector %q: want KEY=VALUE[,KEY=VALUE], e.g. %s=true", s, controller.DefaultNodeSelectorLabel)
		}
		if errs := validation.IsQualifiedName(k); len(errs) > 0 {
			return nil, usagef("--node-selector %q: label key %q: %s", s, k, strings.Join(errs, "; "))
		}
		if errs := validation.IsValidLabelValue(v); len(errs) > 0 {
			return nil, usagef("--node-selector %q: label value %q: %s", s, v, strings.Join(errs, "; "))
		}
		if prev, dup := out[k]; dup && prev != v {
			return nil, usagef("--node-selector %q: label %q is given as %q and %q; a node has one value", s, k, prev, v)
		}
		out[k] = v
	}
	return out, nil
}
