package broker

import (
	"github.com/gpupool/gpupool/broker/state"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/gpupool/gpupool/broker/fsm"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// Rolling upgrades. Each server reports the newest FSM command-set version
// its binary applies (ServerInfo's fsm_version); the leader records every
// server's report in the state (UpsertServerCommand's fsm_version) and
// proposes a command only once every recorded server applies its
// version (versionGate). A server that has not reported counts as
// version 1, the command set of the binaries that predate the reports.

// versionPollInterval is how often the leader asks every server for its
// version: an upgraded server is restarted in place, without a Join.
const versionPollInterval = 2 * time.Second

// versionGate is a Proposer that refuses a command whose type needs a
// newer command-set version than some server of the cluster reports.
type versionGate struct {
	next Proposer
	fsm  *fsm.FSM
	// need is the version a command type needs (fsm.CommandVersion when
	// nil; tests give their own).
	need func(fsm.MessageType) (uint32, bool)
}

func (g versionGate) Propose(cmd proto.Message) Proposal {
	t, err := fsm.TypeOf(cmd)
	if err != nil {
		return g.next.Propose(cmd) // the next layer reports it
	}
	versionOf := fsm.CommandVersion
	if g.need != nil {
		versionOf = g.need
	}
	need, _ := versionOf(t)
	need = max(need, fsm.FieldVersion(cmd))
	if need <= 1 {
		return g.next.Propose(cmd)
	}
	for _, srv := range g.fsm.State().Servers() {
		if have := fsm.ServerVersion(srv.FsmVersion); have < need {
			return failed{refusef(ErrPrecondition,
				"command %T needs every broker at FSM version %d or newer, and broker %s reports version %d: finish upgrading the brokers, then retry",
				cmd, need, srv.Id, have)}
		}
	}
	return g.next.Propose(cmd)
}

// recordServerVersions asks every configured server for its version and
// records those that changed. An unreachable server keeps the version
// recorded for it.
func (ld *leadership) recordServerVersions() {
	f := ld.raft.GetConfiguration()
	if f.Error() != nil {
		return
	}
	st := ld.fsm.State()
	for _, srv := range f.Configuration().Servers {
		id := string(srv.ID)
		cur := st.Server(id)
		if cur == nil {
			continue // upsertServers records it first
		}
		v := fsm.Version
		if id != ld.cfg.NodeID {
			info, err := ld.membership.askInfo(cur.RpcAddress)
			if err != nil || info.Id != id {
				continue
			}
			v = info.FsmVersion
		}
		if cur.FsmVersion == v {
			continue
		}
		up := proto.Clone(cur).(*gpupoolv1.UpsertServerCommand)
		up.FsmVersion = v
		if _, err := ld.apply(up); err != nil {
			ld.log.Warn("record server version", "id", id, "fsm_version", v, "err", err)
			continue
		}
		ld.log.Info("server reports its FSM version", "id", id, "fsm_version", fsm.ServerVersion(v), "was", fsm.ServerVersion(cur.FsmVersion))
	}
}

// watchServerVersions records the servers' versions now and then every
// versionPollInterval, until leadership ends.
func (ld *leadership) watchServerVersions(ls *leaderState) {
	t := time.NewTicker(versionPollInterval)
	defer t.Stop()
	for {
		ld.recordServerVersions()
		select {
		case <-ls.stopCh:
			return
		case <-ld.ctx.Done():
			return
		case <-t.C:
		}
	}
}

// keepVersion carries the recorded version of server id into an upsert
// of its addresses.
func keepVersion(st *state.Reader, cmd *gpupoolv1.UpsertServerCommand) *gpupoolv1.UpsertServerCommand {
	if cur := st.Server(cmd.Id); cur != nil {
		cmd.FsmVersion = cur.FsmVersion
	}
	return cmd
}
