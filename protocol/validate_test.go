package protocol

import (
	"errors"
	"strings"
	"testing"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

func FuzzValidate(f *testing.F) {
	f.Add(int32(1), false, int64(1024), int32(25), int64(60000), "default", "A100*", int32(0))
	f.Add(int32(0), true, int64(0), int32(0), int64(0), "", "[", int32(7))
	f.Fuzz(func(t *testing.T, count int32, excl bool, mem int64, compute int32, ttl int64, tenant, model string, topo int32) {
		r := &gpupoolv1.LeaseRequest{Count: count, Exclusive: excl, MemoryMib: mem, ComputePercent: compute, TtlMs: ttl,
			Tenant: tenant, Constraints: &gpupoolv1.Constraints{Model: model}, Topology: gpupoolv1.Topology(topo)}
		err := Validate(r)
		if err == nil {
			return
		}
		var fe *FieldError
		if !errors.As(err, &fe) || fe.Field == "" || !strings.Contains(err.Error(), fe.Field) {
			t.Fatalf("error %q does not name its field", err)
		}
	})
}
