package nodeplugin

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	oci "github.com/opencontainers/runtime-spec/specs-go"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/proto"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	drapb "k8s.io/kubelet/pkg/apis/dra/v1"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
	"tags.cncf.io/container-device-interface/pkg/cdi"

	"github.com/gpupool/gpupool/client"
	"github.com/gpupool/gpupool/k8s/driver"
	"github.com/gpupool/gpupool/k8s/internal/k8stest"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// fakeBrokers grants attaches to every lease except the ended ones.
type fakeBrokers struct {
	attached chan string // each attached lease id

	mu     sync.Mutex
	ended  map[string]string     // guarded by mu; lease id → the broker's reason
	leases map[string]*fakeLease // guarded by mu; the latest attach of each lease
	calls  map[string]int        // guarded by mu; attaches per lease
}

func newFakeBrokers() *fakeBrokers {
	return &fakeBrokers{attached: make(chan string, 64), ended: map[string]string{},
		leases: map[string]*fakeLease{}, calls: map[string]int{}}
}

func (b *fakeBrokers) Attach(_ context.Context, id string) (FollowedLease, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.calls[id]++
	if why, ok := b.ended[id]; ok {
		return nil, fmt.Errorf("%w: %s", client.ErrLeaseEnded, why)
	}
	l := &fakeLease{id: id, done: make(chan struct{})}
	l.tokens = []*gpupoolv1.HostToken{{Host: "h1", Token: l.nextToken(), Address: "10.0.0.7:7650", CertSha256: "9f86"}}
	b.leases[id] = l
	b.attached <- id
	return l, nil
}

// lease is the latest attach of id.
func (b *fakeBrokers) lease(id string) *fakeLease {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.leases[id]
}

func (b *fakeBrokers) attaches(id string) int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.calls[id]
}

// end makes the broker refuse id from now on, with why.
func (b *fakeBrokers) end(id, why string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.ended[id] = why
}

// waitAttach waits for an attach of id.
func (b *fakeBrokers) waitAttach(t *testing.T, id string) {
	t.Helper()
	timeout := time.After(20 * time.Second)
	for {
		select {
		case got := <-b.attached:
			if got == id {
				return
			}
		case <-timeout:
			t.Fatalf("lease %s was never attached", id)
		}
	}
}

// fakeLease is a lease renewed when the test says.
type fakeLease struct {
	id   string
	done chan struct{}

	mu      sync.Mutex
	n       int                    // guarded by mu; renewals so far
	tokens  []*gpupoolv1.HostToken // guarded by mu
	onRenew func()                 // guarded by mu
	err     error                  // guarded by mu
	closed  bool                   // guarded by mu
}

func (l *fakeLease) nextToken() string {
	l.n++
	return fmt.Sprintf("tok-%s-%d", l.id, l.n)
}

func (l *fakeLease) Tokens() []*gpupoolv1.HostToken {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.tokens
}

func (l *fakeLease) OnRenew(fn func()) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.onRenew = fn
}

func (l *fakeLease) Done() <-chan struct{} { return l.done }

func (l *fakeLease) Err() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.err
}

func (l *fakeLease) Close() { l.stop(context.Canceled) }

func (l *fakeLease) stop(err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.closed {
		l.closed, l.err = true, err
		close(l.done)
	}
}

func (l *fakeLease) isClosed() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.closed
}

// renew gives the lease a new token and returns it.
func (l *fakeLease) renew() string {
	l.mu.Lock()
	t := proto.CloneOf(l.tokens[0])
	t.Token = l.nextToken()
	l.tokens = []*gpupoolv1.HostToken{t}
	fn := l.onRenew
	l.mu.Unlock()
	if fn != nil {
		fn()
	}
	return t.Token
}

// testDevice is one allocated device of a test claim and its status.
type testDevice struct {
	request, pool, device string
	status                *resourceapi.AllocatedDeviceStatus // nil: none yet
}

// leasedDevice is a device the binder leased as lease id.
func leasedDevice(request, pool, device, id string, memMiB int64, compute int32) testDevice {
	raw, _ := json.Marshal(driver.DeviceStatusData{LeaseID: id, Host: pool, AgentAddress: "10.0.0.7:7650", CertSHA256: "9f86",
		MemoryMiB: memMiB, ComputePercent: compute})
	return testDevice{request, pool, device, &resourceapi.AllocatedDeviceStatus{Driver: driver.Name, Pool: pool, Device: device,
		Conditions: []metav1.Condition{{Type: driver.ConditionLeased, Status: metav1.ConditionTrue, Reason: "LeaseGranted"}},
		Data:       &runtime.RawExtension{Raw: raw}}}
}

func newClaim(uid string, devices ...testDevice) *resourceapi.ResourceClaim {
	c := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Namespace: "team-a", Name: "claim-" + uid, UID: types.UID(uid)}}
	c.Status.Allocation = &resourceapi.AllocationResult{}
	for _, d := range devices {
		c.Status.Allocation.Devices.Results = append(c.Status.Allocation.Devices.Results,
			resourceapi.DeviceRequestAllocationResult{Request: d.request, Driver: driver.Name, Pool: d.pool, Device: d.device})
		if d.status != nil {
			c.Status.Devices = append(c.Status.Devices, *d.status)
		}
	}
	return c
}

// testNode is a node plugin served to a test that plays the kubelet.
type testNode struct {
	cfg     Config
	plugin  *Plugin
	brokers *fakeBrokers
	dra     drapb.DRAPluginClient
}

// shortTempDir is a temporary directory with a path short enough for unix
// sockets, removed at the end of the test.
func shortTempDir(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "gpnp")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// newTestConfig configures a plugin with temporary directories and the
// claims in the API.
func newTestConfig(t *testing.T, brokers *fakeBrokers, claims ...*resourceapi.ResourceClaim) Config {
	t.Helper()
	objs := make([]runtime.Object, len(claims))
	for i, c := range claims {
		objs[i] = c
	}
	sockets := shortTempDir(t)
	registrar := filepath.Join(sockets, "registry")
	if err := os.Mkdir(registrar, 0o755); err != nil {
		t.Fatal(err)
	}
	return Config{
		NodeName:     "node-1",
		KubeClient:   fake.NewClientset(objs...),
		Brokers:      brokers,
		StateDir:     t.TempDir(),
		CDIDir:       t.TempDir(),
		PluginDir:    filepath.Join(sockets, "plugin"),
		RegistrarDir: registrar,
		Logger:       slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelInfo})),
	}
}

// startNode starts a plugin with cfg and connects to its DRA socket as
// the kubelet does; both stop at the end of the test.
func startNode(t *testing.T, cfg Config) *testNode {
	t.Helper()
	p, err := Start(t.Context(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Stop)
	conn, err := grpc.NewClient("unix://"+filepath.Join(cfg.PluginDir, "dra.sock"), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return &testNode{cfg: cfg, plugin: p, brokers: cfg.Brokers.(*fakeBrokers), dra: drapb.NewDRAPluginClient(conn)}
}

func (n *testNode) prepare(t *testing.T, claims ...*resourceapi.ResourceClaim) map[string]*drapb.NodePrepareResourceResponse {
	t.Helper()
	req := &drapb.NodePrepareResourcesRequest{}
	for _, c := range claims {
		req.Claims = append(req.Claims, &drapb.Claim{Namespace: c.Namespace, Name: c.Name, Uid: string(c.UID)})
	}
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	resp, err := n.dra.NodePrepareResources(ctx, req)
	if err != nil {
		t.Fatalf("NodePrepareResources: %v", err)
	}
	return resp.Claims
}

// unprepare unprepares the claims with uids, as the kubelet does when
// the claims may be gone: by UID, namespace and name only.
func (n *testNode) unprepare(t *testing.T, uids ...string) map[string]*drapb.NodeUnprepareResourceResponse {
	t.Helper()
	req := &drapb.NodeUnprepareResourcesRequest{}
	for _, uid := range uids {
		req.Claims = append(req.Claims, &drapb.Claim{Namespace: "team-a", Name: "claim-" + uid, Uid: uid})
	}
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	resp, err := n.dra.NodeUnprepareResources(ctx, req)
	if err != nil {
		t.Fatalf("NodeUnprepareResources: %v", err)
	}
	return resp.Claims
}

func (n *testNode) specPath(uid string) string {
	return filepath.Join(n.cfg.CDIDir, driver.Name+"-"+uid+".json")
}

func (n *testNode) tokenPath(uid string) string {
	return filepath.Join(n.cfg.StateDir, "claims", uid, "token.json")
}

// holdsToken checks that the token file at path holds token for lease id,
// for eventually.
func holdsToken(path, id, token string) func() (bool, string) {
	return func() (bool, string) {
		got, err := tokenOf(path, id)
		if err != nil {
			return false, err.Error()
		}
		return got == token, "token " + got + ", want " + token
	}
}

// tokenOf is the token of lease id in the token file at path.
func tokenOf(path, id string) (string, error) {
	tf, err := client.ReadTokenFile(path)
	if err != nil {
		return "", err
	}
	for _, l := range tf.Leases {
		if l.LeaseID == id {
			return l.Tokens[0].Token, nil
		}
	}
	return "", fmt.Errorf("no lease %s in %s", id, path)
}

const uid1 = "0b6c3c1e-7d2a-4c55-9a1e-4f3f5b0c2d11"

func TestRegistersWithTheKubeletAsADRAPluginV1(t *testing.T) {
	n := startNode(t, newTestConfig(t, newFakeBrokers()))
	conn, err := grpc.NewClient("unix://"+filepath.Join(n.cfg.RegistrarDir, driver.Name+"-reg.sock"), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	info, err := registerapi.NewRegistrationClient(conn).GetInfo(t.Context(), &registerapi.InfoRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if info.Name != driver.Name || info.Type != registerapi.DRAPlugin || !slices.Contains(info.SupportedVersions, drapb.DRAPluginService) ||
		info.Endpoint != filepath.Join(n.cfg.PluginDir, "dra.sock") {
		t.Fatalf("registration info %v, want %s as a DRA plugin offering %s at its dra.sock", info, driver.Name, drapb.DRAPluginService)
	}
}

func TestPrepareHandsTheClaimsLeasesToTheContainerThroughCDI(t *testing.T) {
	claim := newClaim(uid1,
		leasedDevice("gpu", "h1", "gpu-0", "l-1", 8192, 25),
		leasedDevice("gpu", "h2", "gpu-3", "l-2", 81920, 100))
	n := startNode(t, newTestConfig(t, newFakeBrokers(), claim))

	resp := n.prepare(t, claim)[uid1]
	if resp.GetError() != "" {
		t.Fatalf("prepare failed: %s", resp.Error)
	}
	cdiID := "gpu.gpupool.dev/claim=" + uid1
	want := []*drapb.Device{
		{RequestNames: []string{"gpu"}, PoolName: "h1", DeviceName: "gpu-0", CdiDeviceIds: []string{cdiID}},
		{RequestNames: []string{"gpu"}, PoolName: "h2", DeviceName: "gpu-3", CdiDeviceIds: []string{cdiID}},
	}
	if !slices.EqualFunc(resp.Devices, want, func(a, b *drapb.Device) bool { return proto.Equal(a, b) }) {
		t.Fatalf("prepared devices %v, want %v", resp.Devices, want)
	}

	// The spec is one the container runtime accepts: read it back with the
	// CDI library and apply it to a container, as the runtime does.
	spec, err := cdi.ReadSpec(n.specPath(uid1), 0)
	if err != nil {
		t.Fatal(err)
	}
	if spec.Kind != CDIKind || spec.GetDevice(uid1) == nil {
		t.Fatalf("spec of kind %s has devices %v, want kind %s with device %s", spec.Kind, spec.Devices, CDIKind, uid1)
	}
	container := &oci.Spec{Process: &oci.Process{}}
	if err := spec.GetDevice(uid1).ApplyEdits(container); err != nil {
		t.Fatal(err)
	}
	for _, env := range []string{
		"GPUPOOL_LEASE_ID=l-1,l-2",
		"GPUPOOL_AGENT_ADDR=10.0.0.7:7650,10.0.0.7:7650",
		"GPUPOOL_MEMORY_MIB=8192,81920",
		"GPUPOOL_COMPUTE_PERCENT=25,100",
		"GPUPOOL_TOKEN_FILE=/var/run/gpupool/token.json",
	} {
		if !slices.Contains(container.Process.Env, env) {
			t.Errorf("container env %v lacks %s", container.Process.Env, env)
		}
	}
	claimDir := filepath.Join(n.cfg.StateDir, "claims", uid1)
	if len(container.Mounts) != 1 || container.Mounts[0].Source != claimDir || container.Mounts[0].Destination != "/var/run/gpupool" ||
		!slices.Contains(container.Mounts[0].Options, "ro") {
		t.Fatalf("container mounts %+v, want %s read-only at /var/run/gpupool", container.Mounts, claimDir)
	}

	// The mounted directory holds the token file the SDK reads.
	l, err := client.OpenTokenFile(n.tokenPath(uid1), "")
	if err != nil {
		t.Fatal(err)
	}
	l.Close()
	tf, err := client.ReadTokenFile(n.tokenPath(uid1))
	if err != nil {
		t.Fatal(err)
	}
	if l.ID() != "l-1" || len(tf.Leases) != 2 || tf.Leases[1].LeaseID != "l-2" || tf.Leases[1].MemoryMiB != 81920 || tf.Leases[1].ComputePercent != 100 {
		t.Fatalf("token file %+v, want l-1 then l-2 with their slices", tf)
	}
	if st, _ := os.Stat(claimDir); st.Mode().Perm() != 0o755 {
		t.Errorf("claim directory mode %v, want 0755: a container's non-root user reads it", st.Mode().Perm())
	}
	if st, _ := os.Stat(filepath.Dir(claimDir)); st.Mode().Perm() != 0o700 {
		t.Errorf("claims directory mode %v, want 0700: other users of the node must not read tokens", st.Mode().Perm())
	}

	// Each renewal rewrites the token file.
	for range 2 {
		tok := n.brokers.lease("l-2").renew()
		k8stest.Eventually(t, "the token file to hold the renewed token", holdsToken(n.tokenPath(uid1), "l-2", tok))
	}

	// Preparing again answers the same, without attaching again.
	again := n.prepare(t, claim)[uid1]
	if !proto.Equal(again, resp) {
		t.Fatalf("second prepare %v, want %v", again, resp)
	}
	if got := n.brokers.attaches("l-1"); got != 1 {
		t.Fatalf("l-1 attached %d times, want once", got)
	}
}

func TestUnprepareStopsRenewingRemovesTheFilesAndIsIdempotent(t *testing.T) {
	claim := newClaim(uid1, leasedDevice("gpu", "h1", "gpu-0", "l-1", 8192, 25))
	n := startNode(t, newTestConfig(t, newFakeBrokers(), claim))
	if resp := n.prepare(t, claim)[uid1]; resp.GetError() != "" {
		t.Fatalf("prepare failed: %s", resp.Error)
	}
	// The kubelet unprepares claims that may be gone from the API.
	if err := n.cfg.KubeClient.ResourceV1().ResourceClaims(claim.Namespace).Delete(t.Context(), claim.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	const unknown = "9d0f6a52-1111-4c55-9a1e-4f3f5b0c2d11"
	for i := range 2 {
		resp := n.unprepare(t, uid1, unknown)
		for uid, r := range resp {
			if r.GetError() != "" {
				t.Fatalf("unprepare %d of %s: %s", i+1, uid, r.Error)
			}
		}
		if len(resp) != 2 {
			t.Fatalf("unprepare %d answered for %d claims, want 2", i+1, len(resp))
		}
		for _, p := range []string{n.specPath(uid1), filepath.Dir(n.tokenPath(uid1))} {
			if _, err := os.Stat(p); !errors.Is(err, fs.ErrNotExist) {
				t.Fatalf("after unprepare %d, %s: %v; want it gone", i+1, p, err)
			}
		}
	}
	if !n.brokers.lease("l-1").isClosed() {
		t.Fatal("the lease is still renewed after unprepare")
	}
}

func TestPrepareSaysWhyAClaimCannotBePreparedYet(t *testing.T) {
	failed := leasedDevice("gpu", "h1", "gpu-0", "l-1", 8192, 25)
	failed.status.Conditions = []metav1.Condition{{Type: driver.ConditionLeaseFailed, Status: metav1.ConditionTrue, Reason: "ResourceExhausted",
		Message: "no GPU of host h1 has 8192 MiB free"}}
	ended := leasedDevice("gpu", "h1", "gpu-0", "l-1", 8192, 25)
	ended.status.Conditions = []metav1.Condition{{Type: driver.ConditionLeased, Status: metav1.ConditionFalse, Reason: "LeaseEnded",
		Message: "released by admin"}}
	noData := leasedDevice("gpu", "h1", "gpu-0", "l-1", 8192, 25)
	noData.status.Data = nil
	badData := leasedDevice("gpu", "h1", "gpu-0", "l-1", 8192, 25)
	badData.status.Data = &runtime.RawExtension{Raw: []byte(`{"leaseId": 7}`)}
	otherDevice := leasedDevice("gpu", "h1", "gpu-1", "l-1", 8192, 25)
	otherDevice.device = "gpu-0" // the status is for a device not allocated

	for _, tc := range []struct {
		name  string
		dev   testDevice
		ended string // the broker says this lease ended
		want  string
	}{
		{"a device the binder has not leased yet", testDevice{"gpu", "h1", "gpu-0", nil}, "", "device gpu-0 of pool h1 (request gpu): not leased yet: status.devices has no Leased=True"},
		{"a status for another device only", otherDevice, "", "device gpu-0 of pool h1 (request gpu): not leased yet"},
		{"a lease the broker refused", failed, "", "the gpupool lease failed (ResourceExhausted): no GPU of host h1 has 8192 MiB free"},
		{"a lease that ended", ended, "", "no gpupool lease (LeaseEnded): released by admin"},
		{"Leased without data", noData, "", "Leased=True but status.devices has no data"},
		{"data of another shape", badData, "", "status.devices data is not gpupool lease data"},
		{"a lease ended at the broker", leasedDevice("gpu", "h1", "gpu-0", "l-1", 8192, 25), "lease l-1 was released: by user", "lease l-1 of device gpu-0 of pool h1: lease ended: lease l-1 was released: by user"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			claim := newClaim(uid1, tc.dev)
			brokers := newFakeBrokers()
			if tc.ended != "" {
				brokers.end("l-1", tc.ended)
			}
			n := startNode(t, newTestConfig(t, brokers, claim))
			resp := n.prepare(t, claim)[uid1]
			if !strings.Contains(resp.GetError(), tc.want) || !strings.Contains(resp.GetError(), "claim team-a/claim-"+uid1) {
				t.Fatalf("prepare error %q, want it to name the claim and say %q", resp.GetError(), tc.want)
			}
			for _, p := range []string{n.specPath(uid1), filepath.Dir(n.tokenPath(uid1))} {
				if _, err := os.Stat(p); !errors.Is(err, fs.ErrNotExist) {
					t.Errorf("a failed prepare left %s: %v", p, err)
				}
			}
		})
	}
}

func TestPluginResumesRenewingAfterARestart(t *testing.T) {
	claim := newClaim(uid1, leasedDevice("gpu", "h1", "gpu-0", "l-1", 8192, 25))
	cfg := newTestConfig(t, newFakeBrokers(), claim)
	first := startNode(t, cfg)
	resp := first.prepare(t, claim)[uid1]
	if resp.GetError() != "" {
		t.Fatalf("prepare failed: %s", resp.Error)
	}
	first.plugin.Stop()
	if !first.brokers.lease("l-1").isClosed() {
		t.Fatal("the stopped plugin still renews")
	}
	if _, err := os.Stat(first.tokenPath(uid1)); err != nil {
		t.Fatalf("stopping removed the token file: %v", err)
	}

	cfg.Brokers = newFakeBrokers()
	second := startNode(t, cfg)
	second.brokers.waitAttach(t, "l-1")
	tok := second.brokers.lease("l-1").renew()
	k8stest.Eventually(t, "the restarted plugin to rewrite the token file", holdsToken(second.tokenPath(uid1), "l-1", tok))
	if again := second.prepare(t, claim)[uid1]; !proto.Equal(again, resp) {
		t.Fatalf("prepare after the restart: %v, want %v", again, resp)
	}
	if r := second.unprepare(t, uid1)[uid1]; r.GetError() != "" {
		t.Fatalf("unprepare after the restart: %s", r.Error)
	}
	if _, err := os.Stat(second.specPath(uid1)); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("CDI spec after unprepare: %v, want it gone", err)
	}
}

func TestALeaseWhoseRenewalStopsIsAttachedAgainUntilTheBrokerSaysItEnded(t *testing.T) {
	claim := newClaim(uid1, leasedDevice("gpu", "h1", "gpu-0", "l-1", 8192, 25))
	n := startNode(t, newTestConfig(t, newFakeBrokers(), claim))
	if resp := n.prepare(t, claim)[uid1]; resp.GetError() != "" {
		t.Fatalf("prepare failed: %s", resp.Error)
	}
	n.brokers.waitAttach(t, "l-1")
	// The brokers were out of reach for a TTL; the binder kept the lease.
	n.brokers.lease("l-1").stop(errors.New("lease ended: could not renew it before it expired"))
	n.brokers.waitAttach(t, "l-1")

	// Now it really ends: the next prepare says so, with the broker's reason.
	n.brokers.end("l-1", "revoked by operator: host h1 drained")
	n.brokers.lease("l-1").stop(client.ErrLeaseEnded)
	k8stest.Eventually(t, "prepare to report the end of the lease", func() (bool, string) {
		e := n.prepare(t, claim)[uid1].GetError()
		return strings.Contains(e, "lease l-1: lease ended: revoked by operator: host h1 drained"), "prepare error " + e
	})
}

func TestPrepareAndUnprepareRefuseAUIDThatCannotNameAFile(t *testing.T) {
	const bad = "../../etc"
	claim := newClaim(bad, leasedDevice("gpu", "h1", "gpu-0", "l-1", 8192, 25))
	n := startNode(t, newTestConfig(t, newFakeBrokers(), claim))
	want := `claim UID "../../etc": must be letters, digits`
	if e := n.prepare(t, claim)[bad].GetError(); !strings.Contains(e, want) {
		t.Errorf("prepare: %q, want %q", e, want)
	}
	if e := n.unprepare(t, bad)[bad].GetError(); !strings.Contains(e, want) {
		t.Errorf("unprepare: %q, want %q", e, want)
	}
}

func TestStartNodePluginSaysWhatIsMissing(t *testing.T) {
	base := newTestConfig(t, newFakeBrokers())
	for _, tc := range []struct {
		name   string
		modify func(*Config)
		want   string
	}{
		{"no node name", func(c *Config) { c.NodeName = "" }, "NodeName: must be set"},
		{"no kube client", func(c *Config) { c.KubeClient = nil }, "KubeClient: must be set"},
		{"no brokers", func(c *Config) { c.Brokers = nil }, "Brokers: must be set"},
		{"no registrar directory", func(c *Config) { c.RegistrarDir = filepath.Join(t.TempDir(), "absent") }, "kubelet's plugins_registry"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := base
			tc.modify(&cfg)
			p, err := Start(t.Context(), cfg)
			if err == nil {
				p.Stop()
			}
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want an error saying %q", err, tc.want)
			}
		})
	}
}

func TestNodePluginFollowsARealBrokerLeaseUntilItEnds(t *testing.T) {
	c := k8stest.StartBroker(t)
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	if _, err := c.Agent.Register(ctx, &gpupoolv1.RegisterRequest{Host: k8stest.ReadyHost("h1", 1)}); err != nil {
		t.Fatal(err)
	}
	// The binder's lease; a short TTL makes renewals frequent.
	l, err := c.Acquire(ctx, &gpupoolv1.LeaseRequest{Count: 1, MemoryMib: 8192, ComputePercent: 25, TtlMs: 1500})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	claim := newClaim(uid1, leasedDevice("gpu", "h1", "gpu-0", l.ID(), 8192, 25))
	cfg := newTestConfig(t, nil, claim)
	cfg.Brokers = ClientAttacher(c)
	p, err := Start(t.Context(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Stop)
	conn, err := grpc.NewClient("unix://"+filepath.Join(cfg.PluginDir, "dra.sock"), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	n := &testNode{cfg: cfg, plugin: p, dra: drapb.NewDRAPluginClient(conn)}
	if resp := n.prepare(t, claim)[uid1]; resp.GetError() != "" {
		t.Fatalf("prepare failed: %s", resp.Error)
	}
	first, err := tokenOf(n.tokenPath(uid1), l.ID())
	if err != nil {
		t.Fatal(err)
	}
	k8stest.Eventually(t, "a renewal to rewrite the token file", func() (bool, string) {
		now, err := tokenOf(n.tokenPath(uid1), l.ID())
		return err == nil && now != first, fmt.Sprintf("token unchanged (%v)", err)
	})

	if err := l.Release(ctx, "test over"); err != nil {
		t.Fatal(err)
	}
	k8stest.Eventually(t, "prepare to report the end of the lease", func() (bool, string) {
		e := n.prepare(t, claim)[uid1].GetError()
		return strings.Contains(e, "lease "+l.ID()) && strings.Contains(e, "lease ended"), "prepare error " + e
	})
	if _, err := ClientAttacher(c).Attach(ctx, "l-0000000000000000"); !errors.Is(err, client.ErrLeaseEnded) {
		t.Fatalf("attach to an unknown lease: %v, want ErrLeaseEnded", err)
	}
}

// A re-prepare that fails (here: the token file cannot be written) leaves
// the claim's directory as it is, the same directory a running container
// has mounted, rather than removing it for the next prepare to make anew.
func TestAFailedReprepareKeepsTheDirectoryARunningContainerMounted(t *testing.T) {
	claim := newClaim(uid1, leasedDevice("gpu", "h1", "gpu-0", "l-1", 8192, 25))
	cfg := newTestConfig(t, newFakeBrokers(), claim)
	n := startNode(t, cfg)
	if resp := n.prepare(t, claim)[uid1]; resp.GetError() != "" {
		t.Fatalf("prepare failed: %s", resp.Error)
	}
	dir := filepath.Dir(n.tokenPath(uid1))
	before, err := os.Stat(dir)
	if err != nil {
		t.Fatal(err)
	}

	// The claim was leased anew (l-2), and its token file cannot be
	// replaced: a non-empty directory is in its way.
	realloc := newClaim(uid1, leasedDevice("gpu", "h1", "gpu-0", "l-2", 8192, 25))
	if _, err := cfg.KubeClient.ResourceV1().ResourceClaims(realloc.Namespace).UpdateStatus(t.Context(), realloc, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	// The plugin's renewal may write the token file again between the
	// remove and the mkdir: try again until the directory is in place
	// (a renewal then fails on it as the re-prepare must).
	inTheWay := filepath.Join(n.tokenPath(uid1), "in-the-way")
	for deadline := time.Now().Add(10 * time.Second); ; {
		if err := os.Remove(n.tokenPath(uid1)); err != nil && !errors.Is(err, fs.ErrNotExist) {
			t.Fatal(err)
		}
		err := os.MkdirAll(inTheWay, 0o755)
		if err == nil {
			break
		}
		if !errors.Is(err, syscall.ENOTDIR) || time.Now().After(deadline) {
			t.Fatal(err)
		}
	}
	if resp := n.prepare(t, realloc)[uid1]; resp.GetError() == "" {
		t.Fatal("re-prepare succeeded, want it to fail writing the token file")
	}
	after, err := os.Stat(dir)
	if err != nil {
		t.Fatalf("the claim's directory after a failed re-prepare: %v, want it kept", err)
	}
	if !os.SameFile(before, after) {
		t.Error("the claim's directory was replaced: a running container would keep the old one mounted")
	}
	if _, err := os.Stat(n.specPath(uid1)); err != nil {
		t.Errorf("the CDI spec after a failed re-prepare: %v, want it kept", err)
	}
}
