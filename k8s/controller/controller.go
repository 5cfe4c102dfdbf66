// Package controller is the cluster side of the gpu.gpupool.dev DRA
// driver, 'gpupool k8s-controller': the Publisher mirrors each pool host
// into a ResourceSlice pool, and the Binder turns each allocated device of
// a ResourceClaim into a broker lease of the controller's tenant and
// reports it in the claim's status, for the node plugin to read. Run runs
// both while this replica leads (a coordination.k8s.io Lease); only the
// leader acts, and leases survive a handover by their request ids.
package controller

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/leaderelection"
	"k8s.io/client-go/tools/leaderelection/resourcelock"

	"github.com/gpupool/gpupool/client"
)

// LeaderLeaseName is the coordination.k8s.io Lease the controllers elect
// their leader with.
const LeaderLeaseName = "gpupool-k8s-controller"

// Leader election timing, as Kubernetes' own controllers have it.
const (
	leaderLeaseDuration = 15 * time.Second
	leaderRenewDeadline = 10 * time.Second
	leaderRetryPeriod   = 2 * time.Second
)

// MinLeaseTTLWithLeaderElection is the shortest lease TTL that outlives a
// failover: the old leader's lock, then the new one's informer sync and
// takeover of the leases of claims still being bound.
const MinLeaseTTLWithLeaderElection = 2*leaderLeaseDuration + 10*time.Second

// namespaceFile names the namespace of a pod's service account.
var namespaceFile = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"

// ErrLostLeadership is what Run returns when another controller took over.
var ErrLostLeadership = errors.New("k8s controller: lost leadership")

// Config configures the controller: publisher and binder.
type Config struct {
	// Brokers are the broker addresses.
	Brokers []string
	// Token is the controller's ACL token: a client token for Tenant (it
	// lists, acquires and releases that tenant's leases and reads the
	// pool). Empty for brokers without ACL.
	Token string
	// TLS, when set, makes the connection to the brokers mutual TLS (see
	// client.Options.TLS); nil is plaintext.
	TLS *tls.Config
	// Kube reaches the apiserver.
	Kube *rest.Config
	// Tenant of the binder's leases; empty means DefaultTenant. The
	// controller claims it for ClusterID at the brokers before it touches
	// the tenant's leases, and stops when another cluster holds it.
	Tenant string
	// ClusterID names this cluster in the tenant claim; empty means the
	// UID of the kube-system namespace (see ClusterID).
	ClusterID string
	// TakeOverTenant replaces another cluster's claim on Tenant: for a
	// cluster that is gone.
	TakeOverTenant bool
	// NodeSelector of every pool: the labels of the nodes that can reach
	// the pool hosts. Empty means every node.
	NodeSelector map[string]string
	// LeaseTTL of the binder's leases; 0 means DefaultLeaseTTL.
	LeaseTTL time.Duration
	// LeaderElect runs publisher and binder only while this controller
	// holds the Lease LeaderLeaseName in Namespace, so that replicas can
	// stand by.
	LeaderElect bool
	// Namespace of the leader Lease; empty means the pod's own namespace,
	// else "default".
	Namespace string
	// Identity in the leader Lease; empty means hostname_pid.
	Identity string
	// Logger defaults to slog.Default().
	Logger *slog.Logger
}

func (c Config) withDefaults() Config {
	if c.Tenant == "" {
		c.Tenant = DefaultTenant
	}
	if c.LeaseTTL <= 0 {
		c.LeaseTTL = DefaultLeaseTTL
	}
	if c.Namespace == "" {
		c.Namespace = os.Getenv("POD_NAMESPACE")
	}
	if c.Namespace == "" {
		if b, err := os.ReadFile(namespaceFile); err == nil {
			c.Namespace = strings.TrimSpace(string(b))
		}
	}
	if c.Namespace == "" {
		c.Namespace = metav1.NamespaceDefault
	}
	if c.Identity == "" {
		host, _ := os.Hostname()
		c.Identity = fmt.Sprintf("%s_%d", host, os.Getpid())
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

// Run runs the publisher and the binder until ctx ends, under leader
// election when cfg.LeaderElect is set. It returns ErrLostLeadership when
// another controller took over: the caller should exit, as Kubernetes'
// own controllers do.
func Run(ctx context.Context, cfg Config) error {
	cfg = cfg.withDefaults()
	if len(cfg.Brokers) == 0 {
		return client.ErrNoAddrs
	}
	if cfg.Kube == nil {
		return errors.New("k8s controller: no apiserver configuration")
	}
	kubeCfg := rest.CopyConfig(cfg.Kube)
	kubeCfg.UserAgent = "gpupool-k8s-controller"
	kube, err := kubernetes.NewForConfig(kubeCfg)
	if err != nil {
		return fmt.Errorf("k8s controller: %w", err)
	}
	c, err := client.DialWith(cfg.Brokers, client.Options{TLS: cfg.TLS, Token: cfg.Token})
	if err != nil {
		return err
	}
	defer c.Close()

	run := func(ctx context.Context) error {
		cluster := cfg.ClusterID
		if cluster == "" {
			if cluster, err = ClusterID(ctx, kube); err != nil {
				return fmt.Errorf("k8s controller: %w", err)
			}
		}
		if err := claimTenant(ctx, c.Lease, cfg.Tenant, cluster, cfg.TakeOverTenant, cfg.Logger.With("component", "controller")); err != nil {
			return fmt.Errorf("k8s controller: %w", err)
		}
		pub := NewPublisher(kube, PoolSource{Pool: c.Pool, Lease: c.Lease}, PublisherConfig{
			Tenant: cfg.Tenant, NodeSelector: cfg.NodeSelector, Logger: cfg.Logger,
		})
		bind := NewBinder(kube, BrokerClient(c), BinderConfig{Tenant: cfg.Tenant, LeaseTTL: cfg.LeaseTTL, Logger: cfg.Logger})
		return runAll(ctx, pub.Run, bind.Run)
	}
	if !cfg.LeaderElect {
		return run(ctx)
	}
	return runElected(ctx, cfg, kube, run)
}

// runAll runs each of fns until ctx ends or one fails, which stops the
// others.
func runAll(ctx context.Context, fns ...func(context.Context) error) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	errc := make(chan error, len(fns))
	for _, fn := range fns {
		go func() { errc <- fn(ctx) }()
	}
	var errs []error
	for range fns {
		if err := <-errc; err != nil {
			errs = append(errs, err)
			cancel()
		}
	}
	return errors.Join(errs...)
}

// runElected runs run while this controller leads. Leadership is given up
// only once run has returned, so two leaders never act at once.
func runElected(ctx context.Context, cfg Config, kube kubernetes.Interface, run func(context.Context) error) error {
	log := cfg.Logger.With("component", "leader-election", "identity", cfg.Identity)
	// The election outlives ctx until what it guards has stopped.
	elCtx, stopElection := context.WithCancel(context.WithoutCancel(ctx))
	defer stopElection()
	lead := make(chan context.Context, 1)
	el, err := leaderelection.NewLeaderElector(leaderelection.LeaderElectionConfig{
		Lock: &resourcelock.LeaseLock{
			LeaseMeta:  metav1.ObjectMeta{Namespace: cfg.Namespace, Name: LeaderLeaseName},
			Client:     kube.CoordinationV1(),
			LockConfig: resourcelock.ResourceLockConfig{Identity: cfg.Identity},
		},
		LeaseDuration:   leaderLeaseDuration,
		RenewDeadline:   leaderRenewDeadline,
		RetryPeriod:     leaderRetryPeriod,
		ReleaseOnCancel: true,
		Name:            LeaderLeaseName,
		Callbacks: leaderelection.LeaderCallbacks{
			OnStartedLeading: func(leadCtx context.Context) { lead <- leadCtx },
			OnStoppedLeading: func() {},
			OnNewLeader: func(id string) {
				if id != cfg.Identity {
					log.Info("standing by", "leader", id)
				}
			},
		},
	})
	if err != nil {
		return fmt.Errorf("k8s controller: leader election: %w", err)
	}
	elected := make(chan struct{})
	go func() {
		defer close(elected)
		el.Run(elCtx)
	}()
	defer func() {
		stopElection()
		<-elected
	}()

	log.Info("waiting for leadership", "lease", cfg.Namespace+"/"+LeaderLeaseName)
	var leadCtx context.Context
	select {
	case <-ctx.Done():
		return nil
	case <-elected:
		return ErrLostLeadership
	case leadCtx = <-lead:
	}
	log.Info("leading: publishing pools and binding claims")
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	defer context.AfterFunc(leadCtx, cancel)()
	if err := run(runCtx); err != nil {
		return err
	}
	if ctx.Err() == nil && leadCtx.Err() != nil {
		return ErrLostLeadership
	}
	return nil
}
