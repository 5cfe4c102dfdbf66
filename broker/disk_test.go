package broker

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/gpupool/gpupool/client"
	"github.com/gpupool/gpupool/internal/clock"
	"github.com/gpupool/gpupool/internal/loopfs"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// slowDisk is a log store whose writes sleep delay first.
type slowDisk struct {
	raft.LogStore
	delay *atomic.Int64
}

func (s slowDisk) StoreLogs(logs []*raft.Log) error {
	time.Sleep(time.Duration(s.delay.Load()))
	return s.LogStore.StoreLogs(logs)
}

func (s slowDisk) StoreLog(l *raft.Log) error { return s.StoreLogs([]*raft.Log{l}) }

func TestALeaderWithASlowDiskHandsLeadershipOver(t *testing.T) {
	var delay atomic.Int64
	first := startServer(t, func(c *Config) {
		c.SlowDiskThreshold = 50 * time.Millisecond
		c.wrapLogStore = func(l raft.LogStore) raft.LogStore { return slowDisk{LogStore: l, delay: &delay} }
	})
	first.registerHost(t, "h1", 8, 81920)
	servers := []*Server{first.s}
	for range 2 {
		s, err := New(Config{DataDir: t.TempDir(), BindAddr: "127.0.0.1:0", RaftBindAddr: "127.0.0.1:0", Join: []string{first.s.Addr()},
			Clock: clock.NewFake(time.Unix(1_700_000_000, 0)), HeartbeatInterval: time.Second, HeartbeatTTL: time.Hour, LockDelay: time.Hour})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { s.Shutdown() })
		servers = append(servers, s)
	}
	waitFor(t, "three voters", func() bool {
		return len(first.s.raft.GetConfiguration().Configuration().Servers) == 3 && servers[2].fsm.State().Host("h1") != nil
	})
	c, err := client.Dial([]string{servers[0].Addr(), servers[1].Addr(), servers[2].Addr()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })

	delay.Store(int64(200 * time.Millisecond))
	// Keep writing until leadership moves: the leader sees its own writes
	// take longer than the threshold.
	deadline := time.Now().Add(30 * time.Second)
	for first.s.IsLeader() {
		if time.Now().After(deadline) {
			t.Fatal("the leader with a slow disk still leads after 30s of writes")
		}
		l, err := c.Lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: slice(256, 1)})
		if err == nil {
			_, _ = c.Lease.Release(ctx(t), &gpupoolv1.ReleaseRequest{LeaseId: l.Lease.Id})
		}
	}
	if got := testutilCounter(t, first.s, "gpupool_slow_disk_leadership_transfers_total"); got != 1 {
		t.Errorf("got %v slow-disk transfers counted, want 1", got)
	}
	// The cluster goes on granting under its new leader.
	waitFor(t, "a grant under the new leader", func() bool {
		_, err := c.Lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: slice(256, 1)})
		return err == nil
	})
}

// testutilCounter reads a counter of s's /metrics.
func testutilCounter(t *testing.T, s *Server, name string) float64 {
	t.Helper()
	mfs, err := s.Metrics().Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name && len(mf.Metric) > 0 {
			return mf.Metric[0].GetCounter().GetValue()
		}
	}
	t.Fatalf("no metric %s", name)
	return 0
}

func TestABrokerOnAFullDiskRefusesWritesAndRecoversBySelf(t *testing.T) {
	mnt := loopfs.Mount(t, 48)
	dir := filepath.Join(mnt, "broker")
	opts := func(c *Config) { c.DataDir = dir; c.DiskReserveMiB = 4 }
	ts := startServer(t, opts)
	ts.registerHost(t, "h1", 8, 81920)
	granted := 0
	acquire := func() error {
		// The client retries Unavailable until the deadline, then
		// returns the broker's last answer: a full disk costs each
		// refused call its whole deadline.
		c, cancel := context.WithTimeout(ctx(t), 5*time.Second)
		defer cancel()
		_, err := ts.c.Lease.Acquire(c, &gpupoolv1.AcquireRequest{Request: slice(256, 1)})
		if err == nil {
			granted++
		}
		return err
	}
	for range 5 {
		if err := acquire(); err != nil {
			t.Fatal(err)
		}
	}

	filler := filepath.Join(mnt, "filler")
	if _, err := loopfs.Fill(filler); err != nil {
		t.Fatal(err)
	}
	var err error
	waitFor(t, "an acquire refused for the full disk", func() bool {
		err = acquire()
		return err != nil
	})
	if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "disk full") || !strings.Contains(err.Error(), dir) {
		t.Fatalf("got %v, want Unavailable saying the data dir %s is full", err, dir)
	}
	if !ts.s.IsLeader() {
		t.Errorf("the broker stopped leading on a full disk; want it to refuse writes and stay leader")
	}

	if err := os.Remove(filler); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "an acquire once space returned", func() bool { return acquire() == nil })

	// Nothing is corrupt: the broker restarts on its data dir with every
	// lease it granted.
	want := len(ts.s.fsm.State().Leases())
	if want != granted {
		t.Errorf("got %d leases in the state, want the %d granted", want, granted)
	}
	if err := ts.s.Shutdown(); err != nil {
		t.Fatal(err)
	}
	again := startServer(t, opts)
	if got := len(again.s.fsm.State().Leases()); got != granted {
		t.Errorf("after a restart: got %d leases, want %d", got, granted)
	}
}

func TestALeaderOnAFullDiskHandsLeadershipOverAndCatchesUpWhenSpaceReturns(t *testing.T) {
	mnt := loopfs.Mount(t, 48)
	dir := filepath.Join(mnt, "broker")
	first := startServer(t, func(c *Config) { c.DataDir = dir; c.DiskReserveMiB = 4 })
	first.registerHost(t, "h1", 8, 81920)
	servers := []*Server{first.s}
	for range 2 {
		s, err := New(Config{DataDir: t.TempDir(), BindAddr: "127.0.0.1:0", RaftBindAddr: "127.0.0.1:0", Join: []string{first.s.Addr()},
			Clock: clock.NewFake(time.Unix(1_700_000_000, 0)), HeartbeatInterval: time.Second, HeartbeatTTL: time.Hour, LockDelay: time.Hour,
			SlowDiskThreshold: -1})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { s.Shutdown() })
		servers = append(servers, s)
	}
	waitFor(t, "three voters", func() bool {
		return len(first.s.raft.GetConfiguration().Configuration().Servers) == 3 && servers[2].fsm.State().Host("h1") != nil
	})
	// The first one shuts down first, while the others still answer:
	// when it leads again by the end, a leader's Raft pipeline to
	// followers already gone can wait on them for good.
	t.Cleanup(func() { first.s.Shutdown() })
	c, err := client.Dial([]string{servers[0].Addr(), servers[1].Addr(), servers[2].Addr()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	acquire := func() error {
		_, err := c.Lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: slice(256, 1)})
		return err
	}
	if err := acquire(); err != nil {
		t.Fatal(err)
	}

	filler := filepath.Join(mnt, "filler")
	if _, err := loopfs.Fill(filler); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the leader on a full disk handing leadership over", func() bool { return !first.s.IsLeader() })
	if got := testutilCounter(t, first.s, "gpupool_full_disk_leadership_transfers_total"); got < 1 {
		t.Errorf("got %v full-disk transfers counted, want at least 1", got)
	}
	// A follower with room leads and grants; the full one stays behind.
	waitFor(t, "a grant under the new leader", func() bool { return acquire() == nil })
	for range 3 {
		if err := acquire(); err != nil {
			t.Fatalf("an acquire under the new leader: %v", err)
		}
	}
	if first.s.IsLeader() {
		t.Fatal("the broker on a full disk leads again")
	}

	// Space returns: the full one catches up by itself.
	if err := os.Remove(filler); err != nil {
		t.Fatal(err)
	}
	var leader *Server
	for _, s := range servers[1:] {
		if s.IsLeader() {
			leader = s
		}
	}
	if leader == nil {
		t.Fatal("no leader among the followers with room")
	}
	want := leader.fsm.State().Index()
	waitFor(t, "the broker that was full catching up", func() bool { return first.s.fsm.State().Index() >= want })
	if got, want := len(first.s.fsm.State().Leases()), len(leader.fsm.State().Leases()); got != want {
		t.Errorf("the broker that was full has %d leases, the leader %d", got, want)
	}
}

// fakeFree is a data dir's free space, set by the test.
type fakeFree struct{ mib atomic.Uint64 }

func (f *fakeFree) read(string) (uint64, error) { return f.mib.Load(), nil }

// What the proposer admitted, the log writes: the log refuses only below
// half the reserve, so a write that found a little less room than its
// admission did (other writes landed between the two) does not fail,
// which would make the leader step down.
func TestTheLogWritesWhatTheProposerAdmitted(t *testing.T) {
	for _, tc := range []struct {
		name                 string
		freeMiB              uint64
		wantAdmit, wantWrite bool
	}{
		{"room to spare", 1000, true, true},
		{"exactly the reserve", 64, true, true},
		{"just below the reserve: no new command, but the log writes", 63, false, true},
		{"half the reserve", 32, false, true},
		{"below half the reserve: the log refuses too", 31, false, false},
		{"nothing free", 0, false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			free := &fakeFree{}
			free.mib.Store(tc.freeMiB)
			d := &diskLog{LogStore: raft.NewInmemStore(), dir: "/data", reserveMiB: 64, freeMiB: free.read}
			admitErr := d.checkSpace()
			if got := admitErr == nil; got != tc.wantAdmit {
				t.Errorf("checkSpace at %d MiB free = %v, want admitted %v", tc.freeMiB, admitErr, tc.wantAdmit)
			}
			writeErr := d.StoreLogs([]*raft.Log{{Index: 1, Term: 1, Data: []byte("x")}})
			if got := writeErr == nil; got != tc.wantWrite {
				t.Errorf("StoreLogs at %d MiB free = %v, want written %v", tc.freeMiB, writeErr, tc.wantWrite)
			}
			for _, err := range []error{admitErr, writeErr} {
				var full *DiskFullError
				if err != nil && (!errors.As(err, &full) || full.Dir != "/data" || full.ReserveMiB != 64) {
					t.Errorf("got %v, want a *DiskFullError naming /data and the 64 MiB reserve", err)
				}
			}
		})
	}
}

// A lone leader whose disk has less than the reserve free refuses every
// acquire at once with Unavailable naming the data dir, and keeps
// leading: Raft's own entries (a barrier here) still reach the log,
// where refusing them would make it step down and leave the cluster
// without a leader until space returns.
func TestALoneLeaderBelowTheReserveRefusesAtOnceAndKeepsLeading(t *testing.T) {
	free := &fakeFree{}
	free.mib.Store(1 << 20)
	dir := filepath.Join(t.TempDir(), "broker")
	ts := startServer(t, func(c *Config) { c.DataDir = dir; c.DiskReserveMiB = 64; c.freeMiB = free.read })
	ts.registerHost(t, "h1", 8, 81920)
	acquire := func() error {
		c, cancel := context.WithTimeout(ctx(t), 5*time.Second) // see above
		defer cancel()
		_, err := ts.c.Lease.Acquire(c, &gpupoolv1.AcquireRequest{Request: slice(256, 1)})
		return err
	}
	if err := acquire(); err != nil {
		t.Fatal(err)
	}
	free.mib.Store(40) // below the reserve, above half of it
	for range 3 {
		err := acquire()
		if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "disk full") || !strings.Contains(err.Error(), dir) {
			t.Fatalf("got %v, want Unavailable saying the data dir %s is full", err, dir)
		}
		if err := ts.s.raft.Barrier(10 * time.Second).Error(); err != nil {
			t.Fatalf("a leader barrier below the reserve: %v, want it written", err)
		}
		if !ts.s.IsLeader() {
			t.Fatal("the broker stopped leading below the reserve; want it to refuse writes and stay leader")
		}
	}
	free.mib.Store(1 << 20)
	if err := acquire(); err != nil {
		t.Fatalf("an acquire once space returned: %v", err)
	}
}
