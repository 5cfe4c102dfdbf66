package main

import (
	"bytes"
	"strings"
	"testing"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

func TestACLCommandsRefuseBadInput(t *testing.T) {
	create := func(extra ...string) []string {
		return append([]string{"operator", "acl", "token", "create"}, extra...)
	}
	checkUsageErrors(t, []usageCase{
		{"create without a kind", create("--tenant", "a"), []string{"--kind is required", "management, client or agent"}},
		{"create with an unknown kind", create("--kind", "root"), []string{`--kind "root"`, "management, client or agent"}},
		{"a client token without a tenant", create("--kind", "client"), []string{"--tenant is required for a client token"}},
		{"a client token with a bad tenant", create("--kind", "client", "--tenant", "ML Team"), []string{`--tenant "ML Team"`, "tenant name"}},
		{"a client token with a bad extra tenant", create("--kind", "client", "--tenant", "a", "--tenants", "b,Not_OK"), []string{"--tenants", "Not_OK"}},
		{"a management token with a tenant", create("--kind", "management", "--tenant", "a"), []string{"--tenant/--tenants", "only client tokens"}},
		{"an agent token without a host", create("--kind", "agent"), []string{"--host-id is required for an agent token"}},
		{"a client token with a host", create("--kind", "client", "--tenant", "a", "--host-id", "h1"), []string{"--host-id", "only agent tokens"}},
		{"a priority limit out of range", create("--kind", "client", "--tenant", "a", "--max-priority", "1001"), []string{"--max-priority 1001", "between 0 and 1000"}},
		{"a priority limit on an agent token", create("--kind", "agent", "--host-id", "h1", "--max-priority", "5"), []string{"--max-priority", "only client tokens"}},
		{"preemptible-only on a management token", create("--kind", "management", "--preemptible-only"), []string{"--preemptible-only", "only client tokens"}},
		{"a negative ttl", create("--kind", "management", "--ttl", "-1h"), []string{"--ttl -1h0m0s", "0 (no expiry)"}},
		{"a ttl of more than ten years", create("--kind", "management", "--ttl", "100000h"), []string{"--ttl 100000h0m0s"}},
		{"revoke without an accessor", []string{"operator", "acl", "token", "revoke"}, []string{"accepts 1 arg(s), received 0", "revoke ACCESSOR"}},
		{"bootstrap with an argument", []string{"operator", "acl", "bootstrap", "now"}, []string{"accepts 0 arg(s)"}},
		{"an unknown acl subcommand", []string{"operator", "acl", "reset"}, []string{`unknown command "reset"`, "bootstrap, token, whoami"}},
	})
}

func TestBrokerACLFlagsRefuseBadCombinations(t *testing.T) {
	base := []string{"broker", "--data-dir", t.TempDir(), "--bind", "127.0.0.1:0", "--raft-bind", "127.0.0.1:0", "--bootstrap-expect", "1"}
	checkUsageErrors(t, []usageCase{
		{"ACL off without TLS", append(append([]string{}, base...), "--acl=false"), []string{"needs TLS", "--insecure"}},
		{"--acl with --insecure", append(append([]string{}, base...), "--acl", "--insecure"), []string{"--acl with --insecure"}},
		{"an audit file in a missing directory", append(append([]string{}, base...), "--insecure", "--audit-file", "/nonexistent/dir/audit.jsonl"), []string{"--audit-file open /nonexistent/dir/audit.jsonl: no such file or directory"}},
	})
}

func TestPrintTokensNeverShowsSecretsAndSaysTheState(t *testing.T) {
	prio := int32(100)
	var buf bytes.Buffer
	err := printTokens(&buf, []*gpupoolv1.AclToken{
		{AccessorId: "acc-1", Name: "ml", Kind: gpupoolv1.TokenKind_TOKEN_KIND_CLIENT, Tenants: []string{"ml", "ml-batch"}, MaxPriority: &prio, PreemptibleOnly: true,
			CreatedBy: &gpupoolv1.Actor{AccessorId: "acc-0", Name: "bootstrap"}},
		{AccessorId: "acc-2", Name: "agent-h1", Kind: gpupoolv1.TokenKind_TOKEN_KIND_AGENT, HostId: "h1", Expired: true, ExpiresAtMs: 1},
		{AccessorId: "acc-3", Name: "old", Kind: gpupoolv1.TokenKind_TOKEN_KIND_MANAGEMENT, Revoked: true, SecretSha256: []byte("must not show")},
	})
	if err != nil {
		t.Fatal(err)
	}
	out := buf.String()
	for _, want := range []string{"tenants ml,ml-batch priority<=100 preemptible only", "bootstrap (acc-0)", "host h1", "expired", "revoked", "everything"} {
		if !strings.Contains(out, want) {
			t.Errorf("token table lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(out, "must not show") {
		t.Errorf("token table shows a secret hash:\n%s", out)
	}
}
