package nodeplugin

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io/fs"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	cdispec "tags.cncf.io/container-device-interface/specs-go"

	"github.com/gpupool/gpupool/client"
	"github.com/gpupool/gpupool/k8s/internal/k8stest"
)

func TestWithTheShimAClaimsCDIDeviceCarriesItAndItsCUDASocketUntilTheLeaseEnds(t *testing.T) {
	claim := newClaim(uid1, leasedDevice("gpu", "h1", "gpu-0", "l-1", 8192, 25))
	cfg := newTestConfig(t, newFakeBrokers(), claim)
	cfg.StateDir = shortTempDir(t) // the claim's socket is in it
	shim := []byte("\x7fELF the shim")
	cfg.CUDAShim = filepath.Join(t.TempDir(), "libcuda.so.1")
	if err := os.WriteFile(cfg.CUDAShim, shim, 0o644); err != nil {
		t.Fatal(err)
	}
	n := startNode(t, cfg)
	if resp := n.prepare(t, claim)[uid1]; resp.GetError() != "" {
		t.Fatalf("prepare failed: %s", resp.Error)
	}
	b, err := os.ReadFile(n.specPath(uid1))
	if err != nil {
		t.Fatal(err)
	}
	var spec cdispec.Spec
	if err := json.Unmarshal(b, &spec); err != nil {
		t.Fatal(err)
	}
	edits := spec.Devices[0].ContainerEdits
	if want := EnvCUDASocket + "=" + ContainerCUDASocket; !slices.Contains(edits.Env, want) {
		t.Errorf("env %v, want %s among it", edits.Env, want)
	}
	installed := filepath.Join(cfg.StateDir, "lib", "libcuda.so.1")
	if got, err := os.ReadFile(installed); err != nil || !bytes.Equal(got, shim) {
		t.Errorf("the shim on the node at %s: %q, %v; want a copy of %s", installed, got, err, cfg.CUDAShim)
	}
	mounted := map[string]string{}
	for _, m := range edits.Mounts {
		mounted[m.ContainerPath] = m.HostPath
	}
	for _, p := range ShimContainerPaths() {
		if mounted[p] != installed {
			t.Errorf("mount at %s: from %q, want %s", p, mounted[p], installed)
		}
	}
	if !slices.Contains(ShimContainerPaths(), "/usr/lib64/libcuda.so.1") {
		t.Errorf("shim paths %v: want /usr/lib64 (the Red Hat family's loader default) among them", ShimContainerPaths())
	}
	sock := filepath.Join(cfg.StateDir, "claims", uid1, "cuda.sock")
	if st, err := os.Stat(sock); err != nil || st.Mode()&fs.ModeSocket == 0 {
		t.Errorf("the claim's CUDA socket %s: %v, want a socket", sock, err)
	}

	// The lease ends: the claim is refused at prepare and its CDI spec,
	// which would give a container a dead GPU, is gone.
	n.brokers.waitAttach(t, "l-1")
	n.brokers.end("l-1", "released by user")
	n.brokers.lease("l-1").stop(client.ErrLeaseEnded)
	k8stest.Eventually(t, "prepare to refuse the claim of an ended lease", func() (bool, string) {
		e := n.prepare(t, claim)[uid1].GetError()
		return strings.Contains(e, "lease ended: released by user"), "prepare error " + e
	})
	if _, err := os.Stat(n.specPath(uid1)); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("CDI spec of the claim of an ended lease: %v, want it gone", err)
	}
	if resp := n.unprepare(t, uid1)[uid1]; resp.GetError() != "" {
		t.Fatalf("unprepare: %s", resp.Error)
	}
	if _, err := os.Stat(sock); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("the CUDA socket after unprepare: %v, want it gone", err)
	}
}

func TestANodePluginWithoutTheShimGivesNoCUDA(t *testing.T) {
	claim := newClaim(uid1, leasedDevice("gpu", "h1", "gpu-0", "l-1", 8192, 25))
	n := startNode(t, newTestConfig(t, newFakeBrokers(), claim))
	if resp := n.prepare(t, claim)[uid1]; resp.GetError() != "" {
		t.Fatalf("prepare failed: %s", resp.Error)
	}
	b, err := os.ReadFile(n.specPath(uid1))
	if err != nil {
		t.Fatal(err)
	}
	if bytes.Contains(b, []byte(EnvCUDASocket)) || bytes.Contains(b, []byte("libcuda")) {
		t.Errorf("spec %s: want no CUDA without a shim", b)
	}
}

func TestAClaimWhoseCUDASocketCannotStartFailsItsPrepareUntilItCan(t *testing.T) {
	claim := newClaim(uid1, leasedDevice("gpu", "h1", "gpu-0", "l-1", 8192, 25))
	cfg := newTestConfig(t, newFakeBrokers(), claim)
	cfg.StateDir = shortTempDir(t)
	cfg.CUDAShim = filepath.Join(t.TempDir(), "libcuda.so.1")
	if err := os.WriteFile(cfg.CUDAShim, []byte("\x7fELF the shim"), 0o644); err != nil {
		t.Fatal(err)
	}
	// Something that is not a socket, and that cannot be removed, holds
	// the socket's path.
	sock := filepath.Join(cfg.StateDir, "claims", uid1, "cuda.sock")
	if err := os.MkdirAll(filepath.Join(sock, "in-the-way"), 0o755); err != nil {
		t.Fatal(err)
	}
	n := startNode(t, cfg)
	if e := n.prepare(t, claim)[uid1].GetError(); !strings.Contains(e, "serving its CUDA socket "+sock) {
		t.Fatalf("prepare with the socket's path taken: error %q, want one naming the socket", e)
	}
	if err := os.RemoveAll(sock); err != nil {
		t.Fatal(err)
	}
	// The kubelet retries; the plugin tries the socket again.
	if e := n.prepare(t, claim)[uid1].GetError(); e != "" {
		t.Fatalf("prepare again once the path is free: %s", e)
	}
	if st, err := os.Stat(sock); err != nil || st.Mode()&fs.ModeSocket == 0 {
		t.Fatalf("the claim's CUDA socket %s after the retried prepare: %v, want a socket", sock, err)
	}
	if n.brokers.attaches("l-1") != 1 {
		t.Errorf("attaches of l-1: %d, want 1 (the failed prepare kept the claim's lease)", n.brokers.attaches("l-1"))
	}
}

func TestAStoppedCUDAProxyLeavesTheSocketOfTheOneThatReplacedIt(t *testing.T) {
	dir := shortTempDir(t)
	l := &followedLease{id: "l-1"}
	log := slog.New(slog.DiscardHandler)
	older, err := startCUDAProxy(context.Background(), dir, l, log)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(older.close)
	// A newer plugin instance resumes the claim: it takes the path over.
	newer, err := startCUDAProxy(context.Background(), dir, l, log)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(newer.close)
	sock := filepath.Join(dir, cudaSocketName)
	before, err := os.Lstat(sock)
	if err != nil {
		t.Fatal(err)
	}
	older.close()
	after, err := os.Lstat(sock)
	if err != nil || !os.SameFile(before, after) {
		t.Fatalf("the newer proxy's socket after the older one stopped: %v, want it left alone", err)
	}
	c, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatalf("connecting to the newer proxy: %v", err)
	}
	c.Close()
	newer.close()
	if _, err := os.Lstat(sock); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("the socket after the newer proxy stopped: %v, want it gone", err)
	}
}
