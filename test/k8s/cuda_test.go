package k8s

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/gpupool/gpupool/cuda/shim"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// cudaNodeLabel marks the node of the CUDA test, the only one its
// controller publishes devices for.
const cudaNodeLabel = "cuda.gpupool.dev/node"

// TestAClaimsCDIEditsRunUnmodifiedCUDAProgramsOnItsLease runs the real
// path of a pod's CUDA calls without a container runtime: a pod's claim is
// leased by the controller and prepared by the node plugin (started with
// --cuda-shim) through the kubelet stand-in; the CDI edits of the prepared
// claim are applied to a local process as a runtime would (its env, and
// its mounts as paths: the shim mounted into a directory the dynamic
// loader searches by default, the claim's directory with the plugin's
// per-claim CUDA socket); and part 1's C programs, linked with -lcuda and
// no run path of their own, run through them on the lease's simulated GPU
// behind a real agent. When the lease ends, the programs' calls fail and
// the claim is refused at prepare.
func TestAClaimsCDIEditsRunUnmodifiedCUDAProgramsOnItsLease(t *testing.T) {
	if _, err := exec.LookPath("gcc"); err != nil {
		t.Skip("gcc is not installed: the shim and the C programs are C (make cc installs it)")
	}
	cp := sharedControlPlane(t)
	cp.ensureDeviceClass(t)
	ns := cp.newNamespace(t)
	ctx := context.Background()
	gpupoolBinary(t)
	b := startBrokers(t, 1)
	admin := cp.kubeconfigFor(t, "cuda-test-admin", "system:masters")

	shimPath, err := shim.Build(filepath.Join(t.TempDir(), "lib"))
	if err != nil {
		t.Fatal(err)
	}
	const node = "cuda-node"
	cp.addNode(t, node, map[string]string{cudaNodeLabel: "true"})
	registry, pluginDir := kubeletDirs(t)
	stateDir, cdiDir := filepath.Join(shortTempDir(t), "state"), t.TempDir()
	startGpupool(t, "cuda-node-plugin", "k8s-node-plugin",
		"--addr", b.Addrs, "--node-name", node, "--kubeconfig", admin,
		"--state-dir", stateDir, "--cdi-dir", cdiDir, "--plugin-dir", pluginDir, "--registrar-dir", registry,
		"--cuda-shim", shimPath, "--log-level", "debug")
	k := newKubelet(t, node, registry)
	startGpupool(t, "cuda-controller", "k8s-controller", "--addr", b.Addrs, "--kubeconfig", admin,
		"--leader-elect=false", "--node-selector", cudaNodeLabel+"=true", "--log-level", "debug")
	cp.waitForPools(t, b.HostIDs...)

	tmpl := fractionalTemplate("cuda-quarter", "20Gi", "25")
	if _, err := cp.Client.ResourceV1().ResourceClaimTemplates(ns).Create(ctx, tmpl, metav1.CreateOptions{FieldValidation: "Strict"}); err != nil {
		t.Fatalf("create ResourceClaimTemplate: %v", err)
	}
	if _, err := cp.Client.CoreV1().Pods(ns).Create(ctx, podWithClaim("cuda", tmpl.Name), metav1.CreateOptions{FieldValidation: "Strict"}); err != nil {
		t.Fatalf("create pod: %v", err)
	}
	var leaseID string
	var cdiIDs []string
	var claimUID string
	eventually(t, "the pod's claim leased and prepared", 2*time.Minute, func(ctx context.Context) error {
		pod, err := cp.Client.CoreV1().Pods(ns).Get(ctx, "cuda", metav1.GetOptions{})
		if err != nil {
			return err
		}
		claim, err := cp.podClaim(ctx, pod, "gpu")
		if err != nil {
			return err
		}
		r, err := scnOurResult(claim)
		if err != nil {
			return err
		}
		ds := scnDeviceStatus(claim, r)
		if ds == nil || !meta.IsStatusConditionTrue(ds.Conditions, scnConditionLeased) || ds.Data == nil {
			return fmt.Errorf("claim %s not leased yet", claim.Name)
		}
		resp, err := k.prepare(ctx, claim)
		if err != nil {
			return err
		}
		got := resp.Claims[string(claim.UID)]
		if got.GetError() != "" {
			return fmt.Errorf("prepare: %s", got.GetError())
		}
		cdiIDs = nil
		for _, d := range got.GetDevices() {
			cdiIDs = append(cdiIDs, d.GetCdiDeviceIds()...)
		}
		claimUID = string(claim.UID)
		leaseID = leaseOfStatus(string(ds.Data.Raw))
		return nil
	})
	if want := driverName + "/claim=" + claimUID; !slices.Equal(cdiIDs, []string{want}) {
		t.Fatalf("prepared CDI devices %v, want [%s]", cdiIDs, want)
	}

	ctr := applyCDIEdits(t, filepath.Join(cdiDir, driverName+"-"+claimUID+".json"), claimUID)
	include := shim.IncludeDir()
	ptx, err := filepath.Abs(filepath.Join("..", "..", "cuda", "shimtest", "testdata", "kernels.ptx"))
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, src string
		args      []string
		want      string
	}{
		{"vecadd", filepath.Join("..", "..", "examples", "cuda", "vecadd.c"), nil, "1048576 of 1048576 sums right"},
		{"devices", filepath.Join("..", "..", "cuda", "shimtest", "testdata", "devices.c"), []string{fmt.Sprint(20 << 30)}, "devices=1"},
		{"kernels", filepath.Join("..", "..", "cuda", "shimtest", "testdata", "kernels.c"), []string{ptx, "sim"}, "vecadd ok saxpy ok"},
		{"pipeline", filepath.Join("..", "..", "cuda", "shimtest", "testdata", "pipeline.c"), []string{ptx}, "pipeline ok"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			prog := buildUnmodified(t, tc.name, tc.src, include, filepath.Dir(shimPath))
			out, err := ctr.run(prog, tc.args...)
			if err != nil || !strings.Contains(out, tc.want) {
				t.Fatalf("%s through the claim's CDI edits: %v\n%s\nwant %q", tc.name, err, out, tc.want)
			}
			t.Logf("%s: %s", tc.name, strings.TrimSpace(out))
		})
	}

	// The lease ends under the claim: a program's calls fail, and the claim
	// is refused at prepare (its CDI spec goes).
	if _, err := b.Client.Lease.Release(ctx, &gpupoolv1.ReleaseRequest{LeaseId: leaseID}); err != nil {
		t.Fatalf("release lease %s: %v", leaseID, err)
	}
	vecadd := buildUnmodified(t, "vecadd", filepath.Join("..", "..", "examples", "cuda", "vecadd.c"), include, filepath.Dir(shimPath))
	eventually(t, "a program of the claim to fail once its lease ended", time.Minute, func(context.Context) error {
		if out, err := ctr.run(vecadd); err == nil {
			return fmt.Errorf("vecadd still runs: %s", out)
		}
		return nil
	})
	// Prepare never hands out the ended lease again: it refuses the claim
	// (and its CDI spec goes), or, once the binder has reported the end
	// and the scheduler allocated the claim again, prepares it with the
	// new lease. Which of the two a poll sees depends on how fast the
	// control plane re-allocates, so either passes; the ended lease never
	// does.
	var newLease string
	eventually(t, "prepare to refuse the claim of an ended lease, or prepare it with another", time.Minute, func(ctx context.Context) error {
		pod, err := cp.Client.CoreV1().Pods(ns).Get(ctx, "cuda", metav1.GetOptions{})
		if err != nil {
			return err
		}
		claim, err := cp.podClaim(ctx, pod, "gpu")
		if err != nil {
			return err
		}
		pr, err := k.prepare(ctx, claim)
		if err != nil {
			return err
		}
		if e := pr.Claims[claimUID].GetError(); e != "" {
			if !strings.Contains(e, "lease") {
				return fmt.Errorf("prepare answered %q, want the lease's end", e)
			}
			return nil
		}
		if string(claim.UID) != claimUID {
			return fmt.Errorf("the pod's claim is %s, want %s", claim.UID, claimUID)
		}
		r, err := scnOurResult(claim)
		if err != nil {
			return err
		}
		ds := scnDeviceStatus(claim, r)
		if ds == nil || ds.Data == nil {
			return fmt.Errorf("prepare succeeded for a claim whose status names no lease")
		}
		if got := leaseOfStatus(string(ds.Data.Raw)); got == leaseID || got == "" {
			return fmt.Errorf("prepare succeeded with lease %q, the ended one; want it refused", got)
		} else {
			newLease = got
		}
		return nil
	})
	spec, err := os.ReadFile(filepath.Join(cdiDir, driverName+"-"+claimUID+".json"))
	switch {
	case newLease == "" && !os.IsNotExist(err):
		t.Errorf("the CDI spec of the claim of an ended lease: %v, want it gone", err)
	case newLease != "" && strings.Contains(string(spec), leaseID):
		t.Errorf("the CDI spec of the claim, prepared again with lease %s, still names the ended lease %s:\n%s", newLease, leaseID, spec)
	case newLease != "":
		t.Logf("the claim was allocated again and prepared with lease %s before a poll saw the refusal", newLease)
	}
}

// leaseOfStatus is the leaseId of a device's status data.
func leaseOfStatus(raw string) string {
	var d scnLeaseData
	_ = json.Unmarshal([]byte(raw), &d)
	return d.LeaseID
}

// buildUnmodified builds src as a program linked with -lcuda against the
// shim, with no run path: alone, it cannot find libcuda.so.1.
func buildUnmodified(t *testing.T, name, src, include, libDir string) string {
	t.Helper()
	out := filepath.Join(t.TempDir(), name)
	cmd := exec.Command("gcc", "-std=gnu11", "-O1", "-Wall", "-Wextra", "-Werror", "-pthread", "-I", include,
		"-o", out, src, "-L", libDir, "-lcuda", "-lm")
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("gcc %s: %v\n%s", name, err, b)
	}
	return out
}

// container is a local process set up from a claim's CDI edits.
type container struct {
	env    []string // the edits' env, container paths turned into host paths
	libDir string   // the loader's default directories, as the mounts fill them
	loader string
}

// applyCDIEdits reads the claim's CDI spec and applies its edits as a
// container runtime would, to a local process: the env as given, except
// that values naming a path inside a mount name its host path; the
// mounts as paths. It checks that the shim lands in a directory this
// machine's dynamic loader searches by default, and then stands in for
// those mounts with --library-path.
func applyCDIEdits(t *testing.T, specPath, uid string) *container {
	t.Helper()
	spec, err := scnReadCDISpec(specPath)
	if err != nil {
		t.Fatal(err)
	}
	edits := spec.ContainerEdits
	for _, d := range spec.Devices {
		if d.Name == uid {
			edits.Env = append(edits.Env, d.ContainerEdits.Env...)
			edits.Mounts = append(edits.Mounts, d.ContainerEdits.Mounts...)
		}
	}
	hostPath := func(p string) (string, bool) {
		best, host := "", ""
		for _, m := range edits.Mounts {
			if (p == m.ContainerPath || strings.HasPrefix(p, m.ContainerPath+"/")) && len(m.ContainerPath) > len(best) {
				best, host = m.ContainerPath, m.HostPath+strings.TrimPrefix(p, m.ContainerPath)
			}
		}
		return host, best != ""
	}
	c := &container{loader: "/lib64/ld-linux-x86-64.so.2"}
	for _, kv := range edits.Env {
		k, v, _ := strings.Cut(kv, "=")
		if strings.HasPrefix(v, "/") {
			if h, ok := hostPath(v); ok {
				v = h
			}
		}
		c.env = append(c.env, k+"="+v)
	}
	c.env = append(c.env, "PATH=/usr/bin:/bin")

	defaults := loaderDefaultDirs(t, c.loader)
	c.libDir = t.TempDir()
	found := false
	for _, m := range edits.Mounts {
		if path.Base(m.ContainerPath) != "libcuda.so.1" || !slices.Contains(defaults, path.Dir(m.ContainerPath)) {
			continue
		}
		found = true
		if err := os.Symlink(m.HostPath, filepath.Join(c.libDir, "libcuda.so.1")); err != nil && !os.IsExist(err) {
			t.Fatal(err)
		}
	}
	if !found {
		t.Fatalf("the CDI edits mount no libcuda.so.1 into a directory this machine's loader searches by default (%v): %+v", defaults, edits.Mounts)
	}
	for _, want := range []string{"GPUPOOL_CUDA_SOCKET=", "GPUPOOL_TOKEN_FILE="} {
		if !slices.ContainsFunc(c.env, func(kv string) bool { return strings.HasPrefix(kv, want) }) {
			t.Fatalf("the CDI edits set no %s: %v", want, edits.Env)
		}
	}
	return c
}

// loaderDefaultDirs are the directories loader searches with no
// LD_LIBRARY_PATH and no ld.so.cache entry.
func loaderDefaultDirs(t *testing.T, loader string) []string {
	t.Helper()
	out, err := exec.Command(loader, "--help").Output()
	if err != nil {
		t.Skipf("%s --help: %v (not glibc's loader)", loader, err)
	}
	var dirs []string
	sc := bufio.NewScanner(strings.NewReader(string(out)))
	for sc.Scan() {
		if d, ok := strings.CutSuffix(strings.TrimSpace(sc.Text()), " (system search path)"); ok {
			dirs = append(dirs, d)
		}
	}
	if len(dirs) == 0 {
		t.Skipf("%s --help names no system search path", loader)
	}
	return dirs
}

// run runs prog in the container's env, its loader finding the mounted
// libraries, and returns its output.
func (c *container) run(prog string, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, c.loader, append([]string{"--library-path", c.libDir, prog}, args...)...)
	cmd.Env = c.env
	out, err := cmd.CombinedOutput()
	return string(out), err
}
