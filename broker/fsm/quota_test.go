package fsm

import (
	"bytes"
	"io"
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

func setQuota(tenant string, gpus int32, memMiB, compute int64) *gpupoolv1.SetQuotaCommand {
	return &gpupoolv1.SetQuotaCommand{Tenant: tenant, Quota: &gpupoolv1.Quota{Tenant: tenant, Gpus: gpus, MemoryMib: memMiB, ComputePercent: compute}}
}

func removeQuota(tenant string) *gpupoolv1.SetQuotaCommand {
	return &gpupoolv1.SetQuotaCommand{Tenant: tenant}
}

// simGrant is a grant of one fractional slice of GPU-h1-dev to tenant sim.
func simGrant(id string, dev int, mem int64, compute int32) *gpupoolv1.GrantLeaseCommand {
	g := grant(id, "h1", dev, mem, compute)
	g.Lease.Tenant = "sim"
	return g
}

// simWhole is a grant of GPU-h1-dev whole to tenant sim.
func simWhole(id string, dev int) *gpupoolv1.GrantLeaseCommand {
	g := simGrant(id, dev, 81920, 100)
	g.Lease.Slices[0].Exclusive = true
	return g
}

func TestApplyQuotas(t *testing.T) {
	end := func(id string) *gpupoolv1.EndLeaseCommand {
		return &gpupoolv1.EndLeaseCommand{LeaseId: id, EndState: gpupoolv1.LeaseState_LEASE_STATE_RELEASED}
	}
	free := func(id string) *gpupoolv1.FreeLeaseCommand { return &gpupoolv1.FreeLeaseCommand{LeaseId: id} }
	retry := simGrant("l-retry", 1, 20480, 10)
	retry.Lease.RequestId = "req-1"
	first := simGrant("l-first", 0, 20480, 10)
	first.Lease.RequestId = "req-1"
	other := grant("l-other", "h1", 0, 40960, 50) // tenant default

	tests := []struct {
		name    string
		log     []proto.Message // after host h1 with 2 GPUs registers
		wantErr string          // in the last entry's error; "" for none
		want    *gpupoolv1.TenantUsage
	}{
		{"a grant within every limit is granted",
			[]proto.Message{setQuota("sim", 1, 40960, 100), simGrant("l-1", 0, 20480, 50)},
			"", &gpupoolv1.TenantUsage{Gpus: 1, MemoryMib: 20480, ComputePercent: 50, Leases: 1}},
		{"a grant past the memory quota is refused, naming tenant, dimension, use, quota and need",
			[]proto.Message{setQuota("sim", 0, 40960, 0), simGrant("l-1", 0, 20480, 10), simGrant("l-2", 1, 20480, 10), simGrant("l-3", 0, 1024, 1)},
			"tenant sim: memory 40 GiB of 40 GiB quota used, the lease needs 1 GiB", &gpupoolv1.TenantUsage{Gpus: 1, MemoryMib: 40960, ComputePercent: 20, Leases: 2}},
		{"an exclusive slice counts one GPU",
			[]proto.Message{setQuota("sim", 1, 0, 0), simWhole("l-1", 0), simWhole("l-2", 1)},
			"tenant sim: gpus 1 of 1 quota used, the lease needs 1", &gpupoolv1.TenantUsage{Gpus: 1, MemoryMib: 81920, ComputePercent: 100, Leases: 1}},
		{"a fractional slice counts its share of a GPU: no slice fits beside a whole GPU under --gpus 1",
			[]proto.Message{setQuota("sim", 1, 0, 0), simWhole("l-1", 0), simGrant("l-2", 1, 1024, 10)},
			"tenant sim: gpus 1 of 1 quota used, the lease needs 1", &gpupoolv1.TenantUsage{Gpus: 1, MemoryMib: 81920, ComputePercent: 100, Leases: 1}},
		{"a fractional slice of 100% compute and all the memory counts a whole GPU",
			[]proto.Message{setQuota("sim", 1, 0, 0), simGrant("l-1", 0, 81920, 100), simGrant("l-2", 1, 81920, 100)},
			"tenant sim: gpus 1 of 1 quota used, the lease needs 1", &gpupoolv1.TenantUsage{Gpus: 1, MemoryMib: 81920, ComputePercent: 100, Leases: 1}},
		{"a fractional slice of all the device's memory counts a whole GPU, whatever its compute",
			[]proto.Message{setQuota("sim", 1, 0, 0), simGrant("l-1", 0, 81920, 1), simGrant("l-2", 1, 1024, 1)},
			"tenant sim: gpus 1 of 1 quota used, the lease needs 1", &gpupoolv1.TenantUsage{Gpus: 1, MemoryMib: 81920, ComputePercent: 1, Leases: 1}},
		{"a fractional slice of 100% compute counts a whole GPU, whatever its memory",
			[]proto.Message{setQuota("sim", 1, 0, 0), simGrant("l-1", 0, 1024, 100), simGrant("l-2", 1, 1024, 1)},
			"tenant sim: gpus 1 of 1 quota used, the lease needs 1", &gpupoolv1.TenantUsage{Gpus: 1, MemoryMib: 1024, ComputePercent: 100, Leases: 1}},
		{"a slice counts the larger of its compute and memory shares",
			[]proto.Message{setQuota("sim", 1, 0, 0), simGrant("l-1", 0, 61440, 10), simGrant("l-2", 1, 40960, 10)}, // 0.75 + 0.5
			"tenant sim: gpus 1 of 1 quota used, the lease needs 1", &gpupoolv1.TenantUsage{Gpus: 1, MemoryMib: 61440, ComputePercent: 10, Leases: 1}},
		{"two half GPUs fit a quota of 1",
			[]proto.Message{setQuota("sim", 1, 0, 0), simGrant("l-1", 0, 40960, 50), simGrant("l-2", 1, 20480, 50)},
			"", &gpupoolv1.TenantUsage{Gpus: 1, MemoryMib: 61440, ComputePercent: 100, Leases: 2}},
		{"shares are summed, then rounded up once: 1.9 GPUs fit a quota of 2",
			[]proto.Message{setQuota("sim", 2, 0, 0),
				simGrant("l-1", 0, 1024, 30), simGrant("l-2", 0, 1024, 30), simGrant("l-3", 0, 1024, 30),
				simGrant("l-4", 1, 1024, 30), simGrant("l-5", 1, 1024, 30), simGrant("l-6", 1, 1024, 30),
				simGrant("l-7", 0, 1024, 10)},
			"", &gpupoolv1.TenantUsage{Gpus: 2, MemoryMib: 7 * 1024, ComputePercent: 190, Leases: 7}},
		{"compute is percent summed over slices",
			[]proto.Message{setQuota("sim", 0, 0, 100), simGrant("l-1", 0, 1024, 60), simGrant("l-2", 1, 1024, 50)},
			"tenant sim: compute 60% of 100% quota used, the lease needs 50%", &gpupoolv1.TenantUsage{Gpus: 1, MemoryMib: 1024, ComputePercent: 60, Leases: 1}},
		{"an exclusive slice counts 100% compute",
			[]proto.Message{setQuota("sim", 0, 0, 150), simGrant("l-1", 0, 1024, 60), simWhole("l-2", 1)},
			"tenant sim: compute 60% of 150% quota used, the lease needs 100%", &gpupoolv1.TenantUsage{Gpus: 1, MemoryMib: 1024, ComputePercent: 60, Leases: 1}},
		{"a zero dimension is unlimited",
			[]proto.Message{setQuota("sim", 0, 0, 250), simGrant("l-1", 0, 81920, 100), simGrant("l-2", 1, 81920, 100)},
			"", &gpupoolv1.TenantUsage{Gpus: 2, MemoryMib: 2 * 81920, ComputePercent: 200, Leases: 2}},
		{"other tenants are not limited by sim's quota",
			[]proto.Message{setQuota("sim", 0, 1024, 0), other},
			"", &gpupoolv1.TenantUsage{}},
		{"a releasing lease still counts",
			[]proto.Message{setQuota("sim", 0, 40960, 0), simGrant("l-1", 0, 40960, 10), end("l-1"), simGrant("l-2", 1, 1024, 10)},
			"memory 40 GiB of 40 GiB quota used", &gpupoolv1.TenantUsage{Gpus: 1, MemoryMib: 40960, ComputePercent: 10, Leases: 1}},
		{"a freed lease gives its usage back",
			[]proto.Message{setQuota("sim", 0, 40960, 0), simGrant("l-1", 0, 40960, 10), end("l-1"), free("l-1"), simGrant("l-2", 1, 40960, 10)},
			"", &gpupoolv1.TenantUsage{Gpus: 1, MemoryMib: 40960, ComputePercent: 10, Leases: 1}},
		{"a retried request gets its first lease even when now over quota",
			[]proto.Message{setQuota("sim", 0, 20480, 0), first, setQuota("sim", 0, 1024, 0), retry},
			"", &gpupoolv1.TenantUsage{Gpus: 1, MemoryMib: 20480, ComputePercent: 10, Leases: 1}},
		{"a quota below usage is set",
			[]proto.Message{simGrant("l-1", 0, 40960, 10), setQuota("sim", 0, 1024, 0)},
			"", &gpupoolv1.TenantUsage{Gpus: 1, MemoryMib: 40960, ComputePercent: 10, Leases: 1}},
		{"a set replaces the whole quota",
			[]proto.Message{setQuota("sim", 0, 1024, 0), setQuota("sim", 1, 0, 0), simGrant("l-1", 0, 40960, 10)},
			"", &gpupoolv1.TenantUsage{Gpus: 1, MemoryMib: 40960, ComputePercent: 10, Leases: 1}},
		{"a removed quota no longer limits",
			[]proto.Message{setQuota("sim", 0, 1024, 0), removeQuota("sim"), simGrant("l-1", 0, 40960, 10)},
			"", &gpupoolv1.TenantUsage{Gpus: 1, MemoryMib: 40960, ComputePercent: 10, Leases: 1}},
		{"removing a quota a tenant does not have is not found",
			[]proto.Message{removeQuota("sim")},
			`tenant "sim" has no quota: not found`, &gpupoolv1.TenantUsage{}},
		{"a negative quota is refused, naming the field",
			[]proto.Message{setQuota("sim", 0, -1, 0)},
			"quota.memory_mib -1: must be 0 (unlimited) or more", &gpupoolv1.TenantUsage{}},
		{"a quota without limits is still applied: the API refuses it, but a log may hold one",
			[]proto.Message{setQuota("sim", 0, 0, 0), simGrant("l-1", 0, 1024, 10)},
			"", &gpupoolv1.TenantUsage{Gpus: 1, MemoryMib: 1024, ComputePercent: 10, Leases: 1}},
		{"a quota without a tenant is refused",
			[]proto.Message{setQuota("", 1, 0, 0)},
			"quota without a tenant", &gpupoolv1.TenantUsage{}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := New(nil)
			res := applyAll(t, f, append([]proto.Message{host("h1", 2)}, tt.log...))
			err := res[len(res)-1].Err
			switch {
			case tt.wantErr == "" && err != nil:
				t.Fatalf("got %v, want no error", err)
			case tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)):
				t.Fatalf("got error %v, want one containing %q", err, tt.wantErr)
			}
			got := TenantUsage(f.State(), "sim")
			tt.want.Tenant = "sim"
			if !proto.Equal(got, tt.want) {
				t.Fatalf("sim's usage: got %v, want %v", got, tt.want)
			}
		})
	}
}

func TestApplyRefusesAGrantOverQuotaWithAQuotaError(t *testing.T) {
	f := New(nil)
	res := applyAll(t, f, []proto.Message{host("h1", 2), setQuota("sim", 0, 1024, 0), simGrant("l-1", 0, 2048, 10)})
	qe, ok := res[2].Err.(*QuotaError)
	if !ok {
		t.Fatalf("got %T %v, want *QuotaError", res[2].Err, res[2].Err)
	}
	if want := (QuotaError{Tenant: "sim", Dimension: "memory", Used: 0, Quota: 1024, Need: 2048}); *qe != want {
		t.Fatalf("got %+v, want %+v", *qe, want)
	}
	if d := f.State().Device("GPU-h1-0"); d.AllocatedMemoryMib != 0 || f.State().Lease("l-1") != nil {
		t.Fatalf("a refused grant left allocation %d MiB and lease %v, want nothing", d.AllocatedMemoryMib, f.State().Lease("l-1"))
	}
}

func TestOverQuotaSaysWhatIsOver(t *testing.T) {
	q := &gpupoolv1.Quota{Tenant: "sim", Gpus: 8, MemoryMib: 320 << 10, ComputePercent: 800}
	used := &gpupoolv1.TenantUsage{Tenant: "sim", Gpus: 8, MemoryMib: 400 << 10, ComputePercent: 900}
	got := OverQuota(q, used)
	want := []string{
		"tenant sim: memory 400 GiB used is over the new 320 GiB quota by 80 GiB; its leases keep their capacity, but new grants are refused until usage is under the quota",
		"tenant sim: compute 900% used is over the new 800% quota by 100%; its leases keep their capacity, but new grants are refused until usage is under the quota",
	}
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Fatalf("got\n%s\nwant\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	if got := OverQuota(q, &gpupoolv1.TenantUsage{Gpus: 8}); len(got) != 0 {
		t.Fatalf("usage at the quota: got warnings %q, want none", got)
	}
}

func TestSnapshotRoundTripsQuotasAndUsage(t *testing.T) {
	f := New(nil)
	applyAll(t, f, []proto.Message{
		host("h1", 2),
		setQuota("sim", 2, 160<<10, 200), setQuota("train", 8, 0, 0), setQuota("gone", 1, 0, 0), removeQuota("gone"),
		simWhole("l-1", 0), simGrant("l-2", 1, 1024, 10),
	})
	snap := snapshotBytes(t, f)
	restored := New(nil)
	if err := restored.Restore(io.NopCloser(bytes.NewReader(snap))); err != nil {
		t.Fatal(err)
	}
	want, got := f.State().Quotas(), restored.State().Quotas()
	if len(got) != 2 || len(got) != len(want) {
		t.Fatalf("restored %d quotas, want 2", len(got))
	}
	for i := range want {
		if !proto.Equal(got[i], want[i]) {
			t.Errorf("quota %d: got %v, want %v", i, got[i], want[i])
		}
	}
	if u, w := TenantUsage(restored.State(), "sim"), TenantUsage(f.State(), "sim"); !proto.Equal(u, w) || u.Gpus != 2 {
		t.Errorf("sim's usage after restore: got %v, want %v", u, w)
	}
	if !bytes.Equal(snapshotBytes(t, restored), snap) {
		t.Error("snapshot of the restored FSM differs from the one it was restored from")
	}
	// The restored FSM enforces the restored quota: 1.1 GPUs used, and a
	// slice of 100% compute is a whole one.
	res := applyAll(t, restored, []proto.Message{simGrant("l-3", 1, 1024, 100)})
	if qe, ok := res[0].Err.(*QuotaError); !ok || qe.Dimension != "gpus" {
		t.Fatalf("grant past the restored GPU quota: got %v, want a *QuotaError on gpus", res[0].Err)
	}
}

func TestValidateQuotaRefusesAQuotaWithoutLimits(t *testing.T) {
	err := ValidateQuota(&gpupoolv1.Quota{Tenant: "sim"})
	want := "quota gpus=0 memory_mib=0 compute_percent=0: limits nothing (0 is unlimited); set at least one limit above 0, or lift tenant sim's limits with 'gpupool operator quota rm sim'"
	if err == nil || err.Error() != want {
		t.Fatalf("got %v, want %q", err, want)
	}
	for _, q := range []*gpupoolv1.Quota{{Tenant: "sim", Gpus: 1}, {Tenant: "sim", MemoryMib: 1}, {Tenant: "sim", ComputePercent: 1}} {
		if err := ValidateQuota(q); err != nil {
			t.Errorf("%v: got %v, want valid", q, err)
		}
	}
}

func TestASliceOfAnUnknownDeviceCountsAWholeGPU(t *testing.T) {
	f := New(nil)
	applyAll(t, f, []proto.Message{host("h1", 1)})
	l := simGrant("l-1", 0, 1024, 10).Lease
	if u := LeaseUsage(f.State(), l); u.Gpus != 1 {
		t.Fatalf("a 10%% slice of a known device: got %d GPUs, want 1 (0.1 rounded up)", u.Gpus)
	}
	l.Slices = append(l.Slices, &gpupoolv1.Slice{Host: "h1", Device: "GPU-gone", MemoryMib: 1024, ComputePercent: 10})
	if u := LeaseUsage(f.State(), l); u.Gpus != 2 {
		t.Fatalf("with a slice of a device not in the state: got %d GPUs, want 2 (0.1 + 1, rounded up)", u.Gpus)
	}
}
