package workload

import (
	"cmp"
	"fmt"
	"os"
	"slices"
	"strconv"
	"sync"
)

// Table finds the processes of leases. It is safe for concurrent use.
//
// A process's lease comes from Track if it was tracked, else from its
// environment, which is read once per Proc and command name: a process
// that changes its own environment keeps the lease it had, but one seen
// between fork and exec (with its parent's environment) is read again
// once it has exec'd.
type Table struct {
	procRoot string
	// fromCgroup, when set, reads a process's lease from its
	// /proc/PID/cgroup instead of its environment. Set before use.
	fromCgroup func(cgroupFile []byte) string

	mu sync.Mutex
	// tracked maps processes registered with Track to their lease. It
	// wins over the environment. Guarded by mu.
	tracked map[Proc]string
	// environ caches the lease each process's environment names, ""
	// for none, with the command name it had then. Guarded by mu.
	environ map[Proc]envEntry
}

type envEntry struct{ lease, comm string }

// NewTable returns a Table that reads processes from procRoot, normally
// "/proc".
func NewTable(procRoot string) *Table {
	return &Table{
		procRoot: procRoot,
		tracked:  make(map[Proc]string),
		environ:  make(map[Proc]envEntry),
	}
}

// SetLeaseOf makes the table read a process's lease from its cgroup: of
// is given the process's /proc/PID/cgroup and returns the lease whose
// cgroup holds it, or "". A process cannot change that, unlike its
// environment. Call it before the table is used.
func (t *Table) SetLeaseOf(of func(cgroupFile []byte) string) { t.fromCgroup = of }

// Lookup returns the live process pid names now. It returns an error
// wrapping ErrNoProcess if there is none, or it has exited.
func (t *Table) Lookup(pid int) (Proc, error) {
	st, err := readStat(t.procRoot, pid)
	switch {
	case vanished(err) || err == nil && st.exited():
		return Proc{}, fmt.Errorf("%w: pid %d", ErrNoProcess, pid)
	case err != nil:
		return Proc{}, fmt.Errorf("workload: %w", err)
	}
	return Proc{PID: pid, Start: st.start}, nil
}

// Track records that p belongs to leaseID whatever its environment says.
// It is forgotten by Untrack(leaseID), or once p has exited and a Scan
// noticed.
func (t *Table) Track(leaseID string, p Proc) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.tracked[p] = leaseID
}

// Untrack forgets every process tracked for leaseID. Processes whose
// environment names leaseID still belong to it.
func (t *Table) Untrack(leaseID string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for p, l := range t.tracked {
		if l == leaseID {
			delete(t.tracked, p)
		}
	}
}

// LeaseOf returns the lease the live process pid belongs to, or "" if it
// belongs to none, has exited, or its environment cannot be read.
func (t *Table) LeaseOf(pid int) string {
	d, err := openProcDir(t.procRoot, pid)
	if err != nil {
		return ""
	}
	defer d.Close()
	p, comm, ok := liveProc(d)
	if !ok {
		return ""
	}
	return t.leaseOf(d, p, comm)
}

// Scan returns every live process that belongs to a lease, grouped by
// lease id and sorted by pid. Processes that vanish while being read,
// whose stat is malformed or whose environment cannot be read are left
// out, as are zombies. It fails only if procRoot cannot be listed.
func (t *Table) Scan() (map[string][]Proc, error) {
	entries, err := os.ReadDir(t.procRoot)
	if err != nil {
		return nil, fmt.Errorf("workload: list processes: %w", err)
	}
	seen := make(map[Proc]bool, len(entries))
	out := make(map[string][]Proc)
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid <= 0 {
			continue
		}
		p, lease := t.scanOne(pid)
		if p.PID == 0 {
			continue
		}
		seen[p] = true
		if lease != "" {
			out[lease] = append(out[lease], p)
		}
	}
	for _, procs := range out {
		slices.SortFunc(procs, func(a, b Proc) int { return cmp.Compare(a.PID, b.PID) })
	}
	t.forget(seen)
	return out, nil
}

// scanOne returns the process pid names and its lease; a zero Proc if
// there is no live process to report.
func (t *Table) scanOne(pid int) (Proc, string) {
	d, err := openProcDir(t.procRoot, pid)
	if err != nil {
		return Proc{}, ""
	}
	defer d.Close()
	p, comm, ok := liveProc(d)
	if !ok {
		return Proc{}, ""
	}
	return p, t.leaseOf(d, p, comm)
}

// liveProc returns the process of d and its command name, if it has not
// exited.
func liveProc(d procDir) (Proc, string, bool) {
	st, err := d.stat()
	if err != nil || st.exited() {
		return Proc{}, "", false
	}
	return Proc{PID: d.pid, Start: st.start}, st.comm, true
}

// leaseOf returns the lease of p, whose directory is d and command name
// comm, reading its cgroup (or environment) unless it is tracked or
// cached.
func (t *Table) leaseOf(d procDir, p Proc, comm string) string {
	t.mu.Lock()
	lease, ok := t.tracked[p]
	if !ok {
		var e envEntry
		e, ok = t.environ[p]
		ok = ok && e.comm == comm
		lease = e.lease
	}
	t.mu.Unlock()
	if ok {
		return lease
	}
	// Reading through d fails if p has gone, so a reused pid's
	// environment is never cached under p.
	var err error
	if t.fromCgroup != nil {
		var b []byte
		if b, err = d.root.ReadFile("cgroup"); err == nil {
			lease = t.fromCgroup(b)
		}
	} else {
		lease, err = d.lease()
	}
	if err != nil {
		return ""
	}
	// A process outside every lease's cgroup may still be moved into one
	// (the sandbox's init joins it before it execs): read it again.
	if t.fromCgroup != nil && lease == "" {
		return ""
	}
	t.mu.Lock()
	t.environ[p] = envEntry{lease: lease, comm: comm}
	t.mu.Unlock()
	return lease
}

// forget drops what the table knows of processes that have exited: those
// not seen by a scan. A tracked process is dropped only once it is known
// to have exited, since it may have started after the scan listed
// procRoot.
func (t *Table) forget(seen map[Proc]bool) {
	t.mu.Lock()
	for p := range t.environ {
		if !seen[p] {
			delete(t.environ, p)
		}
	}
	var unseen []Proc
	for p := range t.tracked {
		if !seen[p] {
			unseen = append(unseen, p)
		}
	}
	t.mu.Unlock()

	var gone []Proc
	for _, p := range unseen {
		if !t.alive(p) {
			gone = append(gone, p)
		}
	}
	if len(gone) == 0 {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, p := range gone {
		delete(t.tracked, p)
	}
}

// alive says whether p is still running, or might be: an unreadable stat
// does not prove it has exited.
func (t *Table) alive(p Proc) bool {
	st, err := readStat(t.procRoot, p.PID)
	switch {
	case vanished(err):
		return false
	case err != nil:
		return true
	}
	return st.start == p.Start && !st.exited()
}
