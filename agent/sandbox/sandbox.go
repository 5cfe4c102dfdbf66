// Package sandbox runs the processes of one lease apart from the pool
// host's agent and from every other lease.
//
// A lease's sandbox is
//   - its own unprivileged user and group, taken from a configured range,
//     which owns the lease's directory (mode 0700): files of other leases
//     and of the agent are unreadable by ordinary permissions. A removed
//     lease's user is quarantined: no lease takes it while a process runs
//     as it or its lease's directory holds a file of it;
//   - a private mount namespace in which the configured hidden
//     directories (the agent's data dir) are empty tmpfs mounts, the
//     lease's directory is mounted back at its path, and /tmp, /var/tmp,
//     /dev/shm and /run/lock are private tmpfs mounts that end with the
//     lease's last process; every other mount is read-only and nosuid
//     there (and nodev outside /dev), so the lease's directory and those
//     tmpfs mounts are all it can write;
//   - a PID namespace with its own /proc: the lease sees its own
//     processes only, and cannot signal or trace any other;
//   - an IPC namespace of its own (SysV shared memory, message queues and
//     semaphores, POSIX message queues) and a UTS namespace whose
//     hostname names the lease, not the host; leases of the shared MPS
//     user keep the host's IPC namespace and /dev/shm, which MPS needs;
//   - a cgroup per lease (v2, or v1 with the cpu, memory, pids and freezer
//     controllers) that holds all of its processes, caps the host CPU and
//     memory the lease asked for, and is how the agent finds them. A
//     process cannot leave it: the cgroup files belong to root;
//   - no new privileges and no capabilities: setuid programs do not
//     raise them, the bounding, ambient and inheritable sets are empty,
//     and locked securebits keep even a root uid from holding any;
//   - a seccomp filter (see leaseFilter) under which the calls that make
//     namespaces, mount, load kernel code or reach the kernel's keyring,
//     clocks and other host state return EPERM.
//
// The agent re-executes its own binary as a small init (see Init) that
// joins the cgroup, sets up the mounts, and then runs the workload as
// the lease's user, as the first process of the PID namespace's only
// child. When that process exits, the init exits with its status, and the
// kernel kills whatever else runs in the namespace.
//
// Where the host cannot provide one of these (the agent does not run as
// root, or finds no cgroup hierarchy), New still succeeds and Report says
// what is missing; the caller decides whether to run workloads with the
// reduced isolation.
package sandbox

import (
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
)

// Mechanisms a sandbox is made of, as Report names them.
const (
	MechUser    = "user"    // an unprivileged user per lease
	MechMounts  = "mounts"  // a private mount namespace
	MechPID     = "pid"     // a PID namespace with its own /proc
	MechCgroup  = "cgroup"  // a cgroup per lease with its CPU and memory caps
	MechNoPrivs = "noprivs" // no new privileges
)

// allMechanisms are the mechanisms of a full sandbox, in the order Report
// lists them.
var allMechanisms = []string{MechUser, MechMounts, MechPID, MechCgroup, MechNoPrivs}

// Range is a range of user (and group) ids: First to First+Count-1.
type Range struct{ First, Count int }

// ParseRange reads "FIRST-LAST" (inclusive), e.g. "200000-265535".
func ParseRange(s string) (Range, error) {
	a, b, ok := strings.Cut(s, "-")
	first, err1 := strconv.Atoi(a)
	last, err2 := strconv.Atoi(b)
	if !ok || err1 != nil || err2 != nil {
		return Range{}, fmt.Errorf("%q: want FIRST-LAST, e.g. 200000-265535", s)
	}
	if first < 1000 || last < first || last > 1<<31-2 {
		return Range{}, fmt.Errorf("%q: want 1000 <= FIRST <= LAST < 2147483647 (ids below 1000 belong to the system)", s)
	}
	return Range{First: first, Count: last - first + 1}, nil
}

func (r Range) String() string { return fmt.Sprintf("%d-%d", r.First, r.First+r.Count-1) }

// DefaultRange is the user range of a sandbox unless configured.
var DefaultRange = Range{First: 200000, Count: 65536}

// Config configures a Manager.
type Config struct {
	// Users are the ids lease users take; each lease takes one while its
	// sandbox exists. Zero means DefaultRange.
	Users Range
	// Hide are directories the lease must not see (the agent's data dir);
	// each is an empty tmpfs in the sandbox's mount namespace.
	Hide []string
	// Expose are paths under Hide that the sandbox sees again, read-only
	// (the MPS pipe directory).
	Expose []string
	// CgroupParent names this agent's cgroups under each hierarchy's root,
	// e.g. "gpupool/host-1"; a lease's cgroup is CgroupParent/<lease id>.
	// Required.
	CgroupParent string
	// CgroupRoot is where the cgroup hierarchies are mounted (default
	// /sys/fs/cgroup).
	CgroupRoot string
	// Logger receives what the manager finds and does; nil discards it.
	Logger *slog.Logger
}

// Spec is what one lease's sandbox holds.
type Spec struct {
	// Lease is the lease id; it names the cgroup.
	Lease string
	// Dir is the lease's working directory, the only writable one.
	Dir string
	// CPUMillicores and MemoryMiB cap the lease's processes; 0 sets no
	// cap.
	CPUMillicores, MemoryMiB int64
	// User, when not 0, is the user the lease runs as instead of one of
	// its own (see Manager.SharedUser).
	User int
}

// Report says which mechanisms the host provides.
type Report struct {
	// Have are the mechanisms every sandbox gets; Missing those it does
	// not, with why.
	Have    []string
	Missing map[string]string
	// Cgroup is "v1" or "v2", "" without cgroups.
	Cgroup string
}

// Full reports whether every mechanism is there.
func (r Report) Full() bool { return len(r.Missing) == 0 }

// String is one line for logs and for users: what a lease's processes run
// in.
func (r Report) String() string {
	if r.Full() {
		return "sandboxed (" + strings.Join(r.Have, ", ") + ", cgroup " + r.Cgroup + ")"
	}
	var miss []string
	for _, m := range allMechanisms {
		if why, ok := r.Missing[m]; ok {
			miss = append(miss, "no "+m+": "+why)
		}
	}
	return "reduced (" + strings.Join(miss, "; ") + ")"
}

// Manager makes, fills and removes the sandboxes of one agent's leases.
// Its methods are safe for concurrent use.
type Manager struct {
	cfg    Config
	log    *slog.Logger
	report Report
	cg     cgroups // nil without cgroups

	mu     sync.Mutex
	leases map[string]leaseBox // guarded by mu
	// quarantine holds the users of removed leases, each with its lease's
	// directory, until nothing on the host is theirs; guarded by mu.
	quarantine map[int]string
}

// leaseBox is what the manager knows of one lease's sandbox.
type leaseBox struct {
	uid       int
	dir       string
	memoryMiB int64
	// hostIPC is set for leases of the shared MPS user: an MPS server and
	// its clients share memory through the host's IPC namespace and
	// /dev/shm.
	hostIPC bool
}

// validLease is what a lease id may look like to name a cgroup and a dir.
var validLease = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$`)

// New probes the host and returns a Manager. It fails only for a bad
// Config; a host that lacks a mechanism shows in Report.
func New(cfg Config) (*Manager, error) {
	if cfg.Users == (Range{}) {
		cfg.Users = DefaultRange
	}
	if cfg.Users.First < 1000 || cfg.Users.Count < 1 {
		return nil, fmt.Errorf("sandbox: Config.Users %s: want ids of 1000 or more", cfg.Users)
	}
	if cfg.CgroupParent == "" || strings.Contains(cfg.CgroupParent, "..") || filepath.IsAbs(cfg.CgroupParent) {
		return nil, fmt.Errorf("sandbox: Config.CgroupParent %q: want a relative path such as gpupool/host-1", cfg.CgroupParent)
	}
	for _, d := range append(slices.Clone(cfg.Hide), cfg.Expose...) {
		if !filepath.IsAbs(d) {
			return nil, fmt.Errorf("sandbox: Config.Hide/Expose %q: must be an absolute path", d)
		}
	}
	if cfg.CgroupRoot == "" {
		cfg.CgroupRoot = "/sys/fs/cgroup"
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	m := &Manager{cfg: cfg, log: log, leases: map[string]leaseBox{}, quarantine: map[int]string{}}
	m.report = Report{Missing: map[string]string{}}
	if os.Geteuid() != 0 {
		for _, mech := range allMechanisms {
			m.report.Missing[mech] = "the agent does not run as root"
		}
	} else {
		cg, err := findCgroups(cfg.CgroupRoot, cfg.CgroupParent)
		if err != nil {
			m.report.Missing[MechCgroup] = err.Error()
		} else {
			m.cg = cg
			m.report.Cgroup = cg.version()
		}
	}
	for _, mech := range allMechanisms {
		if _, ok := m.report.Missing[mech]; !ok {
			m.report.Have = append(m.report.Have, mech)
		}
	}
	return m, nil
}

// Report says what every sandbox of this manager is made of.
func (m *Manager) Report() Report { return m.report }

// SharedUser is the user of leases that must share one (the MPS clients
// of every lease: an MPS daemon serves one user at a time): the range's
// first id. Per-lease users come from the rest of the range.
func (m *Manager) SharedUser() int { return m.cfg.Users.First }

// Prepare makes the sandbox of a lease, or returns the existing one: it
// gives the lease a user, hands it the lease's directory, and makes its
// cgroup with the caps of spec. A cgroup that already holds processes (a
// lease resumed after an agent restart) keeps the caps it has. It
// returns the user id.
func (m *Manager) Prepare(spec Spec) (int, error) {
	if !validLease.MatchString(spec.Lease) {
		return 0, fmt.Errorf("sandbox: lease id %q: not a valid lease id", spec.Lease)
	}
	if !filepath.IsAbs(spec.Dir) {
		return 0, fmt.Errorf("sandbox: lease dir %q: must be absolute", spec.Dir)
	}
	if spec.CPUMillicores < 0 || spec.MemoryMiB < 0 {
		return 0, fmt.Errorf("sandbox: CPU %d millicores, memory %d MiB: must be 0 or more", spec.CPUMillicores, spec.MemoryMiB)
	}
	uid, err := m.user(spec)
	if err != nil {
		return 0, err
	}
	if _, ok := m.report.Missing[MechUser]; !ok {
		if err := os.Chown(spec.Dir, uid, uid); err != nil {
			return 0, fmt.Errorf("sandbox: lease dir: %w", err)
		}
		if err := os.Chmod(spec.Dir, 0o700); err != nil {
			return 0, fmt.Errorf("sandbox: lease dir: %w", err)
		}
	}
	if m.cg != nil {
		if pids, err := m.cg.procs(spec.Lease); err == nil && len(pids) > 0 {
			// A running lease an earlier agent prepared: its caps stay.
			// A memory cap below its usage would OOM-kill it (v2) or
			// fail with EBUSY (v1).
			m.log.Debug("keeping the caps of a lease's cgroup that already has processes",
				"lease", spec.Lease, "processes", len(pids))
			return uid, nil
		}
		if err := m.cg.create(spec.Lease, spec.CPUMillicores, spec.MemoryMiB); err != nil {
			return 0, fmt.Errorf("sandbox: cgroup of lease %s: %w", spec.Lease, err)
		}
	}
	return uid, nil
}

// user returns the lease's user, taking one if it has none: the owner of
// its directory if that is a free id of the range (the agent restarted),
// else the lowest free id. A free id is one no lease holds and no process
// on the host runs as; a removed lease's id is free again only once its
// lease's directory holds nothing of it either (see Remove).
func (m *Manager) user(spec Spec) (int, error) {
	m.mu.Lock()
	if b, ok := m.leases[spec.Lease]; ok {
		m.mu.Unlock()
		return b.uid, nil
	}
	quarantined := maps.Clone(m.quarantine)
	m.mu.Unlock()
	var busy map[int]bool
	if spec.User == 0 {
		// Outside the lock: this reads every process's status and walks
		// the removed leases' directories.
		var err error
		if busy, err = usersInUse("/proc", quarantined); err != nil {
			return 0, fmt.Errorf("sandbox: finding the users in use: %w", err)
		}
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if b, ok := m.leases[spec.Lease]; ok {
		return b.uid, nil
	}
	take := func(uid int) (int, error) {
		m.leases[spec.Lease] = leaseBox{uid: uid, dir: spec.Dir, memoryMiB: spec.MemoryMiB, hostIPC: spec.User == m.SharedUser()}
		delete(m.quarantine, uid)
		return uid, nil
	}
	if spec.User != 0 {
		return take(spec.User)
	}
	for uid, dir := range quarantined {
		if !busy[uid] && m.quarantine[uid] == dir {
			m.log.Debug("a removed lease's user is free again", "uid", uid)
			delete(m.quarantine, uid)
		}
	}
	taken := map[int]bool{m.SharedUser(): true}
	for _, b := range m.leases {
		taken[b.uid] = true
	}
	r := m.cfg.Users
	// The owner of the lease's directory is its own user from before a
	// restart, whose processes may still run: only another lease's hold
	// or files of another lease's directory keep it from the lease.
	if fi, err := os.Stat(spec.Dir); err == nil {
		if st, ok := fi.Sys().(*syscall.Stat_t); ok {
			u := int(st.Uid)
			dir, inQuarantine := m.quarantine[u]
			if u > r.First && u < r.First+r.Count && !taken[u] && (!inQuarantine || dir == spec.Dir) {
				return take(u)
			}
		}
	}
	for u := r.First + 1; u < r.First+r.Count; u++ {
		if _, inQuarantine := m.quarantine[u]; !taken[u] && !inQuarantine && !busy[u] {
			return take(u)
		}
	}
	return 0, fmt.Errorf("sandbox: all %d users of the range %s are taken: by leases, by processes, or (%d of them) quarantined until the files of removed leases are gone; widen --sandbox-users", r.Count-1, r, len(m.quarantine))
}

// usersInUse returns the ids a new lease must not take: every user and
// group id a process under procRoot runs as (real, effective, saved or
// filesystem), and every quarantined user whose lease's directory still
// holds a file it owns (by user or group). It fails rather than miss one.
func usersInUse(procRoot string, quarantined map[int]string) (map[int]bool, error) {
	entries, err := os.ReadDir(procRoot)
	if err != nil {
		return nil, err
	}
	busy := map[int]bool{}
	for _, e := range entries {
		if _, err := strconv.Atoi(e.Name()); err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join(procRoot, e.Name(), "status"))
		if errors.Is(err, fs.ErrNotExist) || errors.Is(err, syscall.ESRCH) {
			continue // it exited meanwhile
		}
		if err != nil {
			return nil, err
		}
		for line := range strings.SplitSeq(string(b), "\n") {
			ids, ok := strings.CutPrefix(line, "Uid:")
			if !ok {
				ids, ok = strings.CutPrefix(line, "Gid:")
			}
			if !ok {
				continue
			}
			for _, f := range strings.Fields(ids) {
				if id, err := strconv.Atoi(f); err == nil {
					busy[id] = true
				}
			}
		}
	}
	for uid, dir := range quarantined {
		if !busy[uid] {
			owns, err := holdsFileOf(dir, uid)
			if err != nil {
				return nil, err
			}
			busy[uid] = owns
		}
	}
	return busy, nil
}

// holdsFileOf reports whether dir (which may be gone) or anything under
// it belongs to id, as user or group.
func holdsFileOf(dir string, id int) (bool, error) {
	found := false
	err := filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			if path == dir && errors.Is(err, fs.ErrNotExist) {
				return fs.SkipAll
			}
			return err
		}
		fi, err := d.Info()
		if errors.Is(err, fs.ErrNotExist) {
			return nil
		}
		if err != nil {
			return err
		}
		if st, ok := fi.Sys().(*syscall.Stat_t); ok && (int(st.Uid) == id || int(st.Gid) == id) {
			found = true
			return fs.SkipAll
		}
		return nil
	})
	return found, err
}

// Command makes cmd run in the lease's sandbox: the agent's binary,
// re-executed as the sandbox init, runs cmd's program with cmd's
// arguments, environment and directory. Prepare must have made the
// sandbox. cmd.SysProcAttr may ask for a process group; the init leads
// it, and the workload is in it. Signals sent to the group reach the
// workload; SIGKILL to the init ends the whole sandbox's processes.
//
// Without users and namespaces (Report says so) cmd is left as it is:
// the process runs with the agent's user, with reduced isolation.
func (m *Manager) Command(lease string, cmd *exec.Cmd) error {
	m.mu.Lock()
	b, ok := m.leases[lease]
	m.mu.Unlock()
	if !ok {
		return fmt.Errorf("sandbox: lease %s has no sandbox", lease)
	}
	if _, missing := m.report.Missing[MechUser]; missing {
		return nil
	}
	if !filepath.IsAbs(cmd.Path) && !strings.Contains(cmd.Path, "/") {
		return fmt.Errorf("sandbox: program %q: must be a path", cmd.Path)
	}
	prog := cmd.Path
	if !filepath.IsAbs(prog) {
		prog = filepath.Join(cmd.Dir, prog)
	}
	self, err := os.Executable()
	if err != nil {
		return fmt.Errorf("sandbox: finding the agent's binary: %w", err)
	}
	s := initSpec{Prog: prog, Dir: cmd.Dir, LeaseDir: b.dir, UID: b.uid, GID: b.uid, Hide: m.cfg.Hide, Expose: m.cfg.Expose,
		Hostname: leaseHostname(lease), TmpfsSize: tmpfsSize(b.memoryMiB), HostIPC: b.hostIPC}
	if m.cg != nil {
		s.Cgroups = m.cg.procsFiles(lease)
	}
	spec, err := json.Marshal(s)
	if err != nil {
		return err
	}
	cmd.Args = append([]string{initArg0, string(spec), "--"}, cmd.Args...)
	cmd.Path = self
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
	cmd.SysProcAttr.Cloneflags |= syscall.CLONE_NEWNS | syscall.CLONE_NEWPID | syscall.CLONE_NEWUTS
	if !b.hostIPC {
		cmd.SysProcAttr.Cloneflags |= syscall.CLONE_NEWIPC
	}
	return nil
}

// leaseHostname is the hostname a lease's processes see: the lease id
// (cut to fit), and a hash of the host's own name, so that the hosts of
// one lease tell each other apart without learning the host's name.
func leaseHostname(lease string) string {
	host, _ := os.Hostname()
	sum := sha256.Sum256([]byte(host))
	const max = 64 - 1 - 8 // HOST_NAME_MAX, a dash and the hash
	return fmt.Sprintf("%.*s-%x", max, lease, sum[:4])
}

// tmpfsSize is the size of a lease's private /tmp, /var/tmp and /dev/shm
// each: its memory cap, or without one tmpfs's own default of half the
// host's memory. What they hold is memory charged to the lease's cgroup,
// so together they never exceed the cap either.
func tmpfsSize(memoryMiB int64) string {
	if memoryMiB > 0 {
		return strconv.FormatInt(memoryMiB, 10) + "m"
	}
	return "50%"
}

// LeaseOf reads a process's /proc/PID/cgroup: the lease whose cgroup
// holds it, or "" for none (or without cgroups).
func (m *Manager) LeaseOf(cgroupFile []byte) string {
	if m.cg == nil {
		return ""
	}
	return m.cg.leaseOf(cgroupFile)
}

// HasCgroups reports whether leases have cgroups: LeaseOf is then how
// their processes are found.
func (m *Manager) HasCgroups() bool { return m.cg != nil }

// Procs lists the processes in a lease's cgroup (host pids).
func (m *Manager) Procs(lease string) ([]int, error) {
	if m.cg == nil {
		return nil, errors.New("sandbox: no cgroups on this host")
	}
	return m.cg.procs(lease)
}

// Remove kills every process left in the lease's cgroup, removes the
// cgroup and puts the lease's user in quarantine: no lease takes it
// again while a process runs as it or the lease's directory holds a file
// of it (the caller removes the directory). The shared MPS user is not
// quarantined. Removing a sandbox that does not exist succeeds.
func (m *Manager) Remove(lease string) error {
	if !validLease.MatchString(lease) {
		return fmt.Errorf("sandbox: lease id %q: not a valid lease id", lease)
	}
	if m.cg != nil {
		if err := m.cg.destroy(lease); err != nil {
			return fmt.Errorf("sandbox: cgroup of lease %s: %w", lease, err)
		}
	}
	m.mu.Lock()
	if b, ok := m.leases[lease]; ok && b.uid != m.SharedUser() {
		m.quarantine[b.uid] = b.dir
	}
	delete(m.leases, lease)
	m.mu.Unlock()
	return nil
}

// Close removes this agent's cgroup parent directories if no lease's
// cgroup is left in them.
func (m *Manager) Close() error {
	if m.cg == nil {
		return nil
	}
	m.cg.removeParent()
	return nil
}

// Join moves a process the sandbox's init did not start (a test's, or
// one the agent adopts) into the lease's cgroup, making the cgroup
// without caps if it does not exist yet.
func (m *Manager) Join(lease string, pid int) error {
	if m.cg == nil {
		return errors.New("sandbox: no cgroups on this host")
	}
	if !validLease.MatchString(lease) {
		return fmt.Errorf("sandbox: lease id %q: not a valid lease id", lease)
	}
	if err := m.cg.create(lease, 0, 0); err != nil {
		return err
	}
	for _, f := range m.cg.procsFiles(lease) {
		if err := os.WriteFile(f, []byte(strconv.Itoa(pid)), 0); err != nil {
			return err
		}
	}
	return nil
}

// Leases lists the leases that have a cgroup under this manager's parent:
// those it prepared, and those the processes of an agent before it (on
// the same parent) still run in. Without cgroups it lists none.
func (m *Manager) Leases() ([]string, error) {
	if m.cg == nil {
		return nil, nil
	}
	return m.cg.leases()
}

// Purge removes every lease cgroup under this manager's parent, killing
// what runs in them, then the parent itself: for tests, and for a host
// taken out of the pool. The agent never purges by itself: a lease's
// processes outlive an agent restart, and a restarted agent removes (see
// Remove) only the cgroups of leases it no longer holds.
func (m *Manager) Purge() error {
	if m.cg == nil {
		return nil
	}
	leases, err := m.cg.leases()
	if err != nil {
		return err
	}
	var errs []error
	for _, l := range leases {
		if err := m.Remove(l); err != nil {
			errs = append(errs, err)
		}
	}
	m.cg.removeParent()
	return errors.Join(errs...)
}
