package cluster_test

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"syscall"
	"testing"
	"time"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// TestGuaranteedWorkTakesBackElasticExtrasThroughALeaderKill runs the
// issue's story on real processes: an elastic job grows over a host's 8
// GPUs; a guaranteed request waits for 4 and preempts 4 extras; the leader
// dies during the grace; the next leader revokes exactly those 4 once, the
// waiting CLI rejoins the queue and is granted, and once it releases, the
// elastic lease grows back.
func TestGuaranteedWorkTakesBackElasticExtrasThroughALeaderKill(t *testing.T) {
	if testing.Short() {
		t.Skip("starts real processes")
	}
	cl := newCluster(t, 1)
	addr := "--addr=" + strings.Join(cl.addrs, ",")
	job, err := cl.c.Acquire(ctxFor(t, 30*time.Second), &gpupoolv1.LeaseRequest{
		Count: 2, ElasticMax: 8, Exclusive: true, TtlMs: 300_000, Tenant: "sim", Holder: "elastic-job",
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(job.Close)
	eventually(t, "the elastic job grows to 8 GPUs", 30*time.Second, func() error {
		if n := len(job.Slices()); n != 8 {
			return fmt.Errorf("%d slices", n)
		}
		return nil
	})

	type result struct {
		out, stderr string
		code        int
	}
	done := make(chan result, 1)
	go func() {
		out, stderr, code := gpupool(t, "lease", "acquire", "--exclusive", "--gpus", "4", "--wait", "2m", "--request-id", "guaranteed-4", "-o", "json", addr)
		done <- result{out, stderr, code}
	}()
	var victims []string
	eventually(t, "4 extras preempted", 30*time.Second, func() error {
		victims = victims[:0]
		for _, l := range cl.listAll(false, cl.c) {
			if l.PreemptAtMs != 0 && l.Parent == job.ID() {
				victims = append(victims, l.Id)
			}
		}
		if len(victims) != 4 {
			return fmt.Errorf("%d preempted", len(victims))
		}
		return nil
	})

	cl.brokers[cl.leader()].signal(t, syscall.SIGKILL)
	var r result
	select {
	case r = <-done:
	case <-time.After(90 * time.Second):
		t.Fatal("the waiting acquire never returned")
	}
	if r.code != 0 {
		t.Fatalf("acquire --wait: exit %d\n%s%s", r.code, r.out, r.stderr)
	}
	var granted struct{ ID, Reason string }
	if err := json.Unmarshal([]byte(r.out), &granted); err != nil || !strings.HasPrefix(granted.Reason, "granted from the queue after") {
		t.Fatalf("acquire -o json: %+v (%v)\n%s", granted, err, r.out)
	}
	for _, id := range victims {
		l := cl.getLease(id)
		if l.State != gpupoolv1.LeaseState_LEASE_STATE_REVOKED || !strings.Contains(l.Reason, "preempted for "+granted.ID) {
			t.Fatalf("victim %s: %v %q, want revoked for %s", id, l.State, l.Reason, granted.ID)
		}
	}
	eventually(t, "the job down to 4 GPUs", 30*time.Second, func() error {
		if n := len(job.Slices()); n != 4 {
			return fmt.Errorf("%d slices", n)
		}
		return nil
	})
	if job.Err() != nil {
		t.Fatalf("the elastic job lost its lease: %v", job.Err())
	}

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := cl.c.Lease.Release(ctx, &gpupoolv1.ReleaseRequest{LeaseId: granted.ID}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the job grows back to 8 GPUs", 60*time.Second, func() error {
		if n := len(job.Slices()); n != 8 {
			return fmt.Errorf("%d slices", n)
		}
		return nil
	})
}
