package sandbox

import (
	"strings"
	"testing"
)

// FuzzLeaseOf feeds arbitrary /proc/PID/cgroup contents to both cgroup
// versions: a lease is only ever a valid lease id directly under the
// agent's parent, and nothing panics.
func FuzzLeaseOf(f *testing.F) {
	f.Add([]byte("12:pids:/gpupool/host-1/l-1\n0::/\n"))
	f.Add([]byte("0::/gpupool/host-1/l-2\n"))
	f.Add([]byte("3:cpu,pids:/gpupool/host-1/../l-3\n"))
	v1 := &cgroupV1{mounts: map[string]string{"pids": "/sys/fs/cgroup/pids"}, parent: "gpupool/host-1"}
	v2 := &cgroupV2{mount: "/sys/fs/cgroup", parent: "gpupool/host-1"}
	f.Fuzz(func(t *testing.T, file []byte) {
		for _, cg := range []cgroups{v1, v2} {
			if l := cg.leaseOf(file); l != "" && (!validLease.MatchString(l) || !strings.Contains(string(file), "/gpupool/host-1/"+l)) {
				t.Fatalf("leaseOf(%q) = %q: not a lease id under the parent", file, l)
			}
		}
	})
}
