package client

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// Outcome is what happened when the client asked one broker about itself.
type Outcome string

// Outcomes of a probe, from worst to best.
const (
	// OutcomeRefused: nothing listens at the address (connection refused).
	OutcomeRefused Outcome = "refused"
	// OutcomeTLS: the TLS handshake failed (a certificate one side refused,
	// or TLS against plaintext).
	OutcomeTLS Outcome = "TLS failure"
	// OutcomeTimeout: no answer before the probe's deadline.
	OutcomeTimeout Outcome = "timeout"
	// OutcomeError: another failure; Member.Detail says which.
	OutcomeError Outcome = "error"
	// OutcomeNoLeader: the broker answers but knows no leader.
	OutcomeNoLeader Outcome = "up, no leader"
	// OutcomeUp: the broker answers and knows the leader.
	OutcomeUp Outcome = "up"
)

// Reachable reports whether the broker answered.
func (o Outcome) Reachable() bool { return o == OutcomeNoLeader || o == OutcomeUp }

// Member is one broker server as the client sees it: every server of the
// Raft configuration a reachable broker knows, and every address the
// client was given, whether it answers or not.
type Member struct {
	// ID is the server's Raft id; "" for an address that never answered
	// and that no reachable broker knows.
	ID string
	// Addr is the gRPC address the client probed (or would probe).
	Addr string
	// RaftAddr is the server's Raft address, when known.
	RaftAddr string
	// Voter is true for voting members of the Raft configuration.
	Voter bool
	// Outcome is what the probe found; Detail is its error, if any.
	Outcome Outcome
	Detail  string
	// What a reachable server says of itself (zero otherwise): its Raft
	// role ("leader", "follower", "candidate"), term, the time since it
	// last heard from a leader (0 on the leader, -1 never), the leader it
	// knows, and its build version.
	Role        string
	Term        uint64
	LastContact time.Duration
	LeaderID    string
	Version     string

	peers []*gpupoolv1.ClusterPeer // what the server said, nil if unreachable
}

// ClusterError is the error of a call that found no working cluster
// within the connect budget (Options.ConnectTimeout): it names each
// broker and what happened to it. Its gRPC code is Unavailable.
type ClusterError struct {
	// Members are every broker tried and every server a reachable broker
	// named, sorted by id then address.
	Members []Member
	// Voters is the size of the Raft configuration, 0 when no broker
	// answered.
	Voters int
	// Budget is the connect budget that ran out; 0 when the call failed
	// before, because no broker could answer (every one refused).
	Budget time.Duration
	// Last is the call's last error.
	Last error
}

// LostQuorum reports whether brokers answer, but fewer than a majority of
// the configuration: no leader can be elected until more come back.
func (e *ClusterError) LostQuorum() bool {
	n := len(e.reachable())
	return n > 0 && e.Voters > 0 && n < e.Voters/2+1
}

func (e *ClusterError) reachable() []string {
	var out []string
	for _, m := range e.Members {
		if m.Outcome.Reachable() {
			out = append(out, m.name())
		}
	}
	return out
}

func (e *ClusterError) Error() string {
	reach := e.reachable()
	var head string
	switch {
	case e.LostQuorum():
		head = fmt.Sprintf("lost quorum: %d of %d brokers reachable (%s); a majority (%d) is needed", len(reach), e.Voters, strings.Join(reach, ", "), e.Voters/2+1)
	case len(reach) == 0 && e.Budget == 0:
		head = "no broker reachable"
	case len(reach) == 0:
		head = fmt.Sprintf("no broker reachable within %s", e.Budget)
	case !slices.ContainsFunc(e.Members, func(m Member) bool { return m.Outcome == OutcomeUp }):
		head = fmt.Sprintf("no leader elected within %s (%d of %d brokers reachable)", e.Budget, len(reach), max(e.Voters, len(e.Members)))
	default:
		msg := ""
		if st, ok := status.FromError(e.Last); ok {
			msg = st.Message()
		} else if e.Last != nil {
			msg = e.Last.Error()
		}
		head = fmt.Sprintf("the brokers answer, but the call kept failing for %s: %s", e.Budget, msg)
	}
	parts := make([]string, 0, len(e.Members))
	for _, m := range e.Members {
		parts = append(parts, m.describe())
	}
	return head + ": " + strings.Join(parts, "; ")
}

// GRPCStatus makes status.Code(err) Unavailable.
func (e *ClusterError) GRPCStatus() *status.Status { return status.New(codes.Unavailable, e.Error()) }

// Unwrap returns the call's last error.
func (e *ClusterError) Unwrap() error { return e.Last }

func (m Member) name() string {
	if m.ID != "" {
		return m.ID
	}
	return m.Addr
}

// describe is one broker's part of an error: "broker-2 (127.0.0.1:7643):
// refused".
func (m Member) describe() string {
	who := m.Addr
	if m.ID != "" {
		who = m.ID + " (" + m.Addr + ")"
		if m.Addr == "" {
			who = m.ID + " (address unknown)"
		}
	}
	switch m.Outcome {
	case OutcomeUp:
		return fmt.Sprintf("%s: up, %s, leader %s", who, m.Role, m.LeaderID)
	case OutcomeNoLeader:
		return fmt.Sprintf("%s: up but no leader (%s, term %d)", who, m.Role, m.Term)
	case OutcomeError, OutcomeTLS:
		return fmt.Sprintf("%s: %s: %s", who, m.Outcome, m.Detail)
	}
	return fmt.Sprintf("%s: %s", who, m.Outcome)
}

// Members asks every broker the client was given, and every server of
// the Raft configuration they name, about itself, each within ctx. It
// needs no leader and no ACL token: it is how to see which brokers are
// down. The error is only ctx's.
func (c *Client) Members(ctx context.Context) ([]Member, error) {
	ms := c.probeAll(ctx)
	if err := ctx.Err(); err != nil && !slices.ContainsFunc(ms, func(m Member) bool { return m.Outcome.Reachable() }) {
		return ms, err
	}
	return ms, nil
}

// probeAll probes the given addresses, then the servers they name that
// were not among them, and merges what it learned.
func (c *Client) probeAll(ctx context.Context) []Member {
	probed := c.probe(ctx, c.addrs)
	byAddr := map[string]*Member{}
	for i := range probed {
		byAddr[probed[i].Addr] = &probed[i]
	}
	// The configuration as the most recent reachable server sees it.
	var peers []*gpupoolv1.ClusterPeer
	var best *Member
	for i, m := range probed {
		if m.Outcome.Reachable() && m.peers != nil && (best == nil || m.Term > best.Term) {
			best, peers = &probed[i], m.peers
		}
	}
	var more []string
	for _, p := range peers {
		if p.RpcAddress != "" && byAddr[p.RpcAddress] == nil {
			more = append(more, p.RpcAddress)
		}
	}
	if len(more) > 0 {
		for _, m := range c.probe(ctx, more) {
			probed = append(probed, m)
		}
		for i := range probed {
			byAddr[probed[i].Addr] = &probed[i]
		}
	}
	out := make([]Member, 0, len(probed))
	seen := map[string]bool{}
	for _, p := range peers {
		m := byAddr[p.RpcAddress]
		if m == nil {
			out = append(out, Member{ID: p.Id, RaftAddr: p.RaftAddress, Voter: p.Voter, Outcome: OutcomeError, Detail: "no gRPC address known", LastContact: -1})
			continue
		}
		seen[m.Addr] = true
		m.ID, m.RaftAddr, m.Voter = p.Id, p.RaftAddress, p.Voter
		out = append(out, *m)
	}
	for _, m := range probed {
		if !seen[m.Addr] {
			out = append(out, m)
		}
	}
	slices.SortFunc(out, func(a, b Member) int {
		if c := strings.Compare(a.ID, b.ID); c != 0 {
			return c
		}
		return strings.Compare(a.Addr, b.Addr)
	})
	for i := range out {
		out[i].peers = nil
	}
	return out
}

// probe asks each address about itself, in parallel, within ctx.
func (c *Client) probe(ctx context.Context, addrs []string) []Member {
	out := make([]Member, len(addrs))
	var wg sync.WaitGroup
	for i, a := range addrs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			out[i] = c.probeOne(ctx, a)
		}()
	}
	wg.Wait()
	return out
}

func (c *Client) probeOne(ctx context.Context, addr string) Member {
	m := Member{Addr: addr, LastContact: -1}
	conn, err := c.dialOne(addr)
	if err != nil {
		m.Outcome, m.Detail = OutcomeError, err.Error()
		return m
	}
	defer conn.Close()
	info, err := gpupoolv1.NewClusterServiceClient(conn).ServerInfo(ctx, &gpupoolv1.ServerInfoRequest{}, grpc.WaitForReady(false))
	if err != nil {
		m.Outcome, m.Detail = classify(addTLSHintIf(c.tls, err))
		return m
	}
	m.ID, m.RaftAddr = info.GetId(), info.GetRaftAddress()
	m.Role, m.Term, m.Version, m.LeaderID = info.GetRaftState(), info.GetTerm(), info.GetVersion(), info.GetLeaderId()
	m.LastContact = time.Duration(info.GetLastContactMs()) * time.Millisecond
	if info.GetLastContactMs() < 0 {
		m.LastContact = -1
	}
	m.Outcome = OutcomeUp
	if m.LeaderID == "" {
		m.Outcome = OutcomeNoLeader
	}
	m.peers = info.GetPeers()
	if m.peers == nil {
		m.peers = []*gpupoolv1.ClusterPeer{}
	}
	for _, p := range info.GetPeers() {
		if p.Id == m.ID {
			m.Voter = p.Voter
		}
	}
	return m
}

// addTLSHintIf adds the plaintext hint when the client dials without TLS.
func addTLSHintIf(tlsOn bool, err error) error {
	if tlsOn {
		return err
	}
	return addTLSHint(err)
}

// classify names a failed probe's outcome.
func classify(err error) (Outcome, string) {
	st, _ := status.FromError(err)
	msg := st.Message()
	switch {
	case errors.Is(err, context.DeadlineExceeded), st.Code() == codes.DeadlineExceeded, strings.Contains(msg, "i/o timeout"):
		return OutcomeTimeout, ""
	case IsTLSError(err):
		return OutcomeTLS, msg
	case strings.Contains(msg, "connection refused"):
		return OutcomeRefused, ""
	case strings.Contains(msg, "no such host"):
		return OutcomeError, "unknown host"
	}
	return OutcomeError, msg
}
