package broker

import (
	"fmt"
	"testing"
	"time"

	"github.com/gpupool/gpupool/broker/placement"
	"github.com/gpupool/gpupool/client"
	"github.com/gpupool/gpupool/internal/clock"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// rebuiltIndex is the dump of a pool index built afresh from s's state.
func rebuiltIndex(s *Server) string {
	return placement.NewIndex(s.fsm.State().HostsWithDevices(), nil).Dump()
}

func TestThePoolIndexAfterALeaderChangeEqualsOneRebuiltFromTheState(t *testing.T) {
	first := startServer(t)
	for i := range 3 {
		first.registerHost(t, fmt.Sprintf("h%d", i), 4, 81920)
	}
	acquire := func(c *client.Client, n int) {
		t.Helper()
		for i := range n {
			r := slice(int64(8192*(1+i%3)), int32(10*(1+i%3)))
			if _, err := c.Lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: r}); err != nil {
				t.Fatal(err)
			}
		}
	}
	acquire(first.c, 5)
	servers := []*Server{first.s}
	for range 2 {
		cfg := Config{DataDir: t.TempDir(), BindAddr: "127.0.0.1:0", RaftBindAddr: "127.0.0.1:0", Join: []string{first.s.Addr()},
			Clock: clock.NewFake(time.Unix(1_700_000_000, 0)), HeartbeatInterval: time.Second, HeartbeatTTL: time.Hour, LockDelay: time.Hour}
		s, err := New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { s.Shutdown() })
		servers = append(servers, s)
	}
	waitFor(t, "the followers to replicate the pool", func() bool {
		for _, s := range servers[1:] {
			if s.fsm.PoolIndex().Dump() != first.s.fsm.PoolIndex().Dump() {
				return false
			}
		}
		return true
	})
	if err := first.s.raft.LeadershipTransfer().Error(); err != nil {
		t.Fatalf("leadership transfer: %v", err)
	}
	var leader *Server
	waitFor(t, "a new leader", func() bool {
		for _, s := range servers[1:] {
			if s.IsLeader() && s.leadership.currentLeader() != nil {
				leader = s
				return true
			}
		}
		return false
	})
	c, err := client.Dial([]string{leader.Addr()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	acquire(c, 4)
	for _, s := range servers {
		waitFor(t, "every server to apply the new grants", func() bool { return s.fsm.State().Index() == leader.fsm.State().Index() })
		if got, want := s.fsm.PoolIndex().Dump(), rebuiltIndex(s); got != want {
			t.Errorf("server %s: the index kept up to date:\n%s\nwant the one rebuilt from its state:\n%s", s.ID(), got, want)
		}
	}
	if got := len(leader.fsm.State().Leases()); got != 9 {
		t.Errorf("got %d leases, want 9 (5 granted by the first leader, 4 by the second)", got)
	}
}
