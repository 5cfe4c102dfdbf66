package broker

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"

	"github.com/hashicorp/raft"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"

	"github.com/gpupool/gpupool/broker/fsm"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
	"github.com/gpupool/gpupool/protocol"
)

// operatorService implements OperatorService.
type operatorService struct {
	gpupoolv1.UnimplementedOperatorServiceServer
	*node
	raft       *raft.Raft
	leadership *leadership
	membership clusterView
	signing    *signing
	history    *usageHistory
}

func (e operatorService) RaftPeers(ctx context.Context, _ *gpupoolv1.RaftPeersRequest) (*gpupoolv1.RaftPeersResponse, error) {
	f := e.raft.GetConfiguration()
	if err := f.Error(); err != nil {
		return nil, raftError(err)
	}
	_, leader := e.raft.LeaderWithID()
	resp := &gpupoolv1.RaftPeersResponse{LeaderId: string(leader), AppliedIndex: e.raft.AppliedIndex()}
	stats := e.raft.Stats()
	fmt.Sscan(stats["term"], &resp.Term)
	fmt.Sscan(stats["commit_index"], &resp.CommitIndex)
	for _, srv := range f.Configuration().Servers {
		resp.Peers = append(resp.Peers, &gpupoolv1.RaftPeer{
			Id:          string(srv.ID),
			RaftAddress: string(srv.Address),
			RpcAddress:  e.membership.rpcAddrOf(string(srv.ID)),
			Leader:      srv.ID == leader,
			Voter:       srv.Suffrage == raft.Voter,
		})
	}
	return resp, nil
}

func (e operatorService) RemovePeer(ctx context.Context, req *gpupoolv1.RemovePeerRequest) (*gpupoolv1.RemovePeerResponse, error) {
	if req.Id == "" {
		return nil, refuse(ErrInvalid, "id: is required; see 'gpupool operator raft peers'")
	}
	if conn, fctx, err := e.membership.leaderConn(ctx); err != nil {
		return nil, err
	} else if conn != nil {
		return gpupoolv1.NewOperatorServiceClient(conn).RemovePeer(fctx, req)
	}
	f := e.raft.GetConfiguration()
	if err := f.Error(); err != nil {
		return nil, raftError(err)
	}
	var ids []string
	found := false
	for _, srv := range f.Configuration().Servers {
		ids = append(ids, string(srv.ID))
		found = found || string(srv.ID) == req.Id
	}
	if !found {
		return nil, refusef(ErrNotFound, "peer %q: not in the configuration; peers are %s", req.Id, strings.Join(ids, ", "))
	}
	if err := e.raft.RemoveServer(raft.ServerID(req.Id), 0, 0).Error(); err != nil {
		return nil, raftError(err)
	}
	return &gpupoolv1.RemovePeerResponse{}, nil
}

func (e operatorService) TransferLeadership(ctx context.Context, req *gpupoolv1.TransferLeadershipRequest) (*gpupoolv1.TransferLeadershipResponse, error) {
	if conn, fctx, err := e.membership.leaderConn(ctx); err != nil {
		return nil, err
	} else if conn != nil {
		return gpupoolv1.NewOperatorServiceClient(conn).TransferLeadership(fctx, req)
	}
	if req.ToId == e.cfg.NodeID {
		return &gpupoolv1.TransferLeadershipResponse{LeaderId: e.cfg.NodeID}, nil // already leads
	}
	var f raft.Future
	if req.ToId == "" {
		f = e.raft.LeadershipTransfer()
	} else {
		addr := ""
		for _, srv := range e.raft.GetConfiguration().Configuration().Servers {
			if string(srv.ID) == req.ToId {
				addr = string(srv.Address)
			}
		}
		if addr == "" {
			return nil, refusef(ErrNotFound, "to_id %q: no such peer; see 'gpupool operator raft peers'", req.ToId)
		}
		f = e.raft.LeadershipTransferToServer(raft.ServerID(req.ToId), raft.ServerAddress(addr))
	}
	if err := f.Error(); err != nil {
		return nil, raftError(err)
	}
	// Answer with the new leader once this server has heard from it; the
	// old leader steps down before the new one announces itself.
	deadline := time.NewTimer(10 * time.Second)
	defer deadline.Stop()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		if _, id := e.raft.LeaderWithID(); id != "" && string(id) != e.cfg.NodeID {
			return &gpupoolv1.TransferLeadershipResponse{LeaderId: string(id)}, nil
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-deadline.C:
			return &gpupoolv1.TransferLeadershipResponse{}, nil
		case <-tick.C:
		}
	}
}

// Snapshot files start with one header line, then the encoded state.
const snapshotMagic = "gpupool-snapshot v1"

const snapshotChunk = 256 << 10

// SnapshotSave streams the leader's state after a barrier, so the
// snapshot holds every write acknowledged before the call.
func (e operatorService) SnapshotSave(req *gpupoolv1.SnapshotSaveRequest, stream grpc.ServerStreamingServer[gpupoolv1.SnapshotChunk]) error {
	if conn, fctx, err := e.membership.leaderConn(stream.Context()); err != nil {
		return err
	} else if conn != nil {
		out, err := gpupoolv1.NewOperatorServiceClient(conn).SnapshotSave(fctx, req)
		if err != nil {
			return err
		}
		return proxyServerStream(stream, out)
	}
	if err := e.raft.Barrier(10 * time.Second).Error(); err != nil {
		return raftError(err)
	}
	st := e.fsm.State()
	data, err := st.Encode(fsm.SnapshotVersion)
	if err != nil {
		return err
	}
	index := st.Index()
	stream.SetTrailer(metadata.Pairs(protocol.SnapshotIndexTrailer, strconv.FormatUint(index, 10)))
	sum := sha256.Sum256(data)
	header := fmt.Sprintf("%s index=%d size=%d sha256=%s\n", snapshotMagic, index, len(data), hex.EncodeToString(sum[:]))
	all := append([]byte(header), data...)
	for len(all) > 0 {
		n := min(len(all), snapshotChunk)
		if err := stream.Send(&gpupoolv1.SnapshotChunk{Data: all[:n]}); err != nil {
			return err
		}
		all = all[n:]
	}
	return nil
}

// parseSnapshot checks a snapshot file and returns its encoded state.
func parseSnapshot(b []byte) ([]byte, error) {
	line, data, ok := bytes.Cut(b, []byte("\n"))
	if !ok || !bytes.HasPrefix(line, []byte(snapshotMagic+" ")) {
		return nil, errors.New("not a gpupool snapshot (missing header); make one with 'gpupool operator snapshot save'")
	}
	var index uint64
	var size int
	var sum string
	if _, err := fmt.Sscanf(string(line[len(snapshotMagic)+1:]), "index=%d size=%d sha256=%s", &index, &size, &sum); err != nil {
		return nil, fmt.Errorf("snapshot header %q: %v", line, err)
	}
	if len(data) != size {
		return nil, fmt.Errorf("snapshot is truncated or padded: header says %d bytes, found %d", size, len(data))
	}
	got := sha256.Sum256(data)
	if hex.EncodeToString(got[:]) != sum {
		return nil, errors.New("snapshot checksum mismatch: the file is damaged")
	}
	var st gpupoolv1.StateSnapshot
	if err := proto.Unmarshal(data, &st); err != nil {
		return nil, fmt.Errorf("snapshot body does not decode: %v", err)
	}
	return data, nil
}

// checkRestoreKeepsACL refuses, on a broker with ACL whose cluster is
// bootstrapped, a snapshot without the ACL bootstrap (saved before it, or
// on a cluster without ACL): after it, anyone could bootstrap again and
// own the cluster.
func (e operatorService) checkRestoreKeepsACL(data []byte) error {
	if !e.cfg.ACL || e.fsm.State().ACLBootstrapIndex() == 0 {
		return nil
	}
	var snap gpupoolv1.StateSnapshot
	if err := proto.Unmarshal(data, &snap); err != nil {
		return refuse(ErrInvalid, "snapshot: body does not decode: "+err.Error())
	}
	if snap.AclBootstrapIndex == 0 {
		return refuse(ErrPrecondition, "snapshot: it has no ACL bootstrap (saved before 'gpupool operator acl bootstrap', or on a cluster without ACL); "+
			"restoring it would let anyone bootstrap this cluster again and take it over: restore a snapshot saved after the bootstrap")
	}
	return nil
}

// SnapshotRestore replaces the cluster state with a saved snapshot.
func (e operatorService) SnapshotRestore(stream grpc.ClientStreamingServer[gpupoolv1.SnapshotChunk, gpupoolv1.SnapshotRestoreResponse]) error {
	var buf bytes.Buffer
	for {
		c, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return err
		}
		buf.Write(c.Data)
		if buf.Len() > 1<<30 {
			return refuse(ErrInvalid, "snapshot: larger than 1 GiB")
		}
	}
	data, err := parseSnapshot(buf.Bytes())
	if err != nil {
		return refuse(ErrInvalid, "snapshot: "+err.Error())
	}
	if conn, fctx, err := e.membership.leaderConn(stream.Context()); err != nil {
		return err
	} else if conn != nil {
		out, err := gpupoolv1.NewOperatorServiceClient(conn).SnapshotRestore(fctx)
		if err != nil {
			return err
		}
		raw := buf.Bytes()
		for len(raw) > 0 {
			n := min(len(raw), snapshotChunk)
			if err := out.Send(&gpupoolv1.SnapshotChunk{Data: raw[:n]}); err != nil {
				return err
			}
			raw = raw[n:]
		}
		resp, err := out.CloseAndRecv()
		if err != nil {
			return err
		}
		return stream.SendAndClose(resp)
	}
	if err := fsm.CheckSnapshot(data); err != nil {
		return refuse(ErrInvalid, "snapshot: "+err.Error())
	}
	if err := e.checkRestoreKeepsACL(data); err != nil {
		return err
	}
	meta := &raft.SnapshotMeta{Version: raft.SnapshotVersionMax, Size: int64(len(data))}
	if err := e.raft.Restore(meta, bytes.NewReader(data), time.Minute); err != nil {
		return raftError(err)
	}
	e.log.Warn("state restored from snapshot", "index", e.raft.AppliedIndex())
	return stream.SendAndClose(&gpupoolv1.SnapshotRestoreResponse{Index: e.raft.AppliedIndex()})
}

func (s *Server) registerServices() {
	watch := stateWatch{node: s.node, leadership: s.leadership, gatekeeper: s.gatekeeper}
	gpupoolv1.RegisterLeaseServiceServer(s.grpc, leaseService{node: s.node, capacity: s.capacity, leadership: s.leadership,
		membership: s.membership, limits: s.limits, metrics: s.metrics, watch: watch})
	gpupoolv1.RegisterPoolServiceServer(s.grpc, poolService{node: s.node, raft: s.raft, capacity: s.capacity,
		leadership: s.leadership, membership: s.membership, watch: watch})
	gpupoolv1.RegisterAgentServiceServer(s.grpc, agentService{node: s.node, leadership: s.leadership, membership: s.membership})
	gpupoolv1.RegisterOperatorServiceServer(s.grpc, operatorService{node: s.node, raft: s.raft, leadership: s.leadership,
		membership: s.membership, signing: s.signing, history: s.history})
	gpupoolv1.RegisterClusterServiceServer(s.grpc, clusterService{node: s.node, raft: s.raft, membership: s.membership})
	gpupoolv1.RegisterAclServiceServer(s.grpc, aclService{node: s.node, membership: s.membership})
	s.registerHealth()
}

func (e operatorService) RotateSigningKey(ctx context.Context, req *gpupoolv1.RotateSigningKeyRequest) (*gpupoolv1.RotateSigningKeyResponse, error) {
	if conn, fctx, err := e.membership.leaderConn(ctx); err != nil {
		return nil, err
	} else if conn != nil {
		return gpupoolv1.NewOperatorServiceClient(conn).RotateSigningKey(fctx, req)
	}
	k, until, err := e.signing.rotateSigningKey()
	if err != nil {
		return nil, err
	}
	e.log.Info("rotated the token signing key", "key", k.Id, "old_keys_verify_until", until.Format(time.RFC3339))
	return &gpupoolv1.RotateSigningKeyResponse{KeyId: k.Id, Keys: publicKeys(e.fsm.State(), e.cfg.Clock.Now())}, nil
}

func (e operatorService) ListSigningKeys(ctx context.Context, req *gpupoolv1.ListSigningKeysRequest) (*gpupoolv1.ListSigningKeysResponse, error) {
	if conn, fctx, err := e.membership.readConn(ctx, false); err != nil {
		return nil, err
	} else if conn != nil {
		return gpupoolv1.NewOperatorServiceClient(conn).ListSigningKeys(fctx, req)
	}
	return &gpupoolv1.ListSigningKeysResponse{Keys: publicKeys(e.fsm.State(), e.cfg.Clock.Now())}, nil
}
