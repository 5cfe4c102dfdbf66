package cluster_test

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/gpupool/gpupool/client"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// tokenJSON is what 'operator acl bootstrap|token create -o json' prints.
type tokenJSON struct {
	Token struct {
		AccessorID string `json:"accessor_id"`
		Name       string `json:"name"`
	} `json:"token"`
	Secret string `json:"secret"`
}

func TestACLOnRealProcesses(t *testing.T) {
	if testing.Short() {
		t.Skip("starts real processes")
	}
	cl := newSecureCluster(t)
	addr := "--addr=" + strings.Join(cl.addrs, ",")
	run := func(args ...string) (string, string, int) {
		t.Helper()
		return gpupool(t, append(append(args, addr, "--timeout=60s", "--connect-timeout=60s"), cl.clientFlags()...)...)
	}
	mustRun := func(args ...string) string {
		t.Helper()
		out, stderr, code := run(args...)
		if code != 0 {
			t.Fatalf("gpupool %s: exit %d: %s", strings.Join(args, " "), code, stderr)
		}
		return out
	}
	newToken := func(args ...string) tokenJSON {
		t.Helper()
		var tok tokenJSON
		out := mustRun(args...)
		if err := json.Unmarshal([]byte(out), &tok); err != nil || tok.Secret == "" {
			t.Fatalf("gpupool %s: %v; output %q", strings.Join(args, " "), err, out)
		}
		return tok
	}

	// Without a token, nothing but the bootstrap.
	_, stderr, code := run("lease", "ls")
	if code != 1 || !strings.Contains(stderr, "unauthenticated: no ACL token") {
		t.Fatalf("lease ls without a token: exit %d, %q; want 1 and unauthenticated", code, stderr)
	}
	boot := newToken("operator", "acl", "bootstrap", "-o", "json")
	_, stderr, code = run("operator", "acl", "bootstrap")
	if code != 1 || !strings.Contains(stderr, "already bootstrapped") {
		t.Fatalf("second bootstrap: exit %d, %q; want 1 and already bootstrapped", code, stderr)
	}
	mgmt := "--token=" + boot.Secret
	a := newToken("operator", "acl", "token", "create", "--kind", "client", "--tenant", "team-a", "-o", "json", mgmt)
	b := newToken("operator", "acl", "token", "create", "--kind", "client", "--tenant", "team-b", "-o", "json", mgmt)
	agent1 := newToken("operator", "acl", "token", "create", "--kind", "agent", "--host-id", "host-1", "-o", "json", mgmt)

	// An agent joins with its own host's token; another host's is refused.
	cl.agents = append(cl.agents, cl.newAgent(0, "--token", agent1.Secret), cl.newAgent(1, "--token", agent1.Secret))
	for _, p := range cl.agents {
		p.start(t)
	}
	cl.c = cl.dialWithToken(boot.Secret, cl.addrs...)
	cl.waitForHosts(1)
	// It stops at once, saying why: retrying cannot make the token fit.
	select {
	case <-cl.agents[1].done:
	case <-time.After(60 * time.Second):
		t.Fatal("host-2's agent, with host-1's token, still runs after 60s")
	}
	if code := cl.agents[1].cmd.ProcessState.ExitCode(); code != 1 {
		t.Errorf("host-2's agent: exit code got %d, want 1", code)
	}
	if log, _ := os.ReadFile(cl.agents[1].log.Name()); !strings.Contains(string(log), "refuse host \"host-2\"") || !strings.Contains(string(log), "not of host") {
		t.Errorf("host-2's agent's log does not say it was refused for another host's token:\n%s", log)
	}
	hosts, err := cl.c.Pool.ListHosts(ctxFor(t, 10*time.Second), &gpupoolv1.ListHostsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if len(hosts.Hosts) != 1 || hosts.Hosts[0].Id != "host-1" {
		t.Fatalf("hosts: got %v, want host-1 only", hosts.Hosts)
	}

	// Tenants are isolated.
	out := mustRun("lease", "acquire", "--memory", "20GiB", "--compute", "25", "-o", "json", "--token="+a.Secret)
	var lease struct {
		ID     string `json:"id"`
		Tenant string `json:"tenant"`
	}
	if err := json.Unmarshal([]byte(out), &lease); err != nil || lease.Tenant != "team-a" {
		t.Fatalf("team-a's acquire: tenant %q (%v), want team-a; output %s", lease.Tenant, err, out)
	}
	for _, cmd := range [][]string{{"lease", "get", lease.ID}, {"lease", "release", lease.ID}} {
		_, stderr, code := run(append(cmd, "--token="+b.Secret)...)
		if code != 1 || !strings.Contains(stderr, "not found") || strings.Contains(stderr, "team-a") {
			t.Errorf("team-b: gpupool %s: exit %d, %q; want 1 and not found, as for a lease that does not exist", strings.Join(cmd, " "), code, stderr)
		}
	}
	// A token file keeps the secret out of ps.
	tokenFile := filepath.Join(t.TempDir(), "team-a.token")
	if err := os.WriteFile(tokenFile, []byte(a.Secret+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if out := mustRun("lease", "ls", "-o", "json", "--token-file", tokenFile); !strings.Contains(out, lease.ID) {
		t.Errorf("team-a's lease ls with --token-file does not show its lease:\n%s", out)
	}
	if out := mustRun("lease", "ls", "-o", "json", "--token="+b.Secret); strings.Contains(out, lease.ID) {
		t.Errorf("team-b's lease ls shows team-a's lease:\n%s", out)
	}
	_, stderr, code = run("lease", "acquire", "--memory", "1GiB", "--compute", "5", "--tenant", "team-a", "--token="+b.Secret)
	if code != 1 || !strings.Contains(stderr, `not tenant "team-a"`) {
		t.Errorf("team-b acquiring for team-a: exit %d, %q; want 1 and a refusal", code, stderr)
	}
	_, stderr, code = run("host", "drain", "host-1", "--force", "--token="+a.Secret)
	if code != 1 || !strings.Contains(stderr, "lacks management") {
		t.Errorf("a client token draining: exit %d, %q; want 1, lacks management", code, stderr)
	}
	if out := mustRun("lease", "get", lease.ID, "--token="+a.Secret); !strings.Contains(out, "GRANTED BY") || !strings.Contains(out, a.Token.AccessorID) {
		t.Errorf("lease get does not say who acquired it:\n%s", out)
	}

	// A tenant forging its agent's refusal of another tenant's lease: a
	// heartbeat needs the host's own agent token.
	forger := cl.dialWithToken(b.Secret, cl.addrs...)
	hb, err := forger.Agent.Heartbeat(ctxFor(t, 30*time.Second))
	if err == nil {
		hb.Send(&gpupoolv1.HeartbeatRequest{HostId: "host-1", Rejected: []*gpupoolv1.Rejection{{LeaseId: lease.ID, Reason: "forged"}}})
		_, err = hb.Recv()
	}
	if status.Code(err) != codes.PermissionDenied {
		t.Errorf("a client token sending host-1's heartbeat with a refusal: got %v, want PermissionDenied", err)
	}
	if out := mustRun("lease", "get", lease.ID, "-o", "json", "--token="+a.Secret); !strings.Contains(out, "GRANTED") {
		t.Errorf("after a forged refusal team-a's lease is no longer granted:\n%s", out)
	}

	// Through a follower: the leader checks the caller's own token, so a
	// forwarded call can do no more than the caller.
	leader := cl.leader()
	follower := cl.addrs[(leader+1)%3]
	viaFollower := func(secret string) *client.Client { return cl.dialWithToken(secret, follower) }
	_, err = viaFollower(b.Secret).Lease.Release(ctxFor(t, 30*time.Second), &gpupoolv1.ReleaseRequest{LeaseId: lease.ID})
	if status.Code(err) != codes.NotFound || !strings.Contains(status.Convert(err).Message(), "not found") {
		t.Errorf("team-b releasing team-a's lease through follower %s: got %v, want NotFound", follower, err)
	}
	_, err = viaFollower("").Lease.Release(ctxFor(t, 30*time.Second), &gpupoolv1.ReleaseRequest{LeaseId: lease.ID})
	if status.Code(err) != codes.Unauthenticated {
		t.Errorf("a release without a token through follower %s: got %v, want Unauthenticated", follower, err)
	}
	// A token made a moment ago works on a follower at once.
	fresh, err := gpupoolv1.NewAclServiceClient(cl.c.Conn()).CreateToken(ctxFor(t, 30*time.Second),
		&gpupoolv1.CreateAclTokenRequest{Name: "fresh", Kind: gpupoolv1.TokenKind_TOKEN_KIND_CLIENT, Tenants: []string{"team-a"}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := viaFollower(fresh.Secret).Lease.Get(ctxFor(t, 30*time.Second), &gpupoolv1.GetLeaseRequest{LeaseId: lease.ID, Stale: true}); err != nil {
		t.Errorf("a token created a moment ago, on follower %s: %v", follower, err)
	}

	// Revoked: refused with the reason; the owner's release is audited.
	mustRun("operator", "acl", "token", "revoke", b.Token.AccessorID, mgmt)
	_, stderr, code = run("lease", "ls", "--token="+b.Secret)
	if code != 1 || !strings.Contains(stderr, "revoked") {
		t.Errorf("a revoked token: exit %d, %q; want 1 and revoked", code, stderr)
	}
	if out := mustRun("operator", "acl", "token", "ls", mgmt); !strings.Contains(out, "revoked") || strings.Contains(out, b.Secret) {
		t.Errorf("token ls: want b listed as revoked and no secret:\n%s", out)
	}
	mustRun("lease", "release", lease.ID, "--token="+a.Secret)
	if out := mustRun("lease", "get", lease.ID, mgmt); !strings.Contains(out, "ENDED BY") || !strings.Contains(out, a.Token.AccessorID) {
		t.Errorf("lease get does not say who released it:\n%s", out)
	}

	// Revoking a token revokes the leases it acquired, unless kept.
	c := newToken("operator", "acl", "token", "create", "--kind", "client", "--tenant", "team-c", "-o", "json", mgmt)
	var leaseC, keptC struct {
		ID string `json:"id"`
	}
	for _, l := range []*struct {
		ID string `json:"id"`
	}{&leaseC, &keptC} {
		if err := json.Unmarshal([]byte(mustRun("lease", "acquire", "--memory", "1GiB", "--compute", "5", "-o", "json", "--token="+c.Secret)), l); err != nil {
			t.Fatal(err)
		}
	}
	d := newToken("operator", "acl", "token", "create", "--kind", "client", "--tenant", "team-c", "-o", "json", mgmt)
	var leaseD struct {
		ID string `json:"id"`
	}
	if err := json.Unmarshal([]byte(mustRun("lease", "acquire", "--memory", "1GiB", "--compute", "5", "-o", "json", "--token="+d.Secret)), &leaseD); err != nil {
		t.Fatal(err)
	}
	if out := mustRun("operator", "acl", "token", "revoke", c.Token.AccessorID, mgmt); !strings.Contains(out, "and 2 of its leases") {
		t.Errorf("revoking team-c's token: %q, want it to say 2 leases were revoked", out)
	}
	if out := mustRun("operator", "acl", "token", "revoke", d.Token.AccessorID, "--keep-leases", mgmt); !strings.Contains(out, "and 0 of its leases") {
		t.Errorf("revoking with --keep-leases: %q, want no lease revoked", out)
	}
	for id, want := range map[string]string{leaseC.ID: "REVOKED", keptC.ID: "REVOKED", leaseD.ID: "GRANTED"} {
		if out := mustRun("lease", "get", id, "-o", "json", mgmt); !strings.Contains(out, want) {
			t.Errorf("lease %s after its token's revocation: want %s in\n%s", id, want, out)
		}
	}
}
