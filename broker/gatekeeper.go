package broker

import "google.golang.org/grpc"

// gatekeeper checks every call's ACL token (acl.go): who the caller is,
// whether the token is still valid, and what it may call. It reads the
// tokens from the state, and reaches the leader through leaderDialer
// only to catch up with it when a token is not here yet.
type gatekeeper struct {
	*node
	membership leaderDialer
	leadership leaderMemory
}

// leaderDialer is how the gatekeeper reaches the leader. It is
// implemented by membership.
type leaderDialer interface {
	// isLeader reports whether Raft says this server leads now.
	isLeader() bool
	// dialLeader returns a connection to the server Raft says leads, or
	// nil when no leader or no address for it is known yet. The
	// connection is shared: the caller must not close it.
	dialLeader() *grpc.ClientConn
}
