package broker

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/hashicorp/raft"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"

	"github.com/gpupool/gpupool/broker/fsm"
	"github.com/gpupool/gpupool/internal/version"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
	"github.com/gpupool/gpupool/protocol"
)

// clustered reports whether this server has a Raft configuration: it
// bootstrapped, joined, or restarted from a data dir that had one.
func (m *membership) clustered() bool {
	f := m.raft.GetConfiguration()
	return f.Error() == nil && len(f.Configuration().Servers) > 0
}

func (m *membership) selfInfo() *gpupoolv1.ServerInfoResponse {
	info := &gpupoolv1.ServerInfoResponse{
		Id:              m.cfg.NodeID,
		RaftAddress:     string(m.transport.LocalAddr()),
		RpcAddress:      m.addr(),
		Clustered:       m.clustered(),
		BootstrapExpect: int32(m.cfg.BootstrapExpect),
		AppliedIndex:    m.fsm.State().Index(),
		FsmVersion:      fsm.Version,
	}
	if _, id := m.raft.LeaderWithID(); id != "" {
		info.LeaderId = string(id)
		info.LeaderRpcAddress = m.rpcAddrOf(string(id))
	}
	info.RaftState = strings.ToLower(m.raft.State().String())
	fmt.Sscan(m.raft.Stats()["term"], &info.Term)
	info.LastContactMs = -1
	if m.raft.State() == raft.Leader {
		info.LastContactMs = 0
	} else if t := m.raft.LastContact(); !t.IsZero() {
		info.LastContactMs = time.Since(t).Milliseconds()
	}
	info.Version = version.Get().Version
	if f := m.raft.GetConfiguration(); f.Error() == nil {
		for _, srv := range f.Configuration().Servers {
			info.Peers = append(info.Peers, &gpupoolv1.ClusterPeer{
				Id: string(srv.ID), RaftAddress: string(srv.Address),
				RpcAddress: m.rpcAddrOf(string(srv.ID)), Voter: srv.Suffrage == raft.Voter,
			})
		}
	}
	return info
}

// formCluster bootstraps a new cluster once --bootstrap-expect servers
// know of each other, or joins an existing one through any --join server.
// It returns once this server is part of a cluster.
func (m *membership) formCluster() {
	for !m.clustered() {
		infos := map[string]*gpupoolv1.ServerInfoResponse{m.cfg.NodeID: m.selfInfo()}
		for _, addr := range m.cfg.Join {
			if addr == m.addr() || addr == m.cfg.BindAddr {
				continue
			}
			info, err := m.askInfo(addr)
			if err != nil {
				m.log.Debug("waiting for server", "addr", addr, "err", err)
				continue
			}
			m.rememberPeer(info)
			if info.Clustered && info.LeaderId != "" {
				if err := m.joinVia(addr); err != nil {
					m.log.Warn("join failed; retrying", "via", addr, "err", err)
					continue
				}
				m.log.Info("joined cluster", "via", addr, "leader", info.LeaderId)
				return
			}
			if !info.Clustered {
				infos[info.Id] = info
			}
		}
		if m.canBootstrap(infos) {
			var conf raft.Configuration
			for _, id := range sortedKeys(infos) {
				conf.Servers = append(conf.Servers, raft.Server{
					Suffrage: raft.Voter, ID: raft.ServerID(id), Address: raft.ServerAddress(infos[id].RaftAddress),
				})
			}
			err := m.raft.BootstrapCluster(conf).Error()
			if err != nil && !errors.Is(err, raft.ErrCantBootstrap) {
				m.log.Error("bootstrap failed", "err", err)
			} else {
				m.log.Info("bootstrapped cluster", "servers", strings.Join(sortedKeys(infos), ","))
				return
			}
		}
		select {
		case <-m.ctx.Done():
			return
		case <-time.After(300 * time.Millisecond):
		}
	}
}

// canBootstrap reports whether this server may bootstrap a cluster of the
// servers in infos: exactly --bootstrap-expect of them, all expecting that
// many. With more servers in sight, different servers could pick different
// sets and form two clusters, so it refuses and says why.
func (m *membership) canBootstrap(infos map[string]*gpupoolv1.ServerInfoResponse) bool {
	want := m.cfg.BootstrapExpect
	if want == 0 || len(infos) < want {
		return false
	}
	if len(infos) > want {
		m.log.Error("not bootstrapping: more unclustered servers than --bootstrap-expect; give every server the same --bootstrap-expect and --join list",
			"expect", want, "servers", strings.Join(sortedKeys(infos), ","))
		return false
	}
	for id, info := range infos {
		if int(info.BootstrapExpect) != want {
			m.log.Error("not bootstrapping: servers disagree on --bootstrap-expect", "server", id, "theirs", info.BootstrapExpect, "ours", want)
			return false
		}
	}
	return true
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}

func (m *membership) rememberPeer(info *gpupoolv1.ServerInfoResponse) {
	m.peerMu.Lock()
	defer m.peerMu.Unlock()
	m.peers[info.Id] = info
}

func (m *membership) askInfo(addr string) (*gpupoolv1.ServerInfoResponse, error) {
	conn, err := m.connTo(addr)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	return gpupoolv1.NewClusterServiceClient(conn).ServerInfo(ctx, &gpupoolv1.ServerInfoRequest{})
}

func (m *membership) joinVia(addr string) error {
	conn, err := m.connTo(addr)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err = gpupoolv1.NewClusterServiceClient(conn).Join(m.withOwnToken(ctx), &gpupoolv1.JoinRequest{
		Id: m.cfg.NodeID, RaftAddress: string(m.transport.LocalAddr()), RpcAddress: m.addr(),
	})
	return err
}

// connTo returns a cached connection to another server.
func (m *membership) connTo(addr string) (*grpc.ClientConn, error) {
	m.connMu.Lock()
	defer m.connMu.Unlock()
	if c, ok := m.conns[addr]; ok {
		return c, nil
	}
	c, err := grpc.NewClient(addr, append(m.peerDialOptions(), protocol.Reconnect)...)
	if err != nil {
		return nil, err
	}
	m.conns[addr] = c
	return c, nil
}

// rpcAddrOf returns a server's gRPC address from the replicated state, or
// from what this server learned while forming the cluster.
func (m *membership) rpcAddrOf(id string) string {
	if id == m.cfg.NodeID {
		return m.addr()
	}
	if srv := m.fsm.State().Server(id); srv != nil {
		return srv.RpcAddress
	}
	m.peerMu.Lock()
	defer m.peerMu.Unlock()
	if p, ok := m.peers[id]; ok {
		return p.RpcAddress
	}
	return ""
}

// clusterService implements the servers' own ClusterService.
type clusterService struct {
	gpupoolv1.UnimplementedClusterServiceServer
	*node
	raft       *raft.Raft
	membership *membership
}

func (c clusterService) ServerInfo(context.Context, *gpupoolv1.ServerInfoRequest) (*gpupoolv1.ServerInfoResponse, error) {
	return c.membership.selfInfo(), nil
}

func (c clusterService) Join(ctx context.Context, req *gpupoolv1.JoinRequest) (*gpupoolv1.JoinResponse, error) {
	if req.Id == "" || req.RaftAddress == "" || req.RpcAddress == "" {
		return nil, refuse(ErrInvalid, "join: id, raft_address and rpc_address are required")
	}
	md, _ := metadata.FromIncomingContext(ctx)
	update := len(md.Get(addressUpdateKey)) > 0
	if conn, fctx, err := c.membership.leaderConn(ctx); err != nil {
		return nil, err
	} else if conn != nil {
		if update {
			fctx = metadata.AppendToOutgoingContext(fctx, addressUpdateKey, "1")
		}
		return gpupoolv1.NewClusterServiceClient(conn).Join(fctx, req)
	}
	// An address update is for a server that is still configured: one
	// removed while it was down must come back with an empty data dir.
	var old raft.ServerAddress
	if update {
		f := c.raft.GetConfiguration()
		if err := f.Error(); err != nil {
			return nil, raftError(err)
		}
		found := false
		for _, srv := range f.Configuration().Servers {
			if string(srv.ID) == req.Id {
				found, old = true, srv.Address
			}
		}
		if !found {
			return nil, refusef(ErrPrecondition, "server %q is not in the Raft configuration (removed?); start it with an empty data dir to join as a new server", req.Id)
		}
	}
	// For an id already configured, AddVoter replaces its address.
	if err := c.raft.AddVoter(raft.ServerID(req.Id), raft.ServerAddress(req.RaftAddress), 0, 0).Error(); err != nil {
		return nil, raftError(err)
	}
	if _, err := c.apply(keepVersion(c.fsm.State(), &gpupoolv1.UpsertServerCommand{Id: req.Id, RpcAddress: req.RpcAddress, RaftAddress: req.RaftAddress})); err != nil {
		return nil, err
	}
	if update {
		c.log.Info("server address updated", "id", req.Id, "old_raft", old, "raft", req.RaftAddress, "rpc", req.RpcAddress)
	} else {
		c.log.Info("server joined", "id", req.Id, "raft", req.RaftAddress, "rpc", req.RpcAddress)
	}
	return &gpupoolv1.JoinResponse{}, nil
}
