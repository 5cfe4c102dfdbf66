package agent

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"

	"github.com/gpupool/gpupool/agent/sandbox"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// prepareSandbox makes the lease's directory and its sandbox. A lease
// with an MPS slice runs as the sandbox's shared MPS user: an MPS daemon
// serves one user at a time, so per-lease users would make fractional
// leases of one GPU wait for each other; the lease's namespaces and
// cgroup still keep it apart from the others. The cgroup is capped at
// hostCaps: a lease that asked for no host CPU or memory gets its default
// share.
func (a *Agent) prepareSandbox(as *gpupoolv1.Assignment) error {
	dir := a.leaseDirPath(as.LeaseId)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("lease dir: %w", err)
	}
	spec := sandbox.Spec{Lease: as.LeaseId, Dir: dir}
	spec.CPUMillicores, spec.MemoryMiB = a.hostCaps(as)
	if slices.ContainsFunc(as.Slices, func(s *gpupoolv1.Slice) bool { return s.Isolation == gpupoolv1.Isolation_ISOLATION_MPS }) {
		spec.User = a.box.SharedUser()
	}
	if _, err := a.box.Prepare(spec); err != nil {
		return err
	}
	return nil
}

// brokerLeaseID is the form of every lease id a broker grants (its
// newLeaseID): "l-" and 16 hex digits. Only a cgroup so named is a
// lease's, whatever else sits under the cgroup parent.
var brokerLeaseID = regexp.MustCompile(`^l-[0-9a-f]{16}$`)

// reapOrphans kills the processes of every lease cgroup under the
// agent's cgroup parent whose lease the agent does not hold: an agent
// before it (killed with SIGKILL, or whose data dir was lost) left them
// running, and no teardown would ever reach them. It removes their
// cgroups and lease directories through the sandbox's teardown path.
// Called once the data dir's leases are resumed: those, and those being
// torn down, are left to the lease table.
//
// A lease cgroup is one named by a broker's lease id, never the agent's
// own: a --cgroup-parent that holds other cgroups (system.slice, with
// its services, the agent's among them) loses none of them.
func (a *Agent) reapOrphans() {
	ids, err := a.box.Leases()
	if err != nil {
		a.log.Error("listing the lease cgroups left by an earlier agent failed; their processes keep running", "err", err)
		return
	}
	var own string
	if b, err := os.ReadFile("/proc/self/cgroup"); err == nil {
		own = a.box.LeaseOf(b)
	}
	for _, id := range ids {
		if a.leases.has(id) {
			continue
		}
		if !brokerLeaseID.MatchString(id) || id == own {
			a.log.Debug("leaving a cgroup under the cgroup parent that is no lease's", "cgroup", id)
			continue
		}
		pids, _ := a.box.Procs(id)
		a.log.Warn("killing the processes of a lease this agent does not hold, left in its cgroup by an earlier agent",
			"lease", id, "processes", len(pids))
		if err := a.box.Remove(id); err != nil {
			a.log.Error("killing an orphaned lease's processes failed", "lease", id, "err", err)
			continue
		}
		if err := os.RemoveAll(a.leaseDirPath(id)); err != nil {
			a.log.Error("removing an orphaned lease's directory failed", "lease", id, "err", err)
		}
	}
}

func (a *Agent) leaseDirPath(id string) string { return filepath.Join(a.cfg.DataDir, "work", id) }

// Sandbox makes a process the data plane starts for a lease run in the
// lease's sandbox, or refuses it on a host with reduced isolation unless
// the agent allows that.
func (a *Agent) Sandbox(leaseID string, cmd *exec.Cmd) error {
	if r := a.box.Report(); !r.Full() && !a.cfg.AllowReducedIsolation {
		return fmt.Errorf("exec refused: this pool host gives leases %s, and its agent runs without --allow-reduced-isolation", r)
	}
	return a.box.Command(leaseID, cmd)
}

// Isolation says what a lease's processes run in on this host.
func (a *Agent) Isolation() sandbox.Report { return a.box.Report() }
