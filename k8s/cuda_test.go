package k8s

import (
	"bytes"
	"encoding/json"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	cdispec "tags.cncf.io/container-device-interface/specs-go"

	"github.com/gpupool/gpupool/client"
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
	eventually(t, "prepare to refuse the claim of an ended lease", func() (bool, string) {
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
