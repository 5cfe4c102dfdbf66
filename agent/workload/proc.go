// Package workload finds and stops the processes of a lease on a pool
// host.
//
// A process belongs to a lease when its environment holds
// GPUPOOL_LEASE_ID=<lease id>, which children inherit, or when the agent
// registered it with Table.Track. A process is named by a Proc, which
// stays unique when the kernel reuses its pid: nothing here signals or
// attributes a process whose start time differs from the Proc's.
//
// Linux only: everything is read from the proc filesystem.
package workload

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
)

// EnvLeaseID is the environment variable whose value names the lease a
// process belongs to.
const EnvLeaseID = "GPUPOOL_LEASE_ID"

// ErrNoProcess reports a pid that names no live process.
var ErrNoProcess = errors.New("workload: no such process")

// Proc identifies one process across pid reuse.
type Proc struct {
	PID int
	// Start is when the process started, in clock ticks since boot
	// (field 22 of /proc/PID/stat). Processes that held the same pid in
	// turn have different Starts unless the pid was reused within one
	// clock tick, which the kernel's pid allocation makes impractical.
	Start uint64
}

// String formats p as pid@start.
func (p Proc) String() string { return fmt.Sprintf("%d@%d", p.PID, p.Start) }

// procStat is what the package needs from /proc/PID/stat.
type procStat struct {
	state byte
	start uint64
	// comm is the command name (field 2). It changes when the process
	// execs, and with it, possibly, its environment.
	comm string
}

// exited says whether the process has exited: a zombie has, although its
// parent has not collected it yet.
func (s procStat) exited() bool {
	return s.state == 'Z' || s.state == 'X' || s.state == 'x'
}

// parseStat reads the state (field 3) and start time (field 22) of
// /proc/PID/stat. The command name (field 2) is in parentheses and may
// itself hold spaces and parentheses, so fields are counted from the last
// ')'.
func parseStat(b []byte) (procStat, error) {
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return procStat{}, errors.New("malformed stat: no ')' closing the command name")
	}
	f := strings.Fields(string(b[i+1:]))
	// f[0] is field 3, so field 22 is f[19].
	if len(f) < 20 {
		return procStat{}, fmt.Errorf("malformed stat: %d fields after the command name, want at least 20", len(f))
	}
	if len(f[0]) != 1 {
		return procStat{}, fmt.Errorf("malformed stat: state %q, want one letter", f[0])
	}
	start, err := strconv.ParseUint(f[19], 10, 64)
	if err != nil {
		return procStat{}, fmt.Errorf("malformed stat: start time %q: not a number", f[19])
	}
	comm := ""
	if j := bytes.IndexByte(b, '('); j >= 0 && j < i {
		comm = string(b[j+1 : i])
	}
	return procStat{state: f[0][0], start: start, comm: comm}, nil
}

// vanished says whether err, from reading a process's files, means the
// process is no longer there.
func vanished(err error) bool {
	return errors.Is(err, fs.ErrNotExist) || errors.Is(err, syscall.ESRCH)
}

// procDir is the /proc/PID directory of one process. Files read through
// it belong to the process that held pid when the directory was opened:
// once that process is gone, reads fail (ESRCH) even if the pid has been
// reused.
type procDir struct {
	pid  int
	root *os.Root
}

// openProcDir opens pid's directory under procRoot.
func openProcDir(procRoot string, pid int) (procDir, error) {
	r, err := os.OpenRoot(filepath.Join(procRoot, strconv.Itoa(pid)))
	if err != nil {
		return procDir{}, err
	}
	return procDir{pid: pid, root: r}, nil
}

func (d procDir) Close() error { return d.root.Close() }

// stat reads and parses the process's stat file.
func (d procDir) stat() (procStat, error) {
	b, err := d.root.ReadFile("stat")
	if err != nil {
		return procStat{}, err
	}
	st, err := parseStat(b)
	if err != nil {
		return procStat{}, fmt.Errorf("pid %d: %w", d.pid, err)
	}
	return st, nil
}

// lease reads the lease id from the process's environment: the value of
// the first EnvLeaseID entry, "" if there is none.
func (d procDir) lease() (string, error) {
	b, err := d.root.ReadFile("environ")
	if err != nil {
		return "", err
	}
	return leaseFromEnviron(b), nil
}

// leaseFromEnviron returns the value of the first EnvLeaseID entry of a
// NUL-separated environment block, as getenv(3) would.
func leaseFromEnviron(b []byte) string {
	prefix := []byte(EnvLeaseID + "=")
	for kv := range bytes.SplitSeq(b, []byte{0}) {
		if v, ok := bytes.CutPrefix(kv, prefix); ok {
			return string(v)
		}
	}
	return ""
}

// readStat reads the stat of pid under procRoot without holding its
// directory open.
func readStat(procRoot string, pid int) (procStat, error) {
	b, err := os.ReadFile(filepath.Join(procRoot, strconv.Itoa(pid), "stat"))
	if err != nil {
		return procStat{}, err
	}
	st, err := parseStat(b)
	if err != nil {
		return procStat{}, fmt.Errorf("pid %d: %w", pid, err)
	}
	return st, nil
}
