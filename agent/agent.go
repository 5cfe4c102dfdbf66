// Package agent is the pool-host side of gpupool: it registers the host's
// GPUs with the brokers and keeps a heartbeat stream open, over which the
// broker sends the leases this host must enforce and those it must tear
// down.
//
// Enforcing a lease means preparing its isolation (an MPS daemon for
// shared GPUs), keeping a state file for it, and watching its processes:
// the watchdog stops those that use more GPU memory than their slice, that
// use a GPU the lease does not hold, or whose lease expired while the
// brokers were unreachable. Tearing a lease down means stopping its
// processes and only then confirming to the broker, which frees the
// capacity. Every process the agent starts for a lease runs in the lease's
// sandbox (see package sandbox), and a lease's processes are those its
// cgroup holds; only on a host without cgroups are they those whose
// environment carries GPUPOOL_LEASE_ID=<lease id>.
package agent

import (
	"cmp"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"regexp"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/gpupool/gpupool/agent/cudaserver"
	"github.com/gpupool/gpupool/agent/device"
	"github.com/gpupool/gpupool/agent/sandbox"
	"github.com/gpupool/gpupool/agent/workload"
	"github.com/gpupool/gpupool/client"
	"github.com/gpupool/gpupool/dataplane"
	"github.com/gpupool/gpupool/internal/clock"
	"github.com/gpupool/gpupool/internal/limits"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// Timing of the agent's connection to the brokers.
const (
	// DefaultHeartbeatInterval is used when the broker names none.
	DefaultHeartbeatInterval = time.Second
	// maxRetryDelay caps the wait between two attempts to reach a broker.
	maxRetryDelay = 2 * time.Second
	// registerTimeout bounds one Register attempt.
	registerTimeout = 5 * time.Second
)

// Config describes the host an Agent offers and the brokers it reports to.
type Config struct {
	// Brokers are the gRPC addresses of the broker servers; any of them
	// will do.
	Brokers []string
	// Token is the agent's ACL join token (empty for brokers without ACL).
	Token string
	// HostID names this host, stable across restarts.
	HostID string
	// Address is the data-plane address (host:port) advertised to lease
	// holders; it may be empty while there is no data plane.
	Address string
	Labels  map[string]string
	// CPUMillicores and MemoryMiB are the host CPU and memory offered to
	// workloads the data plane starts; 0 offers none.
	CPUMillicores, MemoryMiB int64
	// DefaultCPUFloor (millicores) and DefaultMemoryFloorMiB are the
	// least a lease that names no host CPU or memory is capped at (see
	// defaultCaps); 0 means DefaultCPUFloorMillicores and
	// DefaultMemoryFloorMiB.
	DefaultCPUFloor, DefaultMemoryFloorMiB int64
	// Backend discovers the GPUs. The caller closes it after Run returns.
	Backend device.Backend
	// Version is the agent version reported to the broker.
	Version string
	// Logger receives state changes; nil discards them.
	Logger *slog.Logger
	// Clock times the agent's polls, graces, expiries and retries; nil is
	// the wall clock.
	Clock clock.Clock

	// DataDir holds one state file per enforced lease, and the agent's
	// memory of GPU health and unacknowledged events (memory.go);
	// required.
	DataDir string
	// HealthyAfter is how long after its last critical event an unhealthy
	// GPU counts as healthy again; 0 means DefaultHealthyAfter.
	HealthyAfter time.Duration
	// Enforcement tunes the watchdog; zero fields take the defaults.
	Enforcement Enforcement
	// MPS runs the MPS daemons of shared GPUs; nil means this host has no
	// MPS, and fractional slices are enforced by the watchdog alone.
	MPS MPS
	// ProcRoot is the proc filesystem the agent finds processes in
	// (default /proc). NVML reports host PIDs, so it must be the host's.
	ProcRoot string
	// DataBind is where the data plane (QUIC) listens; empty runs none.
	// When Address is empty, the address it listens on is advertised.
	DataBind string
	// TLS, when set, makes the connection to the brokers mutual TLS with
	// the agent's certificate (see client.Options.TLS); nil is plaintext.
	TLS *tls.Config
	// DCGMJobMappingDir, when set, is DCGM's HPC job mapping directory:
	// the agent keeps in it, per GPU index, the ids of the leases holding
	// the GPU (see jobMap). Empty writes none.
	DCGMJobMappingDir string
	// SandboxUsers are the user ids leases run as (zero: the sandbox
	// package's default range).
	SandboxUsers sandbox.Range
	// MetricsLeaseIDs labels per-lease metrics with lease ids; otherwise
	// the label is a pseudonym that names no lease (see Collector).
	MetricsLeaseIDs bool
	// CgroupParent names the agent's cgroups under each hierarchy's root
	// (default gpupool/<host id>).
	CgroupParent string
	// AllowReducedIsolation lets the data plane start processes on a host
	// that cannot give a lease a full sandbox (not root, no cgroups); they
	// then run with the agent's user. Without it exec is refused there.
	AllowReducedIsolation bool
	// CudaServer is the command that runs a lease's CUDA server (the
	// agent's own binary and "agent cuda-server"); the agent adds the
	// lease's description. Empty: the data plane serves no CUDA.
	CudaServer []string
	// DataLimits bounds what one client may make the data plane do; nil is
	// dataplane.DefaultLimits.
	DataLimits *dataplane.Limits
	// CudaLimits bounds the driver objects each process of a lease may
	// hold in its CUDA server; nil is cudaserver.DefaultSessionLimits.
	CudaLimits *cudaserver.SessionLimits
}

// validHostID is what a host id may look like: it shows up in CLI tables,
// metrics labels and lease slices.
var validHostID = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$`)

// CheckHostID says why id cannot name a host, or returns nil. The error
// names the value and what is allowed, without saying where it came from.
func CheckHostID(id string) error {
	if !validHostID.MatchString(id) {
		return fmt.Errorf("%q: must be 1 to 253 letters, digits, '.', '-' or '_', starting with a letter or digit", id)
	}
	return nil
}

func (c *Config) validate() error {
	switch {
	case len(c.Brokers) == 0:
		return errors.New("agent: no broker address: give one or more, e.g. 127.0.0.1:7641")
	case CheckHostID(c.HostID) != nil:
		return fmt.Errorf("agent: host id %w", CheckHostID(c.HostID))
	case c.Backend == nil:
		return errors.New("agent: no device backend")
	case c.CPUMillicores < 0:
		return fmt.Errorf("agent: host CPU %d millicores: must be 0 or more", c.CPUMillicores)
	case c.MemoryMiB < 0:
		return fmt.Errorf("agent: host memory %d MiB: must be 0 or more", c.MemoryMiB)
	case c.DefaultCPUFloor < 0:
		return fmt.Errorf("agent: default CPU floor %d millicores: must be 0 or more", c.DefaultCPUFloor)
	case c.DefaultMemoryFloorMiB < 0:
		return fmt.Errorf("agent: default memory floor %d MiB: must be 0 or more", c.DefaultMemoryFloorMiB)
	case c.DataDir == "":
		return errors.New("agent: no data dir: the agent keeps a state file per lease there")
	}
	for k := range c.Labels {
		if k == "" {
			return errors.New("agent: label with an empty key: want key=value")
		}
	}
	return nil
}

// Agent registers one host with the brokers and follows its assignments.
type Agent struct {
	cfg Config
	log *slog.Logger
	// clock is cfg.Clock, never nil.
	clock clock.Clock
	// memoryMu serialises writes of the agent's memory file (memory.go).
	memoryMu sync.Mutex

	leases *leaseTable
	keys   keyring
	files  *leaseFiles
	procs  *workload.Table
	box    *sandbox.Manager
	// devices are the host's GPUs, by uuid and in index order; read-only
	// after New.
	devices map[string]*gpupoolv1.Device
	byIndex []*gpupoolv1.Device
	health  health

	// runCtx is Run's context: background stops and teardowns run under
	// it. Set once by Run before anything uses it.
	runCtx context.Context

	// mpsMu orders starting MPS daemons for a new lease against stopping
	// them after a teardown.
	mpsMu sync.Mutex

	// dp is the data-plane server, nil without DataBind.
	dp *dataplane.Server
	// limits counts the data plane's refusals, for /metrics.
	limits *limits.Set

	// kickCh asks the heartbeat loop to send at once.
	kickCh chan struct{}
	// wg counts background stops and teardowns.
	wg sync.WaitGroup

	sampleErr, scanErr errorOnce
	// connected is true while a heartbeat stream to the brokers works.
	connected atomic.Bool
	// jobs is DCGM's job mapping; nil without DCGMJobMappingDir.
	jobs *jobMap
}

// New validates cfg and returns an agent ready to Run.
func New(cfg Config) (*Agent, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	cfg.Enforcement.setDefaults()
	if cfg.Clock == nil {
		cfg.Clock = clock.Real
	}
	if cfg.ProcRoot == "" {
		cfg.ProcRoot = "/proc"
	}
	files, err := openLeaseFiles(cfg.DataDir)
	if err != nil {
		return nil, err
	}
	// The data dir holds the agent's key and the leases' dirs: nobody
	// else may enter it.
	if err := os.Chmod(cfg.DataDir, 0o700); err != nil {
		return nil, fmt.Errorf("agent: data dir: %w", err)
	}
	box, err := sandbox.New(sandbox.Config{
		Users:        cfg.SandboxUsers,
		Hide:         []string{cfg.DataDir},
		Expose:       []string{filepath.Join(cfg.DataDir, "mps")},
		CgroupParent: cmp.Or(cfg.CgroupParent, "gpupool/"+cfg.HostID),
		Logger:       log,
	})
	if err != nil {
		return nil, fmt.Errorf("agent: %w", err)
	}
	// An MPS daemon serves one user at a time: with per-lease users, the
	// clients of every lease run as the sandbox's shared MPS user.
	if m, ok := cfg.MPS.(interface{ SetClientUser(int) }); ok && box.Report().Full() {
		m.SetClientUser(box.SharedUser())
	}
	procs := workload.NewTable(cfg.ProcRoot)
	if box.HasCgroups() {
		procs.SetLeaseOf(box.LeaseOf)
	}
	devices, err := cfg.Backend.Devices()
	if err != nil {
		return nil, fmt.Errorf("agent: list GPUs with the %s backend: %w", cfg.Backend.Name(), err)
	}
	byUUID := make(map[string]*gpupoolv1.Device, len(devices))
	for _, d := range devices {
		byUUID[d.Uuid] = d
	}
	return &Agent{
		limits:  limits.NewSet(nil),
		devices: byUUID,
		byIndex: devices,
		cfg:     cfg,
		log:     log.With("host", cfg.HostID),
		clock:   cfg.Clock,
		leases:  newLeaseTable(cfg.Clock),
		files:   files,
		procs:   procs,
		box:     box,
		health:  health{sick: map[string]string{}, sickAt: map[string]time.Time{}},
		kickCh:  make(chan struct{}, 1),
		jobs:    newJobMap(cfg.DCGMJobMappingDir, log.With("host", cfg.HostID)),
	}, nil
}

// syncJobMap brings DCGM's job mapping in line with the enforced leases.
func (a *Agent) syncJobMap() { a.jobs.sync(a.byIndex, a.leases.enforced) }

// Assignments returns a copy of the leases this host enforces, sorted by
// lease id.
func (a *Agent) Assignments() []*gpupoolv1.Assignment { return a.leases.enforced() }

// ErrNotConnected is Ready's answer while no heartbeat stream to the
// brokers works.
var ErrNotConnected = errors.New("not connected to the brokers")

// Ready returns nil while the agent's heartbeat stream to the brokers
// works, ErrNotConnected otherwise.
func (a *Agent) Ready() error {
	if !a.connected.Load() {
		return ErrNotConnected
	}
	return nil
}

// kick makes the heartbeat loop send a heartbeat now.
func (a *Agent) kick() {
	select {
	case a.kickCh <- struct{}{}:
	default:
	}
}

// Run discovers the host's GPUs, resumes the leases of its data dir,
// registers with the brokers and heartbeats until ctx ends, then returns
// nil once its background work stopped. It survives brokers going away:
// it reconnects forever, waiting at most maxRetryDelay between attempts,
// and registers again when a broker no longer knows the host (NotFound).
// Meanwhile the watchdog goes on enforcing. It returns an error only when
// it cannot start: the backend fails to list the GPUs or the data dir
// cannot be read. Run must not be called twice.
func (a *Agent) Run(ctx context.Context) error {
	devices := a.byIndex
	ctx, cancel := context.WithCancel(ctx)
	a.runCtx = ctx
	defer func() {
		cancel()
		a.wg.Wait()
	}()
	// The data plane starts first: teardowns that resume starts revoke
	// through it.
	certSHA, err := a.startDataPlane(ctx)
	if err != nil {
		return err
	}
	if err := a.loadMemory(); err != nil {
		return err
	}
	if err := a.resume(ctx); err != nil {
		return err
	}
	a.wg.Add(2)
	go func() {
		defer a.wg.Done()
		a.watchdog(ctx)
	}()
	go func() {
		defer a.wg.Done()
		if err := a.cfg.Backend.WatchHealth(ctx, a.onHealthEvent); err != nil {
			a.log.Error("watching GPU health failed", "err", err)
		}
	}()
	host := &gpupoolv1.Host{
		Id:             a.cfg.HostID,
		Address:        a.cfg.Address,
		Labels:         a.cfg.Labels,
		AgentVersion:   a.cfg.Version,
		Devices:        devices,
		Backend:        a.cfg.Backend.Name(),
		BackendNote:    a.cfg.Backend.Note(),
		CpuMillicores:  a.cfg.CPUMillicores,
		MemoryMib:      a.cfg.MemoryMiB,
		Mps:            a.cfg.MPS != nil,
		CertSha256:     certSHA,
		LeaseIsolation: a.box.Report().String(),
	}
	if host.Address == "" && a.dp != nil {
		host.Address = a.dp.Addr().String()
	}
	for _, d := range devices {
		d.HostId = a.cfg.HostID
	}
	attrs := []any{"brokers", a.cfg.Brokers, "backend", host.Backend, "gpus", len(devices), "mps", host.Mps}
	if host.BackendNote != "" {
		attrs = append(attrs, "note", host.BackendNote)
	}
	a.log.Info("agent starting", attrs...)
	if r := a.box.Report(); r.Full() {
		a.log.Info("lease isolation: "+r.String(), "users", a.cfg.SandboxUsers)
	} else if a.cfg.AllowReducedIsolation {
		a.log.Warn("lease isolation: " + r.String() + "; workloads run with the agent's user because reduced isolation is allowed")
	} else {
		a.log.Warn("lease isolation: " + r.String() + "; exec is refused (allow it with --allow-reduced-isolation)")
	}
	defer a.box.Close()

	c, err := client.DialWith(a.cfg.Brokers, client.Options{TLS: a.cfg.TLS, Token: a.cfg.Token, DialOptions: []grpc.DialOption{grpc.WithConnectParams(grpc.ConnectParams{
		Backoff:           backoff.Config{BaseDelay: 100 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: maxRetryDelay},
		MinConnectTimeout: 5 * time.Second,
	})}})
	if err != nil {
		return fmt.Errorf("agent: %w", err)
	}
	defer c.Close()

	var (
		retry = newRetryDelay(100*time.Millisecond, maxRetryDelay)
		conn  = connState{flag: &a.connected, clock: a.clock}
		reg   *gpupoolv1.RegisterResponse // nil: (re)register first
	)
	for ctx.Err() == nil {
		if reg == nil {
			reg, err = a.register(ctx, c.Agent, host)
			if status.Code(err) == codes.PermissionDenied {
				// The token does not allow this host (another host's join
				// token, or not an agent token): retrying cannot help.
				return fmt.Errorf("agent: the brokers refuse host %q: %s; start the agent with this host's own join token ('gpupool operator acl token create --kind agent --host-id %s')",
					host.GetId(), status.Convert(err).Message(), host.GetId())
			}
			if err != nil {
				conn.lost(a.log, "register failed", err, retry.peek())
				clock.Sleep(ctx, a.clock, retry.next())
				continue
			}
		}
		progressed, err := a.heartbeat(ctx, c.Agent, reg, &conn)
		if ctx.Err() != nil {
			break
		}
		if progressed {
			retry.reset()
		}
		if status.Code(err) == codes.NotFound {
			a.log.Warn("broker does not know this host; registering again", "err", err)
			reg = nil
		} else {
			conn.lost(a.log, "connection to brokers lost", err, retry.peek())
		}
		clock.Sleep(ctx, a.clock, retry.next())
	}
	a.log.Info("agent stopped")
	return nil
}

// resume loads the leases of the data dir and enforces them again, until
// the brokers say otherwise: their processes, still in their cgroups, are
// adopted with them. Files that cannot be read are quarantined; leases on
// GPUs this host no longer has are dropped, and refused when the brokers
// list them. The processes of every other lease cgroup under the agent's
// parent are killed (see reapOrphans).
func (a *Agent) resume(ctx context.Context) error {
	recs, bad, err := a.files.load()
	if err != nil {
		return err
	}
	for _, q := range bad {
		a.log.Error("lease state file unreadable after a crash: quarantined; the brokers' assignments restore the lease",
			"file", q.File, "moved_to", q.MovedTo, "err", q.Err)
	}
	for _, rec := range recs {
		if err := a.prepareErr(ctx, rec.Assignment, rec.Deadline); err != nil {
			// Its processes may still run: stop them, without telling
			// the brokers, who list the lease again if it still holds.
			a.log.Error("cannot resume a lease from the data dir; stopping its processes", "lease", rec.Assignment.LeaseId, "err", err)
			a.leases.startTeardown(rec.Assignment)
			a.teardown(teardownOrder{a: rec.Assignment, reason: "it could not be resumed: " + err.Error()})
			continue
		}
		a.log.Info("resumed lease from the data dir", "lease", rec.Assignment.LeaseId,
			"expires", rec.Deadline.Format(time.RFC3339), "slices", describeSlices(rec.Assignment.Slices))
	}
	a.reapOrphans()
	a.syncJobMap() // also clears what a crash left
	return nil
}

// register makes one attempt to register host, with its devices' health
// as the agent knows it now.
func (a *Agent) register(ctx context.Context, ac gpupoolv1.AgentServiceClient, host *gpupoolv1.Host) (*gpupoolv1.RegisterResponse, error) {
	for _, d := range host.Devices {
		d.Health, d.HealthReason = a.healthOf(d.Uuid)
	}
	ctx, cancel := context.WithTimeout(ctx, registerTimeout)
	defer cancel()
	resp, err := ac.Register(ctx, &gpupoolv1.RegisterRequest{Host: host})
	if err != nil {
		return nil, err
	}
	a.keys.setKeys(resp.GetKeys())
	a.log.Info("registered", "gpus", len(host.GetDevices()),
		"heartbeat_interval", heartbeatInterval(resp.GetHeartbeatIntervalMs()),
		"heartbeat_ttl", time.Duration(resp.GetHeartbeatTtlMs())*time.Millisecond)
	return resp, nil
}

// heartbeatInterval turns the broker's interval into a duration, or the
// default when the broker names none.
func heartbeatInterval(ms int64) time.Duration {
	if ms <= 0 {
		return DefaultHeartbeatInterval
	}
	return time.Duration(ms) * time.Millisecond
}

// connState tracks whether the agent is connected, so that it logs
// changes and not every failed attempt.
type connState struct {
	down      bool
	downSince time.Time
	flag      *atomic.Bool // mirrors !down for metrics
	clock     clock.Clock
}

// lost records a failed attempt: logged as a warning the first time,
// at debug level while the agent stays disconnected. A broker refusing
// the agent (anything but a connection or timeout failure) is logged as
// an error every time: it will not go away by itself.
func (s *connState) lost(log *slog.Logger, msg string, err error, retryIn time.Duration) {
	switch status.Code(err) {
	case codes.Unavailable, codes.DeadlineExceeded, codes.Canceled, codes.Aborted:
	default:
		log.Error(msg, "err", err, "retry_in", retryIn)
		if !s.down {
			s.down, s.downSince = true, s.clock.Now()
			s.setFlag()
		}
		return
	}
	if s.down {
		log.Debug(msg, "err", err, "retry_in", retryIn)
		return
	}
	s.down, s.downSince = true, s.clock.Now()
	s.setFlag()
	log.Warn(msg, "err", err, "retry_in", retryIn)
}

// up records a working heartbeat stream.
func (s *connState) up(log *slog.Logger) {
	if s.down {
		log.Info("connection to brokers restored", "after", s.clock.Now().Sub(s.downSince).Round(time.Millisecond))
	}
	s.down = false
	s.setFlag()
}

func (s *connState) setFlag() {
	if s.flag != nil {
		s.flag.Store(!s.down)
	}
}
