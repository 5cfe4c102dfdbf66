package cluster_test

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gpupool/gpupool/agent/device"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// leaseWorkload is `sleep 600` run in lease id's sandbox through the
// data plane ('gpupool exec'), as a holder runs it: pid is its host pid,
// found in the lease's cgroup, and exited is closed once it is gone.
type leaseWorkload struct {
	pid    int
	exited chan struct{}
	at     time.Time
}

func startLeaseWorkload(t *testing.T, cl *cluster, host, id string) *leaseWorkload {
	t.Helper()
	ex := exec.Command(binary, "exec", "--addr="+strings.Join(cl.addrs, ","), id, "--", "sleep", "600")
	if err := ex.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ex.Process.Kill(); ex.Wait() })
	// The agents keep each lease's processes in the v1 pids hierarchy
	// (v2 where the host is unified), under their parent/<lease>.
	w := &leaseWorkload{exited: make(chan struct{})}
	eventually(t, "the lease's sleep to run in its cgroup", 20*time.Second, func() error {
		parent := cl.cgroupParent(host)
		procs := filepath.Join("/sys/fs/cgroup/pids", parent, id, "cgroup.procs")
		if _, err := os.Stat("/sys/fs/cgroup/pids"); err != nil {
			procs = filepath.Join("/sys/fs/cgroup", parent, id, "cgroup.procs")
		}
		b, err := os.ReadFile(procs)
		if err != nil {
			return err
		}
		for _, f := range strings.Fields(string(b)) {
			if comm, _ := os.ReadFile("/proc/" + f + "/comm"); strings.TrimSpace(string(comm)) == "sleep" {
				fmt.Sscan(f, &w.pid)
				return nil
			}
		}
		return fmt.Errorf("%s holds %q", procs, b)
	})
	go func() {
		for {
			st, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", w.pid))
			if err != nil || strings.Contains(string(st), ") Z ") {
				w.at = time.Now()
				close(w.exited)
				return
			}
			time.Sleep(10 * time.Millisecond)
		}
	}()
	return w
}

func (w *leaseWorkload) wait(t *testing.T, d time.Duration, why string) {
	t.Helper()
	select {
	case <-w.exited:
	case <-time.After(d):
		t.Fatalf("the lease's process still runs after %s: %s", d, why)
	}
}

func (cl *cluster) sim(i int) device.Simulator {
	return device.DialSimControl(filepath.Join(cl.agentDir(i), "simulate.sock"))
}

func (cl *cluster) getLease(id string) *gpupoolv1.Lease {
	cl.t.Helper()
	r, err := cl.c.Lease.Get(ctxFor(cl.t, 10*time.Second), &gpupoolv1.GetLeaseRequest{LeaseId: id})
	if err != nil {
		cl.t.Fatal(err)
	}
	return r.Lease
}

func TestAgentWithoutNVMLReportsNoGPUsAndStaysUp(t *testing.T) {
	if testing.Short() {
		t.Skip("starts real processes")
	}
	cl := newCluster(t, 0)
	// A library path that does not exist: the host has no NVML even on a
	// machine whose loader would find NVIDIA's libnvidia-ml.so.1.
	lib := filepath.Join(t.TempDir(), "libnvidia-ml.so.1")
	p := cl.newProc("nvml-host", "agent", "--insecure", "--broker", strings.Join(cl.addrs, ","), "--host-id", "nvml-host", "--data-bind", "127.0.0.1:0",
		"--data-dir", filepath.Join(cl.dir, "nvml-host"), "--nvml-library", lib)
	cl.agents = append(cl.agents, p) // stopped with the cluster
	p.start(t)
	cl.waitForHosts(1)
	// Two heartbeats, each sent after the previous one was seen: the agent
	// is still up and talking. A heartbeat is after since when the
	// broker's answer, asked for at asked, puts it there: the broker
	// reads its age no earlier than asked.
	since := time.Now()
	for range 2 {
		eventually(t, "a heartbeat from nvml-host after the last one seen", 20*time.Second, func() error {
			asked := time.Now()
			h, err := cl.c.Pool.GetHost(ctxFor(t, 5*time.Second), &gpupoolv1.GetHostRequest{HostId: "nvml-host"})
			if err != nil {
				return err
			}
			if len(h.Host.Devices) != 0 || h.Host.BackendNote != "NVML library "+lib+" not found: this host offers no GPUs" {
				return fmt.Errorf("devices %d, note %q: want none and why", len(h.Host.Devices), h.Host.BackendNote)
			}
			age := h.Host.LastHeartbeatAgeMs
			if at := asked.Add(-time.Duration(age) * time.Millisecond); age < 0 || !at.After(since) {
				return fmt.Errorf("last heartbeat %d ms ago, none since %s", age, since.Format(time.StampMilli))
			}
			since = asked
			return nil
		})
	}
	if !p.running() {
		t.Fatal("the agent exited")
	}
	out, _, code := gpupool(t, "host", "ls", "--addr="+strings.Join(cl.addrs, ","))
	if code != 0 || !strings.Contains(out, "no GPUs: NVML library "+lib+" not found") {
		t.Fatalf("host ls (exit %d) does not say why nvml-host has no GPUs:\n%s", code, out)
	}
	log, _ := os.ReadFile(p.log.Name())
	if n := strings.Count(string(log), lib+" not found"); n != 1 {
		t.Fatalf("the agent's log says why %d times, want once:\n%s", n, log)
	}
}

func TestAgentEnforcesALeaseThroughARestartAndReportsTheViolation(t *testing.T) {
	if testing.Short() {
		t.Skip("starts real processes")
	}
	cl := newCluster(t, 1)
	acq, err := cl.c.Lease.Acquire(ctxFor(t, 10*time.Second), fractional(1024, 10, "enforce-1"))
	if err != nil {
		t.Fatal(err)
	}
	l := acq.Lease
	gpu := int(l.Slices[0].DeviceIndex)
	if iso := l.Slices[0].Isolation; iso != gpupoolv1.Isolation_ISOLATION_WATCHDOG {
		t.Fatalf("isolation on a host without MPS: got %v, want watchdog", iso)
	}
	ka, err := cl.c.Lease.KeepAlive(ctxFor(t, 2*time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	if err := ka.Send(&gpupoolv1.KeepAliveRequest{LeaseId: l.Id}); err != nil {
		t.Fatal(err)
	}
	events := make(chan *gpupoolv1.LeaseEvent, 16)
	go func() {
		for {
			r, err := ka.Recv()
			if err != nil {
				close(events)
				return
			}
			if r.Event != nil {
				events <- r.Event
			}
		}
	}()

	w := startLeaseWorkload(t, cl, "host-1", l.Id)
	if err := cl.sim(0).SetProcess(gpu, w.pid, 512); err != nil {
		t.Fatal(err)
	}
	eventually(t, "lease get shows the agent's usage", 20*time.Second, func() error {
		u := cl.getLease(l.Id).Usage
		if len(u) != 1 || u[0].Slices[0].MemoryUsedMib != 512 || u[0].Slices[0].Processes != 1 {
			return fmt.Errorf("usage %v", u)
		}
		return nil
	})
	out, _, code := gpupool(t, "lease", "get", l.Id, "--addr="+strings.Join(cl.addrs, ","))
	if code != 0 || !strings.Contains(out, "watchdog") || !strings.Contains(out, "512 MiB") {
		t.Fatalf("lease get (exit %d) lacks the isolation and usage:\n%s", code, out)
	}

	// kill -9 the agent and start it again: it resumes from its data dir.
	cl.agents[0].signal(t, syscall.SIGKILL)
	cl.agents[0].start(t)
	eventually(t, "the restarted agent resumed the lease", 20*time.Second, func() error {
		b, _ := os.ReadFile(cl.agents[0].log.Name())
		if !strings.Contains(string(b), "resumed lease from the data dir") {
			return fmt.Errorf("not in its log yet")
		}
		return nil
	})

	start := time.Now()
	if err := cl.sim(0).SetProcess(gpu, w.pid, 4096); err != nil {
		t.Fatal(err)
	}
	w.wait(t, 20*time.Second, "it used 4 GiB of a 1 GiB slice")
	t.Logf("over-quota process stopped %s after it went over (poll 100ms, grace 500ms, kill after 1s)", w.at.Sub(start).Round(time.Millisecond))
	deadline := time.After(20 * time.Second)
	for got := false; !got; {
		select {
		case ev, ok := <-events:
			if !ok {
				t.Fatal("keepalive stream ended before the violation")
			}
			got = ev.Type == gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_VIOLATION && strings.Contains(ev.Message, "4 GiB")
		case <-deadline:
			t.Fatal("the holder never heard of the violation")
		}
	}
	if got := cl.getLease(l.Id); got.Violations != 1 || got.State != gpupoolv1.LeaseState_LEASE_STATE_GRANTED {
		t.Fatalf("lease after the violation: %d violations, %v; want 1 and still granted", got.Violations, got.State)
	}
}

func TestAKilledAgentsReleasedLeaseHasNoProcessesAfterItsRestart(t *testing.T) {
	if testing.Short() {
		t.Skip("starts real processes")
	}
	cl := newCluster(t, 1)
	acq, err := cl.c.Lease.Acquire(ctxFor(t, 10*time.Second), fractional(1024, 10, "orphan-1"))
	if err != nil {
		t.Fatal(err)
	}
	l := acq.Lease
	w := startLeaseWorkload(t, cl, "host-1", l.Id)

	// kill -9 the agent: the lease's processes outlive it, as they must
	// for a restart to resume the lease.
	cl.agents[0].signal(t, syscall.SIGKILL)
	select {
	case <-w.exited:
		t.Fatal("the lease's process died with its agent; a restart could not have resumed it")
	default:
	}
	// While it is down, the lease is released and the agent's data dir
	// loses the lease's state file: nothing the restarted agent reads
	// names the lease any more.
	if _, err := cl.c.Lease.Release(ctxFor(t, 10*time.Second), &gpupoolv1.ReleaseRequest{LeaseId: l.Id}); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(filepath.Join(cl.agentDir(0), "leases", l.Id+".json")); err != nil {
		t.Fatal(err)
	}
	// Nor can a broker's teardown list tell it: the brokers are gone too.
	for _, b := range cl.brokers {
		b.signal(t, syscall.SIGKILL)
	}
	cl.agents[0].start(t)
	w.wait(t, 20*time.Second, "the restarted agent kills what runs in the cgroup of a lease it does not hold")
}

func TestXidMakesAGPUUnhealthyAndNewLeasesAvoidIt(t *testing.T) {
	if testing.Short() {
		t.Skip("starts real processes")
	}
	cl := newCluster(t, 1)
	sim := cl.sim(0)
	if err := sim.InjectXid(1, 13); err != nil { // an application error: ignored
		t.Fatal(err)
	}
	if err := sim.InjectXid(0, 79); err != nil { // fallen off the bus
		t.Fatal(err)
	}
	eventually(t, "GPU 0 unhealthy at the broker", 20*time.Second, func() error {
		for _, d := range cl.devices() {
			if d.Index == 0 && d.Health == gpupoolv1.DeviceHealth_DEVICE_HEALTH_UNHEALTHY && d.HealthReason == "Xid 79" {
				return nil
			}
		}
		return fmt.Errorf("GPU 0 still healthy")
	})
	for _, d := range cl.devices() {
		if d.Index != 0 && d.Health != gpupoolv1.DeviceHealth_DEVICE_HEALTH_HEALTHY {
			t.Fatalf("GPU %d is %v (%s), want healthy: Xid 13 is an application error", d.Index, d.Health, d.HealthReason)
		}
	}
	var used []int32
	for i := range 7 {
		r, err := cl.c.Lease.Acquire(ctxFor(t, 10*time.Second), &gpupoolv1.AcquireRequest{Request: &gpupoolv1.LeaseRequest{
			Count: 1, Exclusive: true, TtlMs: 600_000, RequestId: fmt.Sprintf("whole-%d", i)}})
		if err != nil {
			t.Fatalf("whole GPU %d of the 7 healthy ones: %v", i+1, err)
		}
		used = append(used, r.Lease.Slices[0].DeviceIndex)
	}
	if slices.Contains(used, 0) {
		t.Fatalf("a new lease got the unhealthy GPU 0: %v", used)
	}
	_, err := cl.c.Lease.Acquire(ctxFor(t, 10*time.Second), &gpupoolv1.AcquireRequest{Request: &gpupoolv1.LeaseRequest{
		Count: 1, Exclusive: true, TtlMs: 600_000, RequestId: "whole-8"}})
	if err == nil || !strings.Contains(err.Error(), "unhealthy") {
		t.Fatalf("an 8th whole GPU: got %v, want a refusal naming the unhealthy GPU", err)
	}
	out, _, _ := gpupool(t, "host", "ls", "--addr="+strings.Join(cl.addrs, ","))
	if !strings.Contains(out, "1 unhealthy: Xid 79") || !strings.Contains(out, "nvlink 8, pcie 4") {
		t.Fatalf("host ls lacks health or topology:\n%s", out)
	}
}

// fakeMPSControl is a stand-in for nvidia-cuda-mps-control that records
// each call: its arguments, the MPS environment and its stdin.
const fakeMPSControl = `#!/bin/sh
log="$(dirname "$0")/mps.log"
if [ "$1" = "-d" ]; then
  echo "-d CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES pipe=$(basename "$(dirname "$CUDA_MPS_PIPE_DIRECTORY")")" >> "$log"
  exit 0
fi
while read -r line; do
  echo "$line CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES" >> "$log"
done
`

func TestMPSDaemonFollowsTheGPUsSharedLeases(t *testing.T) {
	if testing.Short() {
		t.Skip("starts real processes")
	}
	cl := newCluster(t, 0)
	bin := t.TempDir()
	if err := os.WriteFile(filepath.Join(bin, "nvidia-cuda-mps-control"), []byte(fakeMPSControl), 0o755); err != nil {
		t.Fatal(err)
	}
	p := cl.newAgent(0, "--mps", "on")
	p.env = []string{"PATH=" + bin + ":" + os.Getenv("PATH")}
	cl.agents = append(cl.agents, p)
	p.start(t)
	cl.waitForHosts(1)

	a, err := cl.c.Lease.Acquire(ctxFor(t, 10*time.Second), fractional(1024, 10, "mps-1"))
	if err != nil {
		t.Fatal(err)
	}
	b, err := cl.c.Lease.Acquire(ctxFor(t, 10*time.Second), fractional(1024, 10, "mps-2"))
	if err != nil {
		t.Fatal(err)
	}
	uuid := a.Lease.Slices[0].Device
	if b.Lease.Slices[0].Device != uuid || a.Lease.Slices[0].Isolation != gpupoolv1.Isolation_ISOLATION_MPS {
		t.Fatalf("want both leases binpacked on one GPU with MPS isolation, got %v and %v", a.Lease.Slices, b.Lease.Slices)
	}
	logFile := filepath.Join(bin, "mps.log")
	wantLog := func(want ...string) {
		t.Helper()
		eventually(t, fmt.Sprintf("the MPS calls %q", want), 20*time.Second, func() error {
			b, _ := os.ReadFile(logFile)
			if got := strings.Split(strings.TrimSpace(string(b)), "\n"); !slices.Equal(got, want) {
				return fmt.Errorf("got %q", got)
			}
			return nil
		})
	}
	// One daemon for the GPU, and its server started at once for the
	// sandbox's shared MPS user (the first of host-1's range): an MPS
	// daemon serves one user at a time.
	start := []string{"-d CUDA_VISIBLE_DEVICES=" + uuid + " pipe=" + uuid, "start_server -uid 300000 CUDA_VISIBLE_DEVICES=" + uuid}
	wantLog(start...)
	// Both leases' processes run as that user, and reach the daemon's
	// pipe directory from their sandboxes.
	for _, l := range []*gpupoolv1.Lease{a.Lease, b.Lease} {
		out, stderr, code := gpupool(t, "exec", "--addr="+strings.Join(cl.addrs, ","), l.Id, "--", "sh", "-c", `id -u; test -d "$CUDA_MPS_PIPE_DIRECTORY" && echo pipe`)
		if code != 0 || out != "300000\npipe\n" {
			t.Fatalf("exec on %s: exit %d, stdout %q, stderr %s; want the MPS user 300000 and its pipe directory", l.Id, code, out, stderr)
		}
	}
	for _, l := range []*gpupoolv1.Lease{a.Lease, b.Lease} {
		if _, err := cl.c.Lease.Release(ctxFor(t, 10*time.Second), &gpupoolv1.ReleaseRequest{LeaseId: l.Id}); err != nil {
			t.Fatal(err)
		}
	}
	wantLog(append(start, "quit CUDA_VISIBLE_DEVICES="+uuid)...)
}
