package protocol

import (
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

func TestEachRuleRefusesItsBadInputsNamingTheFieldAndWhatIsAllowed(t *testing.T) {
	mod := func(f func(r *gpupoolv1.LeaseRequest)) *gpupoolv1.LeaseRequest {
		r := slice(1024, 10)
		f(r)
		return r
	}
	elastic := func(f func(r *gpupoolv1.LeaseRequest)) *gpupoolv1.LeaseRequest {
		return mod(func(r *gpupoolv1.LeaseRequest) { r.Count, r.ElasticMax = 2, 6; f(r) })
	}
	for _, tc := range []struct {
		name  string
		req   *gpupoolv1.LeaseRequest
		field string
		want  string // in the message
	}{
		{"a missing request", nil, "request", "request <empty>: is required"},
		{"no GPUs", mod(func(r *gpupoolv1.LeaseRequest) { r.Count = 0 }), "count", "count 0: must be between 1 and 256 GPUs"},
		{"more GPUs than a lease may hold", mod(func(r *gpupoolv1.LeaseRequest) { r.Count = 257 }), "count", "count 257: must be between 1 and 256"},
		{"exclusive with a slice's memory", mod(func(r *gpupoolv1.LeaseRequest) { r.Exclusive = true }), "exclusive", "exclusive true: cannot be combined with memory_mib (1024) or compute_percent (10)"},
		{"a slice without memory", mod(func(r *gpupoolv1.LeaseRequest) { r.MemoryMib = 0 }), "memory_mib", "memory_mib 0: must be at least 1 MiB"},
		{"a slice without compute", mod(func(r *gpupoolv1.LeaseRequest) { r.ComputePercent = 0 }), "compute_percent", "compute_percent 0: must be between 1 and 100"},
		{"compute over 100", mod(func(r *gpupoolv1.LeaseRequest) { r.ComputePercent = 101 }), "compute_percent", "compute_percent 101: must be between 1 and 100"},
		{"negative host cpu", mod(func(r *gpupoolv1.LeaseRequest) { r.HostCpuMillicores = -1 }), "host_cpu_millicores", "host_cpu_millicores -1: must be 0 or more (millicores"},
		{"negative host memory", mod(func(r *gpupoolv1.LeaseRequest) { r.HostMemoryMib = -1 }), "host_memory_mib", "host_memory_mib -1: must be 0 or more"},
		{"a TTL under a second", mod(func(r *gpupoolv1.LeaseRequest) { r.TtlMs = 999 }), "ttl_ms", "ttl_ms 999: must be between 1000 (1s) and 86400000 (24h)"},
		{"a TTL over a day", mod(func(r *gpupoolv1.LeaseRequest) { r.TtlMs = 86_400_001 }), "ttl_ms", "ttl_ms 86400001: must be between 1000 (1s) and 86400000 (24h)"},
		{"a bad model glob", mod(func(r *gpupoolv1.LeaseRequest) { r.Constraints = &gpupoolv1.Constraints{Model: "A100["} }), "constraints.model", `constraints.model "A100[": must be a valid glob`},
		{"a model with an empty alternative", mod(func(r *gpupoolv1.LeaseRequest) { r.Constraints = &gpupoolv1.Constraints{Model: "T4||A10"} }), "constraints.model", `constraints.model "T4||A10": has an empty alternative`},
		{"a negative minimum memory", mod(func(r *gpupoolv1.LeaseRequest) { r.Constraints = &gpupoolv1.Constraints{MinMemoryMib: -1} }), "constraints.min_memory_mib", "constraints.min_memory_mib -1: must be 0 or more"},
		{"an empty label key", mod(func(r *gpupoolv1.LeaseRequest) {
			r.Constraints = &gpupoolv1.Constraints{Labels: map[string]string{"": "x"}}
		}), "constraints.labels", "label keys must not be empty"},
		{"too many devices", mod(func(r *gpupoolv1.LeaseRequest) { r.Constraints = &gpupoolv1.Constraints{Devices: make([]string, 65)} }), "constraints.devices", "constraints.devices (65 devices): must name at most 64 devices"},
		{"an empty device", mod(func(r *gpupoolv1.LeaseRequest) { r.Constraints = &gpupoolv1.Constraints{Devices: []string{""}} }), "constraints.devices", `constraints.devices "": must be device UUIDs of 1 to 128 bytes`},
		{"an unknown topology", mod(func(r *gpupoolv1.LeaseRequest) { r.Topology = 42 }), "topology", "topology 42: must be one of same-host"},
		{"an unknown class", mod(func(r *gpupoolv1.LeaseRequest) { r.Class = 9 }), "class", "class 9: must be guaranteed or preemptible"},
		{"a negative priority", mod(func(r *gpupoolv1.LeaseRequest) { r.Priority = -1 }), "priority", "priority -1: must be between 0 and 1000"},
		{"a priority over the most", mod(func(r *gpupoolv1.LeaseRequest) { r.Priority = 1001 }), "priority", "priority 1001: must be between 0 and 1000"},
		{"an elastic max under the count", elastic(func(r *gpupoolv1.LeaseRequest) { r.ElasticMax = 1 }), "elastic_max", "elastic_max 1: must be between count (2, the guaranteed slices) and 256"},
		{"a preemptible elastic lease", elastic(func(r *gpupoolv1.LeaseRequest) { r.Class = gpupoolv1.LeaseClass_LEASE_CLASS_PREEMPTIBLE }), "class", "an elastic lease must be guaranteed"},
		{"an elastic lease with a topology", elastic(func(r *gpupoolv1.LeaseRequest) { r.Topology = gpupoolv1.Topology_TOPOLOGY_SAME_HOST }), "topology", "must be unset for an elastic lease"},
		{"an elastic lease with host cpu", elastic(func(r *gpupoolv1.LeaseRequest) { r.HostCpuMillicores = 1000 }), "host_cpu_millicores", "must be unset for an elastic lease"},
		{"an elastic lease with host memory", elastic(func(r *gpupoolv1.LeaseRequest) { r.HostMemoryMib = 1024 }), "host_memory_mib", "must be unset for an elastic lease"},
		{"a tenant with capitals and a space", mod(func(r *gpupoolv1.LeaseRequest) { r.Tenant = "Bad Tenant" }), "tenant", `tenant "Bad Tenant": must be 1-63 lowercase letters`},
		{"a request id over the most", mod(func(r *gpupoolv1.LeaseRequest) { r.RequestId = strings.Repeat("r", 129) }), "request_id", "request_id (129 bytes): must be at most 128 bytes"},
		{"a holder over the most", mod(func(r *gpupoolv1.LeaseRequest) { r.Holder = strings.Repeat("h", 257) }), "holder", "holder (257 bytes): must be at most 256 bytes"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := Validate(tc.req)
			var fe *FieldError
			if !errors.As(err, &fe) || fe.Field != tc.field || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v (field %q), want field %q and %q", err, fe.GetField(), tc.field, tc.want)
			}
			if !slices.Contains(RequestFields, fe.Field) {
				t.Fatalf("field %q is missing from RequestFields", fe.Field)
			}
		})
	}
}

func TestWaitRefusesANegativeWaitAndOneOverADay(t *testing.T) {
	for _, tc := range []struct {
		name string
		ms   int64
		want string
	}{
		{"a negative wait", -1, "wait_ms -1: must be between 0 (fail at once) and 86400000 (24h)"},
		{"a wait over a day", 86_400_001, "wait_ms 86400001: must be between 0"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if err := ValidateWait(tc.ms); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want %q", err, tc.want)
			}
		})
	}
	if err := ValidateWait(MaxWait.Milliseconds()); err != nil {
		t.Fatalf("the longest wait: got %v, want it allowed", err)
	}
}

func TestHumanWritesLimitsWithoutTrailingZeroUnits(t *testing.T) {
	for d, want := range map[string]string{"24h": "24h", "1s": "1s", "90m": "1h30m", "720h": "720h"} {
		if got := Human(mustDuration(t, d)); got != want {
			t.Errorf("Human(%s): got %q, want %q", d, got, want)
		}
	}
}

func mustDuration(t *testing.T, s string) time.Duration {
	t.Helper()
	d, err := time.ParseDuration(s)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

func slice(mem int64, compute int32) *gpupoolv1.LeaseRequest {
	return &gpupoolv1.LeaseRequest{Count: 1, MemoryMib: mem, ComputePercent: compute, TtlMs: 60_000}
}
