package protocol

import (
	"errors"
	"slices"
	"testing"

	"google.golang.org/protobuf/proto"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

func TestFillDefaultsGivesTheCallersTenantAndAGuaranteedClass(t *testing.T) {
	client := func(tenants ...string) *gpupoolv1.AclToken {
		return &gpupoolv1.AclToken{Kind: gpupoolv1.TokenKind_TOKEN_KIND_CLIENT, Tenants: tenants}
	}
	management := &gpupoolv1.AclToken{Kind: gpupoolv1.TokenKind_TOKEN_KIND_MANAGEMENT}
	preemptible := gpupoolv1.LeaseClass_LEASE_CLASS_PREEMPTIBLE
	guaranteed := gpupoolv1.LeaseClass_LEASE_CLASS_GUARANTEED
	for _, tc := range []struct {
		name       string
		tenant     string
		class      gpupoolv1.LeaseClass
		token      *gpupoolv1.AclToken
		wantTenant string
		wantClass  gpupoolv1.LeaseClass
	}{
		{"no token and no tenant count against the default tenant", "", 0, nil, DefaultTenant, guaranteed},
		{"no token keeps the tenant named", "team-b", preemptible, nil, "team-b", preemptible},
		{"a management token without a tenant counts against the default tenant", "", 0, management, DefaultTenant, guaranteed},
		{"a management token may name any tenant", "team-z", 0, management, "team-z", guaranteed},
		{"a client token without a tenant counts against its first tenant", "", 0, client("team-a", "team-b"), "team-a", guaranteed},
		{"a client token may name another of its tenants", "team-b", preemptible, client("team-a", "team-b"), "team-b", preemptible},
		{"a client token of the default tenant defaults to it", "", 0, client(DefaultTenant), DefaultTenant, guaranteed},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := &gpupoolv1.LeaseRequest{Count: 1, Tenant: tc.tenant, Class: tc.class}
			if err := FillDefaults(r, tc.token); err != nil {
				t.Fatalf("got %v, want nil", err)
			}
			if r.Tenant != tc.wantTenant || r.Class != tc.wantClass {
				t.Fatalf("got tenant %q class %v, want %q %v", r.Tenant, r.Class, tc.wantTenant, tc.wantClass)
			}
			again := proto.CloneOf(r)
			if err := FillDefaults(again, tc.token); err != nil || !proto.Equal(again, r) {
				t.Fatalf("filled in twice: got %v (%v), want %v unchanged", again, err, r)
			}
		})
	}
}

func TestFillDefaultsRefusesATenantTheTokenDoesNotHoldNamingItAndTheAllowedOnes(t *testing.T) {
	for _, tc := range []struct {
		name    string
		tenant  string
		token   *gpupoolv1.AclToken
		want    string
		allowed []string
	}{
		{"another tenant", "team-c", &gpupoolv1.AclToken{Kind: gpupoolv1.TokenKind_TOKEN_KIND_CLIENT, Tenants: []string{"team-a", "team-b"}},
			`tenant "team-c": the token may act for tenants team-a, team-b only`, []string{"team-a", "team-b"}},
		{"the default tenant, not the token's", DefaultTenant, &gpupoolv1.AclToken{Kind: gpupoolv1.TokenKind_TOKEN_KIND_CLIENT, Tenants: []string{"team-a"}},
			`tenant "default": the token may act for tenants team-a only`, []string{"team-a"}},
		{"a token of no tenant", "", &gpupoolv1.AclToken{Kind: gpupoolv1.TokenKind_TOKEN_KIND_AGENT, HostId: "h1"},
			`tenant "default": the token may act for no tenant`, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := &gpupoolv1.LeaseRequest{Count: 1, Tenant: tc.tenant}
			err := FillDefaults(r, tc.token)
			var te *TenantError
			if !errors.As(err, &te) {
				t.Fatalf("got %v, want a *TenantError", err)
			}
			if got := err.Error(); got != tc.want {
				t.Errorf("got %q, want %q", got, tc.want)
			}
			if te.Field != "tenant" || !slices.Equal(te.Allowed, tc.allowed) {
				t.Errorf("got field %q allowed %v, want tenant %v", te.Field, te.Allowed, tc.allowed)
			}
			if r.Tenant != tc.tenant || r.Class != gpupoolv1.LeaseClass_LEASE_CLASS_UNSPECIFIED {
				t.Errorf("got tenant %q class %v, want the request unchanged", r.Tenant, r.Class)
			}
		})
	}
}
