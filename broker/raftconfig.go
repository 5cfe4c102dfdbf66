package broker

import (
	"io"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/raft"
)

// Raft's timings and batching on every broker. They are the same on every
// server of a cluster (they are not negotiated), and these invariants hold:
//
//   - RaftLeaderLeaseTimeout < RaftElectionTimeout: a leader cut off from
//     its quorum steps down before any other server can have been
//     elected, which the renewals answered from the leader's memory rely
//     on (see verify.go);
//   - pre-vote stays on (hashicorp/raft's default): a server that was cut
//     off and comes back does not depose a healthy leader by bumping the
//     term;
//   - the leader heartbeats every RaftHeartbeatTimeout/10 (hashicorp/raft),
//     so a follower calls an election only after ten heartbeats in a row
//     went missing: a busy CPU delays heartbeats by milliseconds, not by
//     the half second that takes.
const (
	// RaftHeartbeatTimeout is how long a follower goes without hearing
	// from the leader before it calls an election (hashicorp/raft waits
	// a random 1-2x of it). It is most of a failover's time.
	RaftHeartbeatTimeout = 500 * time.Millisecond
	// RaftElectionTimeout is how long a candidate waits for votes before
	// it tries again (also randomized 1-2x).
	RaftElectionTimeout = 500 * time.Millisecond
	// RaftLeaderLeaseTimeout is how long a leader keeps leading without
	// hearing from a quorum.
	RaftLeaderLeaseTimeout = 400 * time.Millisecond
	// RaftCommitTimeout is how long the leader waits without new entries
	// before it tells followers the commit index anyway.
	RaftCommitTimeout = 50 * time.Millisecond
	// RaftMaxAppendEntries is the most entries the leader writes to its
	// log with one fsync and sends to a follower in one message (group
	// commit): the leader takes every command waiting, up to this many,
	// at once.
	RaftMaxAppendEntries = 512
)

// raftConfig is the configuration of this server's Raft: hashicorp/raft's
// defaults with the timings above and group commit.
func raftConfig(id string, notify chan<- bool, logOutput io.Writer) *raft.Config {
	conf := raft.DefaultConfig()
	conf.LocalID = raft.ServerID(id)
	conf.NotifyCh = notify
	conf.Logger = hclog.New(&hclog.LoggerOptions{Name: "raft", Level: hclog.Warn, Output: logOutput})
	conf.HeartbeatTimeout = RaftHeartbeatTimeout
	conf.ElectionTimeout = RaftElectionTimeout
	conf.LeaderLeaseTimeout = RaftLeaderLeaseTimeout
	conf.CommitTimeout = RaftCommitTimeout
	conf.MaxAppendEntries = RaftMaxAppendEntries
	// Proposers hand commands to a buffer of MaxAppendEntries instead of
	// waiting for the leader's loop to take each one, so the loop finds
	// a whole batch waiting. Apply's timeout then bounds only the
	// handoff to the buffer, which is all applyTimeout is for.
	conf.BatchApplyCh = true
	return conf
}
