package k8s

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	resourceapi "k8s.io/api/resource/v1"
	drapb "k8s.io/kubelet/pkg/apis/dra/v1"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
)

// kubelet stands in for one node's kubelet towards our DRA driver's node
// plugin: it performs the plugin-registration handshake, as the kubelet's
// plugin watcher does, and then calls the plugin's DRAPlugin v1 service
// with the claims of pods on its node, as the kubelet's DRA manager does.
type kubelet struct {
	// Node is the node's name.
	Node string
	// Plugin is what the plugin said of itself at registration.
	Plugin *registerapi.PluginInfo

	dra drapb.DRAPluginClient
}

// newKubelet waits (up to a minute) for our driver's registration socket in
// registryDir (the plugin's --registrar-dir, the kubelet's
// /var/lib/kubelet/plugins_registry), registers the plugin as the kubelet
// does (GetInfo, check it offers the v1 DRAPlugin service, connect to its
// endpoint, NotifyRegistrationStatus), and returns the connected kubelet.
// registryDir should come from shortTempDir: socket paths are short.
func newKubelet(t testing.TB, node, registryDir string) *kubelet {
	t.Helper()
	var info *registerapi.PluginInfo
	var reg registerapi.RegistrationClient
	eventually(t, "the node plugin's registration socket in "+registryDir, time.Minute, func(ctx context.Context) error {
		var err error
		info, reg, err = findPlugin(ctx, t, registryDir)
		return err
	})
	if info.Type != registerapi.DRAPlugin {
		t.Fatalf("plugin %s registers as type %q, want %q", info.Name, info.Type, registerapi.DRAPlugin)
	}
	if !slices.Contains(info.SupportedVersions, drapb.DRAPluginService) {
		t.Fatalf("plugin %s supports %v, want %s among them", info.Name, info.SupportedVersions, drapb.DRAPluginService)
	}
	conn := dialUnix(t, info.Endpoint)
	k := &kubelet{Node: node, Plugin: info, dra: drapb.NewDRAPluginClient(conn)}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := reg.NotifyRegistrationStatus(ctx, &registerapi.RegistrationStatus{PluginRegistered: true}); err != nil {
		t.Fatalf("notify plugin %s of its registration: %v", info.Name, err)
	}
	return k
}

// kubeletDirs makes, under a short temporary directory, the kubelet's
// plugin registry directory (/var/lib/kubelet/plugins_registry) and our
// node plugin's data directory (/var/lib/kubelet/plugins/gpu.gpupool.dev),
// which the kubelet and the DaemonSet's hostPath volumes would create:
// kubeletplugin creates sockets in them, not the directories.
func kubeletDirs(t testing.TB) (registry, plugin string) {
	t.Helper()
	dir := shortTempDir(t)
	registry, plugin = filepath.Join(dir, "registry"), filepath.Join(dir, "plugins", driverName)
	for _, d := range []string{registry, plugin} {
		if err := os.MkdirAll(d, 0o750); err != nil {
			t.Fatal(err)
		}
	}
	return registry, plugin
}

// findPlugin asks every socket in dir for its plugin info and returns our
// driver's, with a client of its registration service.
func findPlugin(ctx context.Context, t testing.TB, dir string) (*registerapi.PluginInfo, registerapi.RegistrationClient, error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, nil, err
	}
	var seen []string
	for _, e := range entries {
		if e.Type()&os.ModeSocket == 0 {
			continue
		}
		conn, err := grpc.NewClient("unix://"+filepath.Join(dir, e.Name()), grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			return nil, nil, err
		}
		reg := registerapi.NewRegistrationClient(conn)
		callCtx, cancel := context.WithTimeout(ctx, 5*time.Second)
		info, err := reg.GetInfo(callCtx, &registerapi.InfoRequest{})
		cancel()
		if err == nil && info.Name == driverName {
			t.Cleanup(func() { conn.Close() })
			return info, reg, nil
		}
		conn.Close()
		if err != nil {
			seen = append(seen, fmt.Sprintf("%s: %v", e.Name(), err))
		} else {
			seen = append(seen, fmt.Sprintf("%s: plugin %q", e.Name(), info.Name))
		}
	}
	if len(seen) == 0 {
		return nil, nil, errors.New("no socket yet")
	}
	return nil, nil, fmt.Errorf("no socket of %s: %s", driverName, strings.Join(seen, "; "))
}

// dialUnix connects to the gRPC server on a unix socket; the connection is
// closed when t ends.
func dialUnix(t testing.TB, path string) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient("unix://"+path, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatalf("dial %s: %v", path, err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

// prepare calls NodePrepareResources with claims, identified as the kubelet
// does by namespace, name and UID. Per-claim failures are in the response.
func (k *kubelet) prepare(ctx context.Context, claims ...*resourceapi.ResourceClaim) (*drapb.NodePrepareResourcesResponse, error) {
	return k.dra.NodePrepareResources(ctx, &drapb.NodePrepareResourcesRequest{Claims: claimRefs(claims)})
}

// unprepare calls NodeUnprepareResources with claims. Per-claim failures
// are in the response.
func (k *kubelet) unprepare(ctx context.Context, claims ...*resourceapi.ResourceClaim) (*drapb.NodeUnprepareResourcesResponse, error) {
	return k.dra.NodeUnprepareResources(ctx, &drapb.NodeUnprepareResourcesRequest{Claims: claimRefs(claims)})
}

func claimRefs(claims []*resourceapi.ResourceClaim) []*drapb.Claim {
	refs := make([]*drapb.Claim, 0, len(claims))
	for _, c := range claims {
		refs = append(refs, &drapb.Claim{Namespace: c.Namespace, Name: c.Name, Uid: string(c.UID)})
	}
	return refs
}
