package broker

import (
	"context"
	"fmt"
	"strings"

	"google.golang.org/protobuf/proto"

	"github.com/gpupool/gpupool/broker/fsm"
	"github.com/gpupool/gpupool/broker/state"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
	"github.com/gpupool/gpupool/protocol"
)

// SetQuota replaces a tenant's quota. A quota below the tenant's usage is
// set all the same; the response warns what is over.
func (e operatorService) SetQuota(ctx context.Context, req *gpupoolv1.SetQuotaRequest) (*gpupoolv1.SetQuotaResponse, error) {
	if req.GetQuota() == nil {
		return nil, refuse(ErrInvalid, "quota: is required")
	}
	if err := fsm.ValidateQuota(req.Quota); err != nil {
		return nil, err
	}
	if conn, fctx, err := e.membership.leaderConn(ctx); err != nil {
		return nil, err
	} else if conn != nil {
		return gpupoolv1.NewOperatorServiceClient(conn).SetQuota(fctx, req)
	}
	q := proto.Clone(req.Quota).(*gpupoolv1.Quota)
	q.UpdatedAtMs = e.nowMs()
	by := callerFrom(ctx).actor()
	q.UpdatedBy = by
	if _, err := e.apply(&gpupoolv1.SetQuotaCommand{Tenant: q.Tenant, Quota: q, Actor: by, NowMs: q.UpdatedAtMs}); err != nil {
		return nil, err
	}
	e.log.Info("quota set", "tenant", q.Tenant, "gpus", q.Gpus, "memory_mib", q.MemoryMib, "compute_percent", q.ComputePercent, "by", protocol.ActorText(by))
	if ls := e.leadership.currentLeader(); ls != nil {
		ls.kickQueue() // a raised quota may let a pending lease through
	}
	qs := quotaStatus(e.fsm.State(), q)
	warnings := fsm.OverQuota(q, qs.Usage)
	if len(warnings) > 0 {
		e.log.Warn("quota set below the tenant's usage", "tenant", q.Tenant, "over", strings.Join(warnings, "; "))
	}
	return &gpupoolv1.SetQuotaResponse{Quota: qs, Warnings: warnings}, nil
}

// RemoveQuota drops a tenant's quota.
func (e operatorService) RemoveQuota(ctx context.Context, req *gpupoolv1.RemoveQuotaRequest) (*gpupoolv1.RemoveQuotaResponse, error) {
	if req.Tenant == "" {
		return nil, refuse(ErrInvalid, "tenant: is required; see 'gpupool operator quota ls'")
	}
	if err := protocol.ValidateTenant("tenant", req.Tenant); err != nil {
		return nil, err
	}
	if conn, fctx, err := e.membership.leaderConn(ctx); err != nil {
		return nil, err
	} else if conn != nil {
		return gpupoolv1.NewOperatorServiceClient(conn).RemoveQuota(fctx, req)
	}
	old := e.fsm.State().Quota(req.Tenant)
	if old == nil {
		return nil, noQuota(e.fsm.State(), req.Tenant)
	}
	by := callerFrom(ctx).actor()
	if _, err := e.apply(&gpupoolv1.SetQuotaCommand{Tenant: req.Tenant, Actor: by, NowMs: e.nowMs()}); err != nil {
		return nil, err
	}
	e.log.Info("quota removed", "tenant", req.Tenant, "by", protocol.ActorText(by))
	if ls := e.leadership.currentLeader(); ls != nil {
		ls.kickQueue()
	}
	return &gpupoolv1.RemoveQuotaResponse{Quota: old}, nil
}

// ListQuotas lists the quotas, each with its tenant's usage.
func (e operatorService) ListQuotas(ctx context.Context, req *gpupoolv1.ListQuotasRequest) (*gpupoolv1.ListQuotasResponse, error) {
	c := callerFrom(ctx)
	if req.Tenant != "" {
		if err := protocol.ValidateTenant("tenant", req.Tenant); err != nil {
			return nil, err
		}
		if err := c.mayActFor(req.Tenant, "tenant"); err != nil {
			return nil, err
		}
	}
	if conn, fctx, err := e.membership.readConn(ctx, req.Stale); err != nil {
		return nil, err
	} else if conn != nil {
		return gpupoolv1.NewOperatorServiceClient(conn).ListQuotas(fctx, req)
	}
	st := e.fsm.State()
	resp := &gpupoolv1.ListQuotasResponse{}
	for _, q := range st.Quotas() {
		if (req.Tenant == "" || q.Tenant == req.Tenant) && c.mayActFor(q.Tenant, "") == nil {
			resp.Quotas = append(resp.Quotas, quotaStatus(st, q))
		}
	}
	if req.Tenant != "" && len(resp.Quotas) == 0 {
		if !c.management() {
			return nil, refusef(ErrNotFound, "tenant %q: has no quota", req.Tenant)
		}
		return nil, noQuota(st, req.Tenant)
	}
	return resp, nil
}

func quotaStatus(st *state.Reader, q *gpupoolv1.Quota) *gpupoolv1.QuotaStatus {
	return &gpupoolv1.QuotaStatus{Quota: q, Usage: fsm.TenantUsage(st, q.Tenant)}
}

// noQuota is the NotFound answer for a tenant without a quota, naming the
// tenants that have one.
func noQuota(st *state.Reader, tenant string) error {
	var have []string
	for _, q := range st.Quotas() {
		have = append(have, q.Tenant)
	}
	known := "no tenant has a quota"
	if len(have) > 0 {
		known = "tenants with a quota: " + strings.Join(have, ", ")
	}
	return refuse(ErrNotFound, fmt.Sprintf("tenant %q: has no quota (%s); see 'gpupool operator quota ls'", tenant, known))
}
