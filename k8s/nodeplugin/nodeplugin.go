// Package nodeplugin is the node side of the gpu.gpupool.dev DRA driver,
// 'gpupool k8s-node-plugin': a kubelet plugin that prepares a claim the
// controller has leased by writing a CDI spec that mounts the lease's
// token file (and, with the CUDA shim, its CUDA socket) into the
// container, and renews the claim's leases until it is unprepared. What it
// reads of the claim is the contract in k8s/driver.
package nodeplugin

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/klog/v2"

	"github.com/gpupool/gpupool/client"
	"github.com/gpupool/gpupool/internal/clock"
	"github.com/gpupool/gpupool/k8s/driver"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// Defaults of the node plugin's directories.
const (
	DefaultNodeStateDir = "/var/lib/gpupool/k8s"
	DefaultCDIDir       = "/var/run/cdi"
	// DefaultPluginDir is where the kubelet dials the plugin's dra.sock.
	DefaultPluginDir = kubeletplugin.KubeletPluginsDir + "/" + driver.Name
	// DefaultRegistrarDir is where the kubelet finds plugins' registration
	// sockets.
	DefaultRegistrarDir = kubeletplugin.KubeletRegistryDir
)

// How long the node plugin waits before attaching again to a lease whose
// renewal stopped, or whose attach failed for another reason than its end.
const (
	reattachFirst = time.Second
	reattachMax   = 30 * time.Second
)

// FollowedLease is a lease the node plugin renews for a prepared claim;
// *client.Lease is one.
type FollowedLease interface {
	// Tokens returns the current token of each host of the lease, the
	// host of its first slice first.
	Tokens() []*gpupoolv1.HostToken
	// OnRenew makes fn run after every renewal, once Tokens returns the
	// tokens it brought. No call starts after Close returns.
	OnRenew(fn func())
	// Done is closed when the lease is no longer renewed; Err says why.
	Done() <-chan struct{}
	Err() error
	// Close stops renewing without ending the lease.
	Close()
}

// LeaseAttacher is what the node plugin needs of the brokers.
// ClientAttacher adapts a *client.Client; tests use a fake.
type LeaseAttacher interface {
	// Attach renews the granted lease leaseID from this process. It
	// fails with an error wrapping client.ErrLeaseEnded, and the broker's
	// reason, when the lease has ended or is unknown; any other error may
	// pass.
	Attach(ctx context.Context, leaseID string) (FollowedLease, error)
}

// ClientAttacher adapts c to LeaseAttacher.
func ClientAttacher(c *client.Client) LeaseAttacher { return clientAttacher{c} }

type clientAttacher struct{ c *client.Client }

func (a clientAttacher) Attach(ctx context.Context, leaseID string) (FollowedLease, error) {
	l, err := a.c.Attach(ctx, leaseID)
	if status.Code(err) == codes.NotFound {
		return nil, fmt.Errorf("%w: %s", client.ErrLeaseEnded, status.Convert(err).Message())
	}
	if err != nil {
		return nil, err
	}
	return l, nil
}

// Config configures a Plugin. The directories are the
// node's own paths: the kubelet dials the sockets, and the container
// runtime reads the CDI specs and bind-mounts the claims' directories, by
// the paths the plugin writes.
type Config struct {
	// NodeName is the node the plugin serves. Required.
	NodeName string
	// KubeClient reads the ResourceClaims the kubelet asks to prepare.
	// Required.
	KubeClient kubernetes.Interface
	// Brokers attaches to the claims' leases. Required.
	Brokers LeaseAttacher
	// StateDir holds claims/<uid>/token.json for every prepared claim;
	// the plugin resumes from it after a restart. Default
	// DefaultNodeStateDir.
	StateDir string
	// CDIDir is where the container runtime reads CDI specs. Default
	// DefaultCDIDir.
	CDIDir string
	// PluginDir is the plugin's data directory, where it serves the DRA
	// service to the kubelet (dra.sock). Default DefaultPluginDir.
	PluginDir string
	// RegistrarDir is the kubelet's plugin registration directory, where
	// the plugin announces itself; it must exist. Default
	// DefaultRegistrarDir.
	RegistrarDir string
	// CUDAShim is the path of gpupool's CUDA shim (libcuda.so.1) to give
	// the claims' containers, with a per-claim CUDA proxy the plugin
	// serves (see ShimContainerPaths); "" gives them none. The plugin
	// copies it into StateDir/lib, a node path the runtime can mount.
	CUDAShim string
	// Logger receives the plugin's logs, and kubeletplugin's at debug
	// level; nil discards them.
	Logger *slog.Logger
}

func (c Config) withDefaults() Config {
	for _, d := range []struct {
		v   *string
		def string
	}{{&c.StateDir, DefaultNodeStateDir}, {&c.CDIDir, DefaultCDIDir}, {&c.PluginDir, DefaultPluginDir}, {&c.RegistrarDir, DefaultRegistrarDir}} {
		if *d.v == "" {
			*d.v = d.def
		}
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	return c
}

// Plugin is the kubelet plugin of the driver: it hands the leases the
// binder took for a claim to the claim's containers, and keeps them
// renewed while the claim is prepared on this node.
//
// NodePrepareResources reads each claim's status.devices[] (never the
// allocation alone), attaches to the lease of every allocated device of
// this driver, writes the claim's token file (rewritten after every
// renewal) and one CDI spec, and returns the CDI device CDIDeviceID(uid)
// for each device. NodeUnprepareResources needs only the claim's UID: it
// stops renewing and removes both files. Both are idempotent. The leases
// are never released here: the binder owns them.
type Plugin struct {
	cfg    Config
	log    *slog.Logger
	specs  *cdiSpecs
	helper *kubeletplugin.Helper
	ctx    context.Context // ends at Stop; bounds the renewals
	cancel context.CancelFunc
	failed chan struct{} // closed by the first fatal error

	// The kubelet's calls come one at a time (kubeletplugin serializes
	// them); mu guards what renewals and Stop share with them.
	mu     sync.Mutex
	claims map[types.UID]*nodeClaim // guarded by mu
	err    error                    // guarded by mu; the fatal error
}

var _ kubeletplugin.DRAPlugin = (*Plugin)(nil)

// Start resumes renewing the leases of the claims prepared in
// cfg.StateDir, then serves the kubelet: the registration socket in
// RegistrarDir and the DRA service (v1 and v1beta1) in PluginDir. It
// returns once both listen. ctx bounds the plugin's life, as Stop does.
func Start(ctx context.Context, cfg Config) (*Plugin, error) {
	cfg = cfg.withDefaults()
	switch {
	case cfg.NodeName == "":
		return nil, errors.New("k8s: Config.NodeName: must be set")
	case cfg.KubeClient == nil:
		return nil, errors.New("k8s: Config.KubeClient: must be set")
	case cfg.Brokers == nil:
		return nil, errors.New("k8s: Config.Brokers: must be set")
	}
	if st, err := os.Stat(cfg.RegistrarDir); err != nil || !st.IsDir() {
		return nil, fmt.Errorf("k8s: registrar directory %s: no such directory; it must be the kubelet's plugins_registry, mounted at the same path", cfg.RegistrarDir)
	}
	// claims/ is private: only the container runtime reaches a claim's
	// directory, to bind-mount it.
	for _, d := range []struct {
		path string
		perm fs.FileMode
	}{{claimsDir(cfg.StateDir), 0o700}, {cfg.CDIDir, 0o755}, {cfg.PluginDir, 0o750}} {
		if err := os.MkdirAll(d.path, d.perm); err != nil {
			return nil, fmt.Errorf("k8s: %w", err)
		}
	}
	// MkdirAll keeps an existing directory's mode: make sure claims/ is
	// private, and a directory rather than a link to one.
	if st, err := os.Lstat(claimsDir(cfg.StateDir)); err != nil || !st.IsDir() {
		return nil, fmt.Errorf("k8s: %s must be a directory, not a symbolic link", claimsDir(cfg.StateDir))
	}
	if err := os.Chmod(claimsDir(cfg.StateDir), 0o700); err != nil {
		return nil, fmt.Errorf("k8s: %w", err)
	}
	shim, err := installShim(cfg.CUDAShim, cfg.StateDir)
	if err != nil {
		return nil, fmt.Errorf("k8s: %w", err)
	}
	specs, err := newCDISpecs(cfg.CDIDir, shim)
	if err != nil {
		return nil, fmt.Errorf("k8s: %w", err)
	}
	pctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	p := &Plugin{cfg: cfg, log: cfg.Logger, specs: specs, ctx: pctx, cancel: cancel,
		failed: make(chan struct{}), claims: map[types.UID]*nodeClaim{}}
	p.resume()
	kctx := klog.NewContext(ctx, logr.FromSlogHandler(cfg.Logger.Handler()))
	p.helper, err = kubeletplugin.Start(kctx, p,
		kubeletplugin.DriverName(driver.Name),
		kubeletplugin.NodeName(cfg.NodeName),
		kubeletplugin.KubeClient(cfg.KubeClient),
		kubeletplugin.PluginDataDirectoryPath(cfg.PluginDir),
		kubeletplugin.RegistrarDirectoryPath(cfg.RegistrarDir),
	)
	if err != nil {
		p.Stop()
		return nil, fmt.Errorf("k8s: start the kubelet plugin: %w", err)
	}
	context.AfterFunc(ctx, p.Stop)
	p.log.Info("node plugin serving the kubelet", "node", cfg.NodeName, "plugin_dir", cfg.PluginDir,
		"registrar_dir", cfg.RegistrarDir, "state_dir", cfg.StateDir, "cdi_dir", cfg.CDIDir)
	return p, nil
}

// Stop stops serving the kubelet and renewing, and returns when both
// stopped. The claims' files stay, for the next start to resume from.
func (p *Plugin) Stop() {
	p.helper.Stop()
	p.cancel()
	p.mu.Lock()
	claims := slices.Collect(maps.Values(p.claims))
	p.mu.Unlock()
	for _, c := range claims {
		c.wg.Wait()
	}
}

// Failed is closed when the plugin hit an error it cannot recover from,
// such as its gRPC server failing; Err says which. Stop it then.
func (p *Plugin) Failed() <-chan struct{} { return p.failed }

// Err is the error that closed Failed, or nil.
func (p *Plugin) Err() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.err
}

// HandleError implements kubeletplugin.DRAPlugin: errors kubeletplugin
// hits in the background. Those not marked recoverable close Failed.
func (p *Plugin) HandleError(_ context.Context, err error, msg string) {
	if errors.Is(err, kubeletplugin.ErrRecoverable) {
		p.log.Warn(msg, "err", err)
		return
	}
	p.log.Error(msg, "err", err)
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.err == nil {
		p.err = fmt.Errorf("%s: %w", msg, err)
		close(p.failed)
	}
}

// PrepareResourceClaims implements kubeletplugin.DRAPlugin: the kubelet's
// NodePrepareResources, with the claims already read. A claim that cannot
// be prepared yet (no lease granted, a lease ended) gets an error that
// says why; the kubelet retries.
func (p *Plugin) PrepareResourceClaims(ctx context.Context, claims []*resourceapi.ResourceClaim) (map[types.UID]kubeletplugin.PrepareResult, error) {
	out := make(map[types.UID]kubeletplugin.PrepareResult, len(claims))
	for _, claim := range claims {
		devices, err := p.prepare(ctx, claim)
		if err != nil {
			p.log.Warn("claim not prepared", "claim", claim.Namespace+"/"+claim.Name, "uid", claim.UID, "err", err)
			err = fmt.Errorf("claim %s/%s: %w", claim.Namespace, claim.Name, err)
		}
		out[claim.UID] = kubeletplugin.PrepareResult{Devices: devices, Err: err}
	}
	return out, nil
}

// UnprepareResourceClaims implements kubeletplugin.DRAPlugin: the
// kubelet's NodeUnprepareResources. A claim that is not prepared here is
// no error.
func (p *Plugin) UnprepareResourceClaims(_ context.Context, claims []kubeletplugin.NamespacedObject) (map[types.UID]error, error) {
	out := make(map[types.UID]error, len(claims))
	for _, c := range claims {
		out[c.UID] = p.unprepare(c.UID)
		if out[c.UID] != nil {
			p.log.Warn("claim not unprepared", "claim", c.NamespacedName.String(), "uid", c.UID, "err", out[c.UID])
		}
	}
	return out, nil
}

// claimDeviceLease is an allocated device of a claim and the lease the
// binder took for it.
type claimDeviceLease struct {
	driver.DeviceStatusData
	result resourceapi.DeviceRequestAllocationResult
}

// claimLeases reads, for every device of claim allocated to this driver,
// the lease the binder reported in status.devices[].
func claimLeases(claim *resourceapi.ResourceClaim) ([]claimDeviceLease, error) {
	results := driver.Results(claim)
	if len(results) == 0 {
		return nil, fmt.Errorf("no device of %s is allocated to it", driver.Name)
	}
	out := make([]claimDeviceLease, 0, len(results))
	for _, r := range results {
		what := fmt.Sprintf("device %s of pool %s (request %s)", r.Device, r.Pool, r.Request)
		ds := driver.DeviceStatus(claim, r)
		var leased *metav1.Condition
		if ds != nil {
			leased = meta.FindStatusCondition(ds.Conditions, driver.ConditionLeased)
		}
		switch {
		case ds != nil && meta.IsStatusConditionTrue(ds.Conditions, driver.ConditionLeaseFailed):
			c := meta.FindStatusCondition(ds.Conditions, driver.ConditionLeaseFailed)
			return nil, fmt.Errorf("%s: the gpupool lease failed (%s): %s", what, c.Reason, c.Message)
		case leased != nil && leased.Status != metav1.ConditionTrue:
			return nil, fmt.Errorf("%s: no gpupool lease (%s): %s", what, leased.Reason, leased.Message)
		case leased == nil:
			return nil, fmt.Errorf("%s: not leased yet: status.devices has no %s=True for it (the gpupool controller grants the lease; the kubelet retries)", what, driver.ConditionLeased)
		case ds.Data == nil:
			return nil, fmt.Errorf("%s: %s=True but status.devices has no data for it", what, driver.ConditionLeased)
		}
		l := claimDeviceLease{result: r}
		if err := json.Unmarshal(ds.Data.Raw, &l.DeviceStatusData); err != nil {
			return nil, fmt.Errorf("%s: status.devices data is not gpupool lease data: %w", what, err)
		}
		if l.LeaseID == "" || l.Host == "" {
			return nil, fmt.Errorf("%s: status.devices data %s lacks leaseId or host", what, ds.Data.Raw)
		}
		out = append(out, l)
	}
	return out, nil
}

// prepare prepares one claim and returns its devices.
func (p *Plugin) prepare(ctx context.Context, claim *resourceapi.ResourceClaim) ([]kubeletplugin.Device, error) {
	if err := checkClaimUID(claim.UID); err != nil {
		return nil, err
	}
	leases, err := claimLeases(claim)
	if err != nil {
		// A claim prepared before whose lease is gone (ended, failed):
		// no container may start with the edits of a dead lease.
		if rerr := p.specs.remove(claim.UID); rerr != nil {
			p.log.Warn("cannot remove the CDI spec of a claim that cannot be prepared", "uid", claim.UID, "err", rerr)
		}
		return nil, err
	}
	devices := make([]kubeletplugin.Device, 0, len(leases))
	for _, l := range leases {
		devices = append(devices, kubeletplugin.Device{Requests: []string{l.result.Request}, PoolName: l.result.Pool,
			DeviceName: l.result.Device, ShareID: l.result.ShareID, CDIDeviceIDs: []string{CDIDeviceID(claim.UID)}})
	}
	dir := claimDir(p.cfg.StateDir, claim.UID)

	p.mu.Lock()
	prepared := p.claims[claim.UID]
	p.mu.Unlock()
	if prepared != nil && prepared.holds(leases) {
		if err := prepared.endedErr(); err != nil {
			// No container may start with the edits of an ended lease.
			if rerr := p.specs.remove(claim.UID); rerr != nil {
				p.log.Warn("cannot remove the CDI spec of a claim whose lease ended", "uid", claim.UID, "err", rerr)
			}
			return nil, err
		}
		// Again, in case the runtime's directory was wiped, or the
		// socket failed to start before.
		if err := p.specs.write(claim.UID, dir, leases); err != nil {
			return nil, err
		}
		if err := prepared.serveCUDA(p); err != nil {
			return nil, err
		}
		return devices, nil
	}
	if prepared != nil { // other leases now: start over
		p.forget(prepared)
	}

	c := &nodeClaim{uid: claim.UID, dir: dir}
	attached := make([]FollowedLease, 0, len(leases))
	closeAll := func() {
		for _, l := range attached {
			l.Close()
		}
	}
	for _, l := range leases {
		held, err := p.cfg.Brokers.Attach(ctx, l.LeaseID)
		if err != nil {
			closeAll()
			return nil, fmt.Errorf("lease %s of device %s of pool %s: %w", l.LeaseID, l.result.Device, l.result.Pool, err)
		}
		attached = append(attached, held)
		c.leases = append(c.leases, &followedLease{id: l.LeaseID, memoryMiB: l.MemoryMiB, computePercent: l.ComputePercent, tokens: held.Tokens()})
	}
	// The container's user, whoever it is, reads the token file; claims/
	// keeps the node's other users out. A directory that exists was made
	// by an earlier prepare of the claim, and a running container may
	// have it mounted: it is written into, never replaced or removed here.
	err = os.Mkdir(dir, 0o755)
	created := err == nil
	if errors.Is(err, fs.ErrExist) {
		err = nil
	}
	if err == nil {
		err = os.Chmod(dir, 0o755) // whatever the umask
	}
	if err == nil {
		err = c.writeTokenFile()
	}
	if err == nil {
		err = p.specs.write(claim.UID, dir, leases)
	}
	if err != nil {
		closeAll()
		if created {
			p.removeFiles(claim.UID)
		}
		return nil, err
	}
	p.mu.Lock()
	p.claims[claim.UID] = c
	p.mu.Unlock()
	c.start(p, attached)
	if err := c.serveCUDA(p); err != nil {
		// The claim stays prepared, its leases renewed: the kubelet's
		// next prepare tries the socket again.
		return nil, err
	}
	p.log.Info("claim prepared", "claim", claim.Namespace+"/"+claim.Name, "uid", claim.UID, "leases", c.leaseIDs())
	return devices, nil
}

// unprepare stops renewing the leases of the claim with uid and removes
// its files, whether this process prepared it or not.
func (p *Plugin) unprepare(uid types.UID) error {
	if err := checkClaimUID(uid); err != nil {
		return err
	}
	p.mu.Lock()
	c := p.claims[uid]
	p.mu.Unlock()
	if c != nil {
		p.forget(c)
	}
	if err := p.removeFiles(uid); err != nil {
		return err
	}
	if c != nil {
		p.log.Info("claim unprepared", "uid", uid, "leases", c.leaseIDs())
	}
	return nil
}

// forget stops renewing c's leases and drops it.
func (p *Plugin) forget(c *nodeClaim) {
	c.stop()
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.claims[c.uid] == c {
		delete(p.claims, c.uid)
	}
}

// removeFiles removes the CDI spec and the state directory of the claim
// with uid; either may be gone already.
func (p *Plugin) removeFiles(uid types.UID) error {
	if err := p.specs.remove(uid); err != nil {
		return err
	}
	if err := os.RemoveAll(claimDir(p.cfg.StateDir, uid)); err != nil {
		return fmt.Errorf("state of claim %s: %w", uid, err)
	}
	return nil
}

// resume renews the leases of the claims prepared in the state directory.
// A claim whose token file cannot be read is left alone, for its
// unprepare to remove.
func (p *Plugin) resume() {
	entries, err := os.ReadDir(claimsDir(p.cfg.StateDir))
	if err != nil {
		p.log.Error("cannot resume the prepared claims", "err", err)
		return
	}
	for _, e := range entries {
		uid := types.UID(e.Name())
		if !e.IsDir() || checkClaimUID(uid) != nil {
			continue
		}
		c := &nodeClaim{uid: uid, dir: claimDir(p.cfg.StateDir, uid)}
		tf, err := client.ReadTokenFile(c.tokenFile())
		if err != nil {
			p.log.Warn("cannot resume a prepared claim; its unprepare removes it", "uid", uid, "err", err)
			continue
		}
		for _, l := range tf.Leases {
			c.leases = append(c.leases, &followedLease{id: l.LeaseID, memoryMiB: l.MemoryMiB, computePercent: l.ComputePercent, tokens: l.Tokens})
		}
		p.mu.Lock()
		p.claims[uid] = c
		p.mu.Unlock()
		c.start(p, make([]FollowedLease, len(c.leases)))
		if err := c.serveCUDA(p); err != nil {
			p.log.Error("cannot serve the claim's CUDA socket; the claim's next prepare tries again", "uid", uid, "err", err)
		}
		p.log.Info("claim resumed", "uid", uid, "leases", c.leaseIDs())
	}
}

func claimsDir(stateDir string) string { return filepath.Join(stateDir, "claims") }

func claimDir(stateDir string, uid types.UID) string {
	return filepath.Join(claimsDir(stateDir), string(uid))
}

// nodeClaim is a claim prepared on this node: its leases, renewed until
// it is unprepared or the plugin stops, and its token file.
type nodeClaim struct {
	uid    types.UID
	dir    string
	leases []*followedLease // in allocation order; fixed once started
	ctx    context.Context  // the claim's: ends at stop; set by start
	cancel context.CancelFunc
	wg     sync.WaitGroup // the renewals

	cudaMu sync.Mutex
	cuda   *cudaProxy // guarded by cudaMu; the claim's CUDA socket, or nil

	writeMu sync.Mutex // serializes writes of the token file
}

// followedLease is one lease of a nodeClaim.
type followedLease struct {
	id             string
	memoryMiB      int64
	computePercent int32

	mu     sync.Mutex
	tokens []*gpupoolv1.HostToken // guarded by mu; the latest
	ended  error                  // guarded by mu; the broker's word that it ended
}

func (c *nodeClaim) tokenFile() string { return filepath.Join(c.dir, tokenFileName) }

func (c *nodeClaim) leaseIDs() []string {
	ids := make([]string, len(c.leases))
	for i, l := range c.leases {
		ids[i] = l.id
	}
	return ids
}

// holds reports whether c's leases are leases, in order.
func (c *nodeClaim) holds(leases []claimDeviceLease) bool {
	return slices.EqualFunc(c.leases, leases, func(f *followedLease, l claimDeviceLease) bool { return f.id == l.LeaseID })
}

// endedErr is why one of c's leases ended, or nil.
func (c *nodeClaim) endedErr() error {
	for _, l := range c.leases {
		l.mu.Lock()
		err := l.ended
		l.mu.Unlock()
		if err != nil {
			return fmt.Errorf("lease %s: %w", l.id, err)
		}
	}
	return nil
}

// writeTokenFile writes the latest tokens of c's leases.
func (c *nodeClaim) writeTokenFile() error {
	c.writeMu.Lock()
	defer c.writeMu.Unlock()
	tf := &client.TokenFile{}
	for _, l := range c.leases {
		l.mu.Lock()
		tf.Leases = append(tf.Leases, client.TokenFileLease{LeaseID: l.id, MemoryMiB: l.memoryMiB, ComputePercent: l.computePercent, Tokens: l.tokens})
		l.mu.Unlock()
	}
	return client.WriteTokenFile(c.tokenFile(), tf)
}

// start renews c's leases in the background until stop or p.Stop;
// attached[i] is c.leases[i] already attached, or nil.
func (c *nodeClaim) start(p *Plugin, attached []FollowedLease) {
	ctx, cancel := context.WithCancel(p.ctx)
	c.ctx, c.cancel = ctx, cancel
	for i, l := range c.leases {
		c.wg.Go(func() { c.follow(ctx, p, l, attached[i]) })
	}
}

// stop stops renewing and waits until no renewal runs, nor rewrites the
// token file.
func (c *nodeClaim) stop() {
	c.cancel()
	c.wg.Wait()
	c.cudaMu.Lock()
	c.cuda.close()
	c.cuda = nil
	c.cudaMu.Unlock()
}

// serveCUDA serves the claim's CUDA socket, when the plugin has the shim,
// unless it does already. Its error fails the prepare, which the kubelet
// retries: a container must not start with a CDI spec whose socket
// nobody serves.
func (c *nodeClaim) serveCUDA(p *Plugin) error {
	if p.specs.shim == "" || len(c.leases) == 0 {
		return nil
	}
	c.cudaMu.Lock()
	defer c.cudaMu.Unlock()
	if c.cuda != nil || c.ctx.Err() != nil {
		return nil
	}
	px, err := startCUDAProxy(c.ctx, c.dir, c.leases[0], p.log.With("uid", c.uid))
	if err != nil {
		return fmt.Errorf("claim %s: serving its CUDA socket %s: %w", c.uid, filepath.Join(c.dir, cudaSocketName), err)
	}
	c.cuda = px
	return nil
}

// follow renews lease l (held, or to attach when nil) and rewrites the
// token file after every renewal, until ctx ends or the brokers say the
// lease ended. When renewal stops for another reason (the brokers were
// out of reach for a TTL, say) it attaches again: the binder may have
// kept the lease alive meanwhile.
func (c *nodeClaim) follow(ctx context.Context, p *Plugin, l *followedLease, held FollowedLease) {
	log := p.log.With("uid", c.uid, "lease", l.id)
	wait := reattachFirst
	for {
		for held == nil {
			var err error
			held, err = p.cfg.Brokers.Attach(ctx, l.id)
			switch {
			case ctx.Err() != nil:
				if held != nil {
					held.Close()
				}
				return
			case errors.Is(err, client.ErrLeaseEnded):
				log.Warn("lease ended; the claim's containers can no longer use it", "err", err)
				l.mu.Lock()
				l.ended = err
				l.mu.Unlock()
				return
			case err != nil:
				log.Warn("cannot attach to the lease; retrying", "err", err, "in", wait)
				if !clock.Sleep(ctx, clock.Real, wait) {
					return
				}
				wait = min(2*wait, reattachMax)
			default:
				wait = reattachFirst
			}
		}
		renewed := func() {
			l.mu.Lock()
			l.tokens = held.Tokens()
			l.mu.Unlock()
			if err := c.writeTokenFile(); err != nil {
				log.Error("cannot rewrite the token file", "err", err)
			}
		}
		held.OnRenew(renewed)
		renewed() // catch up with a renewal before OnRenew
		select {
		case <-ctx.Done():
			held.Close()
			return
		case <-held.Done():
		}
		log.Warn("lease renewal stopped; attaching again", "err", held.Err(), "in", wait)
		held.Close()
		held = nil
		if !clock.Sleep(ctx, clock.Real, wait) {
			return
		}
	}
}
