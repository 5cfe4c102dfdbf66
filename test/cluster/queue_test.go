package cluster_test

import (
	"context"
	"encoding/json"
	"fmt"
	"os/exec"
	"regexp"
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

// TestAWaitingAcquireOfAScopedTokenShowsItsQueueAndNamesItsRequestWhenStopped
// runs 'lease acquire --wait' with a client token scoped to team-a alone,
// naming no tenant: the brokers queue the request under team-a, and the
// CLI must follow it there (not under "default", which the token may not
// list) and, interrupted, name the request that left the queue.
func TestAWaitingAcquireOfAScopedTokenShowsItsQueueAndNamesItsRequestWhenStopped(t *testing.T) {
	if testing.Short() {
		t.Skip("starts real processes")
	}
	cl := newSecureCluster(t)
	acl := gpupoolv1.NewAclServiceClient(cl.c.Conn())
	boot, err := acl.Bootstrap(ctxFor(t, 60*time.Second), &gpupoolv1.AclBootstrapRequest{})
	if err != nil {
		t.Fatal(err)
	}
	cl.c = cl.dialWithToken(boot.Secret, cl.addrs...)
	acl = gpupoolv1.NewAclServiceClient(cl.c.Conn())
	newToken := func(r *gpupoolv1.CreateAclTokenRequest) string {
		t.Helper()
		tok, err := acl.CreateToken(ctxFor(t, 30*time.Second), r)
		if err != nil {
			t.Fatal(err)
		}
		return tok.Secret
	}
	teamA := newToken(&gpupoolv1.CreateAclTokenRequest{Name: "team-a", Kind: gpupoolv1.TokenKind_TOKEN_KIND_CLIENT, Tenants: []string{"team-a"}})
	agent := newToken(&gpupoolv1.CreateAclTokenRequest{Name: "host-1", Kind: gpupoolv1.TokenKind_TOKEN_KIND_AGENT, HostId: "host-1"})
	cl.agents = append(cl.agents, cl.newAgent(0, "--token", agent))
	cl.agents[0].start(t)
	cl.waitForHosts(1)
	// Every GPU of the pool is taken, so team-a's request waits.
	if _, err := cl.c.Acquire(ctxFor(t, 30*time.Second), &gpupoolv1.LeaseRequest{
		Count: 8, Exclusive: true, TtlMs: 300_000, Tenant: "other", Holder: "the whole pool",
	}); err != nil {
		t.Fatal(err)
	}

	args := append([]string{"lease", "acquire", "--exclusive", "--gpus", "1", "--wait", "2m", "--token=" + teamA,
		"--addr=" + strings.Join(cl.addrs, ","), "--timeout=60s", "--connect-timeout=60s"}, cl.clientFlags()...)
	cmd := exec.Command(binary, args...)
	var stderr syncBuffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { cmd.Wait(); close(done) }()
	t.Cleanup(func() { cmd.Process.Kill(); <-done })

	eventually(t, "acquire --wait to report the queue", 60*time.Second, func() error {
		if !strings.Contains(stderr.String(), "waiting in queue (") {
			return fmt.Errorf("stderr so far: %q", stderr.String())
		}
		return nil
	})
	cmd.Process.Signal(syscall.SIGINT)
	select {
	case <-done:
	case <-time.After(60 * time.Second):
		t.Fatalf("acquire --wait still runs 60s after SIGINT; stderr:\n%s", stderr.String())
	}
	if code := cmd.ProcessState.ExitCode(); code != 130 {
		t.Errorf("acquire --wait after SIGINT: exit %d, want 130; stderr:\n%s", code, stderr.String())
	}
	m := regexp.MustCompile(`interrupted: stopped waiting: request (\S+) left the queue`).FindStringSubmatch(stderr.String())
	if m == nil {
		t.Fatalf("acquire --wait after SIGINT does not name its request; stderr:\n%s", stderr.String())
	}
	leases, err := cl.c.Lease.List(ctxFor(t, 30*time.Second), &gpupoolv1.ListLeasesRequest{Tenant: "team-a", IncludeEnded: true})
	if err != nil {
		t.Fatal(err)
	}
	var named []string
	for _, l := range leases.Leases {
		if l.RequestId == m[1] {
			named = append(named, l.Id)
		}
	}
	if len(named) != 1 {
		t.Errorf("team-a's leases of request %s: got %v, want the one pending lease it queued", m[1], named)
	}
}
