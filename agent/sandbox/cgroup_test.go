package sandbox

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestLeaseOfReadsTheLeaseFromACgroupFile(t *testing.T) {
	v1 := &cgroupV1{mounts: map[string]string{"pids": "/sys/fs/cgroup/pids"}, parent: "gpupool/host-1"}
	v2 := &cgroupV2{mount: "/sys/fs/cgroup", parent: "gpupool/host-1"}
	tests := []struct {
		name string
		cg   cgroups
		file string
		want string
	}{
		{"v1: the pids hierarchy names the lease", v1, "12:pids:/gpupool/host-1/l-1\n4:memory:/gpupool/host-1/l-1\n0::/\n", "l-1"},
		{"v1: a combined controller line", v1, "3:cpu,pids:/gpupool/host-1/l-2\n", "l-2"},
		{"v1: another agent's lease is none of ours", v1, "12:pids:/gpupool/host-2/l-1\n", ""},
		{"v1: a process in no lease", v1, "12:pids:/user.slice\n", ""},
		{"v1: a cgroup below a lease's is not the lease", v1, "12:pids:/gpupool/host-1/l-1/x\n", ""},
		{"v2: the unified line names the lease", v2, "0::/gpupool/host-1/l-3\n", "l-3"},
		{"v2: v1 lines are ignored", v2, "12:pids:/gpupool/host-1/l-1\n0::/init.scope\n", ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := tt.cg.leaseOf([]byte(tt.file)); got != tt.want {
				t.Fatalf("got %q, want %q", got, tt.want)
			}
		})
	}
}

// TestCgroupV2WritesTheCapsAndEnablesTheControllers runs the v2 code on a
// directory laid out as a unified hierarchy: this machine, like CI's, has
// a v2 hierarchy without controllers, so the v1 path is the one the other
// tests exercise on real cgroups.
func TestCgroupV2WritesTheCapsAndEnablesTheControllers(t *testing.T) {
	root := t.TempDir()
	if err := os.WriteFile(filepath.Join(root, "cgroup.controllers"), []byte("cpuset cpu io memory pids\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	cg, err := newV2(root, "gpupool/host-1")
	if err != nil {
		t.Fatal(err)
	}
	if err := cg.create("l-1", 1500, 2048); err != nil {
		t.Fatal(err)
	}
	for file, want := range map[string]string{
		"cgroup.subtree_control":                "+cpu +memory +pids",
		"gpupool/cgroup.subtree_control":        "+cpu +memory +pids",
		"gpupool/host-1/cgroup.subtree_control": "+cpu +memory +pids",
		"gpupool/host-1/l-1/cpu.max":            "150000 100000",
		"gpupool/host-1/l-1/memory.max":         "2147483648",
		"gpupool/host-1/l-1/pids.max":           "8192",
	} {
		b, err := os.ReadFile(filepath.Join(root, file))
		if got := strings.TrimSpace(string(b)); err != nil || got != want {
			t.Errorf("%s: got %q (%v), want %q", file, got, err, want)
		}
	}
	if got, want := cg.procsFiles("l-1"), []string{filepath.Join(root, "gpupool/host-1/l-1/cgroup.procs")}; len(got) != 1 || got[0] != want[0] {
		t.Errorf("procsFiles: got %v, want %v", got, want)
	}
	if _, err := newV2(t.TempDir(), "x"); err == nil {
		t.Error("newV2 on a hierarchy without cgroup.controllers succeeded")
	}
	noMem := t.TempDir()
	os.WriteFile(filepath.Join(noMem, "cgroup.controllers"), []byte("cpu pids\n"), 0o644)
	if _, err := newV2(noMem, "x"); err == nil || !strings.Contains(err.Error(), "has no memory controller") {
		t.Errorf("newV2 without the memory controller: got %v, want an error naming it", err)
	}
}
