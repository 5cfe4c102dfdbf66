// Package lease holds the rules of leases that do not depend on the pool:
// request validation, and the leader's keyed deadlines (TTLs, heartbeats,
// lock-delays).
package lease

import (
	"fmt"
	"path"
	"regexp"
	"time"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// Limits of a lease request.
const (
	MaxCount    = 256
	MinTTL      = time.Second
	MaxTTL      = 24 * time.Hour
	MaxPriority = 1000
	// DefaultTenant is used when a request names none.
	DefaultTenant = "default"
)

// FieldError is a request field whose value is not allowed. Its message
// names the field, the value and what is allowed.
type FieldError struct {
	Field   string
	Value   any
	Allowed string
}

func (e *FieldError) Error() string {
	return fmt.Sprintf("%s %v: %s", e.Field, e.Value, e.Allowed)
}

var tenantRE = regexp.MustCompile(`^[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?$`)

// ValidateTenant returns a *FieldError for field unless tenant is a valid
// tenant name.
func ValidateTenant(field, tenant string) error {
	if !tenantRE.MatchString(tenant) {
		return &FieldError{field, fmt.Sprintf("%q", tenant), "must be 1-63 lowercase letters, digits, '.', '_' or '-', starting and ending with a letter or digit"}
	}
	return nil
}

// Validate checks a request on its own, without looking at the pool. It
// returns the first *FieldError it finds, or nil.
func Validate(r *gpupoolv1.LeaseRequest) error {
	if r == nil {
		return &FieldError{"request", "<empty>", "is required"}
	}
	if r.Count < 1 || r.Count > MaxCount {
		return &FieldError{"count", r.Count, fmt.Sprintf("must be between 1 and %d GPUs", MaxCount)}
	}
	if r.Exclusive {
		if r.MemoryMib != 0 || r.ComputePercent != 0 {
			return &FieldError{"exclusive", true, fmt.Sprintf("cannot be combined with memory_mib (%d) or compute_percent (%d): an exclusive lease holds whole GPUs; set either exclusive or memory_mib and compute_percent", r.MemoryMib, r.ComputePercent)}
		}
	} else {
		if r.MemoryMib < 1 {
			return &FieldError{"memory_mib", r.MemoryMib, "must be at least 1 MiB for a fractional slice (or set exclusive for whole GPUs)"}
		}
		if r.ComputePercent < 1 || r.ComputePercent > 100 {
			return &FieldError{"compute_percent", r.ComputePercent, "must be between 1 and 100 (percent of one GPU's SMs)"}
		}
	}
	if r.HostCpuMillicores < 0 {
		return &FieldError{"host_cpu_millicores", r.HostCpuMillicores, "must be 0 or more"}
	}
	if r.HostMemoryMib < 0 {
		return &FieldError{"host_memory_mib", r.HostMemoryMib, "must be 0 or more"}
	}
	if ttl := time.Duration(r.TtlMs) * time.Millisecond; ttl < MinTTL || ttl > MaxTTL {
		return &FieldError{"ttl_ms", r.TtlMs, fmt.Sprintf("must be between %d (%s) and %d (%s)", MinTTL.Milliseconds(), MinTTL, MaxTTL.Milliseconds(), "24h")}
	}
	if err := validateConstraints(r.Constraints); err != nil {
		return err
	}
	if _, ok := gpupoolv1.Topology_name[int32(r.Topology)]; !ok {
		return &FieldError{"topology", int32(r.Topology), "must be one of same-host, distinct-gpus, same-nvlink, same-pcie-root, or unset"}
	}
	if _, ok := gpupoolv1.LeaseClass_name[int32(r.Class)]; !ok {
		return &FieldError{"class", int32(r.Class), "must be guaranteed or preemptible"}
	}
	if r.Priority < 0 || r.Priority > MaxPriority {
		return &FieldError{"priority", r.Priority, fmt.Sprintf("must be between 0 and %d", MaxPriority)}
	}
	if err := validateElastic(r); err != nil {
		return err
	}
	if r.Tenant != "" {
		if err := ValidateTenant("tenant", r.Tenant); err != nil {
			return err
		}
	}
	if len(r.RequestId) > 128 {
		return &FieldError{"request_id", fmt.Sprintf("(%d bytes)", len(r.RequestId)), "must be at most 128 bytes"}
	}
	if len(r.Holder) > 256 {
		return &FieldError{"holder", fmt.Sprintf("(%d bytes)", len(r.Holder)), "must be at most 256 bytes"}
	}
	return nil
}

// validateElastic checks an elastic request: elastic_max is the most
// slices in all, at least count; the lease itself is guaranteed (its
// extras are preemptible), and its slices have no topology between them
// because extras go wherever there is room.
func validateElastic(r *gpupoolv1.LeaseRequest) error {
	switch {
	case r.ElasticMax == 0:
		return nil
	case r.ElasticMax < r.Count || r.ElasticMax > MaxCount:
		return &FieldError{"elastic_max", r.ElasticMax, fmt.Sprintf("must be between count (%d, the guaranteed slices) and %d", r.Count, MaxCount)}
	case r.Class == gpupoolv1.LeaseClass_LEASE_CLASS_PREEMPTIBLE:
		return &FieldError{"class", "preemptible", "an elastic lease must be guaranteed (its extra slices are preemptible); drop class or elastic_max"}
	case r.Topology != gpupoolv1.Topology_TOPOLOGY_UNSPECIFIED:
		return &FieldError{"topology", r.Topology.String(), "must be unset for an elastic lease: its extra slices go wherever there is room"}
	case r.HostCpuMillicores > 0 || r.HostMemoryMib > 0:
		return &FieldError{"host_cpu_millicores", r.HostCpuMillicores, "host cpu and memory must be unset for an elastic lease: its extra slices may be on other hosts"}
	}
	return nil
}

// MaxWait is the longest an Acquire may wait in the queue.
const MaxWait = 24 * time.Hour

// ValidateWait checks an Acquire's wait_ms.
func ValidateWait(ms int64) error {
	if ms < 0 || time.Duration(ms)*time.Millisecond > MaxWait {
		return &FieldError{"wait_ms", ms, fmt.Sprintf("must be between 0 (fail at once) and %d (24h)", MaxWait.Milliseconds())}
	}
	return nil
}

func validateConstraints(c *gpupoolv1.Constraints) error {
	if c == nil {
		return nil
	}
	if _, err := path.Match(c.Model, ""); err != nil {
		return &FieldError{"constraints.model", fmt.Sprintf("%q", c.Model), "must be a valid glob such as A100* ([ needs a matching ])"}
	}
	if c.MinMemoryMib < 0 {
		return &FieldError{"constraints.min_memory_mib", c.MinMemoryMib, "must be 0 or more"}
	}
	for k := range c.Labels {
		if k == "" {
			return &FieldError{"constraints.labels", `""`, "label keys must not be empty"}
		}
	}
	if len(c.Devices) > 64 {
		return &FieldError{"constraints.devices", fmt.Sprintf("(%d devices)", len(c.Devices)), "must name at most 64 devices"}
	}
	for _, d := range c.Devices {
		if d == "" || len(d) > 128 {
			return &FieldError{"constraints.devices", fmt.Sprintf("%q", d), "must be device UUIDs of 1 to 128 bytes, as gpupool host get shows them"}
		}
	}
	return nil
}

// TTL returns the request's TTL as a duration.
func TTL(r *gpupoolv1.LeaseRequest) time.Duration {
	return time.Duration(r.GetTtlMs()) * time.Millisecond
}
