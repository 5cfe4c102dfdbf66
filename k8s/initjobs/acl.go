package initjobs

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/gpupool/gpupool/client"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// KeyToken is the key of the bootstrap Secret that holds the management
// token's secret.
const KeyToken = "token"

// ACLConfig says which tokens ACLInit makes and where it keeps them.
type ACLConfig struct {
	Namespace string
	// BootstrapSecret keeps the cluster's first management token (key
	// "token"). Whoever can read it can do anything.
	BootstrapSecret string
	// TokensSecret gets a client token for Tenant under ControllerKey and
	// NodePluginKey, and a management token the brokers use to join after
	// the bootstrap under BrokerKey.
	TokensSecret                            string
	ControllerKey, NodePluginKey, BrokerKey string
	Tenant                                  string
	// AgentTokensSecret gets one agent join token per pool host, under
	// the host's id: HostIDs, and the names of the nodes that match
	// AgentNodeSelector (a label selector; "" selects none).
	AgentTokensSecret string
	AgentNodeSelector string
	HostIDs           []string
}

// Validate names the first field that is wrong.
func (c ACLConfig) Validate() error {
	switch {
	case c.Namespace == "":
		return errors.New("namespace: required (--namespace or $POD_NAMESPACE)")
	case c.BootstrapSecret == "" || c.TokensSecret == "" || c.AgentTokensSecret == "":
		return errors.New("secret names: --bootstrap-secret, --tokens-secret and --agent-tokens-secret are required")
	case c.ControllerKey == "" || c.NodePluginKey == "" || c.BrokerKey == "":
		return errors.New("keys: --controller-key, --node-plugin-key and --broker-key must not be empty")
	case c.Tenant == "":
		return errors.New("tenant: required: the tenant of the controller's leases")
	}
	if c.AgentNodeSelector != "" {
		if _, err := metav1.ParseToLabelSelector(c.AgentNodeSelector); err != nil {
			return fmt.Errorf("agent-node-selector %q: %v", c.AgentNodeSelector, err)
		}
	}
	return nil
}

// WaitForLeader waits until a broker names a leader, printing who is up
// every few seconds.
func WaitForLeader(ctx context.Context, c *client.Client, out io.Writer) error {
	last := time.Time{}
	for {
		pctx, cancel := context.WithTimeout(ctx, 3*time.Second)
		ms, _ := c.Members(pctx)
		cancel()
		if slices.ContainsFunc(ms, func(m client.Member) bool { return m.Outcome == client.OutcomeUp }) {
			return nil
		}
		if time.Since(last) > 10*time.Second {
			var parts []string
			for _, m := range ms {
				p := fmt.Sprintf("%s %s", m.Addr, m.Outcome)
				if m.Detail != "" {
					p += " (" + m.Detail + ")"
				}
				parts = append(parts, p)
			}
			fmt.Fprintf(out, "waiting for the brokers to elect a leader: %s\n", strings.Join(parts, ", "))
			last = time.Now()
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("the brokers elected no leader in time: %w", ctx.Err())
		case <-time.After(time.Second):
		}
	}
}

// ACLInit bootstraps the ACL (once: its secret goes into BootstrapSecret
// at once) and creates every token of cfg that its Secret lacks. acl
// talks to the brokers without a token; ACLInit sends the bootstrap
// token on the calls that need one.
func ACLInit(ctx context.Context, kube kubernetes.Interface, acl gpupoolv1.AclServiceClient, cfg ACLConfig, out io.Writer) error {
	if err := cfg.Validate(); err != nil {
		return err
	}
	s := secrets{kube: kube, ns: cfg.Namespace, out: out, by: "acl-init"}
	mgmt, err := bootstrap(ctx, s, acl, cfg.BootstrapSecret)
	if err != nil {
		return err
	}
	withMgmt := client.WithTokenCall(mgmt)

	hosts := slices.Clone(cfg.HostIDs)
	if cfg.AgentNodeSelector != "" {
		nodes, err := kube.CoreV1().Nodes().List(ctx, metav1.ListOptions{LabelSelector: cfg.AgentNodeSelector})
		if err != nil {
			return fmt.Errorf("list the pool-host nodes (%s): %w", cfg.AgentNodeSelector, err)
		}
		for _, n := range nodes.Items {
			hosts = append(hosts, n.Name)
		}
	}
	slices.Sort(hosts)
	hosts = slices.Compact(hosts)

	type want struct {
		key string
		req *gpupoolv1.CreateAclTokenRequest
	}
	clientToken := func(name string) *gpupoolv1.CreateAclTokenRequest {
		return &gpupoolv1.CreateAclTokenRequest{Name: name, Kind: gpupoolv1.TokenKind_TOKEN_KIND_CLIENT, Tenants: []string{cfg.Tenant}}
	}
	sets := []struct {
		secret string
		wants  []want
	}{
		{cfg.TokensSecret, []want{
			{cfg.ControllerKey, clientToken("k8s-controller")},
			{cfg.NodePluginKey, clientToken("k8s-node-plugin")},
			{cfg.BrokerKey, &gpupoolv1.CreateAclTokenRequest{Name: "broker-join", Kind: gpupoolv1.TokenKind_TOKEN_KIND_MANAGEMENT}},
		}},
		{cfg.AgentTokensSecret, nil},
	}
	for _, h := range hosts {
		sets[1].wants = append(sets[1].wants, want{h, &gpupoolv1.CreateAclTokenRequest{
			Name: "agent-" + h, Kind: gpupoolv1.TokenKind_TOKEN_KIND_AGENT, HostId: h,
		}})
	}
	for _, set := range sets {
		sec, err := s.get(ctx, set.secret)
		if err != nil {
			return err
		}
		if sec == nil {
			if sec, _, err = s.create(ctx, set.secret, map[string][]byte{}); err != nil {
				return err
			}
		}
		for _, w := range set.wants {
			if len(sec.Data[w.key]) > 0 {
				continue
			}
			tok, err := acl.CreateToken(ctx, w.req, withMgmt)
			if err != nil {
				return fmt.Errorf("create the %s token %q: %w", kindName(w.req.Kind), w.req.Name, err)
			}
			if sec, err = s.setKey(ctx, sec, w.key, []byte(tok.GetSecret())); err != nil {
				return fmt.Errorf("%w (token %s was created but not stored; revoke it with 'gpupool operator acl token revoke %s')", err, tok.GetToken().GetAccessorId(), tok.GetToken().GetAccessorId())
			}
			fmt.Fprintf(out, "created %s token %q (accessor %s) in Secret %s, key %s\n", kindName(w.req.Kind), w.req.Name, tok.GetToken().GetAccessorId(), set.secret, w.key)
		}
	}
	return nil
}

// bootstrap returns the management token: from its Secret, or by
// bootstrapping the ACL and storing the secret at once.
func bootstrap(ctx context.Context, s secrets, acl gpupoolv1.AclServiceClient, name string) (string, error) {
	sec, err := s.get(ctx, name)
	if err != nil {
		return "", err
	}
	if sec != nil {
		if tok := string(sec.Data[KeyToken]); tok != "" {
			return tok, nil
		}
		return "", fmt.Errorf("Secret %s/%s has no key %q: put the management token there, or delete the Secret before the ACL is bootstrapped", s.ns, name, KeyToken)
	}
	resp, err := acl.Bootstrap(ctx, &gpupoolv1.AclBootstrapRequest{Name: "helm-acl-init"})
	if status.Code(err) == codes.FailedPrecondition {
		return "", fmt.Errorf("the ACL was bootstrapped already, but not by this Job: store its management token in Secret %s/%s, key %s (kubectl -n %s create secret generic %s --from-literal=%s=SECRET), and run again",
			s.ns, name, KeyToken, s.ns, name, KeyToken)
	}
	if err != nil {
		return "", fmt.Errorf("bootstrap the ACL: %w", err)
	}
	if _, created, err := s.create(ctx, name, map[string][]byte{KeyToken: []byte(resp.GetSecret())}); err != nil || !created {
		return "", fmt.Errorf("the ACL is bootstrapped (token %s) but its secret could not be stored in Secret %s/%s: %v", resp.GetToken().GetAccessorId(), s.ns, name, err)
	}
	fmt.Fprintf(s.out, "bootstrapped the ACL: management token %s in Secret %s, key %s\n", resp.GetToken().GetAccessorId(), name, KeyToken)
	return resp.GetSecret(), nil
}

func kindName(k gpupoolv1.TokenKind) string {
	return strings.ToLower(strings.TrimPrefix(k.String(), "TOKEN_KIND_"))
}
