package cluster_test

import (
	"encoding/json"
	"fmt"
	"strings"
	"syscall"
	"testing"
	"time"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// acquireOnHost leases a small slice on host for five minutes.
func (cl *cluster) acquireOnHost(t *testing.T, host string) string {
	t.Helper()
	req := fractional(1024, 5, "")
	req.Request.TtlMs = 300_000
	req.Request.Constraints = &gpupoolv1.Constraints{Host: host}
	resp, err := cl.c.Lease.Acquire(ctxFor(t, 30*time.Second), req)
	if err != nil {
		t.Fatal(err)
	}
	return resp.Lease.Id
}

func TestDrainDeadlineFiresAfterALeaderKillAndTheCLIMonitorsToDrained(t *testing.T) {
	if testing.Short() {
		t.Skip("starts real processes")
	}
	cl := newCluster(t, 2)
	addr := "--addr=" + strings.Join(cl.addrs, ",")
	leases := []string{cl.acquireOnHost(t, "host-1"), cl.acquireOnHost(t, "host-1")}

	out, stderr, code := gpupool(t, "host", "drain", "host-1", "--deadline", "4s", "--detach", "--reason", "leader kill test", "-o", "json", addr)
	if code != 0 {
		t.Fatalf("drain: exit %d\n%s%s", code, out, stderr)
	}
	var resp struct {
		Host struct {
			Status string
			Drain  struct {
				DeadlineMs string `json:"deadline_ms"`
			}
		}
		Leases int
	}
	if err := json.Unmarshal([]byte(out), &resp); err != nil || resp.Host.Status != "HOST_STATUS_DRAINING" || resp.Host.Drain.DeadlineMs == "" || resp.Leases != 2 {
		t.Fatalf("drain -o json: got %+v (%v), want draining with a deadline and 2 leases:\n%s", resp, err, out)
	}

	// The leader dies before the deadline; the next one fires it.
	cl.brokers[cl.leader()].signal(t, syscall.SIGKILL)
	eventually(t, "host-1 drained after the deadline", 60*time.Second, func() error {
		h, err := cl.c.Pool.GetHost(ctxFor(t, 5*time.Second), &gpupoolv1.GetHostRequest{HostId: "host-1"})
		if err != nil {
			return err
		}
		if h.Host.Status != gpupoolv1.HostStatus_HOST_STATUS_DRAINED {
			return fmt.Errorf("host-1 %v with %d leases", h.Host.Status, len(h.Leases))
		}
		return nil
	})
	for _, id := range leases {
		l := cl.getLease(id)
		if l.State != gpupoolv1.LeaseState_LEASE_STATE_REVOKED || !strings.HasPrefix(l.Reason, "host host-1 drained: the drain deadline passed") {
			t.Fatalf("lease %s: got %v %q, want revoked at the drain deadline", id, l.State, l.Reason)
		}
	}

	other := cl.acquireOnHost(t, "host-2")
	for _, tc := range []struct {
		name     string
		args     []string
		wantCode int
		want     string
	}{
		{"a drained host takes no lease", []string{"lease", "acquire", "--memory", "1GiB", "--compute", "5", "--host", "host-1"}, 1, "drained"},
		{"a prefix of two hosts fails under --yes", []string{"host", "drain", "host-", "--yes"}, 2, `HOST_ID "host-" matches 2 hosts (host-1, host-2): --yes does not confirm a prefix`},
		{"a prefix of two hosts fails without a terminal", []string{"host", "drain", "host-"}, 2, "stdin is not a terminal to confirm"},
		{"a selector matching nothing fails", []string{"host", "drain", "--selector", "rack=nowhere"}, 1, `--selector "rack=nowhere": matches no host`},
		{"enabling a drained host", []string{"host", "eligibility", "host-1", "--enable"}, 0, "host host-1: ready, eligible=yes"},
		{"a forced drain monitored to drained", []string{"host", "drain", "host-2", "--force", "--monitor"}, 0, "host-2: drained"},
		{"disabling a drained host keeps it drained", []string{"host", "eligibility", "host-2", "--disable"}, 0, "host host-2: drained, eligible=no"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out, stderr, code := gpupool(t, append(tc.args, addr)...)
			if code != tc.wantCode || !strings.Contains(out+stderr, tc.want) {
				t.Fatalf("exit %d, want %d; output lacks %q?\nstdout: %s\nstderr: %s", code, tc.wantCode, tc.want, out, stderr)
			}
		})
	}
	if l := cl.getLease(other); l.State != gpupoolv1.LeaseState_LEASE_STATE_REVOKED {
		t.Fatalf("lease on the force-drained host: got %v, want revoked", l.State)
	}
}
