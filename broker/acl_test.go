package broker

import (
	"context"
	"errors"
	"io"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/gpupool/gpupool/client"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// aclServer is a server with ACL on whose ts.c carries the bootstrap
// management token, with host h1 (2 GPUs) registered.
type aclServer struct {
	*testServer
	mgmt string // the bootstrap secret
}

func startACLServer(t *testing.T, opts ...func(*Config)) *aclServer {
	t.Helper()
	ts := startServer(t, append([]func(*Config){func(c *Config) { c.ACL = true }}, opts...)...)
	anon := ts.c
	boot, err := gpupoolv1.NewAclServiceClient(anon.Conn()).Bootstrap(ctx(t), &gpupoolv1.AclBootstrapRequest{})
	if err != nil {
		t.Fatal(err)
	}
	ts.c = ts.clientWith(t, boot.Secret)
	ts.registerHost(t, "h1", 2, 81920)
	return &aclServer{testServer: ts, mgmt: boot.Secret}
}

// clientWith dials the server with an ACL token ("" for none).
func (ts *testServer) clientWith(t *testing.T, secret string) *client.Client {
	t.Helper()
	c, err := client.DialWith([]string{ts.s.Addr()}, client.Options{Token: secret})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// token creates a token with the management client and returns it and its secret.
func (as *aclServer) token(t *testing.T, req *gpupoolv1.CreateAclTokenRequest) (*gpupoolv1.AclToken, string) {
	t.Helper()
	if req.Name == "" {
		req.Name = "test-" + strings.ToLower(req.Kind.String())
	}
	resp, err := gpupoolv1.NewAclServiceClient(as.c.Conn()).CreateToken(ctx(t), req)
	if err != nil {
		t.Fatal(err)
	}
	return resp.Token, resp.Secret
}

func clientToken(tenants ...string) *gpupoolv1.CreateAclTokenRequest {
	return &gpupoolv1.CreateAclTokenRequest{Kind: gpupoolv1.TokenKind_TOKEN_KIND_CLIENT, Tenants: tenants}
}

// wantStatus fails unless err has code and its message every fragment.
func wantStatus(t *testing.T, err error, code codes.Code, fragments ...string) {
	t.Helper()
	st, _ := status.FromError(err)
	if err == nil || st.Code() != code {
		t.Fatalf("got %v, want %s", err, code)
	}
	for _, f := range fragments {
		if !strings.Contains(st.Message(), f) {
			t.Errorf("got %s %q, want it to mention %q", st.Code(), st.Message(), f)
		}
	}
}

func TestACLRefusesMissingUnknownRevokedAndExpiredTokens(t *testing.T) {
	as := startACLServer(t)
	revoked, revokedSecret := as.token(t, clientToken("a"))
	if _, err := gpupoolv1.NewAclServiceClient(as.c.Conn()).RevokeToken(ctx(t), &gpupoolv1.RevokeAclTokenRequest{AccessorId: revoked.AccessorId}); err != nil {
		t.Fatal(err)
	}
	ttl := clientToken("a")
	ttl.TtlMs = 60_000
	expiring, expiringSecret := as.token(t, ttl)
	as.clock.Advance(time.Minute)

	tests := []struct {
		name      string
		secret    string
		fragments []string
	}{
		{"a missing token", "", []string{"no ACL token", "--token", "GPUPOOL_TOKEN"}},
		{"an unknown token", strings.Repeat("ab", 32), []string{"not recognised"}},
		{"a revoked token", revokedSecret, []string{revoked.AccessorId, "revoked", "bootstrap"}},
		{"an expired token", expiringSecret, []string{expiring.AccessorId, "expired at"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := as.clientWith(t, tt.secret)
			_, err := c.Lease.List(ctx(t), &gpupoolv1.ListLeasesRequest{})
			wantStatus(t, err, codes.Unauthenticated, tt.fragments...)
			// Streams are checked as well.
			w, err := c.Lease.Watch(ctx(t), &gpupoolv1.WatchLeasesRequest{})
			if err == nil {
				_, err = w.Recv()
			}
			wantStatus(t, err, codes.Unauthenticated, tt.fragments...)
		})
	}

	list, err := gpupoolv1.NewAclServiceClient(as.c.Conn()).ListTokens(ctx(t), &gpupoolv1.ListAclTokensRequest{})
	if err != nil {
		t.Fatal(err)
	}
	for _, tok := range list.Tokens {
		if len(tok.SecretSha256) != 0 {
			t.Errorf("token %s listed with its secret hash", tok.AccessorId)
		}
		if got, want := tok.Expired, tok.AccessorId == expiring.AccessorId; got != want {
			t.Errorf("token %s: expired %t, want %t", tok.Name, got, want)
		}
		if got, want := tok.Revoked, tok.AccessorId == revoked.AccessorId; got != want {
			t.Errorf("token %s: revoked %t, want %t", tok.Name, got, want)
		}
	}
}

func TestACLBootstrapsOnce(t *testing.T) {
	as := startACLServer(t)
	anon := as.clientWith(t, "")
	_, err := gpupoolv1.NewAclServiceClient(anon.Conn()).Bootstrap(ctx(t), &gpupoolv1.AclBootstrapRequest{})
	wantStatus(t, err, codes.FailedPrecondition, "already bootstrapped", "acl token create")
	who, err := gpupoolv1.NewAclServiceClient(as.c.Conn()).WhoAmI(ctx(t), &gpupoolv1.WhoAmIRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if tok := who.Token; !tok.Bootstrap || tok.Kind != gpupoolv1.TokenKind_TOKEN_KIND_MANAGEMENT || tok.SecretSha256 != nil {
		t.Errorf("whoami with the bootstrap secret: got %v, want the bootstrap management token without its hash", tok)
	}
}

func TestACLRefusesTokensWithoutTheRight(t *testing.T) {
	as := startACLServer(t)
	_, cSecret := as.token(t, clientToken("a"))
	_, aSecret := as.token(t, &gpupoolv1.CreateAclTokenRequest{Kind: gpupoolv1.TokenKind_TOKEN_KIND_AGENT, HostId: "h1"})
	cl, agent := as.clientWith(t, cSecret), as.clientWith(t, aSecret)

	tests := []struct {
		name      string
		call      func() error
		fragments []string
	}{
		{"a client token draining a host", func() error {
			_, err := cl.Pool.DrainHost(ctx(t), &gpupoolv1.DrainHostRequest{HostId: "h1"})
			return err
		}, []string{"DrainHost", "lacks management"}},
		{"a client token setting a quota", func() error {
			_, err := cl.Operator.SetQuota(ctx(t), &gpupoolv1.SetQuotaRequest{Quota: &gpupoolv1.Quota{Tenant: "a", Gpus: 1}})
			return err
		}, []string{"SetQuota", "lacks management"}},
		{"a client token rotating the signing key", func() error {
			_, err := cl.Operator.RotateSigningKey(ctx(t), &gpupoolv1.RotateSigningKeyRequest{})
			return err
		}, []string{"lacks management"}},
		{"a client token creating tokens", func() error {
			_, err := gpupoolv1.NewAclServiceClient(cl.Conn()).CreateToken(ctx(t), clientToken("b"))
			return err
		}, []string{"CreateToken", "lacks management"}},
		{"a client token registering a host", func() error {
			_, err := cl.Agent.Register(ctx(t), &gpupoolv1.RegisterRequest{Host: &gpupoolv1.Host{Id: "h1"}})
			return err
		}, []string{"lacks agent access"}},
		{"an agent token acquiring a lease", func() error {
			_, err := agent.Lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: slice(1024, 10)})
			return err
		}, []string{"Acquire", "agent", "lacks lease access"}},
		{"an agent token listing hosts", func() error {
			_, err := agent.Pool.ListHosts(ctx(t), &gpupoolv1.ListHostsRequest{})
			return err
		}, []string{"lacks pool read access"}},
		{"an agent token registering another host id", func() error {
			h := &gpupoolv1.Host{Id: "h2", Address: "127.0.0.1:1", Devices: []*gpupoolv1.Device{{Uuid: "GPU-h2-0", Model: "A100", MemoryMib: 1024}}}
			_, err := agent.Agent.Register(ctx(t), &gpupoolv1.RegisterRequest{Host: h})
			return err
		}, []string{`host_id "h2"`, `join token of host "h1"`, `not of host "h2"`}},
		{"an agent token heartbeating as another host id", func() error {
			hb, err := agent.Agent.Heartbeat(ctx(t))
			if err != nil {
				return err
			}
			if err := hb.Send(&gpupoolv1.HeartbeatRequest{HostId: "h9"}); err != nil {
				return err
			}
			_, err = hb.Recv()
			return err
		}, []string{`host_id "h9"`, `host "h1"`}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			wantStatus(t, tt.call(), codes.PermissionDenied, tt.fragments...)
		})
	}

	// The agent's own host is fine, on both calls.
	h := &gpupoolv1.Host{Id: "h1", Address: "127.0.0.1:1", CpuMillicores: 64000, MemoryMib: 256 << 10,
		Devices: []*gpupoolv1.Device{{Uuid: "GPU-h1-0", Index: 0, Model: "A100-SXM4-80GB", MemoryMib: 81920}, {Uuid: "GPU-h1-1", Index: 1, Model: "A100-SXM4-80GB", MemoryMib: 81920}}}
	if _, err := agent.Agent.Register(ctx(t), &gpupoolv1.RegisterRequest{Host: h}); err != nil {
		t.Fatalf("agent registering its own host: %v", err)
	}
	hb, err := agent.Agent.Heartbeat(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	if err := hb.Send(&gpupoolv1.HeartbeatRequest{HostId: "h1"}); err != nil {
		t.Fatal(err)
	}
	if _, err := hb.Recv(); err != nil {
		t.Fatalf("agent heartbeating as its own host: %v", err)
	}
}

func TestACLKeepsClientTokensInTheirScope(t *testing.T) {
	as := startACLServer(t)
	limited := clientToken("a", "a2")
	prio := int32(10)
	limited.MaxPriority, limited.PreemptibleOnly = &prio, true
	tok, secret := as.token(t, limited)
	c := as.clientWith(t, secret)
	preemptible := func(r *gpupoolv1.LeaseRequest) *gpupoolv1.LeaseRequest {
		r.Class = gpupoolv1.LeaseClass_LEASE_CLASS_PREEMPTIBLE
		return r
	}

	tests := []struct {
		name      string
		req       *gpupoolv1.LeaseRequest
		fragments []string
	}{
		{"another tenant", func() *gpupoolv1.LeaseRequest { r := preemptible(slice(1024, 5)); r.Tenant = "b"; return r }(),
			[]string{"request.tenant", `not tenant "b"`, "a, a2", tok.AccessorId}},
		{"a priority above the limit", func() *gpupoolv1.LeaseRequest { r := preemptible(slice(1024, 5)); r.Priority = 11; return r }(),
			[]string{"request.priority 11", "priority 10 at most"}},
		{"a guaranteed lease", slice(1024, 5), []string{"request.class guaranteed", "preemptible leases only"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := c.Lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: tt.req})
			wantStatus(t, err, codes.PermissionDenied, tt.fragments...)
		})
	}

	// Within scope: no tenant means the token's first; a2 may be named.
	for _, tenant := range []string{"", "a2"} {
		r := preemptible(slice(1024, 5))
		r.Tenant, r.Priority = tenant, 10
		resp, err := c.Lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: r})
		if err != nil {
			t.Fatalf("acquire for tenant %q: %v", tenant, err)
		}
		want := tenant
		if want == "" {
			want = "a"
		}
		if resp.Lease.Tenant != want {
			t.Errorf("acquire for tenant %q: got tenant %q, want %q", tenant, resp.Lease.Tenant, want)
		}
		if by := resp.Lease.GrantedBy; by.GetAccessorId() != tok.AccessorId || by.GetName() != tok.Name {
			t.Errorf("granted_by: got %v, want the token %s (%s)", by, tok.AccessorId, tok.Name)
		}
	}
}

func TestACLIsolatesTenants(t *testing.T) {
	as := startACLServer(t)
	_, aSecret := as.token(t, clientToken("a"))
	bTok, bSecret := as.token(t, clientToken("b"))
	a, b := as.clientWith(t, aSecret), as.clientWith(t, bSecret)
	got, err := a.Lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: slice(1024, 5)})
	if err != nil {
		t.Fatal(err)
	}
	aLease := got.Lease.Id

	// b sees nothing of a's lease and cannot touch it: it answers as a
	// lease that does not exist, so b cannot even tell it exists.
	notFound := `lease "` + aLease + `": not found`
	_, err = b.Lease.Get(ctx(t), &gpupoolv1.GetLeaseRequest{LeaseId: aLease})
	wantStatus(t, err, codes.NotFound, notFound)
	_, missing := b.Lease.Get(ctx(t), &gpupoolv1.GetLeaseRequest{LeaseId: "l-0000000000000000"})
	if status.Code(missing) != codes.NotFound || strings.ReplaceAll(status.Convert(missing).Message(), "l-0000000000000000", aLease) != status.Convert(err).Message() {
		t.Errorf("another tenant's lease: %v; a missing one: %v; want the same answer", err, missing)
	}
	_, err = b.Lease.Release(ctx(t), &gpupoolv1.ReleaseRequest{LeaseId: aLease})
	wantStatus(t, err, codes.NotFound, notFound)
	_, err = b.Lease.List(ctx(t), &gpupoolv1.ListLeasesRequest{Tenant: "a"})
	wantStatus(t, err, codes.PermissionDenied, "tenant", `not tenant "a"`)
	wctx, wcancel := context.WithTimeout(ctx(t), 300*time.Millisecond)
	defer wcancel()
	w, err := b.Lease.Watch(wctx, &gpupoolv1.WatchLeasesRequest{LeaseId: aLease})
	if err == nil {
		var ev *gpupoolv1.LeaseEvent
		if ev, err = w.Recv(); err == nil {
			t.Errorf("b watching a's lease got an event: %v", ev)
		}
	}
	wantStatus(t, err, codes.DeadlineExceeded)
	ka, err := b.Lease.KeepAlive(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	if err := ka.Send(&gpupoolv1.KeepAliveRequest{LeaseId: aLease}); err != nil {
		t.Fatal(err)
	}
	if resp, err := ka.Recv(); err != nil || resp.Error != notFound || resp.TtlMs != 0 {
		t.Errorf("b renewing a's lease: got %v, %v; want %q", resp, err, notFound)
	}
	host, err := b.Pool.GetHost(ctx(t), &gpupoolv1.GetHostRequest{HostId: "h1"})
	if err != nil {
		t.Fatal(err)
	}
	if len(host.Leases) != 0 {
		t.Errorf("b's host get: got %d leases, want none of a's", len(host.Leases))
	}
	list, err := b.Lease.List(ctx(t), &gpupoolv1.ListLeasesRequest{IncludeEnded: true})
	if err != nil {
		t.Fatal(err)
	}
	if len(list.Leases) != 0 {
		t.Errorf("b's list: got %d leases, want none of a's", len(list.Leases))
	}
	// b's watch of everything starts with b's own lease, not a's.
	all, err := b.Lease.Watch(ctx(t), &gpupoolv1.WatchLeasesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	bLease, err := b.Lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: slice(1024, 5)})
	if err != nil {
		t.Fatal(err)
	}
	ev, err := all.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if ev.Lease.Id != bLease.Lease.Id {
		t.Errorf("b's watch: first event is about lease %s of tenant %s, want b's own %s", ev.Lease.Id, ev.Lease.Tenant, bLease.Lease.Id)
	}
	if ev.Actor.GetAccessorId() != bTok.AccessorId {
		t.Errorf("b's watch: event actor %v, want b's token %s", ev.Actor, bTok.AccessorId)
	}

	// The management token sees and ends both; the audit says who.
	mlist, err := as.c.Lease.List(ctx(t), &gpupoolv1.ListLeasesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if len(mlist.Leases) != 2 {
		t.Errorf("management list: got %d leases, want 2", len(mlist.Leases))
	}
	rel, err := as.c.Lease.Release(ctx(t), &gpupoolv1.ReleaseRequest{LeaseId: aLease})
	if err != nil {
		t.Fatal(err)
	}
	if by := rel.Lease.EndedBy; by.GetName() != "bootstrap" || by.GetAccessorId() == "" {
		t.Errorf("ended_by: got %v, want the bootstrap token", by)
	}
}

func TestACLAuditsDrainsAndQuotas(t *testing.T) {
	as := startACLServer(t)
	who, err := gpupoolv1.NewAclServiceClient(as.c.Conn()).WhoAmI(ctx(t), &gpupoolv1.WhoAmIRequest{})
	if err != nil {
		t.Fatal(err)
	}
	me := who.Token.AccessorId
	q, err := as.c.Operator.SetQuota(ctx(t), &gpupoolv1.SetQuotaRequest{Quota: &gpupoolv1.Quota{Tenant: "a", Gpus: 4}})
	if err != nil {
		t.Fatal(err)
	}
	if got := q.Quota.Quota.UpdatedBy.GetAccessorId(); got != me {
		t.Errorf("quota updated_by: got %q, want %q", got, me)
	}
	r := slice(1024, 5)
	r.Class = gpupoolv1.LeaseClass_LEASE_CLASS_PREEMPTIBLE
	l, err := as.c.Lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: r})
	if err != nil {
		t.Fatal(err)
	}
	d, err := as.c.Pool.DrainHost(ctx(t), &gpupoolv1.DrainHostRequest{HostId: "h1", Reason: "firmware"})
	if err != nil {
		t.Fatal(err)
	}
	if got := d.Host.Drain.By.GetAccessorId(); got != me {
		t.Errorf("drain by: got %q, want %q", got, me)
	}
	// The drain revoked the preemptible lease at once: by whoever drained.
	if got := as.s.fsm.State().Lease(l.Lease.Id).EndedBy.GetAccessorId(); got != me {
		t.Errorf("revoked lease ended_by: got %q, want the drainer %q", got, me)
	}
}

func TestACLRevocationEndsOpenStreams(t *testing.T) {
	as := startACLServer(t)
	tok, secret := as.token(t, clientToken("a"))
	c := as.clientWith(t, secret)
	l, err := c.Lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: slice(1024, 5)})
	if err != nil {
		t.Fatal(err)
	}
	ka, err := c.Lease.KeepAlive(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	if err := ka.Send(&gpupoolv1.KeepAliveRequest{LeaseId: l.Lease.Id}); err != nil {
		t.Fatal(err)
	}
	if resp, err := ka.Recv(); err != nil || resp.Error != "" {
		t.Fatalf("renewal before revocation: %v %v", resp, err)
	}
	if _, err := gpupoolv1.NewAclServiceClient(as.c.Conn()).RevokeToken(ctx(t), &gpupoolv1.RevokeAclTokenRequest{AccessorId: tok.AccessorId}); err != nil {
		t.Fatal(err)
	}
	if err := ka.Send(&gpupoolv1.KeepAliveRequest{LeaseId: l.Lease.Id}); err != nil && !errors.Is(err, io.EOF) {
		t.Fatal(err)
	}
	for {
		_, err = ka.Recv()
		if err != nil {
			break
		}
	}
	wantStatus(t, err, codes.Unauthenticated, tok.AccessorId, "revoked")
}

func TestACLRefusesMalformedTokensWhole(t *testing.T) {
	as := startACLServer(t)
	prio := int32(1001)
	tests := []struct {
		name      string
		req       *gpupoolv1.CreateAclTokenRequest
		fragments []string
	}{
		{"no kind", &gpupoolv1.CreateAclTokenRequest{Name: "x"}, []string{"kind", "management, client or agent"}},
		{"a client token without tenants", &gpupoolv1.CreateAclTokenRequest{Name: "x", Kind: gpupoolv1.TokenKind_TOKEN_KIND_CLIENT}, []string{"tenants", "at least one tenant"}},
		{"a bad tenant name", &gpupoolv1.CreateAclTokenRequest{Name: "x", Kind: gpupoolv1.TokenKind_TOKEN_KIND_CLIENT, Tenants: []string{"Bad Tenant"}}, []string{"tenants[0]"}},
		{"a tenant twice", &gpupoolv1.CreateAclTokenRequest{Name: "x", Kind: gpupoolv1.TokenKind_TOKEN_KIND_CLIENT, Tenants: []string{"a", "a"}}, []string{"tenants[1]", "twice"}},
		{"a priority limit out of range", &gpupoolv1.CreateAclTokenRequest{Name: "x", Kind: gpupoolv1.TokenKind_TOKEN_KIND_CLIENT, Tenants: []string{"a"}, MaxPriority: &prio}, []string{"max_priority 1001", "between 0 and 1000"}},
		{"an agent token without a host", &gpupoolv1.CreateAclTokenRequest{Name: "x", Kind: gpupoolv1.TokenKind_TOKEN_KIND_AGENT}, []string{"host_id", "needs the host id"}},
		{"a management token with tenants", &gpupoolv1.CreateAclTokenRequest{Name: "x", Kind: gpupoolv1.TokenKind_TOKEN_KIND_MANAGEMENT, Tenants: []string{"a"}}, []string{"only client tokens have tenants"}},
		{"a negative ttl", &gpupoolv1.CreateAclTokenRequest{Name: "x", Kind: gpupoolv1.TokenKind_TOKEN_KIND_MANAGEMENT, TtlMs: -1}, []string{"ttl_ms -1"}},
		{"no name", &gpupoolv1.CreateAclTokenRequest{Kind: gpupoolv1.TokenKind_TOKEN_KIND_MANAGEMENT}, []string{"name", "required"}},
	}
	acl := gpupoolv1.NewAclServiceClient(as.c.Conn())
	before, err := acl.ListTokens(ctx(t), &gpupoolv1.ListAclTokensRequest{})
	if err != nil {
		t.Fatal(err)
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := acl.CreateToken(ctx(t), tt.req)
			wantStatus(t, err, codes.InvalidArgument, tt.fragments...)
		})
	}
	_, err = acl.RevokeToken(ctx(t), &gpupoolv1.RevokeAclTokenRequest{AccessorId: "no-such"})
	wantStatus(t, err, codes.NotFound, "no-such")
	after, err := acl.ListTokens(ctx(t), &gpupoolv1.ListAclTokensRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if len(after.Tokens) != len(before.Tokens) {
		t.Errorf("tokens: %d after the refused creates, want %d", len(after.Tokens), len(before.Tokens))
	}
}

func TestEveryMethodHasARight(t *testing.T) {
	ts := startServer(t)
	for svc, info := range ts.s.grpc.GetServiceInfo() {
		for _, m := range info.Methods {
			name := "/" + svc + "/" + m.Name
			if _, ok := methodRights[name]; !ok {
				t.Errorf("%s has no entry in methodRights: say who may call it", name)
			}
		}
	}
}

func TestWithoutACLEveryoneActsAsAnonymous(t *testing.T) {
	ts := startServer(t)
	ts.registerHost(t, "h1", 1, 81920)
	l, err := ts.c.Lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: slice(1024, 5)})
	if err != nil {
		t.Fatal(err)
	}
	if got := l.Lease.GrantedBy.GetName(); got != "anonymous" {
		t.Errorf("granted_by without ACL: got %q, want anonymous", got)
	}
}

func TestJoinIsOpenOnlyUntilTheACLBootstrap(t *testing.T) {
	ts := startServer(t, func(c *Config) { c.ACL = true })
	join := func(c *client.Client) error {
		_, err := gpupoolv1.NewClusterServiceClient(c.Conn()).Join(ctx(t), &gpupoolv1.JoinRequest{})
		return err
	}
	// Before the bootstrap the cluster forms without tokens: the request
	// reaches the handler, which refuses it for its empty fields.
	wantStatus(t, join(ts.c), codes.InvalidArgument, "id, raft_address and rpc_address")

	boot, err := gpupoolv1.NewAclServiceClient(ts.c.Conn()).Bootstrap(ctx(t), &gpupoolv1.AclBootstrapRequest{})
	if err != nil {
		t.Fatal(err)
	}
	as := &aclServer{testServer: ts, mgmt: boot.Secret}
	as.c = ts.clientWith(t, boot.Secret)
	_, cSecret := as.token(t, clientToken("a"))
	wantStatus(t, join(ts.clientWith(t, "")), codes.Unauthenticated, "no ACL token")
	wantStatus(t, join(ts.clientWith(t, cSecret)), codes.PermissionDenied, "Join", "lacks management")
	wantStatus(t, join(as.c), codes.InvalidArgument, "id, raft_address and rpc_address")
}

func TestACLShowsClientsTheirOwnQuotasOnly(t *testing.T) {
	as := startACLServer(t)
	for _, tenant := range []string{"a", "b"} {
		if _, err := as.c.Operator.SetQuota(ctx(t), &gpupoolv1.SetQuotaRequest{Quota: &gpupoolv1.Quota{Tenant: tenant, Gpus: 2}}); err != nil {
			t.Fatal(err)
		}
	}
	_, secret := as.token(t, clientToken("a"))
	c := as.clientWith(t, secret)
	resp, err := c.Operator.ListQuotas(ctx(t), &gpupoolv1.ListQuotasRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Quotas) != 1 || resp.Quotas[0].Quota.Tenant != "a" {
		t.Errorf("a's quota list: got %v, want a's quota only", resp.Quotas)
	}
	_, err = c.Operator.ListQuotas(ctx(t), &gpupoolv1.ListQuotasRequest{Tenant: "b"})
	wantStatus(t, err, codes.PermissionDenied, `not tenant "b"`)
}

// saveSnapshot saves the state through c, as 'operator snapshot save' does.
func saveSnapshot(t *testing.T, c *client.Client) []byte {
	t.Helper()
	s, err := c.Operator.SnapshotSave(ctx(t), &gpupoolv1.SnapshotSaveRequest{})
	if err != nil {
		t.Fatal(err)
	}
	var out []byte
	for {
		chunk, err := s.Recv()
		if err == io.EOF {
			return out
		}
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, chunk.Data...)
	}
}

func restoreSnapshot(t *testing.T, c *client.Client, data []byte) error {
	t.Helper()
	s, err := c.Operator.SnapshotRestore(ctx(t))
	if err != nil {
		return err
	}
	if err := s.Send(&gpupoolv1.SnapshotChunk{Data: data}); err != nil {
		return err
	}
	_, err = s.CloseAndRecv()
	return err
}

// A snapshot without the ACL bootstrap would reopen the bootstrap to
// anyone: a bootstrapped cluster refuses it, and takes its own.
func TestRestoreRefusesASnapshotWithoutTheACLBootstrap(t *testing.T) {
	open := startServer(t)
	unbootstrapped := saveSnapshot(t, open.c)

	as := startACLServer(t)
	err := restoreSnapshot(t, as.c, unbootstrapped)
	wantStatus(t, err, codes.FailedPrecondition, "no ACL bootstrap", "anyone bootstrap")
	own := saveSnapshot(t, as.c)
	if err := restoreSnapshot(t, as.c, own); err != nil {
		t.Fatalf("restoring the cluster's own snapshot: %v", err)
	}
	if _, err := gpupoolv1.NewAclServiceClient(as.clientWith(t, "").Conn()).Bootstrap(ctx(t), &gpupoolv1.AclBootstrapRequest{}); status.Code(err) == codes.OK {
		t.Fatal("a second bootstrap after the restore succeeded")
	}
}
