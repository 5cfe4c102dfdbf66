package main

import (
	"context"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/gpupool/gpupool/client"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
	"github.com/gpupool/gpupool/protocol"
)

func newACLCmd() *cobra.Command {
	return newGroupCmd(&cobra.Command{
		Use:   "acl",
		Short: "Bootstrap and manage ACL tokens: who may reach the pool, and for what",
		Long: `Brokers started without --insecure check an ACL token on every call. A
token is a random secret; the brokers store only its SHA-256 and its scope:

  management  everything: tokens, quotas, drains, the Raft cluster, every tenant
  client      leases of its tenants (--tenant, --tenants), within --max-priority
              and --preemptible-only, reads of the pool and of its tenants' quotas
  agent       an agent's join token: register and heartbeat as one --host-id

'bootstrap' creates the first management token, once per cluster. Pass a
token with --token or GPUPOOL_TOKEN.`,
		Example: `  gpupool operator acl bootstrap
  export GPUPOOL_TOKEN=<the management secret>
  gpupool operator acl token create --kind client --tenant ml --name ml-team
  gpupool operator acl token create --kind agent --host-id gpu-07 --ttl 8760h
  gpupool operator acl token ls
  gpupool operator acl token revoke 6f1c2d3e-...`,
	},
		newACLBootstrapCmd(),
		newGroupCmd(&cobra.Command{
			Use:   "token",
			Short: "Create, list and revoke ACL tokens (needs a management token)",
			Long:  `Token commands create tokens of each kind, list them (never with their secrets) and revoke them.`,
			Example: `  gpupool operator acl token create --kind client --tenant ml --tenants ml,ml-batch --max-priority 100
  gpupool operator acl token ls -o json
  gpupool operator acl token revoke ACCESSOR`,
		},
			newACLTokenCreateCmd(),
			newACLTokenListCmd(),
			newACLTokenRevokeCmd(),
		),
		newACLWhoAmICmd(),
	)
}

func newACLBootstrapCmd() *cobra.Command {
	var name string
	cmd := &cobra.Command{
		Use:   "bootstrap [--name NAME]",
		Short: "Create the cluster's first management token (once)",
		Long: `Bootstrap creates the first management token of a cluster whose brokers run
with ACL (the default). It works once: a second bootstrap is refused, whoever
asks. The secret is printed here and nowhere else; keep it like a root
password, and create narrower tokens with it for everyday use.`,
		Example: `  gpupool operator acl bootstrap
  gpupool operator acl bootstrap -o json > bootstrap-token.json
  export GPUPOOL_TOKEN=$(gpupool operator acl bootstrap -q)   # the secret alone`,
		Args: exactArgs(0),
		RunE: func(cmd *cobra.Command, _ []string) error {
			return withClient(cmd, func(ctx context.Context, c *client.Client) error {
				resp, err := gpupoolv1.NewAclServiceClient(c.Conn()).Bootstrap(ctx, &gpupoolv1.AclBootstrapRequest{Name: name})
				if err != nil {
					return err
				}
				return renderSecret(cmd.OutOrStdout(), resp)
			})
		},
	}
	cmd.Flags().StringVar(&name, "name", "bootstrap", "name of the token")
	return cmd
}

// aclTokenFlags are the flags of 'token create'.
type aclTokenFlags struct {
	kind            string
	name            string
	tenant          string
	tenants         string
	maxPriority     int32
	preemptibleOnly bool
	hostID          string
	ttl             time.Duration
}

// request validates the flags and returns the request they make.
func (f *aclTokenFlags) request(cmd *cobra.Command) (*gpupoolv1.CreateAclTokenRequest, error) {
	req := &gpupoolv1.CreateAclTokenRequest{Name: f.name, PreemptibleOnly: f.preemptibleOnly, HostId: f.hostID}
	switch f.kind {
	case "management":
		req.Kind = gpupoolv1.TokenKind_TOKEN_KIND_MANAGEMENT
	case "client":
		req.Kind = gpupoolv1.TokenKind_TOKEN_KIND_CLIENT
	case "agent":
		req.Kind = gpupoolv1.TokenKind_TOKEN_KIND_AGENT
	case "":
		return nil, usagef("--kind is required: management, client or agent")
	default:
		return nil, usagef("--kind %q: must be management, client or agent", f.kind)
	}
	client := req.Kind == gpupoolv1.TokenKind_TOKEN_KIND_CLIENT
	if f.tenant != "" {
		req.Tenants = append(req.Tenants, f.tenant)
	}
	for _, t := range splitTenants(f.tenants) {
		if t != f.tenant {
			req.Tenants = append(req.Tenants, t)
		}
	}
	switch {
	case client && len(req.Tenants) == 0:
		return nil, usagef("--tenant is required for a client token: the tenant it acts for (more with --tenants a,b)")
	case !client && len(req.Tenants) > 0:
		return nil, usagef("--tenant/--tenants: only client tokens act for tenants, not %s tokens", f.kind)
	case req.Kind == gpupoolv1.TokenKind_TOKEN_KIND_AGENT && f.hostID == "":
		return nil, usagef("--host-id is required for an agent token: the one host it may register as")
	case req.Kind != gpupoolv1.TokenKind_TOKEN_KIND_AGENT && f.hostID != "":
		return nil, usagef("--host-id: only agent tokens have a host, not %s tokens", f.kind)
	case f.preemptibleOnly && !client:
		return nil, usagef("--preemptible-only: only client tokens can be limited to preemptible leases")
	}
	for i, t := range req.Tenants {
		if err := protocol.ValidateTenant("--tenants", t); err != nil {
			if i == 0 && f.tenant != "" {
				return nil, usagef("--tenant %q: must be a tenant name (lower-case letters, digits, '.', '_', '-'; at most 63)", t)
			}
			return nil, usagef("%v", err)
		}
	}
	if cmd.Flags().Changed("max-priority") {
		if !client {
			return nil, usagef("--max-priority: only client tokens have a priority limit")
		}
		if f.maxPriority < 0 || f.maxPriority > protocol.MaxPriority {
			return nil, usagef("--max-priority %d: must be between 0 and %d", f.maxPriority, protocol.MaxPriority)
		}
		req.MaxPriority = &f.maxPriority
	}
	if f.ttl < 0 || f.ttl > protocol.MaxTokenTTL {
		return nil, usagef("--ttl %s: must be 0 (no expiry) or up to %s", f.ttl, protocol.MaxTokenTTL)
	}
	if f.ttl > 0 && f.ttl < time.Millisecond {
		return nil, usagef("--ttl %s: must be at least 1ms", f.ttl)
	}
	req.TtlMs = f.ttl.Milliseconds()
	if req.Name == "" {
		req.Name = defaultTokenName(req)
	}
	return req, nil
}

// splitTenants splits a --tenants list, dropping blanks, as an address
// list is split.
func splitTenants(s string) []string { return client.ParseAddrs(s) }

func defaultTokenName(req *gpupoolv1.CreateAclTokenRequest) string {
	switch req.Kind {
	case gpupoolv1.TokenKind_TOKEN_KIND_CLIENT:
		return "client-" + req.Tenants[0]
	case gpupoolv1.TokenKind_TOKEN_KIND_AGENT:
		return "agent-" + req.HostId
	}
	return "management"
}

func newACLTokenCreateCmd() *cobra.Command {
	var f aclTokenFlags
	cmd := &cobra.Command{
		Use:   "create --kind management|client|agent [--tenant T] [--tenants a,b] [--max-priority N] [--preemptible-only] [--host-id H] [--ttl 720h] [--name N]",
		Short: "Create an ACL token and print its secret (once)",
		Long: `Create makes a token of one kind and prints its secret, which is shown
nowhere else. A client token acts for --tenant (its default, used when a
request names no tenant) and the tenants in --tenants; --max-priority caps the
priority it may ask for and --preemptible-only limits it to preemptible leases.
An agent token registers and heartbeats as --host-id only. --ttl makes it expire
(0: never).`,
		Example: `  # a team's token for tenant ml, priority 100 at most
  gpupool operator acl token create --kind client --tenant ml --max-priority 100 --name ml-team

  # the Kubernetes controller's token for tenant k8s
  gpupool operator acl token create --kind client --tenant k8s --name k8s-controller

  # an agent's join token, for one year, into the file its agent reads
  gpupool operator acl token create --kind agent --host-id gpu-07 --ttl 8760h -q > gpu-07.token

  # -q (or -o name) prints the secret alone; -o json the token and secret`,
		Args: exactArgs(0),
		RunE: func(cmd *cobra.Command, _ []string) error {
			req, err := f.request(cmd)
			if err != nil {
				return err
			}
			return withClient(cmd, func(ctx context.Context, c *client.Client) error {
				resp, err := gpupoolv1.NewAclServiceClient(c.Conn()).CreateToken(ctx, req)
				if err != nil {
					return err
				}
				return renderSecret(cmd.OutOrStdout(), resp)
			})
		},
	}
	fs := cmd.Flags()
	fs.StringVar(&f.kind, "kind", "", "token kind: management, client or agent")
	fs.StringVar(&f.name, "name", "", "name shown in lists and audit records (default: from the kind and scope)")
	fs.StringVar(&f.tenant, "tenant", "", "client: the tenant the token acts for by default")
	fs.StringVar(&f.tenants, "tenants", "", "client: more tenants it may act for, comma-separated")
	fs.Int32Var(&f.maxPriority, "max-priority", 0, fmt.Sprintf("client: the highest lease priority it may ask for (0-%d; default no limit)", protocol.MaxPriority))
	fs.BoolVar(&f.preemptibleOnly, "preemptible-only", false, "client: only preemptible leases")
	fs.StringVar(&f.hostID, "host-id", "", "agent: the host id it registers as")
	fs.DurationVar(&f.ttl, "ttl", 0, "how long the token is valid, e.g. 720h (0: no expiry)")
	return cmd
}

func newACLTokenListCmd() *cobra.Command {
	var stale bool
	cmd := &cobra.Command{
		Use:     "ls",
		Aliases: []string{"list"},
		Short:   "List the ACL tokens (never their secrets)",
		Long: `Ls lists every token with its kind, scope, and state: active, expired (its
--ttl has passed on the broker's clock) or revoked. Secrets are never shown:
the brokers do not have them.`,
		Example: `  gpupool operator acl token ls
  gpupool operator acl token ls -o json`,
		Args: exactArgs(0),
		RunE: func(cmd *cobra.Command, _ []string) error {
			return withClient(cmd, func(ctx context.Context, c *client.Client) error {
				resp, err := gpupoolv1.NewAclServiceClient(c.Conn()).ListTokens(ctx, &gpupoolv1.ListAclTokensRequest{Stale: stale})
				if err != nil {
					return err
				}
				ids := idsOf(resp.GetTokens(), (*gpupoolv1.AclToken).GetAccessorId)
				return renderList(cmd.OutOrStdout(), resp, "", ids, func(w io.Writer) error { return printTokens(w, resp.GetTokens()) })
			})
		},
	}
	addStaleFlag(cmd, &stale)
	return cmd
}

func newACLTokenRevokeCmd() *cobra.Command {
	var keepLeases bool
	cmd := &cobra.Command{
		Use:   "revoke ACCESSOR [--keep-leases]",
		Short: "Revoke an ACL token and the leases it acquired: calls with it fail from now on",
		Long: `Revoke marks the token with this accessor id revoked: every broker refuses it
from the moment the revocation is applied, including on streams already open
(lease renewals, watches, agent heartbeats). Revoking twice keeps the first
revocation.

The granted and pending leases the token acquired are revoked with it, so that
their lease tokens stop working on the pool hosts at once rather than at their
expiry. --keep-leases leaves them running until they end by themselves.`,
		Example: `  gpupool operator acl token revoke 6f1c2d3e-4b5a-4c3d-9e8f-0a1b2c3d4e5f
  gpupool operator acl token revoke 6f1c2d3e-4b5a-4c3d-9e8f-0a1b2c3d4e5f --keep-leases`,
		Args: exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return withClient(cmd, func(ctx context.Context, c *client.Client) error {
				resp, err := gpupoolv1.NewAclServiceClient(c.Conn()).RevokeToken(ctx, &gpupoolv1.RevokeAclTokenRequest{AccessorId: args[0], KeepLeases: keepLeases})
				if err != nil {
					return err
				}
				return render(cmd.OutOrStdout(), resp, func(w io.Writer) error {
					_, err := fmt.Fprintf(w, "revoked token %s (%s) and %d of its leases\n", resp.GetToken().GetAccessorId(), resp.GetToken().GetName(), len(resp.GetRevokedLeases()))
					return err
				})
			})
		},
	}
	cmd.Flags().BoolVar(&keepLeases, "keep-leases", false, "leave the leases the token acquired running")
	return cmd
}

func newACLWhoAmICmd() *cobra.Command {
	return &cobra.Command{
		Use:     "whoami",
		Short:   "Show the token the brokers see on your calls",
		Long:    `Whoami shows the token --token or GPUPOOL_TOKEN carries: its accessor id, kind and scope.`,
		Example: `  GPUPOOL_TOKEN=... gpupool operator acl whoami`,
		Args:    exactArgs(0),
		RunE: func(cmd *cobra.Command, _ []string) error {
			return withClient(cmd, func(ctx context.Context, c *client.Client) error {
				resp, err := gpupoolv1.NewAclServiceClient(c.Conn()).WhoAmI(ctx, &gpupoolv1.WhoAmIRequest{})
				if err != nil {
					return err
				}
				return render(cmd.OutOrStdout(), resp, func(w io.Writer) error {
					if !resp.GetAclEnabled() {
						_, err := fmt.Fprintln(w, "the brokers run without ACL (--insecure or gpupool dev): every call is accepted")
						return err
					}
					return printTokens(w, []*gpupoolv1.AclToken{resp.GetToken()})
				})
			})
		},
	}
}

// printSecret shows a new token and its secret, once.
func printSecret(w io.Writer, s *gpupoolv1.AclTokenSecret) error {
	t := s.GetToken()
	fmt.Fprintf(w, "accessor: %s\nname:     %s\nkind:     %s\nscope:    %s\n", t.GetAccessorId(), t.GetName(), protocol.TokenKindName(t.GetKind()), tokenScope(t))
	if t.GetExpiresAtMs() != 0 {
		fmt.Fprintf(w, "expires:  %s\n", formatTimeMs(t.GetExpiresAtMs()))
	}
	_, err := fmt.Fprintf(w, "secret:   %s\n\nThe secret is shown only now. Use it with --token or GPUPOOL_TOKEN.\n", s.GetSecret())
	return err
}

// tokenScope says in a few words what a token may do.
func tokenScope(t *gpupoolv1.AclToken) string {
	switch t.GetKind() {
	case gpupoolv1.TokenKind_TOKEN_KIND_MANAGEMENT:
		return "everything"
	case gpupoolv1.TokenKind_TOKEN_KIND_AGENT:
		return "host " + t.GetHostId()
	}
	parts := []string{"tenants " + strings.Join(t.GetTenants(), ",")}
	if t.MaxPriority != nil {
		parts = append(parts, "priority<="+strconv.Itoa(int(t.GetMaxPriority())))
	}
	if t.GetPreemptibleOnly() {
		parts = append(parts, "preemptible only")
	}
	return strings.Join(parts, " ")
}

// tokenState is active, expired or revoked.
func tokenState(t *gpupoolv1.AclToken) string {
	switch {
	case t.GetRevoked():
		return "revoked"
	case t.GetExpired():
		return "expired"
	}
	return "active"
}

// renderSecret prints a new token: the secret alone under -q (or -o
// name), for a script or a token file; else as render does.
func renderSecret(w io.Writer, resp *gpupoolv1.AclTokenSecret) error {
	if global.output == "name" {
		_, err := fmt.Fprintln(w, resp.GetSecret())
		return err
	}
	return render(w, resp, func(w io.Writer) error { return printSecret(w, resp) })
}

func printTokens(w io.Writer, tokens []*gpupoolv1.AclToken) error {
	if len(tokens) == 0 {
		_, err := fmt.Fprintln(w, "no tokens: create the first one with 'gpupool operator acl bootstrap'")
		return err
	}
	t := newTable(w, "ACCESSOR", "NAME", "KIND", "SCOPE", "STATE", "CREATED", "EXPIRES", "CREATED BY")
	for _, tok := range tokens {
		expires := "never"
		if tok.GetExpiresAtMs() != 0 {
			expires = formatTimeMs(tok.GetExpiresAtMs())
		}
		t.row(tok.GetAccessorId(), tok.GetName(), protocol.TokenKindName(tok.GetKind()), tokenScope(tok), tokenState(tok),
			formatTimeMs(tok.GetCreatedAtMs()), expires, protocol.ActorText(tok.GetCreatedBy()))
	}
	return t.flush()
}
