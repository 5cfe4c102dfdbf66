package protocol

import (
	"fmt"
	"slices"
	"strings"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// TenantError is a lease request whose tenant its caller's token may not
// act for. Field is the request field (tenant), Tenant the tenant the
// request named or was given by default, and Allowed the tenants the
// token holds, its default first.
type TenantError struct {
	Field   string
	Tenant  string
	Allowed []string
}

func (e *TenantError) Error() string {
	if len(e.Allowed) == 0 {
		return fmt.Sprintf("%s %q: the token may act for no tenant", e.Field, e.Tenant)
	}
	return fmt.Sprintf("%s %q: the token may act for tenants %s only", e.Field, e.Tenant, strings.Join(e.Allowed, ", "))
}

// FillDefaults fills in, in place, what a lease request leaves to its
// caller: an empty tenant becomes the caller's default tenant, and an
// unspecified class becomes guaranteed. It is the one rule for both; the
// broker applies it to every Acquire before it reads the tenant (the ACL
// check, the tenant's pending cap, the quota and the queue all see the
// filled-in request), and the SDK applies it to learn the tenant a waiting
// request is queued under.
//
// token is the caller's ACL token, nil on brokers without ACL. A
// management token, or nil, may act for every tenant, and its default
// tenant is DefaultTenant. Any other token may act for its Tenants only,
// and its default tenant is the first of them (DefaultTenant when it has
// none).
//
// After a nil return r.Tenant is not empty and r.Class is not
// LEASE_CLASS_UNSPECIFIED; no other field changes. When the tenant,
// named or defaulted, is one the token may not act for, it returns a
// *TenantError and leaves r unchanged. It is idempotent: a filled-in
// request passes through again unchanged, so a follower and the leader
// may both apply it to a forwarded call.
func FillDefaults(r *gpupoolv1.LeaseRequest, token *gpupoolv1.AclToken) error {
	tenant, err := tenantFor(r.GetTenant(), token)
	if err != nil {
		return err
	}
	r.Tenant = tenant
	if r.Class == gpupoolv1.LeaseClass_LEASE_CLASS_UNSPECIFIED {
		r.Class = gpupoolv1.LeaseClass_LEASE_CLASS_GUARANTEED
	}
	return nil
}

// tenantFor is the tenant a request naming tenant ("" for none) counts
// against for a caller with token; see FillDefaults.
func tenantFor(tenant string, token *gpupoolv1.AclToken) (string, error) {
	if token == nil || token.Kind == gpupoolv1.TokenKind_TOKEN_KIND_MANAGEMENT {
		if tenant == "" {
			return DefaultTenant, nil
		}
		return tenant, nil
	}
	if tenant == "" {
		tenant = DefaultTenant
		if len(token.Tenants) > 0 {
			tenant = token.Tenants[0]
		}
	}
	if !slices.Contains(token.Tenants, tenant) {
		return "", &TenantError{Field: "tenant", Tenant: tenant, Allowed: slices.Clone(token.Tenants)}
	}
	return tenant, nil
}
