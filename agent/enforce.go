package agent

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/gpupool/gpupool/agent/device"
	"github.com/gpupool/gpupool/agent/workload"
	"github.com/gpupool/gpupool/internal/clock"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// MPS runs one CUDA MPS control daemon per shared GPU. *mps.Controller
// implements it.
type MPS interface {
	// Start ensures uuid's daemon runs; it is idempotent.
	Start(ctx context.Context, uuid string) error
	// Stop quits uuid's daemon; it is idempotent.
	Stop(ctx context.Context, uuid string) error
	// ClientEnv is the environment a process needs to use memMiB and
	// computePercent of uuid through its daemon.
	ClientEnv(uuid string, memMiB int64, computePercent int) []string
}

// mpsTimeout bounds starting or stopping one MPS daemon. Preparing a lease
// runs on the heartbeat loop, so it stays well under the heartbeat TTL.
const mpsTimeout = 3 * time.Second

// LeaseEnvVar names the environment variable that ties a process to its
// lease: the agent finds a lease's processes by it.
const LeaseEnvVar = "GPUPOOL_LEASE_ID"

// prepare starts enforcing a new lease, or refuses it: every slice must be
// on a GPU of this host, an MPS slice needs MPS, and the lease's state
// file must be written. A refused lease leaves nothing behind.
func (a *Agent) prepare(ctx context.Context, as *gpupoolv1.Assignment, now time.Time) {
	if err := a.prepareErr(ctx, as, deadlineOf(as, now)); err != nil {
		if errors.Is(err, syscall.ENOSPC) {
			err = fmt.Errorf("agent data dir %s: disk full: %w; free space there and the agent takes new leases again by itself (the leases it holds keep running)", a.cfg.DataDir, err)
		}
		a.log.Error("refusing a lease", "lease", as.LeaseId, "err", err)
		a.leases.reject(as.LeaseId, err.Error())
		a.kick()
		return
	}
	a.log.Info("enforcing lease", "lease", as.LeaseId, "slices", describeSlices(as.Slices), "tenant", as.Tenant, "holder", as.Holder)
	a.syncJobMap()
}

func (a *Agent) prepareErr(ctx context.Context, as *gpupoolv1.Assignment, deadline time.Time) error {
	if !validLeaseID.MatchString(as.LeaseId) {
		return fmt.Errorf("lease id %q: not a valid lease id", as.LeaseId)
	}
	if len(as.Slices) == 0 {
		return fmt.Errorf("lease %s: has no slice on this host", as.LeaseId)
	}
	var mpsGPUs []string
	for i, s := range as.Slices {
		if a.devices[s.Device] == nil {
			return fmt.Errorf("slices[%d].device %s: not a GPU of this host (it has %s)", i, s.Device, a.deviceList())
		}
		switch s.Isolation {
		case gpupoolv1.Isolation_ISOLATION_MPS:
			if a.cfg.MPS == nil {
				return fmt.Errorf("slices[%d].isolation mps: this agent runs no MPS (start it with --mps on, or release the lease)", i)
			}
			if !slices.Contains(mpsGPUs, s.Device) {
				mpsGPUs = append(mpsGPUs, s.Device)
			}
		case gpupoolv1.Isolation_ISOLATION_UNSPECIFIED, gpupoolv1.Isolation_ISOLATION_EXCLUSIVE, gpupoolv1.Isolation_ISOLATION_WATCHDOG:
		default:
			return fmt.Errorf("slices[%d].isolation %v: must be exclusive, mps or watchdog", i, s.Isolation)
		}
	}
	// Starting daemons and adding the lease is one step against a
	// teardown's stopping them: a daemon is never stopped under a lease
	// being added.
	a.mpsMu.Lock()
	defer a.mpsMu.Unlock()
	var started []string
	undo := func() {
		for _, uuid := range started {
			a.releaseMPSLocked(uuid, as.LeaseId)
		}
	}
	for _, uuid := range mpsGPUs {
		sctx, cancel := context.WithTimeout(ctx, mpsTimeout)
		err := a.cfg.MPS.Start(sctx, uuid)
		cancel()
		if err != nil {
			undo()
			return fmt.Errorf("start the MPS daemon of %s: %w", uuid, err)
		}
		started = append(started, uuid)
	}
	if err := a.prepareSandbox(as); err != nil {
		undo()
		return err
	}
	if err := a.files.put(leaseRecord{Assignment: as, Deadline: deadline}); err != nil {
		undo()
		return fmt.Errorf("write the lease's state file: %w", err)
	}
	a.leases.add(as, deadline)
	return nil
}

// releaseMPS quits uuid's MPS daemon unless a lease other than leaseID
// that is not torn down still uses it.
func (a *Agent) releaseMPS(uuid, leaseID string) {
	a.mpsMu.Lock()
	defer a.mpsMu.Unlock()
	a.releaseMPSLocked(uuid, leaseID)
}

func (a *Agent) releaseMPSLocked(uuid, leaseID string) {
	if a.cfg.MPS == nil || a.leases.mpsInUse(uuid, leaseID) {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), mpsTimeout)
	defer cancel()
	if err := a.cfg.MPS.Stop(ctx, uuid); err != nil {
		a.log.Error("stopping an MPS daemon failed", "device", uuid, "err", err)
	}
}

// leaseProcs lists the live processes of lease id, as they are from now
// on: the lease is no longer enforced, so no process joins it after the
// call. With cgroups, its cgroup lists them (with those tracked for it),
// so the cost does not grow with the host's other processes. Without, a
// scan of every process finds them, one scan shared by the teardowns that
// ask together: a scan per teardown kept a core busy under a churn of
// short leases.
func (a *Agent) leaseProcs(ctx context.Context, id string) ([]workload.Proc, error) {
	if !a.box.HasCgroups() {
		// The wall clock: the process table dates its scans by it.
		all, err := a.procs.ScanSince(ctx, time.Now())
		return all[id], err
	}
	pids, err := a.box.Procs(id)
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, err // a lease never given a cgroup has no process in one
	}
	return a.procs.Members(id, pids), nil
}

// teardown stops a lease's processes in the background, releases its MPS
// daemons and state file, and marks it torn down for the broker. It
// confirms only after a scan of the processes succeeded and found none;
// until then it retries, with a growing pause, for as long as the agent
// runs. A restart resumes it from the state file.
func (a *Agent) teardown(o teardownOrder) {
	ctx := a.runCtx
	id := o.a.GetLeaseId()
	a.log.Info("tearing down lease", "lease", id, "why", o.reason)
	a.wg.Add(1)
	go func() {
		defer a.wg.Done()
		a.syncJobMap() // the lease is no longer enforced: off DCGM's map
		if a.dp != nil {
			// The lease is no longer enforced (LeaseEnv says so), so no
			// new stream is authorized; Revoke ends the open ones and the
			// processes exec started.
			a.dp.Revoke(id)
		}
		start := a.clock.Now()
		pause := 100 * time.Millisecond
		for round := 1; ; round++ {
			procs, err := a.leaseProcs(ctx, id)
			if ctx.Err() != nil {
				return // the agent is stopping; the file stays and a restart resumes
			}
			if err == nil && len(procs) == 0 {
				break
			}
			if err != nil {
				a.log.Error("listing a lease's processes failed; retrying", "lease", id, "err", err, "retry_in", pause)
			} else {
				res, err := workload.Stop(ctx, procs, a.cfg.Enforcement.KillAfter)
				a.logStop(id, res, err)
				if err == nil && len(res.Remaining) == 0 {
					continue // scan again: a process may have forked meanwhile
				}
				if round > 1 {
					a.log.Error("a lease's processes outlive SIGKILL; not confirming its teardown", "lease", id, "retry_in", pause)
				}
			}
			if !clock.Sleep(ctx, a.clock, pause) {
				return // the agent is stopping; the file stays and a restart resumes
			}
			pause = min(2*pause, 5*time.Second)
		}
		if err := a.box.Remove(id); err != nil {
			a.log.Error("removing a lease's sandbox failed", "lease", id, "err", err)
		}
		if err := a.files.remove(id); err != nil {
			a.log.Error("removing a lease's state file failed", "lease", id, "err", err)
		}
		if validLeaseID.MatchString(id) {
			if err := os.RemoveAll(filepath.Join(a.cfg.DataDir, "work", id)); err != nil {
				a.log.Error("removing a lease's working directory failed", "lease", id, "err", err)
			}
		}
		a.procs.Untrack(id)
		// Torn down first, so that of two leases of one GPU torn down
		// together the last one sees the daemon unused and stops it.
		a.leases.finishTeardown(id, o.confirm)
		for _, s := range o.a.GetSlices() {
			if s.Isolation == gpupoolv1.Isolation_ISOLATION_MPS {
				a.releaseMPS(s.Device, id)
			}
		}
		a.log.Info("lease torn down", "lease", id, "took", a.clock.Now().Sub(start).Round(time.Millisecond))
		a.kick()
	}()
}

// LeaseEnv returns the environment a process of an enforced lease runs
// with: GPUPOOL_LEASE_ID, CUDA_VISIBLE_DEVICES with the slices' GPU UUIDs,
// and for MPS slices the daemon's pipe and the client limits. It reports
// false when the lease is not enforced here.
func (a *Agent) LeaseEnv(leaseID string) ([]string, bool) {
	as, ok := a.leases.get(leaseID)
	if !ok {
		return nil, false
	}
	env := []string{LeaseEnvVar + "=" + leaseID}
	var uuids []string
	for _, s := range as.Slices {
		if !slices.Contains(uuids, s.Device) {
			uuids = append(uuids, s.Device)
		}
	}
	env = append(env, "CUDA_VISIBLE_DEVICES="+strings.Join(uuids, ","))
	// A process talks to one MPS daemon: the first MPS slice's. Its
	// limits are the client's for device ordinal 0.
	for _, s := range as.Slices {
		if s.Isolation == gpupoolv1.Isolation_ISOLATION_MPS && a.cfg.MPS != nil {
			env = append(env, a.cfg.MPS.ClientEnv(s.Device, s.MemoryMib, int(s.ComputePercent))...)
			break
		}
	}
	return env, true
}

func describeSlices(ss []*gpupoolv1.Slice) string {
	parts := make([]string, len(ss))
	for i, s := range ss {
		parts[i] = describeSlice(s) + " " + isolationName(s.Isolation)
	}
	return strings.Join(parts, ", ")
}

// isolationName is "exclusive", "mps" or "watchdog".
func isolationName(i gpupoolv1.Isolation) string {
	if i == gpupoolv1.Isolation_ISOLATION_UNSPECIFIED {
		return "watchdog"
	}
	return strings.ToLower(strings.TrimPrefix(i.String(), "ISOLATION_"))
}

func (a *Agent) deviceList() string {
	if len(a.devices) == 0 {
		return "no GPUs"
	}
	idx := make([]string, 0, len(a.devices))
	for _, d := range a.devices {
		idx = append(idx, strconv.Itoa(int(d.Index)))
	}
	slices.Sort(idx)
	return "GPUs " + strings.Join(idx, ", ")
}

// health is what the agent knows of its GPUs: the critical health events
// seen since it started and the watchdog's last readings.
type health struct {
	mu       sync.Mutex
	sick     map[string]string // guarded by mu; uuid → why it is unhealthy
	allLost  string            // guarded by mu; set when every GPU is lost
	readings map[string]device.Sample
	// sickAt and allLostAt date the last critical event (memory.go);
	// guarded by mu.
	sickAt    map[string]time.Time
	allLostAt time.Time
}

// markUnhealthy records that device uuid ("" for every device) is
// unhealthy; it reports whether that is news.
func (a *Agent) markUnhealthy(uuid, reason string) {
	a.health.mu.Lock()
	now := a.clock.Now()
	if uuid == "" {
		a.health.allLostAt = now
		if a.health.allLost == "" {
			a.health.allLost = reason
			a.log.Error("every GPU is unhealthy", "why", reason)
			a.kick()
		}
	} else {
		a.health.sickAt[uuid] = now
		if _, ok := a.health.sick[uuid]; !ok {
			a.health.sick[uuid] = reason
			a.log.Error("GPU unhealthy", "device", uuid, "why", reason)
			a.kick()
		}
	}
	a.health.mu.Unlock()
	a.saveMemory()
}

// onHealthEvent handles one event from the device backend.
func (a *Agent) onHealthEvent(ev device.HealthEvent) {
	if !ev.Critical {
		a.log.Info("GPU event ignored: not a hardware fault", "device", ev.UUID, "kind", ev.Kind.String(), "reason", ev.Reason)
		return
	}
	a.markUnhealthy(ev.UUID, ev.Reason)
}

// healthOf returns a device's health and why.
func (a *Agent) healthOf(uuid string) (gpupoolv1.DeviceHealth, string) {
	a.health.mu.Lock()
	healed := a.healAfterLocked(a.clock.Now())
	h, why := a.healthLocked(uuid)
	a.health.mu.Unlock()
	if healed {
		a.saveMemory()
	}
	return h, why
}

func (a *Agent) healthLocked(uuid string) (gpupoolv1.DeviceHealth, string) {
	if a.health.allLost != "" {
		return gpupoolv1.DeviceHealth_DEVICE_HEALTH_UNHEALTHY, a.health.allLost
	}
	if why, ok := a.health.sick[uuid]; ok {
		return gpupoolv1.DeviceHealth_DEVICE_HEALTH_UNHEALTHY, why
	}
	return gpupoolv1.DeviceHealth_DEVICE_HEALTH_HEALTHY, ""
}

func (a *Agent) setReadings(samples []device.Sample) {
	m := make(map[string]device.Sample, len(samples))
	for _, s := range samples {
		m[s.UUID] = s
	}
	a.health.mu.Lock()
	a.health.readings = m
	a.health.mu.Unlock()
}

// deviceReports is every device's health and last readings, by index.
func (a *Agent) deviceReports() []*gpupoolv1.DeviceReport {
	uuids := slices.SortedFunc(maps.Keys(a.devices), func(x, y string) int { return int(a.devices[x].Index - a.devices[y].Index) })
	out := make([]*gpupoolv1.DeviceReport, 0, len(uuids))
	for _, uuid := range uuids {
		h, why := a.healthOf(uuid)
		r := &gpupoolv1.DeviceReport{Uuid: uuid, Health: h, HealthReason: why, UsedMemoryMib: -1, UtilizationPercent: -1}
		a.health.mu.Lock()
		if s, ok := a.health.readings[uuid]; ok {
			r.UsedMemoryMib, r.UtilizationPercent = s.MemoryUsedMiB, s.UtilizationPercent
		}
		a.health.mu.Unlock()
		out = append(out, r)
	}
	return out
}

// errorOnce logs a recurring failure when it starts and when it ends, not
// on every poll.
type errorOnce struct {
	mu     sync.Mutex
	failed bool // guarded by mu
}

func (e *errorOnce) log(log *slog.Logger, msg string, err error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if !e.failed {
		log.Error(msg, "err", err)
	}
	e.failed = true
}

func (e *errorOnce) clear(log *slog.Logger, msg string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.failed {
		log.Info(msg)
	}
	e.failed = false
}
