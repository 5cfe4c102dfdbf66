package broker

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/hashicorp/raft"
	raftboltdb "github.com/hashicorp/raft-boltdb/v2"
	"go.etcd.io/bbolt"
	"google.golang.org/grpc"

	"github.com/gpupool/gpupool/internal/clock"
	"github.com/gpupool/gpupool/internal/pki"
)

// Config configures one broker server.
type Config struct {
	// NodeID names the server in the Raft configuration. Empty: the id
	// stored in the data dir, or a new one on first start.
	NodeID string
	// DataDir holds the Raft log (bbolt), snapshots and the node id.
	DataDir string
	// BindAddr is the gRPC address; RaftBindAddr the Raft transport's
	// (empty: BindAddr's port + 1).
	BindAddr     string
	RaftBindAddr string
	// BootstrapExpect is how many servers form a new cluster; 0 means this
	// server only joins an existing one.
	BootstrapExpect int
	// Join lists other servers' gRPC addresses.
	Join []string
	// Policy is one of Policies (placement.FGD by default).
	Policy string
	// PlacementWindow is accepted for compatibility and ignored: every
	// placement is the best of the whole pool, through the pool index.
	PlacementWindow int

	HeartbeatInterval time.Duration // how often agents heartbeat
	HeartbeatTTL      time.Duration // a host is down after this long without one
	LockDelay         time.Duration // capacity on a down host is freed after this long
	// PreemptGrace is how long a preempted lease (or an elastic lease's
	// extra taken back) keeps running after its notice.
	PreemptGrace time.Duration
	// PendingGrace is how long a pending lease waits for its client to
	// return after a leader change before it leaves the queue.
	PendingGrace time.Duration
	// ACL makes every RPC present a valid ACL token (see acl.go). Off,
	// the broker accepts everyone: tests and `gpupool dev` only.
	ACL bool
	// Token is this server's own ACL token, a management token, sent when
	// it asks to join a cluster whose ACL is bootstrapped (a new server,
	// or one whose address changed). Not needed to form a new cluster.
	Token string

	// TLS, when set, makes every connection mutual TLS: gRPC (clients,
	// agents and the other servers must present a certificate of the
	// cluster CA) and Raft (brokers only). Nil serves plaintext to anyone:
	// only for tests and 'gpupool dev' ('gpupool broker --insecure').
	TLS *pki.Source

	// UsageHistoryInterval is how often the server samples each tenant's
	// usage into its memory (DefaultUsageHistoryInterval when 0).
	UsageHistoryInterval time.Duration
	// UI configures the web console; its Bind empty serves none.
	UI UIConfig
	// Limits bounds what one caller may make the server do; nil is
	// DefaultLimits.
	Limits *Limits
	// DiskReserveMiB is the free space of the data dir's file system
	// below which the Raft log refuses writes (ErrDiskFull) until space
	// returns; 0 is DefaultDiskReserveMiB, negative none.
	DiskReserveMiB int
	// SlowDiskThreshold is the median Raft log write time above which a
	// leader hands leadership to a follower (see watchDisk); 0 is
	// DefaultSlowDiskThreshold, negative never.
	SlowDiskThreshold time.Duration

	// EndedLeaseRetention is how long an ended lease stays readable
	// (DefaultEndedLeaseRetention when 0), and EndedLeasesMax how many
	// ended leases are kept at most (DefaultEndedLeasesMax when 0); the
	// leader collects the others (see collect.go).
	EndedLeaseRetention time.Duration
	EndedLeasesMax      int

	Clock  clock.Clock
	Logger *slog.Logger

	// wrapProposer, set by the package's tests only, wraps the Raft
	// proposer in a test double (one that injects faults).
	wrapProposer func(Proposer) Proposer
	// wrapLogStore, set by the package's tests only, wraps the Raft log
	// store in a test double (a slow disk).
	wrapLogStore func(raft.LogStore) raft.LogStore
	// freeMiB, set by the package's tests only, stands for statfs in the
	// data dir's disk checks.
	freeMiB func(dir string) (uint64, error)
	// RaftLogOutput receives raft's own log (default: discarded below warn).
	RaftLogOutput io.Writer
	// AuditSink, when set, receives every audit entry this server applies,
	// one JSON object per line, for shipping elsewhere. A server replaying
	// its log after a restart writes the replayed entries again: (index,
	// seq) identifies an entry.
	AuditSink io.Writer
}

// Defaults for Config's durations.
const (
	DefaultHeartbeatInterval = 2 * time.Second
	DefaultHeartbeatTTL      = 10 * time.Second
	DefaultLockDelay         = 15 * time.Second
	DefaultPreemptGrace      = 30 * time.Second
	DefaultPendingGrace      = 30 * time.Second
)

func (c *Config) setDefaults() error {
	if c.DataDir == "" {
		return errors.New("broker: --data-dir is required")
	}
	if c.BindAddr == "" {
		return errors.New("broker: --bind is required")
	}
	if c.RaftBindAddr == "" {
		host, port, err := net.SplitHostPort(c.BindAddr)
		if err != nil {
			return fmt.Errorf("broker: --bind %q: %w", c.BindAddr, err)
		}
		p, err := strconv.Atoi(port)
		if err != nil || p == 0 {
			return fmt.Errorf("broker: --bind %q: needs an explicit port when --raft-bind is not set", c.BindAddr)
		}
		c.RaftBindAddr = net.JoinHostPort(host, strconv.Itoa(p+1))
	}
	if c.BootstrapExpect < 0 {
		return fmt.Errorf("broker: --bootstrap-expect %d: must be 0 (join only) or more", c.BootstrapExpect)
	}
	if c.BootstrapExpect == 0 && len(c.Join) == 0 {
		return errors.New("broker: set --bootstrap-expect N to form a new cluster, or --join to join one")
	}
	if c.Policy == "" {
		c.Policy = Policies[0]
	}
	if !slices.Contains(Policies, c.Policy) {
		return fmt.Errorf("broker: --policy %q: must be one of %s", c.Policy, strings.Join(Policies, ", "))
	}
	if c.PlacementWindow < 0 {
		return fmt.Errorf("broker: --placement-window %d: must be 0 (every host) or more", c.PlacementWindow)
	}
	if c.HeartbeatInterval <= 0 {
		c.HeartbeatInterval = DefaultHeartbeatInterval
	}
	if c.HeartbeatTTL <= 0 {
		c.HeartbeatTTL = DefaultHeartbeatTTL
	}
	if c.HeartbeatTTL <= c.HeartbeatInterval {
		return fmt.Errorf("broker: --heartbeat-ttl %s: must be longer than the heartbeat interval %s", c.HeartbeatTTL, c.HeartbeatInterval)
	}
	if c.LockDelay <= 0 {
		c.LockDelay = DefaultLockDelay
	}
	if c.PreemptGrace < 0 {
		return fmt.Errorf("broker: --preempt-grace %s: must not be negative", c.PreemptGrace)
	}
	if c.PreemptGrace == 0 {
		c.PreemptGrace = DefaultPreemptGrace
	}
	if c.PendingGrace <= 0 {
		c.PendingGrace = DefaultPendingGrace
	}
	if err := c.validateCollection(); err != nil {
		return err
	}
	if err := c.UI.validate(); err != nil {
		return err
	}
	if c.DiskReserveMiB == 0 {
		c.DiskReserveMiB = DefaultDiskReserveMiB
	}
	if c.SlowDiskThreshold == 0 {
		c.SlowDiskThreshold = DefaultSlowDiskThreshold
	}
	if c.Limits == nil {
		l := DefaultLimits()
		c.Limits = &l
	}
	if err := c.Limits.Validate(); err != nil {
		return err
	}
	if c.UsageHistoryInterval <= 0 {
		c.UsageHistoryInterval = DefaultUsageHistoryInterval
	}
	if c.Clock == nil {
		c.Clock = clock.Real
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	if c.RaftLogOutput == nil {
		c.RaftLogOutput = io.Discard
	}
	return nil
}

// Server is one broker server. It wires the components that do the work
// and owns what they share: Raft, its stores and transport, the gRPC
// server and the lifetime (node). The components talk through small
// interfaces (see docs/architecture.md):
//
//   - capacity decides what is placed and granted (Acquire, the queue);
//   - leadership keeps the leader's memory and runs its duties;
//   - membership knows the other servers and forwards to the leader;
//   - signing holds the token signing keys and signs lease tokens.
//
// The endpoints and the metrics collectors hold the components they use,
// never the Server.
type Server struct {
	*node
	raft *raft.Raft

	store     *raftboltdb.BoltStore
	disk      *diskLog // the Raft log: store with the disk checks
	transport *raft.NetworkTransport
	grpc      *grpc.Server
	listener  net.Listener

	capacity   *capacity
	leadership *leadership
	membership *membership
	signing    *signing
	gatekeeper *gatekeeper

	metrics *metrics
	// limits bound what one caller may make the server do.
	limits *limiters
	// history is each tenant's recent usage, this server's memory only.
	history *usageHistory
	// ui is the web console, nil unless Config.UI.Bind is set.
	ui *uiServer

	shutdownOnce sync.Once
}

// ErrDataDir wraps problems with the data dir that stop the server.
var ErrDataDir = errors.New("data dir")

const (
	nodeIDFile = "node-id"
	raftDir    = "raft"
	raftDBFile = "raft.db"
)

// New opens the data dir and starts Raft and the gRPC listener. The
// server serves until Shutdown.
func New(cfg Config) (*Server, error) {
	if err := cfg.setDefaults(); err != nil {
		return nil, err
	}
	nd := newNode(cfg)
	s := &Server{node: nd, history: newUsageHistory()}
	s.limits = newLimiters(*cfg.Limits, cfg.Clock.Now)
	s.signing = &signing{node: nd}
	s.leadership = newLeadership(nd)
	s.membership = newMembership(nd, s.leadership)
	s.gatekeeper = &gatekeeper{node: nd, membership: s.membership, leadership: s.leadership}
	s.leadership.membership, s.leadership.signing = s.membership, s.signing
	s.metrics = newMetrics(nd, s.leadership, s.membership, s.limits)
	s.leadership.metrics = s.metrics
	if err := s.openRaft(); err != nil {
		s.cancel(err)
		s.closeStores()
		return nil, err
	}
	lis, err := net.Listen("tcp", cfg.BindAddr)
	if err != nil {
		s.cancel(err)
		s.raft.Shutdown().Error()
		s.closeStores()
		return nil, fmt.Errorf("broker: listen on --bind %s: %w", cfg.BindAddr, err)
	}
	s.listener = lis
	s.membership.raft, s.membership.transport, s.membership.listener = s.raft, s.transport, lis
	s.capacity = newCapacity(nd, s.leadership, s.signing) // after openRaft: it proposes
	s.leadership.raft, s.leadership.capacity = s.raft, s.capacity
	// Errors leave through toStatus, outermost; then TLS's role checks
	// run, then the ACL's token checks, then the token's limits. A
	// connection over its client's limit has its calls refused first.
	opts := []grpc.ServerOption{grpc.InTapHandle(s.limits.tapLimits),
		grpc.ChainUnaryInterceptor(statusUnary), grpc.ChainStreamInterceptor(statusStream),
		grpc.MaxConcurrentStreams(maxStreamsPerConn)}
	opts = append(opts, s.grpcServerOptions()...)
	s.grpc = grpc.NewServer(append(opts,
		grpc.ChainUnaryInterceptor(s.membership.nameLeader, s.gatekeeper.unaryACL, s.unaryLimits),
		grpc.ChainStreamInterceptor(s.gatekeeper.streamACL, s.streamLimits))...)
	s.registerServices()
	s.goFunc(func() { s.serve(limitListener{Listener: lis, l: s.limits}) })
	s.goFunc(s.leadership.monitorLeadership)
	s.goFunc(func() { watchLeader(s.raft, s.membership.leaders, s.ctx.Done()) })
	s.goFunc(s.watchDisk)
	s.goFunc(s.membership.formCluster)
	s.goFunc(s.membership.keepOwnAddressCurrent)
	s.goFunc(s.metrics.countLeaseEvents)
	s.goFunc(s.sampleTenantUsage)
	if err := s.startUI(); err != nil {
		s.Shutdown()
		return nil, err
	}
	s.log.Info("broker started", "id", s.cfg.NodeID, "rpc", s.Addr(), "raft", s.cfg.RaftBindAddr, "data_dir", s.cfg.DataDir, "acl", s.cfg.ACL)
	return s, nil
}

// Addr is the gRPC address the server listens on.
func (s *Server) Addr() string { return s.listener.Addr().String() }

// RaftAddr is the address the Raft transport listens on.
func (s *Server) RaftAddr() string { return string(s.transport.LocalAddr()) }

// ID is the server's Raft id.
func (s *Server) ID() string { return s.cfg.NodeID }

// IsLeader reports whether this server is the Raft leader now.
func (s *Server) IsLeader() bool { return s.raft.State() == raft.Leader }

// openRaft prepares the data dir and starts raft on it.
func (s *Server) openRaft() error {
	dir := s.cfg.DataDir
	rdir := filepath.Join(dir, raftDir)
	dbPath := filepath.Join(rdir, raftDBFile)
	idPath := filepath.Join(dir, nodeIDFile)

	storedID, err := os.ReadFile(idPath)
	hadState := err == nil
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("broker: %w %s: read %s: %v", ErrDataDir, dir, nodeIDFile, err)
	}
	_, dbErr := os.Stat(dbPath)
	if hadState && errors.Is(dbErr, fs.ErrNotExist) {
		return fmt.Errorf("broker: %w %s: it belongs to server %q but %s is missing; refusing to start empty (restore the file, or use a new data dir to join as a new server)",
			ErrDataDir, dir, strings.TrimSpace(string(storedID)), filepath.Join(raftDir, raftDBFile))
	}
	if err := os.MkdirAll(rdir, 0o700); err != nil {
		return fmt.Errorf("broker: %w %s: %v", ErrDataDir, dir, err)
	}
	switch id := strings.TrimSpace(string(storedID)); {
	case hadState && s.cfg.NodeID != "" && s.cfg.NodeID != id:
		return fmt.Errorf("broker: %w %s belongs to server %q, not --node-id %q", ErrDataDir, dir, id, s.cfg.NodeID)
	case hadState:
		s.cfg.NodeID = id
	default:
		if s.cfg.NodeID == "" {
			s.cfg.NodeID = "broker-" + randomHex(4)
		}
		if err := writeFileSync(idPath, []byte(s.cfg.NodeID+"\n")); err != nil {
			return fmt.Errorf("broker: %w %s: %v", ErrDataDir, dir, err)
		}
	}

	store, err := raftboltdb.New(raftboltdb.Options{
		Path:        dbPath,
		BoltOptions: &bbolt.Options{Timeout: time.Second},
	})
	if errors.Is(err, bbolt.ErrTimeout) {
		return fmt.Errorf("broker: %w %s: %s is locked by another process (is another broker using this data dir?)", ErrDataDir, dir, dbPath)
	}
	if err != nil {
		return fmt.Errorf("broker: %w %s: cannot open %s: %v; the file is damaged or not a gpupool Raft log: restore it from a snapshot or move it aside", ErrDataDir, dir, dbPath, err)
	}
	s.store = store
	snaps, err := raft.NewFileSnapshotStore(rdir, 3, s.cfg.RaftLogOutput)
	if err != nil {
		return fmt.Errorf("broker: %w %s: snapshots: %v", ErrDataDir, dir, err)
	}
	addr, err := net.ResolveTCPAddr("tcp", s.cfg.RaftBindAddr)
	if err != nil {
		return fmt.Errorf("broker: --raft-bind %q: %w", s.cfg.RaftBindAddr, err)
	}
	var advertise net.Addr = addr
	if addr.Port == 0 {
		advertise = nil // tests bind :0; advertise what the kernel chose
	}
	var trans *raft.NetworkTransport
	if s.cfg.TLS != nil {
		stream, err := newTLSStreamLayer(s.cfg.RaftBindAddr, advertise, s.cfg.TLS)
		if err != nil {
			return fmt.Errorf("broker: listen on --raft-bind %s: %w", s.cfg.RaftBindAddr, err)
		}
		trans = raft.NewNetworkTransport(stream, 3, 10*time.Second, s.cfg.RaftLogOutput)
	} else {
		trans, err = raft.NewTCPTransport(s.cfg.RaftBindAddr, advertise, 3, 10*time.Second, s.cfg.RaftLogOutput)
		if err != nil {
			return fmt.Errorf("broker: listen on --raft-bind %s: %w", s.cfg.RaftBindAddr, err)
		}
	}
	s.transport = trans

	conf := raftConfig(s.cfg.NodeID, s.leadership.notifyCh, s.cfg.RaftLogOutput)
	setSnapshotSchedule(conf)
	reserve := uint64(max(s.cfg.DiskReserveMiB, 0))
	var logs raft.LogStore = store
	if s.cfg.wrapLogStore != nil {
		logs = s.cfg.wrapLogStore(logs)
	}
	s.disk = &diskLog{LogStore: injectDiskFaults(dir, logs, s.ctx.Done(), s.goFunc), dir: dir, reserveMiB: reserve, observe: s.metrics.observeLogWrite, freeMiB: s.cfg.freeMiB}
	r, err := raft.NewRaft(conf, s.fsm, s.disk, store, snaps, trans)
	if err != nil {
		return fmt.Errorf("broker: %w %s: start raft: %v", ErrDataDir, dir, err)
	}
	s.raft = r
	s.proposer = versionGate{next: raftProposer{r: r, observe: s.metrics.observeApply, roomFor: s.disk.checkSpace, stopped: s.ctx.Done()}, fsm: s.fsm}
	if s.cfg.wrapProposer != nil {
		s.proposer = s.cfg.wrapProposer(s.proposer)
	}
	return nil
}

func (s *Server) closeStores() {
	if s.transport != nil {
		s.transport.Close()
	}
	if s.store != nil {
		s.store.Close()
	}
}

// Shutdown stops serving, steps down and closes the data dir. Safe to
// call more than once.
func (s *Server) Shutdown() error {
	var err error
	s.shutdownOnce.Do(func() {
		s.cancel(ErrShutdown)
		s.stopUI()
		s.grpc.Stop()
		err = s.raft.Shutdown().Error()
		s.closeAndWait()
		s.membership.closeConns()
		s.closeStores()
	})
	return err
}

// ErrShutdown is the cause of a server's end when Shutdown ended it.
var ErrShutdown = errors.New("broker: shut down")

// Done is closed when the server stops: Shutdown was called, or a part
// it cannot serve without failed (then Err says which, and the server
// has shut itself down or is doing so).
func (s *Server) Done() <-chan struct{} { return s.ctx.Done() }

// Err returns why the server stopped: nil while it serves, ErrShutdown
// after Shutdown, or the failure that stopped it.
func (s *Server) Err() error { return context.Cause(s.ctx) }

// serve serves gRPC on lis until the server shuts down. A Serve that
// fails on its own (the listener broke) leaves a broker nobody can
// reach: the failure is logged and the server shuts down, so that the
// process running it sees Done and exits rather than carry on deaf.
func (s *Server) serve(lis net.Listener) {
	err := s.grpc.Serve(lis)
	if s.ctx.Err() != nil || err == nil || errors.Is(err, grpc.ErrServerStopped) {
		return // Shutdown stopped it
	}
	err = fmt.Errorf("broker: serving gRPC on %s: %w", lis.Addr(), err)
	s.log.Error("gRPC server failed; shutting the broker down", "err", err)
	s.cancel(err)
	// Not through goFunc: Shutdown waits for every goFunc, this one too.
	go s.Shutdown()
}

func randomHex(n int) string {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		panic(err)
	}
	return hex.EncodeToString(b)
}

func writeFileSync(path string, b []byte) error {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o600)
	if err != nil {
		return err
	}
	if _, err := f.Write(b); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// Raft snapshot schedule: Raft looks every snapshotInterval to 2x that
// whether snapshotThreshold entries are new since its last snapshot, and
// takes one if so; it keeps trailingLogs entries behind the snapshot for
// followers that lag. The log lives in bbolt, not in memory; what a
// shorter schedule buys is a shorter replay after a restart (a restart
// applies every entry after the snapshot again, about 0.4 ms of CPU
// each with 100k leases held) and a smaller raft.db. The look is cheap
// (the log's last index), so it is frequent: the log is snapshotted soon
// after it grows by the threshold, however fast it grows. The snapshot
// itself is encoded off the FSM's goroutine (fsm.Snapshot) and costs
// about half a second of one core with 100k leases; the threshold bounds
// that cost to one snapshot per 2048 entries.
const (
	snapshotInterval  = 2 * time.Second
	snapshotThreshold = 2048
	trailingLogs      = 4096
)

func setSnapshotSchedule(conf *raft.Config) {
	conf.SnapshotInterval = snapshotInterval
	conf.SnapshotThreshold = snapshotThreshold
	conf.TrailingLogs = trailingLogs
}
