package protocol

import (
	"fmt"
	"path"
	"regexp"
	"strings"
	"time"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// FieldError is a request field whose value is not allowed. Its message
// names the field, the value and what is allowed. Field is the field's
// name as in the .proto (nested ones dotted: constraints.model), so a
// front end can report it under its own name for the field (a CLI flag);
// Allowed may name other fields the same way.
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
	if r.Exclusive && (r.MemoryMib != 0 || r.ComputePercent != 0) {
		if r.Count < 1 || r.Count > MaxCount {
			return countError(r.Count)
		}
		return &FieldError{"exclusive", true, fmt.Sprintf("cannot be combined with memory_mib (%d) or compute_percent (%d): an exclusive lease holds whole GPUs; set either exclusive or memory_mib and compute_percent", r.MemoryMib, r.ComputePercent)}
	}
	if err := ValidateShape(r); err != nil {
		return err
	}
	if ttl := time.Duration(r.TtlMs) * time.Millisecond; ttl < MinTTL || ttl > MaxTTL {
		return &FieldError{"ttl_ms", r.TtlMs, fmt.Sprintf("must be between %d (%s) and %d (%s)", MinTTL.Milliseconds(), MinTTL, MaxTTL.Milliseconds(), Human(MaxTTL))}
	}
	if err := validateConstraints(r.Constraints); err != nil {
		return err
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
	if len(r.RequestId) > MaxRequestIDLen {
		return &FieldError{"request_id", fmt.Sprintf("(%d bytes)", len(r.RequestId)), fmt.Sprintf("must be at most %d bytes", MaxRequestIDLen)}
	}
	if len(r.Holder) > MaxHolderLen {
		return &FieldError{"holder", fmt.Sprintf("(%d bytes)", len(r.Holder)), fmt.Sprintf("must be at most %d bytes", MaxHolderLen)}
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
	case r.HostCpuMillicores > 0:
		return &FieldError{"host_cpu_millicores", r.HostCpuMillicores, "host cpu and memory must be unset for an elastic lease: its extra slices may be on other hosts"}
	case r.HostMemoryMib > 0:
		return &FieldError{"host_memory_mib", r.HostMemoryMib, "host cpu and memory must be unset for an elastic lease: its extra slices may be on other hosts"}
	}
	return nil
}

// ValidateWait checks an Acquire's wait_ms.
func ValidateWait(ms int64) error {
	if ms < 0 || time.Duration(ms)*time.Millisecond > MaxWait {
		return &FieldError{"wait_ms", ms, fmt.Sprintf("must be between 0 (fail at once) and %d (%s)", MaxWait.Milliseconds(), Human(MaxWait))}
	}
	return nil
}

// ValidateShape checks what a request asks each GPU for and how many: the
// count, the slice (memory and compute, unless exclusive), host CPU and
// memory, and the topology. The placement engine checks these alone, for
// callers that place without a full request (the replay benchmarks).
func ValidateShape(r *gpupoolv1.LeaseRequest) error {
	if r.GetCount() < 1 || r.GetCount() > MaxCount {
		return countError(r.GetCount())
	}
	if !r.GetExclusive() {
		if r.GetMemoryMib() < 1 {
			return &FieldError{"memory_mib", r.GetMemoryMib(), "must be at least 1 MiB for a fractional slice (or set exclusive for whole GPUs)"}
		}
		if c := r.GetComputePercent(); c < 1 || c > 100 {
			return &FieldError{"compute_percent", c, "must be between 1 and 100 (percent of one GPU's SMs)"}
		}
	}
	if r.GetHostCpuMillicores() < 0 {
		return &FieldError{"host_cpu_millicores", r.GetHostCpuMillicores(), "must be 0 or more (millicores: 1000 = one CPU)"}
	}
	if r.GetHostMemoryMib() < 0 {
		return &FieldError{"host_memory_mib", r.GetHostMemoryMib(), "must be 0 or more"}
	}
	if _, ok := gpupoolv1.Topology_name[int32(r.GetTopology())]; !ok {
		return &FieldError{"topology", int32(r.GetTopology()), "must be one of same-host, distinct-gpus, same-nvlink, same-pcie-root, or unset"}
	}
	return nil
}

func countError(n int32) error {
	return &FieldError{"count", n, fmt.Sprintf("must be between 1 and %d GPUs", MaxCount)}
}

// ValidateModel checks a model constraint: shell globs, alternatives
// separated by a single | (A100*|H100*); "" is no constraint.
func ValidateModel(m string) error {
	if m == "" {
		return nil
	}
	for _, alt := range strings.Split(m, "|") {
		if alt == "" {
			return &FieldError{"constraints.model", fmt.Sprintf("%q", m), "has an empty alternative: separate glob patterns with a single |"}
		}
		if _, err := path.Match(alt, ""); err != nil {
			return &FieldError{"constraints.model", fmt.Sprintf("%q", m), "must be a valid glob such as A100* ([ needs a matching ]), alternatives separated by |"}
		}
	}
	return nil
}

func validateConstraints(c *gpupoolv1.Constraints) error {
	if c == nil {
		return nil
	}
	if err := ValidateModel(c.Model); err != nil {
		return err
	}
	if c.MinMemoryMib < 0 {
		return &FieldError{"constraints.min_memory_mib", c.MinMemoryMib, "must be 0 or more"}
	}
	for k := range c.Labels {
		if k == "" {
			return &FieldError{"constraints.labels", `""`, "label keys must not be empty"}
		}
	}
	if len(c.Devices) > MaxConstraintDevices {
		return &FieldError{"constraints.devices", fmt.Sprintf("(%d devices)", len(c.Devices)), fmt.Sprintf("must name at most %d devices", MaxConstraintDevices)}
	}
	for _, d := range c.Devices {
		if d == "" || len(d) > MaxDeviceUUIDLen {
			return &FieldError{"constraints.devices", fmt.Sprintf("%q", d), fmt.Sprintf("must be device UUIDs of 1 to %d bytes, as gpupool host get shows them", MaxDeviceUUIDLen)}
		}
	}
	return nil
}

// Human writes a limit for people: 24h rather than 24h0m0s.
func Human(d time.Duration) string {
	s := d.String()
	if strings.HasSuffix(s, "m0s") {
		s = strings.TrimSuffix(s, "0s")
	}
	if strings.HasSuffix(s, "h0m") {
		s = strings.TrimSuffix(s, "0m")
	}
	return s
}

// TTL returns the request's TTL as a duration.
func TTL(r *gpupoolv1.LeaseRequest) time.Duration {
	return time.Duration(r.GetTtlMs()) * time.Millisecond
}

// RequestFields names every field of a LeaseRequest (and of an Acquire,
// wait_ms) that a *FieldError from this package may name, so that a front
// end can check it reports each under a name of its own.
var RequestFields = []string{
	"request", "count", "exclusive", "memory_mib", "compute_percent",
	"host_cpu_millicores", "host_memory_mib", "ttl_ms",
	"constraints.model", "constraints.min_memory_mib", "constraints.labels", "constraints.devices",
	"topology", "class", "priority", "elastic_max", "tenant", "request_id", "holder", "wait_ms",
}

// GetField returns the field e names, "" for a nil e.
func (e *FieldError) GetField() string {
	if e == nil {
		return ""
	}
	return e.Field
}
