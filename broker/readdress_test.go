package broker

import "testing"

// A server restarted on its data dir with another Raft address gets the
// configuration updated; a single server does it itself once it leads.
func TestRestartOnANewRaftAddressUpdatesTheConfiguration(t *testing.T) {
	dir := t.TempDir()
	start := func() *Server {
		t.Helper()
		s, err := New(Config{DataDir: dir, BindAddr: "127.0.0.1:0", RaftBindAddr: "127.0.0.1:0", BootstrapExpect: 1})
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	s := start()
	waitFor(t, "leadership", func() bool { return s.leadership.currentLeader() != nil })
	first := s.transport.LocalAddr()
	if err := s.Shutdown(); err != nil {
		t.Fatal(err)
	}

	s = start() // :0 again: the kernel picks another port
	defer s.Shutdown()
	now := s.transport.LocalAddr()
	if now == first {
		t.Skipf("the kernel gave the same port %s twice", now)
	}
	waitFor(t, "the configuration to list "+string(now), func() bool {
		addr, ok := s.membership.configuredAddress()
		return ok && addr == now
	})
	waitFor(t, "the servers table to record "+string(now), func() bool {
		srv := s.fsm.State().Server(s.ID())
		return srv != nil && srv.RaftAddress == string(now) && srv.RpcAddress == s.Addr()
	})
	if _, id := s.raft.LeaderWithID(); string(id) != s.ID() {
		t.Fatalf("leader %q, want %q", id, s.ID())
	}
}
