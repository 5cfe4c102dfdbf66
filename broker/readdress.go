package broker

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/hashicorp/raft"
	"google.golang.org/grpc/metadata"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// addressUpdateKey marks a Join that only moves a server already in the
// Raft configuration to a new address: the leader refuses it for a server
// that is no longer configured (removed while it was down), so a restart
// on a new address never undoes a remove-peer.
const addressUpdateKey = "gpupool-address-update"

// configuredAddress returns this server's Raft address in the latest Raft
// configuration, and whether the configuration lists it at all.
func (m *membership) configuredAddress() (raft.ServerAddress, bool) {
	f := m.raft.GetConfiguration()
	if f.Error() != nil {
		return "", false
	}
	for _, srv := range f.Configuration().Servers {
		if string(srv.ID) == m.cfg.NodeID {
			return srv.Address, true
		}
	}
	return "", false
}

// keepOwnAddressCurrent runs once at start. A server restarted on its data
// dir with a Raft address other than the one in the Raft configuration
// (a pod recreated with a new IP, a changed --raft-bind) cannot be reached
// by the leader, which keeps dialling the old address; with every server
// moved once no leader could be elected. So it asks the leader, through any
// other server, to re-add it at its new address: AddVoter for an existing
// id replaces the address. The leader commits that with the other servers
// (a majority must be up and reachable at their configured addresses) and
// then replicates to the new address, so the followers learn it too. It
// returns once the configuration this server holds has the new address.
func (m *membership) keepOwnAddressCurrent() {
	if !m.clustered() {
		return // a new server: formCluster joins with the current address
	}
	cur := m.transport.LocalAddr()
	old, ok := m.configuredAddress()
	if !ok || old == cur {
		return // not configured (removed), or unchanged
	}
	m.log.Warn(fmt.Sprintf("raft address changed from %s to %s; asking the leader to update it", old, cur),
		"id", m.cfg.NodeID, "old", old, "new", cur)
	for backoff := 200 * time.Millisecond; ; backoff = min(2*backoff, 5*time.Second) {
		via, err := m.askAddressUpdate()
		if err == nil {
			// The leader committed the change; it arrives here with the
			// next replication to the new address.
			if m.waitOwnAddress(cur, 10*time.Second) {
				m.log.Info("raft configuration has this server's new address", "id", m.cfg.NodeID, "raft", cur, "via", via)
				return
			}
			err = fmt.Errorf("the leader accepted %s but this server has not received the new configuration yet", cur)
		}
		if addr, ok := m.configuredAddress(); !ok {
			m.log.Error("this server is no longer in the Raft configuration (removed while it was down?); start it with an empty data dir to join as a new server", "id", m.cfg.NodeID)
			return
		} else if addr == cur {
			m.log.Info("raft configuration has this server's new address", "id", m.cfg.NodeID, "raft", cur)
			return
		}
		m.log.Warn("raft address update not done yet; retrying", "id", m.cfg.NodeID, "new", cur, "err", err, "retry_in", backoff)
		select {
		case <-m.ctx.Done():
			return
		case <-time.After(backoff):
		}
	}
}

// askAddressUpdate sends one address-update Join: to itself when it leads
// (a single-server cluster, or it won an election before the update), else
// to each --join address and each other server's recorded gRPC address in
// turn; any server forwards it to the leader. It returns who accepted it.
func (m *membership) askAddressUpdate() (string, error) {
	req := &gpupoolv1.JoinRequest{Id: m.cfg.NodeID, RaftAddress: string(m.transport.LocalAddr()), RpcAddress: m.addr()}
	if m.isLeader() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		ctx = metadata.NewIncomingContext(ctx, metadata.Pairs(addressUpdateKey, "1"))
		if _, err := (clusterService{node: m.node, raft: m.raft, membership: m}).Join(ctx, req); err != nil {
			return "", err
		}
		return "self", nil
	}
	var lastErr error = fmt.Errorf("no other server's address is known: give --join")
	for _, addr := range m.updateTargets() {
		conn, err := m.connTo(addr)
		if err != nil {
			lastErr = err
			continue
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		ctx = metadata.AppendToOutgoingContext(m.withOwnToken(ctx), addressUpdateKey, "1")
		_, err = gpupoolv1.NewClusterServiceClient(conn).Join(ctx, req)
		cancel()
		if err == nil {
			return addr, nil
		}
		lastErr = fmt.Errorf("via %s: %w", addr, err)
		m.log.Debug("raft address update failed", "via", addr, "err", err)
	}
	return "", lastErr
}

// updateTargets lists other servers' gRPC addresses: --join first (stable
// names, in Kubernetes), then those recorded in the state (which may be
// stale when they moved too).
func (m *membership) updateTargets() []string {
	var out []string
	add := func(a string) {
		if a != "" && a != m.addr() && a != m.cfg.BindAddr && !slices.Contains(out, a) {
			out = append(out, a)
		}
	}
	for _, a := range m.cfg.Join {
		add(a)
	}
	for _, srv := range m.fsm.State().Servers() {
		if srv.Id != m.cfg.NodeID {
			add(srv.RpcAddress)
		}
	}
	return out
}

// waitOwnAddress polls until the configuration this server holds lists it
// at addr, for up to d.
func (m *membership) waitOwnAddress(addr raft.ServerAddress, d time.Duration) bool {
	deadline := time.Now().Add(d)
	for {
		if got, ok := m.configuredAddress(); ok && got == addr {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		select {
		case <-m.ctx.Done():
			return false
		case <-time.After(50 * time.Millisecond):
		}
	}
}
