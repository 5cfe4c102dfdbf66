package sandbox

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"
)

const (
	// maxPids caps the processes of one lease: a fork bomb stays inside.
	maxPids = 8192
	// cpuPeriodUs is the CFS period the CPU cap is a quota of.
	cpuPeriodUs = 100000
	// destroyWait bounds how long a cgroup's processes take to die.
	destroyWait = 10 * time.Second
)

// cgroups is one cgroup version's way of keeping a lease's processes.
type cgroups interface {
	version() string
	// create makes the lease's cgroup (again) with its caps.
	create(lease string, cpuMillicores, memoryMiB int64) error
	// procsFiles are the cgroup.procs files a process writes itself to to
	// join the lease's cgroup.
	procsFiles(lease string) []string
	// leaseOf reads a /proc/PID/cgroup file: the lease whose cgroup holds
	// the process, or "".
	leaseOf(cgroupFile []byte) string
	// procs lists the processes in the lease's cgroup.
	procs(lease string) ([]int, error)
	// destroy kills every process in the lease's cgroup and removes it.
	destroy(lease string) error
	// removeParent removes the empty directories of the agent's parent
	// path.
	removeParent()
	// leases lists the lease cgroups under the agent's parent.
	leases() ([]string, error)
}

// leaseDirs lists the lease cgroups in dir.
func leaseDirs(dir string) ([]string, error) {
	entries, err := os.ReadDir(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var out []string
	for _, e := range entries {
		if e.IsDir() && validLease.MatchString(e.Name()) {
			out = append(out, e.Name())
		}
	}
	return out, nil
}

// removeEmptyPath removes dir/parent and its ancestors up to dir while
// they are empty.
func removeEmptyPath(dir, parent string) {
	for p := parent; p != "." && p != "/" && p != ""; p = filepath.Dir(p) {
		if os.Remove(filepath.Join(dir, p)) != nil {
			return
		}
	}
}

// findCgroups finds the hierarchies mounted under root: cgroup v2 when it
// is mounted at root itself (a unified host), else the v1 hierarchies of
// the cpu, memory and pids controllers (and freezer, if mounted). On a
// hybrid host, where a v2 hierarchy without controllers sits beside the
// v1 ones, v1 is used.
func findCgroups(root, parent string) (cgroups, error) {
	mi, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	v1 := map[string]string{} // controller → mount point
	for line := range strings.SplitSeq(string(mi), "\n") {
		// id parent major:minor root mountpoint options... - fstype source superoptions
		pre, post, ok := strings.Cut(line, " - ")
		if !ok {
			continue
		}
		f, g := strings.Fields(pre), strings.Fields(post)
		if len(f) < 5 || len(g) < 3 || f[3] != "/" {
			continue
		}
		mnt := f[4]
		switch g[0] {
		case "cgroup2":
			if filepath.Clean(mnt) == filepath.Clean(root) {
				return newV2(mnt, parent)
			}
		case "cgroup":
			for _, opt := range strings.Split(g[2], ",") {
				switch opt {
				case "cpu", "memory", "pids", "freezer":
					v1[opt] = mnt
				}
			}
		}
	}
	var missing []string
	for _, c := range []string{"cpu", "memory", "pids"} {
		if v1[c] == "" {
			missing = append(missing, c)
		}
	}
	if len(missing) > 0 {
		return nil, fmt.Errorf("no cgroup v2 at %s and no cgroup v1 hierarchy of the %s controller", root, strings.Join(missing, ", "))
	}
	return &cgroupV1{mounts: v1, parent: parent}, nil
}

// leaseOfPath returns the lease named by a cgroup path parent/<lease>.
func leaseOfPath(parent, path string) string {
	rest, ok := strings.CutPrefix(path, "/"+parent+"/")
	if !ok || !validLease.MatchString(rest) {
		return ""
	}
	return rest
}

// readPids reads a cgroup.procs file.
func readPids(file string) ([]int, error) {
	b, err := os.ReadFile(file)
	if err != nil {
		return nil, err
	}
	var out []int
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		if pid, err := strconv.Atoi(strings.TrimSpace(sc.Text())); err == nil {
			out = append(out, pid)
		}
	}
	return out, nil
}

// waitEmpty polls a cgroup.procs file until it lists nothing, sending
// SIGKILL to what it lists, for destroyWait at most.
func waitEmpty(file string) error {
	deadline := time.Now().Add(destroyWait)
	for {
		pids, err := readPids(file)
		if errors.Is(err, fs.ErrNotExist) {
			return nil
		}
		if err != nil {
			return err
		}
		if len(pids) == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("processes %v still in %s after %s", pids, filepath.Dir(file), destroyWait)
		}
		for _, pid := range pids {
			syscall.Kill(pid, syscall.SIGKILL)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func writeFile(file, value string) error {
	return os.WriteFile(file, []byte(value), 0o644)
}

// cgroupV1 keeps a lease in one cgroup of each of the cpu, memory, pids
// (and freezer) hierarchies.
type cgroupV1 struct {
	mounts map[string]string // controller → mount point
	parent string
}

func (c *cgroupV1) version() string { return "v1" }

func (c *cgroupV1) dir(controller, lease string) string {
	return filepath.Join(c.mounts[controller], c.parent, lease)
}

// controllers lists the hierarchies used, each mount point once.
func (c *cgroupV1) controllers() []string {
	var out []string
	seen := map[string]bool{}
	for _, k := range slices.Sorted(func(yield func(string) bool) {
		for k := range c.mounts {
			if !yield(k) {
				return
			}
		}
	}) {
		if !seen[c.mounts[k]] {
			seen[c.mounts[k]] = true
			out = append(out, k)
		}
	}
	return out
}

func (c *cgroupV1) create(lease string, cpu, mem int64) error {
	for _, ctl := range c.controllers() {
		if err := os.MkdirAll(c.dir(ctl, lease), 0o755); err != nil {
			return err
		}
	}
	if cpu > 0 {
		if err := writeFile(filepath.Join(c.dir("cpu", lease), "cpu.cfs_period_us"), strconv.Itoa(cpuPeriodUs)); err != nil {
			return err
		}
		if err := writeFile(filepath.Join(c.dir("cpu", lease), "cpu.cfs_quota_us"), strconv.FormatInt(max(1000, cpu*cpuPeriodUs/1000), 10)); err != nil {
			return err
		}
	}
	if mem > 0 {
		if err := writeFile(filepath.Join(c.dir("memory", lease), "memory.limit_in_bytes"), strconv.FormatInt(mem<<20, 10)); err != nil {
			return err
		}
	}
	return writeFile(filepath.Join(c.dir("pids", lease), "pids.max"), strconv.Itoa(maxPids))
}

func (c *cgroupV1) removeParent() {
	for _, ctl := range c.controllers() {
		removeEmptyPath(c.mounts[ctl], c.parent)
	}
}

func (c *cgroupV1) leases() ([]string, error) {
	seen := map[string]bool{}
	var out []string
	for _, ctl := range c.controllers() {
		ls, err := leaseDirs(filepath.Join(c.mounts[ctl], c.parent))
		if err != nil {
			return nil, err
		}
		for _, l := range ls {
			if !seen[l] {
				seen[l] = true
				out = append(out, l)
			}
		}
	}
	return out, nil
}

func (c *cgroupV1) procsFiles(lease string) []string {
	var out []string
	for _, ctl := range c.controllers() {
		out = append(out, filepath.Join(c.dir(ctl, lease), "cgroup.procs"))
	}
	return out
}

func (c *cgroupV1) leaseOf(file []byte) string {
	for line := range strings.SplitSeq(string(file), "\n") {
		parts := strings.SplitN(line, ":", 3)
		if len(parts) == 3 && slices.Contains(strings.Split(parts[1], ","), "pids") {
			return leaseOfPath(c.parent, parts[2])
		}
	}
	return ""
}

func (c *cgroupV1) procs(lease string) ([]int, error) {
	return readPids(filepath.Join(c.dir("pids", lease), "cgroup.procs"))
}

func (c *cgroupV1) destroy(lease string) error {
	procs := filepath.Join(c.dir("pids", lease), "cgroup.procs")
	if _, err := os.Stat(procs); err == nil {
		// Frozen, the processes cannot fork while they are killed.
		state := filepath.Join(c.dir("freezer", lease), "freezer.state")
		frozen := c.mounts["freezer"] != "" && writeFile(state, "FROZEN") == nil
		pids, _ := readPids(procs)
		for _, pid := range pids {
			syscall.Kill(pid, syscall.SIGKILL)
		}
		if frozen {
			writeFile(state, "THAWED")
		}
		if err := waitEmpty(procs); err != nil {
			return err
		}
	}
	var errs []error
	for _, ctl := range c.controllers() {
		if err := os.Remove(c.dir(ctl, lease)); err != nil && !errors.Is(err, fs.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// cgroupV2 keeps a lease in one cgroup of the unified hierarchy.
type cgroupV2 struct {
	mount, parent string
}

// newV2 checks that the controllers are there and enables them down to
// parent.
func newV2(mount, parent string) (cgroups, error) {
	b, err := os.ReadFile(filepath.Join(mount, "cgroup.controllers"))
	if err != nil {
		return nil, err
	}
	have := strings.Fields(string(b))
	for _, c := range []string{"cpu", "memory", "pids"} {
		if !slices.Contains(have, c) {
			return nil, fmt.Errorf("cgroup v2 at %s has no %s controller (it has %q)", mount, c, have)
		}
	}
	dir := mount
	for _, part := range strings.Split(parent, "/") {
		if err := writeFile(filepath.Join(dir, "cgroup.subtree_control"), "+cpu +memory +pids"); err != nil {
			return nil, fmt.Errorf("enabling the cpu, memory and pids controllers under %s: %w", dir, err)
		}
		dir = filepath.Join(dir, part)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return nil, err
		}
	}
	if err := writeFile(filepath.Join(dir, "cgroup.subtree_control"), "+cpu +memory +pids"); err != nil {
		return nil, fmt.Errorf("enabling the cpu, memory and pids controllers under %s: %w", dir, err)
	}
	return &cgroupV2{mount: mount, parent: parent}, nil
}

func (c *cgroupV2) version() string { return "v2" }

func (c *cgroupV2) dir(lease string) string { return filepath.Join(c.mount, c.parent, lease) }

func (c *cgroupV2) create(lease string, cpu, mem int64) error {
	d := c.dir(lease)
	if err := os.MkdirAll(d, 0o755); err != nil {
		return err
	}
	if cpu > 0 {
		if err := writeFile(filepath.Join(d, "cpu.max"), fmt.Sprintf("%d %d", max(1000, cpu*cpuPeriodUs/1000), cpuPeriodUs)); err != nil {
			return err
		}
	}
	if mem > 0 {
		if err := writeFile(filepath.Join(d, "memory.max"), strconv.FormatInt(mem<<20, 10)); err != nil {
			return err
		}
	}
	return writeFile(filepath.Join(d, "pids.max"), strconv.Itoa(maxPids))
}

func (c *cgroupV2) removeParent() { removeEmptyPath(c.mount, c.parent) }

func (c *cgroupV2) leases() ([]string, error) { return leaseDirs(filepath.Join(c.mount, c.parent)) }

func (c *cgroupV2) procsFiles(lease string) []string {
	return []string{filepath.Join(c.dir(lease), "cgroup.procs")}
}

func (c *cgroupV2) leaseOf(file []byte) string {
	for line := range strings.SplitSeq(string(file), "\n") {
		if path, ok := strings.CutPrefix(line, "0::"); ok {
			return leaseOfPath(c.parent, path)
		}
	}
	return ""
}

func (c *cgroupV2) procs(lease string) ([]int, error) {
	return readPids(filepath.Join(c.dir(lease), "cgroup.procs"))
}

func (c *cgroupV2) destroy(lease string) error {
	d := c.dir(lease)
	if _, err := os.Stat(d); errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	// cgroup.kill (Linux 5.14) kills everything at once, forks included.
	writeFile(filepath.Join(d, "cgroup.kill"), "1")
	if err := waitEmpty(filepath.Join(d, "cgroup.procs")); err != nil {
		return err
	}
	if err := os.Remove(d); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	return nil
}
