package broker

import (
	"context"
	"net"
	"sync"

	"github.com/hashicorp/raft"
	"google.golang.org/grpc"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// membership knows the other servers of the cluster: it forms the
// cluster or joins it (cluster.go), keeps this server's own address
// current in the Raft configuration (readdress.go), holds the
// connections to the other servers and forwards calls to the leader
// (forward.go). It reads the leader's memory through leaderMemory only,
// to tell whether this server is ready to answer as leader.
type membership struct {
	*node
	leadership leaderMemory
	// leaders wakes the calls waiting for a leader to be elected.
	leaders *leaderWatch

	// raft, transport and listener are set by New before the server
	// serves, and never changed.
	raft      *raft.Raft
	transport *raft.NetworkTransport
	listener  net.Listener

	connMu sync.Mutex
	conns  map[string]*grpc.ClientConn // guarded by connMu; to other servers

	peerMu sync.Mutex
	peers  map[string]*gpupoolv1.ServerInfoResponse // guarded by peerMu; learned while forming
}

func newMembership(nd *node, lm leaderMemory) *membership {
	return &membership{
		node: nd, leadership: lm, leaders: newLeaderWatch(),
		conns: map[string]*grpc.ClientConn{},
		peers: map[string]*gpupoolv1.ServerInfoResponse{},
	}
}

// addr is the gRPC address the server listens on.
func (m *membership) addr() string { return m.listener.Addr().String() }

// isLeader reports whether Raft says this server leads now.
func (m *membership) isLeader() bool { return m.raft.State() == raft.Leader }

// closeConns closes the connections to the other servers; call it once
// nothing dials them any more (Shutdown, after the goroutines ended).
func (m *membership) closeConns() {
	m.connMu.Lock()
	defer m.connMu.Unlock()
	for _, c := range m.conns {
		c.Close()
	}
}

// peerAddresses tells where the other servers serve gRPC. It is
// implemented by membership.
type peerAddresses interface {
	// rpcAddrOf returns the gRPC address of server id: this server's
	// own, the one the state records, or the one learned while forming
	// the cluster; "" when none is known yet.
	rpcAddrOf(id string) string
	// askInfo asks the server at gRPC address addr who it is and where
	// it stands (its id, version, Raft state), within a short timeout.
	askInfo(addr string) (*gpupoolv1.ServerInfoResponse, error)
}

// dialLeader returns a connection to the server Raft says leads, or nil
// when no leader or no address for it is known yet; see leaderDialer.
func (m *membership) dialLeader() *grpc.ClientConn {
	_, id := m.raft.LeaderWithID()
	addr := m.rpcAddrOf(string(id))
	if addr == "" {
		return nil
	}
	conn, err := m.connTo(addr)
	if err != nil {
		return nil
	}
	return conn
}

// forwarder sends a call to the leader when this server does not lead.
// It is implemented by membership; every endpoint holds one.
type forwarder interface {
	// leaderConn returns a nil connection when this server leads and
	// serves the call itself; otherwise a connection to the leader and
	// the context to forward the call with (the caller's token, marked
	// forwarded). It waits a while for an election when there is no
	// leader, and refuses (ErrUnavailable) a call that was forwarded
	// here already, so a call is forwarded at most once.
	leaderConn(ctx context.Context) (*grpc.ClientConn, context.Context, error)
	// readConn is leaderConn for a read: stale reads are served here,
	// and a leader serves only once it has confirmed that it still
	// leads, so a read never misses a write it was told committed.
	readConn(ctx context.Context, stale bool) (*grpc.ClientConn, context.Context, error)
}

// clusterView is membership as the endpoints that also name other
// servers see it: the way to the leader, and where each server serves.
type clusterView interface {
	forwarder
	peerAddresses
}
