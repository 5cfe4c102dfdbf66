package cluster_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// upgradeFrom is the older commit the upgrade test starts from: the main
// branch before snapshots and servers carried versions.
const upgradeFrom = "a648e863ac7e535e1440ed5c4f7edccebabc7c59"

// buildAt builds cmd/gpupool of commit rev of this repository into a
// temporary dir: git archive, then go build there.
func buildAt(t *testing.T, rev string) string {
	t.Helper()
	root, err := exec.Command("git", "rev-parse", "--show-toplevel").Output()
	if err != nil {
		t.Fatalf("the upgrade test builds an older commit of this repository and needs its git history: git rev-parse: %v", err)
	}
	repo := strings.TrimSpace(string(root))
	if out, err := exec.Command("git", "-C", repo, "cat-file", "-e", rev+"^{commit}").CombinedOutput(); err != nil {
		t.Fatalf("this clone lacks commit %s, the older version the upgrade test starts from (a shallow clone?): fetch it with 'git fetch --unshallow' or 'git fetch origin %s' (%v %s)", rev, rev, err, out)
	}
	dir := t.TempDir()
	src := filepath.Join(dir, "src")
	if err := os.MkdirAll(src, 0o755); err != nil {
		t.Fatal(err)
	}
	archive := exec.Command("sh", "-c", fmt.Sprintf("git -C %q archive %s | tar -x -C %q", repo, rev, src))
	if out, err := archive.CombinedOutput(); err != nil {
		t.Fatalf("git archive %s: %v\n%s", rev, err, out)
	}
	bin := filepath.Join(dir, "gpupool-"+rev[:7])
	build := exec.Command("go", "build", "-o", bin, "./cmd/gpupool")
	build.Dir = src
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build gpupool at %s: %v\n%s", rev, err, out)
	}
	return bin
}

// renewals renews leases every interval until stopped and keeps, per
// lease, the longest time between two successful renewals and the
// renewals refused (an answer with an error: the lease is gone).
type renewals struct {
	mu      sync.Mutex
	last    map[string]time.Time
	longest map[string]time.Duration
	refused []string
	ok      int
}

func renewForever(ctx context.Context, cl *cluster, ids []string, interval time.Duration) *renewals {
	r := &renewals{last: map[string]time.Time{}, longest: map[string]time.Duration{}}
	now := time.Now()
	for _, id := range ids {
		r.last[id] = now
	}
	go func() {
		for ctx.Err() == nil {
			for _, id := range ids {
				cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
				resp, err := keepAliveOnce(cctx, cl, id)
				cancel()
				r.mu.Lock()
				switch {
				case err != nil: // no answer (a broker restarting): try again
				case resp.Error != "":
					r.refused = append(r.refused, fmt.Sprintf("%s: %s", id, resp.Error))
				default:
					t := time.Now()
					r.longest[id] = max(r.longest[id], t.Sub(r.last[id]))
					r.last[id] = t
					r.ok++
				}
				r.mu.Unlock()
			}
			select {
			case <-ctx.Done():
			case <-time.After(interval):
			}
		}
	}()
	return r
}

func keepAliveOnce(ctx context.Context, cl *cluster, id string) (*gpupoolv1.KeepAliveResponse, error) {
	ka, err := cl.c.Lease.KeepAlive(ctx)
	if err != nil {
		return nil, err
	}
	defer ka.CloseSend()
	if err := ka.Send(&gpupoolv1.KeepAliveRequest{LeaseId: id}); err != nil {
		return nil, err
	}
	for {
		resp, err := ka.Recv()
		if err != nil {
			return nil, err
		}
		if resp.Event == nil && resp.LeaseId == id {
			return resp, nil
		}
	}
}

// TestRollingUpgradeFromAnOlderReleaseKeepsEveryLease starts a cluster
// of the binary of an older commit with leases held and renewed, saves
// a snapshot with it, replaces the brokers one at a time with the current
// build, then the agent, and checks that no lease was lost or refused a
// renewal, that the new brokers replayed the old log and report their
// version, and that the current build restores the old snapshot.
func TestRollingUpgradeFromAnOlderReleaseKeepsEveryLease(t *testing.T) {
	if os.Getenv("GPUPOOL_UPGRADE_TEST") != "1" {
		t.Skip("builds an older commit of this repository; run make test-upgrade (or set GPUPOOL_UPGRADE_TEST=1)")
	}
	old := buildAt(t, upgradeFrom)
	current := binary
	binary, olderAgents = old, true
	t.Cleanup(func() { binary, olderAgents = current, false })
	cl := newCluster(t, 1)
	addr := "--addr=" + strings.Join(cl.addrs, ",")

	const ttl = 20 * time.Second
	var ids []string
	fences := map[string]uint64{}
	for i := range 3 {
		req := fractional(4096, 10, fmt.Sprintf("upgrade-%d", i))
		req.Request.TtlMs = ttl.Milliseconds()
		resp, err := cl.c.Lease.Acquire(ctxFor(t, 30*time.Second), req)
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, resp.Lease.Id)
		fences[resp.Lease.Id] = resp.Lease.FencingToken
	}
	snap := filepath.Join(t.TempDir(), "old.snap")
	if out, stderr, code := gpupool(t, "operator", "snapshot", "save", snap, addr); code != 0 {
		t.Fatalf("snapshot save with the old binary: exit %d\n%s%s", code, out, stderr)
	}

	ctx, stop := context.WithCancel(context.Background())
	defer stop()
	ren := renewForever(ctx, cl, ids, time.Second)

	// The new build from here on, one process at a time.
	binary = current
	upgrade := func(p *proc, ready func() error) {
		t.Helper()
		p.signal(t, syscall.SIGTERM)
		p.start(t)
		eventually(t, p.name+" back on the current build", 90*time.Second, ready)
	}
	for i, b := range cl.brokers {
		upgrade(b, func() error {
			info, err := gpupoolv1.NewClusterServiceClient(cl.dial(cl.addrs[i]).Conn()).ServerInfo(ctxFor(t, 5*time.Second), &gpupoolv1.ServerInfoRequest{})
			switch {
			case err != nil:
				return err
			case info.FsmVersion == 0:
				return fmt.Errorf("%s still runs the old build", b.name)
			case info.LeaderId == "":
				return fmt.Errorf("%s knows no leader yet", b.name)
			}
			return nil
		})
		cl.leader()
		t.Logf("%s upgraded", b.name)
	}
	for _, a := range cl.agents {
		upgrade(a, func() error {
			cl.waitForHosts(len(cl.agents))
			return nil
		})
		t.Logf("%s upgraded", a.name)
	}
	// A few more renewals on the upgraded cluster.
	ren.mu.Lock()
	seen := ren.ok
	ren.mu.Unlock()
	eventually(t, "renewals on the upgraded cluster", 60*time.Second, func() error {
		ren.mu.Lock()
		defer ren.mu.Unlock()
		if ren.ok < seen+2*len(ids) {
			return fmt.Errorf("%d renewals since the upgrade", ren.ok-seen)
		}
		return nil
	})
	stop()

	ren.mu.Lock()
	defer ren.mu.Unlock()
	if len(ren.refused) > 0 {
		t.Errorf("renewals refused during the upgrade: %v", ren.refused)
	}
	for _, id := range ids {
		l := cl.getLease(id)
		if l.State != gpupoolv1.LeaseState_LEASE_STATE_GRANTED || l.FencingToken != fences[id] {
			t.Errorf("lease %s after the upgrade: got %v fence %d, want granted fence %d", id, l.State, l.FencingToken, fences[id])
		}
		if ren.longest[id] >= ttl {
			t.Errorf("lease %s went %s without a renewal, longer than its TTL %s", id, ren.longest[id], ttl)
		}
		t.Logf("lease %s: longest time between renewals %s (TTL %s)", id, ren.longest[id].Round(time.Millisecond), ttl)
	}
	t.Logf("%d renewals acknowledged, none refused", ren.ok)

	// The current build restores the snapshot the old one saved.
	if out, stderr, code := gpupool(t, "operator", "snapshot", "restore", snap, "--yes", addr); code != 0 {
		t.Fatalf("snapshot restore of the old binary's snapshot: exit %d\n%s%s", code, out, stderr)
	}
	for _, id := range ids {
		if l := cl.getLease(id); l.State != gpupoolv1.LeaseState_LEASE_STATE_GRANTED {
			t.Errorf("lease %s after restoring the old snapshot: got %v, want granted", id, l.State)
		}
	}
}
