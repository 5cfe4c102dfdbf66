package agent

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/gpupool/gpupool/agent/cudaserver"
	"github.com/gpupool/gpupool/dataplane"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
	"github.com/gpupool/gpupool/token"
)

// startDataPlane starts the QUIC server when DataBind is set, with the
// certificate kept in the data dir, and returns the certificate's
// fingerprint for the brokers to hand to lease holders.
func (a *Agent) startDataPlane(ctx context.Context) (string, error) {
	if a.cfg.DataBind == "" {
		return "", nil
	}
	cert, sha, err := dataplane.LoadOrCreateCert(filepath.Join(a.cfg.DataDir, "tls"))
	if err != nil {
		return "", fmt.Errorf("agent: data-plane certificate: %w", err)
	}
	cfg := dataplane.ServerConfig{Addr: a.cfg.DataBind, Cert: cert, Auth: a, Leases: dpLeases{a}, Logger: a.log,
		Limits: a.cfg.DataLimits, LimitSet: a.limits}
	if len(a.cfg.CudaServer) > 0 {
		cfg.CudaServer = a.cudaServerCommand
	}
	srv, err := dataplane.NewServer(cfg)
	if err != nil {
		return "", fmt.Errorf("agent: data plane on %s: %w", a.cfg.DataBind, err)
	}
	a.dp = srv
	a.wg.Add(1)
	go func() {
		defer a.wg.Done()
		if err := srv.Serve(ctx); err != nil && ctx.Err() == nil {
			a.log.Error("data plane stopped", "err", err)
		}
	}()
	a.log.Info("data plane listening", "addr", srv.Addr().String(), "cert_sha256", sha)
	return sha, nil
}

// cudaServerCommand is the command line of a lease's CUDA server: the
// lease's slices on this host, this host's devices, and the backend that
// matches the device backend (simulated GPUs get the simulated one).
func (a *Agent) cudaServerCommand(leaseID string) ([]string, error) {
	as, ok := a.leases.get(leaseID)
	if !ok {
		return nil, fmt.Errorf("lease %s: %w", leaseID, ErrNotEnforced)
	}
	lease := &gpupoolv1.Lease{Id: leaseID}
	for _, s := range as.Slices {
		s = proto.CloneOf(s)
		if s.Host == "" {
			s.Host = a.cfg.HostID
		}
		lease.Slices = append(lease.Slices, s)
	}
	backend := cudaserver.BackendReal
	if a.cfg.Backend.Name() == "simulated" {
		backend = cudaserver.BackendSimulated
	}
	arg, err := cudaserver.LeaseServer{Lease: lease, HostID: a.cfg.HostID, Inventory: a.byIndex, Backend: backend, Limits: a.cfg.CudaLimits}.Arg()
	if err != nil {
		return nil, err
	}
	return append(slices.Clone(a.cfg.CudaServer), "--lease", arg), nil
}

// dpLeases is what the data plane asks the agent about a lease.
type dpLeases struct{ a *Agent }

func (l dpLeases) Env(id string) ([]string, bool)                { return l.a.LeaseEnv(id) }
func (l dpLeases) Dir(id string) (string, error)                 { return l.a.LeaseDir(id) }
func (l dpLeases) Started(id string, pid int)                    { l.a.TrackProcess(id, pid) }
func (l dpLeases) Usage(id string) (*gpupoolv1.LeaseUsage, bool) { return l.a.LeaseUsage(id) }
func (l dpLeases) Sandbox(id string, cmd *exec.Cmd) error        { return l.a.Sandbox(id, cmd) }
func (l dpLeases) Listens(id string, port int) bool              { return l.a.Listens(id, port) }

// assignmentWait is how long a valid token for a lease this agent does
// not enforce yet waits for the broker's assignment: Acquire returns as
// soon as the grant commits, and the push to the agent follows.
const assignmentWait = 3 * time.Second

// ErrNotEnforced is returned for a lease this host does not enforce.
var ErrNotEnforced = errors.New("lease not enforced on this host")

// keyring holds the brokers' public token keys as the agent last heard
// them, and the fence: the newest fencing token and the capacity of every
// slice the brokers list for this host.
type keyring struct {
	mu    sync.Mutex
	keys  []*gpupoolv1.PublicKey // guarded by mu
	fence fenceTable             // guarded by mu
}

// setKeys replaces the keys, unless the brokers sent none (an older
// broker): a key set only ever changes by rotation.
func (k *keyring) setKeys(keys []*gpupoolv1.PublicKey) {
	if len(keys) == 0 {
		return
	}
	k.mu.Lock()
	k.keys = keys
	k.mu.Unlock()
}

// sawResponse records the slices a heartbeat response lists.
func (k *keyring) sawResponse(resp *gpupoolv1.HeartbeatResponse) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.fence == nil {
		k.fence = fenceTable{}
	}
	k.fence.sawResponse(resp)
}

// Authorize checks a lease token presented to the data plane: signed by
// a broker key the agent knows, not expired, for this host, for a lease
// this host enforces with the same fencing token and slices, and not
// fenced out on any of its slices (see fenceTable). It returns the lease
// id, or an error that says why.
func (a *Agent) Authorize(tok string) (string, error) {
	a.keys.mu.Lock()
	keys := a.keys.keys
	a.keys.mu.Unlock()
	if len(keys) == 0 {
		return "", errors.New("this agent has no broker keys yet: it has not reached a broker since it started")
	}
	c, err := token.Verify(keys, tok, a.clock.Now())
	if err != nil {
		return "", err
	}
	if c.HostId != a.cfg.HostID {
		return "", fmt.Errorf("token for lease %s is for host %s, this is host %s", c.LeaseId, c.HostId, a.cfg.HostID)
	}
	as, ok := a.leases.waitEnforced(c.LeaseId, assignmentWait)
	if !ok {
		return "", fmt.Errorf("lease %s: %w", c.LeaseId, ErrNotEnforced)
	}
	a.keys.mu.Lock()
	defer a.keys.mu.Unlock()
	if err := a.keys.fence.check(c.LeaseId, c.FencingToken, as.Slices, a.gpuMemoryMiB); err != nil {
		return "", err
	}
	if c.FencingToken != as.FencingToken || !sameDevices(c.Slices, as.Slices) {
		return "", fmt.Errorf("token for lease %s does not match what this host enforces (fencing token %d, want %d)", c.LeaseId, c.FencingToken, as.FencingToken)
	}
	return c.LeaseId, nil
}

// gpuMemoryMiB is the memory of the GPU with uuid, 0 if it is not one of
// this host's.
func (a *Agent) gpuMemoryMiB(uuid string) int64 {
	return a.devices[uuid].GetMemoryMib()
}

func sameDevices(a, b []*gpupoolv1.Slice) bool {
	devs := func(ss []*gpupoolv1.Slice) []string {
		var out []string
		for _, s := range ss {
			out = append(out, s.Device)
		}
		slices.Sort(out)
		return out
	}
	return slices.Equal(devs(a), devs(b))
}

// LeaseDir returns the working directory of an enforced lease,
// DATA_DIR/work/<lease id>, creating it (0700) if needed.
func (a *Agent) LeaseDir(leaseID string) (string, error) {
	if _, ok := a.leases.get(leaseID); !ok {
		return "", fmt.Errorf("lease %s: %w", leaseID, ErrNotEnforced)
	}
	dir := filepath.Join(a.cfg.DataDir, "work", leaseID)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", fmt.Errorf("agent: lease dir: %w", err)
	}
	return dir, nil
}

// TrackProcess records that pid, started by the data plane, belongs to a
// lease, so the watchdog counts it and teardown stops it even if it drops
// GPUPOOL_LEASE_ID from its environment.
func (a *Agent) TrackProcess(leaseID string, pid int) {
	p, err := a.procs.Lookup(pid)
	if err != nil {
		return // already gone
	}
	a.procs.Track(leaseID, p)
}

// LeaseUsage returns the watchdog's last reading of an enforced lease.
func (a *Agent) LeaseUsage(leaseID string) (*gpupoolv1.LeaseUsage, bool) {
	a.leases.mu.Lock()
	defer a.leases.mu.Unlock()
	e := a.leases.entries[leaseID]
	if e == nil || e.phase != enforcing || e.usage == nil {
		return nil, false
	}
	return e.usage, true
}
