package main

import (
	"context"
	"fmt"
	"os"
	"time"

	"github.com/spf13/cobra"
	"k8s.io/client-go/kubernetes"

	"github.com/gpupool/gpupool/client"
	"github.com/gpupool/gpupool/k8s/initjobs"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

func newK8sInitCmd() *cobra.Command {
	return newGroupCmd(&cobra.Command{
		Use:   "k8s",
		Short: "Make the TLS certificates and ACL tokens of a Kubernetes installation into Secrets (the Helm chart's init Jobs)",
		Long: `The Helm chart runs these as Jobs so that 'helm install' comes up with mutual
TLS and ACL tokens and no manual step: tls-init before the brokers start,
acl-init once they are up. Both keep every Secret that exists and make only
what is missing, so running them again (every 'helm upgrade' does) changes
nothing else.`,
		Example: `  gpupool operator k8s tls-init --broker-hosts '*.gpupool-broker.gpupool-system.svc.cluster.local'
  gpupool operator k8s acl-init --agent-node-selector gpu.gpupool.dev/pool-host=true`,
	}, newK8sTLSInitCmd(), newK8sACLInitCmd())
}

// k8sInitFlags are what both init commands share.
type k8sInitFlags struct {
	kubeconfig string
	namespace  string
	prefix     string
}

func (f *k8sInitFlags) register(cmd *cobra.Command) {
	fs := cmd.Flags()
	fs.StringVar(&f.kubeconfig, "kubeconfig", "", "kubeconfig file (default: in-cluster, else $KUBECONFIG or ~/.kube/config)")
	fs.StringVar(&f.namespace, "namespace", os.Getenv("POD_NAMESPACE"), "namespace of the Secrets (default $POD_NAMESPACE)")
	fs.StringVar(&f.prefix, "prefix", "gpupool", "the chart's full name: the default Secret names start with it")
}

func (f *k8sInitFlags) kube() (kubernetes.Interface, error) {
	cfg, err := loadKubeConfig(f.kubeconfig)
	if err != nil {
		return nil, err
	}
	return kubernetes.NewForConfig(cfg)
}

// orDefault is v, or prefix-suffix when v is empty.
func orDefault(v, prefix, suffix string) string {
	if v != "" {
		return v
	}
	return prefix + "-" + suffix
}

func newK8sTLSInitCmd() *cobra.Command {
	var (
		f     k8sInitFlags
		cfg   initjobs.TLSConfig
		hosts string
		days  int
	)
	cmd := &cobra.Command{
		Use:   "tls-init --broker-hosts HOSTS",
		Short: "Create the cluster CA and the broker, agent and client certificates into Secrets",
		Long: `Tls-init keeps the cluster's CA in a Secret (PREFIX-ca: ca.crt, ca.key),
creating it on the first run, and creates from it each TLS Secret that is
missing (ca.crt, tls.crt, tls.key, the shape the chart mounts):
PREFIX-broker-tls for --broker-hosts, PREFIX-agent-tls (one certificate for
every node) and PREFIX-client-tls (the controller, the node plugin and
acl-init). A Secret that exists is kept: only a certificate of this CA that
expires within 30 days is issued again. A Secret with another CA's
certificate (made by hand, or by cert-manager) is never touched.

It needs get, create and update on Secrets of the namespace.`,
		Example: `  gpupool operator k8s tls-init --namespace gpupool-system \
    --broker-hosts '*.gpupool-broker.gpupool-system.svc.cluster.local,gpupool.gpupool-system.svc'`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg.Namespace = f.namespace
			cfg.CASecret = orDefault(cfg.CASecret, f.prefix, "ca")
			cfg.BrokerSecret = orDefault(cfg.BrokerSecret, f.prefix, "broker-tls")
			cfg.AgentSecret = orDefault(cfg.AgentSecret, f.prefix, "agent-tls")
			cfg.ClientSecret = orDefault(cfg.ClientSecret, f.prefix, "client-tls")
			cfg.BrokerHosts = client.ParseAddrs(hosts)
			cfg.Validity = time.Duration(days) * 24 * time.Hour
			if err := cfg.Validate(); err != nil {
				return usagef("%v", err)
			}
			kube, err := f.kube()
			if err != nil {
				return err
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), global.timeout)
			defer cancel()
			if err := initjobs.TLSInit(ctx, kube, cfg, cmd.OutOrStdout()); err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "TLS Secrets ready in namespace %s: %s, %s, %s\n", cfg.Namespace, cfg.BrokerSecret, cfg.AgentSecret, cfg.ClientSecret)
			return nil
		},
	}
	f.register(cmd)
	fs := cmd.Flags()
	fs.StringVar(&hosts, "broker-hosts", "", "DNS names and IPs the brokers are dialed at, comma-separated (wildcards like *.NAME.NS.svc.cluster.local allowed)")
	fs.StringVar(&cfg.CASecret, "ca-secret", "", "Secret of the CA (default PREFIX-ca)")
	fs.StringVar(&cfg.BrokerSecret, "broker-secret", "", "TLS Secret of the brokers (default PREFIX-broker-tls)")
	fs.StringVar(&cfg.AgentSecret, "agent-secret", "", "TLS Secret of the agents (default PREFIX-agent-tls)")
	fs.StringVar(&cfg.ClientSecret, "client-secret", "", "TLS Secret of the controller, node plugin and acl-init (default PREFIX-client-tls)")
	fs.IntVar(&days, "days", 365, "validity of the certificates in days")
	return cmd
}

func newK8sACLInitCmd() *cobra.Command {
	var (
		f     k8sInitFlags
		cfg   initjobs.ACLConfig
		hosts string
		wait  time.Duration
	)
	cmd := &cobra.Command{
		Use:   "acl-init",
		Short: "Bootstrap the ACL once the brokers are up and store the components' tokens in Secrets",
		Long: `Acl-init waits for the brokers (--addr, or $GPUPOOL_ADDR, with the TLS client
certificate of $GPUPOOL_TLS_*) to elect a leader, bootstraps the ACL and keeps
the management token in PREFIX-acl-bootstrap (key token), then creates each
token its Secret lacks:
  PREFIX-tokens        controller and node-plugin (client tokens for --tenant),
                       broker (a management token brokers use to rejoin)
  PREFIX-agent-tokens  one agent join token per pool host, under its host id:
                       every node matching --agent-node-selector, and --host-ids
Tokens already in the Secrets are kept, so a second run changes nothing; a
run after new pool-host nodes joined adds their tokens. When the ACL was
bootstrapped by someone else it stops and says how to hand it the token.

It needs get, create and update on Secrets of the namespace, and list on
Nodes.`,
		Example: `  GPUPOOL_ADDR=gpupool-broker-0.gpupool-broker.gpupool-system.svc:7641 \
    gpupool operator k8s acl-init --namespace gpupool-system --agent-node-selector gpu.gpupool.dev/pool-host=true`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg.Namespace = f.namespace
			cfg.BootstrapSecret = orDefault(cfg.BootstrapSecret, f.prefix, "acl-bootstrap")
			cfg.TokensSecret = orDefault(cfg.TokensSecret, f.prefix, "tokens")
			cfg.AgentTokensSecret = orDefault(cfg.AgentTokensSecret, f.prefix, "agent-tokens")
			cfg.HostIDs = client.ParseAddrs(hosts)
			if err := cfg.Validate(); err != nil {
				return usagef("%v", err)
			}
			if wait <= 0 {
				return usagef("--wait %s: must be positive, e.g. 10m", wait)
			}
			kube, err := f.kube()
			if err != nil {
				return err
			}
			global.token = "" // the management token comes from the bootstrap
			os.Unsetenv("GPUPOOL_TOKEN")
			c, err := dial()
			if err != nil {
				return err
			}
			defer c.Close()
			ctx, cancel := context.WithTimeout(cmd.Context(), wait)
			defer cancel()
			if err := initjobs.WaitForLeader(ctx, c, cmd.ErrOrStderr()); err != nil {
				return err
			}
			if err := initjobs.ACLInit(ctx, kube, gpupoolv1.NewAclServiceClient(c.Conn()), cfg, cmd.OutOrStdout()); err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "ACL tokens ready in namespace %s: %s, %s\n", cfg.Namespace, cfg.TokensSecret, cfg.AgentTokensSecret)
			return nil
		},
	}
	f.register(cmd)
	fs := cmd.Flags()
	fs.StringVar(&cfg.BootstrapSecret, "bootstrap-secret", "", "Secret of the management token (default PREFIX-acl-bootstrap)")
	fs.StringVar(&cfg.TokensSecret, "tokens-secret", "", "Secret of the controller's, node plugin's and brokers' tokens (default PREFIX-tokens)")
	fs.StringVar(&cfg.AgentTokensSecret, "agent-tokens-secret", "", "Secret of the agents' join tokens, one key per host id (default PREFIX-agent-tokens)")
	fs.StringVar(&cfg.ControllerKey, "controller-key", "controller", "key of the controller's token")
	fs.StringVar(&cfg.NodePluginKey, "node-plugin-key", "node-plugin", "key of the node plugin's token")
	fs.StringVar(&cfg.BrokerKey, "broker-key", "broker", "key of the brokers' management token")
	fs.StringVar(&cfg.Tenant, "tenant", "k8s", "tenant of the controller's and node plugin's tokens")
	fs.StringVar(&cfg.AgentNodeSelector, "agent-node-selector", "", "label selector of the pool-host nodes that get an agent token each, e.g. gpu.gpupool.dev/pool-host=true")
	fs.StringVar(&hosts, "host-ids", "", "more host ids that get an agent token, comma-separated")
	fs.DurationVar(&wait, "wait", 10*time.Minute, "how long to wait for the brokers and the whole run")
	return cmd
}
