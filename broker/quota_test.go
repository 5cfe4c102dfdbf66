package broker

import (
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/gpupool/gpupool/broker/fsm"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

func (ts *testServer) setQuota(t *testing.T, q *gpupoolv1.Quota) *gpupoolv1.SetQuotaResponse {
	t.Helper()
	resp, err := ts.c.Operator.SetQuota(ctx(t), &gpupoolv1.SetQuotaRequest{Quota: q})
	if err != nil {
		t.Fatal(err)
	}
	return resp
}

func tenantSlice(tenant string, mem int64, compute int32) *gpupoolv1.LeaseRequest {
	r := slice(mem, compute)
	r.Tenant = tenant
	return r
}

func TestQuotaCallsRejectBadInput(t *testing.T) {
	ts := startServer(t)
	ts.setQuota(t, &gpupoolv1.Quota{Tenant: "sim", Gpus: 1})
	set := func(q *gpupoolv1.Quota) func() error {
		return func() error {
			_, err := ts.c.Operator.SetQuota(ctx(t), &gpupoolv1.SetQuotaRequest{Quota: q})
			return err
		}
	}
	tests := []struct {
		name string
		call func() error
		code codes.Code
		want string // in the message
	}{
		{"a set without a quota", set(nil), codes.InvalidArgument, "quota: is required"},
		{"a set without a tenant", set(&gpupoolv1.Quota{Gpus: 1}), codes.InvalidArgument, `quota.tenant "": is required`},
		{"a set for a bad tenant name", set(&gpupoolv1.Quota{Tenant: "Sim Team"}), codes.InvalidArgument, `quota.tenant "Sim Team": must be 1-63 lowercase`},
		{"a quota without a limit", set(&gpupoolv1.Quota{Tenant: "sim"}), codes.InvalidArgument,
			"quota gpus=0 memory_mib=0 compute_percent=0: limits nothing (0 is unlimited); set at least one limit above 0, or lift tenant sim's limits with 'gpupool operator quota rm sim'"},
		{"negative gpus", set(&gpupoolv1.Quota{Tenant: "sim", Gpus: -1}), codes.InvalidArgument, "quota.gpus -1: must be 0 (unlimited) or more"},
		{"negative memory", set(&gpupoolv1.Quota{Tenant: "sim", MemoryMib: -5}), codes.InvalidArgument, "quota.memory_mib -5: must be 0 (unlimited) or more"},
		{"negative compute", set(&gpupoolv1.Quota{Tenant: "sim", ComputePercent: -100}), codes.InvalidArgument, "quota.compute_percent -100"},
		{"a remove without a tenant", func() error {
			_, err := ts.c.Operator.RemoveQuota(ctx(t), &gpupoolv1.RemoveQuotaRequest{})
			return err
		}, codes.InvalidArgument, "tenant: is required"},
		{"a remove of a tenant without a quota", func() error {
			_, err := ts.c.Operator.RemoveQuota(ctx(t), &gpupoolv1.RemoveQuotaRequest{Tenant: "nobody"})
			return err
		}, codes.NotFound, `tenant "nobody": has no quota (tenants with a quota: sim)`},
		{"a list of a tenant without a quota", func() error {
			_, err := ts.c.Operator.ListQuotas(ctx(t), &gpupoolv1.ListQuotasRequest{Tenant: "nobody"})
			return err
		}, codes.NotFound, `tenant "nobody": has no quota`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			st, _ := status.FromError(tt.call())
			if st.Code() != tt.code || !strings.Contains(st.Message(), tt.want) {
				t.Fatalf("got %v %q, want %v containing %q", st.Code(), st.Message(), tt.code, tt.want)
			}
		})
	}
	// Nothing changed sim's quota.
	resp, err := ts.c.Operator.ListQuotas(ctx(t), &gpupoolv1.ListQuotasRequest{})
	if err != nil || len(resp.Quotas) != 1 || resp.Quotas[0].Quota.Gpus != 1 {
		t.Fatalf("after bad calls: got %v (err %v), want only sim with 1 GPU", resp, err)
	}
}

func TestQuotaIsSetListedEnforcedAndRemoved(t *testing.T) {
	ts := startServer(t)
	ts.registerHost(t, "h1", 2, 81920)
	set := ts.setQuota(t, &gpupoolv1.Quota{Tenant: "sim", Gpus: 1, MemoryMib: 40 << 10, ComputePercent: 100})
	if len(set.Warnings) != 0 || set.Quota.Quota.UpdatedAtMs != ts.clock.Now().UnixMilli() {
		t.Fatalf("set: got %v, want no warnings and the time stamped", set)
	}
	if _, err := ts.c.Lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: tenantSlice("sim", 30<<10, 50)}); err != nil {
		t.Fatal(err)
	}
	_, err := ts.c.Lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: tenantSlice("sim", 20<<10, 10)})
	want := "tenant sim: memory 30 GiB of 40 GiB quota used, the lease needs 20 GiB; see 'gpupool operator quota ls'"
	if st, _ := status.FromError(err); st.Code() != codes.ResourceExhausted || st.Message() != want {
		t.Fatalf("an acquire past the quota: got %v %q, want ResourceExhausted %q", st.Code(), st.Message(), want)
	}
	// Another tenant is not limited by sim's quota.
	if _, err := ts.c.Lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: tenantSlice("train", 40<<10, 50)}); err != nil {
		t.Fatalf("tenant train: %v", err)
	}
	ls, err := ts.c.Operator.ListQuotas(ctx(t), &gpupoolv1.ListQuotasRequest{})
	if err != nil {
		t.Fatal(err)
	}
	wantUsage := &gpupoolv1.TenantUsage{Tenant: "sim", Gpus: 1, MemoryMib: 30 << 10, ComputePercent: 50, Leases: 1}
	if len(ls.Quotas) != 1 || !proto.Equal(ls.Quotas[0].Usage, wantUsage) {
		t.Fatalf("ls: got %v, want sim using %v", ls.Quotas, wantUsage)
	}

	// Lowering the quota below usage is allowed, with a warning.
	set = ts.setQuota(t, &gpupoolv1.Quota{Tenant: "sim", MemoryMib: 20 << 10})
	if len(set.Warnings) != 1 || !strings.Contains(set.Warnings[0], "tenant sim: memory 30 GiB used is over the new 20 GiB quota by 10 GiB") {
		t.Fatalf("quota below usage: got warnings %q, want one saying memory is 10 GiB over", set.Warnings)
	}

	rm, err := ts.c.Operator.RemoveQuota(ctx(t), &gpupoolv1.RemoveQuotaRequest{Tenant: "sim"})
	if err != nil || rm.Quota.MemoryMib != 20<<10 {
		t.Fatalf("rm: got %v (err %v), want the removed 20 GiB quota", rm, err)
	}
	if _, err := ts.c.Lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: tenantSlice("sim", 20<<10, 10)}); err != nil {
		t.Fatalf("after rm: %v", err)
	}
}

// TestConcurrentAcquiresNeverExceedTheQuota races 500 acquires of whole
// GPUs and slices against a quota far smaller than the pool.
func TestConcurrentAcquiresNeverExceedTheQuota(t *testing.T) {
	ts := startServer(t)
	for i := range 4 {
		ts.registerHost(t, fmt.Sprintf("h%d", i), 8, 81920)
	}
	q := &gpupoolv1.Quota{Tenant: "sim", Gpus: 6, MemoryMib: 600 << 10, ComputePercent: 1000}
	ts.setQuota(t, q)
	const n = 500
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := tenantSlice("sim", 4<<10, 10)
			if i%4 == 0 {
				r = &gpupoolv1.LeaseRequest{Tenant: "sim", Count: 1, Exclusive: true, TtlMs: 60_000}
			}
			r.RequestId = fmt.Sprintf("req-%d", i)
			_, errs[i] = ts.c.Lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: r})
		}()
	}
	wg.Wait()
	granted := 0
	for i, err := range errs {
		st, _ := status.FromError(err)
		switch {
		case err == nil:
			granted++
		case st.Code() != codes.ResourceExhausted || !strings.HasPrefix(st.Message(), "tenant sim: "):
			t.Errorf("acquire %d: got %v %q, want OK or ResourceExhausted naming tenant sim", i, st.Code(), st.Message())
		}
	}
	// Sum what the granted leases hold, independently of the broker's count.
	ls, err := ts.c.Lease.List(ctx(t), &gpupoolv1.ListLeasesRequest{Tenant: "sim"})
	if err != nil {
		t.Fatal(err)
	}
	// A slice's GPU share, in units of 1/(100*81920) of a GPU: the larger
	// of compute/100 and memory/81920, or 1 when exclusive; GPUs are the
	// summed shares rounded up.
	const gpu = 100 * 81920
	var shares, mem, compute int64
	for _, l := range ls.Leases {
		for _, s := range l.Slices {
			if s.Exclusive {
				shares += gpu
			} else {
				shares += max(int64(s.ComputePercent)*81920, s.MemoryMib*100)
			}
			mem += s.MemoryMib
			compute += int64(s.ComputePercent)
		}
	}
	gpus := (shares + gpu - 1) / gpu
	if len(ls.Leases) != granted || granted == 0 {
		t.Fatalf("%d acquires succeeded but %d leases are listed; want equal and above 0", granted, len(ls.Leases))
	}
	if gpus > int64(q.Gpus) || mem > q.MemoryMib || compute > q.ComputePercent {
		t.Fatalf("granted leases hold %d GPUs, %d MiB, %d%% compute: over the quota %v", gpus, mem, compute, q)
	}
	u := fsm.TenantUsage(ts.s.fsm.State(), "sim")
	if u.Gpus != int32(gpus) || u.MemoryMib != mem || u.ComputePercent != compute {
		t.Fatalf("the broker counts %v, the leases hold %d GPUs, %d MiB, %d%%", u, gpus, mem, compute)
	}
	// The quota, not the pool, stopped the acquires: the pool has room left.
	_, err = ts.c.Lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: tenantSlice("sim", 4<<10, 10)})
	if st, _ := status.FromError(err); st.Code() != codes.ResourceExhausted || !strings.HasPrefix(st.Message(), "tenant sim: ") {
		t.Fatalf("one more slice: got %v, want refused by the quota", err)
	}
	if _, err := ts.c.Lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: tenantSlice("other", 4<<10, 10)}); err != nil {
		t.Fatalf("another tenant's slice: %v; the pool should have room", err)
	}
}

// TestConcurrentGrantsInTheLogNeverExceedTheQuota proposes 500 grants at
// once straight to Raft, past placement and the leader's quota check, so
// only Apply's check in the grant's own entry stands between them and the
// quota.
func TestConcurrentGrantsInTheLogNeverExceedTheQuota(t *testing.T) {
	ts := startServer(t)
	for i := range 4 {
		ts.registerHost(t, fmt.Sprintf("h%d", i), 8, 81920)
	}
	const quota = 73 // percent; every grant needs 1
	ts.setQuota(t, &gpupoolv1.Quota{Tenant: "sim", ComputePercent: quota})
	const n = 500
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			h := fmt.Sprintf("h%d", i%4)
			l := &gpupoolv1.Lease{
				Id: fmt.Sprintf("l-raw-%d", i), Tenant: "sim", TtlMs: 60_000, CreatedAtMs: ts.s.nowMs(),
				Slices: []*gpupoolv1.Slice{{Host: h, Device: fmt.Sprintf("GPU-%s-%d", h, i/4%8), MemoryMib: 1024, ComputePercent: 1}},
			}
			_, errs[i] = ts.s.apply(&gpupoolv1.GrantLeaseCommand{Lease: l})
		}()
	}
	wg.Wait()
	granted := 0
	for i, err := range errs {
		var qe *fsm.QuotaError
		switch {
		case err == nil:
			granted++
		case !errors.As(err, &qe):
			t.Errorf("grant %d: got %v, want nil or a *fsm.QuotaError", i, err)
		}
	}
	if granted != quota {
		t.Fatalf("%d grants applied, want exactly %d (the compute quota, 1%% each)", granted, quota)
	}
	if u := fsm.TenantUsage(ts.s.fsm.State(), "sim"); u.ComputePercent != quota || u.Leases != quota {
		t.Fatalf("sim's usage: got %v, want %d%% in %d leases", u, quota, quota)
	}
}

// TestAFractionalSliceOfAWholeGPUCountsAgainstTheGPUQuota: a slice that
// takes all of a GPU's compute, or all its memory, is a GPU, so fractional
// slices cannot bypass --gpus; smaller slices count their share.
func TestAFractionalSliceOfAWholeGPUCountsAgainstTheGPUQuota(t *testing.T) {
	ts := startServer(t)
	ts.registerHost(t, "h1", 4, 81920)
	ts.setQuota(t, &gpupoolv1.Quota{Tenant: "sim", Gpus: 1})
	acquire := func(mem int64, compute int32) error {
		_, err := ts.c.Lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: tenantSlice("sim", mem, compute)})
		return err
	}
	if err := acquire(80<<10, 100); err != nil {
		t.Fatal(err)
	}
	want := "tenant sim: gpus 1 of 1 quota used, the lease needs 1; see 'gpupool operator quota ls'"
	for _, r := range []struct {
		mem     int64
		compute int32
	}{{80 << 10, 100}, {1 << 10, 100}, {80 << 10, 1}, {1 << 10, 1}} {
		if st, _ := status.FromError(acquire(r.mem, r.compute)); st.Code() != codes.ResourceExhausted || st.Message() != want {
			t.Fatalf("a slice of %d MiB, %d%% beside a whole GPU: got %v %q, want ResourceExhausted %q", r.mem, r.compute, st.Code(), st.Message(), want)
		}
	}

	// Half GPUs: two fit a quota of 1, a third does not.
	ts.setQuota(t, &gpupoolv1.Quota{Tenant: "other", Gpus: 1})
	for i := range 2 {
		if _, err := ts.c.Lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: tenantSlice("other", 40<<10, 10)}); err != nil {
			t.Fatalf("half GPU %d: %v", i, err)
		}
	}
	_, err := ts.c.Lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: tenantSlice("other", 1<<10, 50)})
	if st, _ := status.FromError(err); st.Code() != codes.ResourceExhausted || !strings.HasPrefix(st.Message(), "tenant other: gpus 1 of 1 quota used") {
		t.Fatalf("a third half GPU: got %v, want refused by the GPU quota", err)
	}
}
