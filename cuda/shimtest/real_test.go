package shimtest

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/gpupool/gpupool/agent/cudaserver"
)

const example = "../../examples/cuda/vecadd.c"

func TestTheVecaddExamplePrintsTheRightSums(t *testing.T) {
	sock, _ := serve(t, slice)
	out, _, err := runProgram(t, sock, programAt(t, "vecadd", example))
	if err != nil {
		t.Fatalf("vecadd: %v\n%s", err, out)
	}
	for _, want := range []string{"1 device(s); device 0: NVIDIA A100-SXM4-40GB, 8192 MiB", "c[1000] = 3000", "1048576 of 1048576 sums right"} {
		if !strings.Contains(out, want) {
			t.Errorf("got %q, want %q", out, want)
		}
	}
}

// stubDriver builds testdata/stubcuda.c, a libcuda of our own, so that the
// real backend's loading and marshalling run without a GPU.
func stubDriver(t *testing.T) string {
	t.Helper()
	needGCC(t)
	out := filepath.Join(t.TempDir(), "libcuda-stub.so")
	args := []string{"-std=gnu11", "-O1", "-fPIC", "-shared", "-Wall", "-Wextra", "-Werror", "-fvisibility=hidden",
		"-o", out, filepath.Join("testdata", "stubcuda.c")}
	if b, err := exec.Command("gcc", args...).CombinedOutput(); err != nil {
		t.Fatalf("gcc stubcuda: %v\n%s", err, b)
	}
	return out
}

func TestTheRealBackendRunsTheExampleThroughAStubDriver(t *testing.T) {
	drv, err := cudaserver.OpenRealDriver(stubDriver(t))
	if err != nil {
		t.Fatal(err)
	}
	srv, err := cudaserver.New(cudaserver.Config{Devices: []cudaserver.Device{{Index: 1, MemoryBytes: 8 << 30}}, NewBackend: drv.NewBackend})
	if err != nil {
		t.Fatal(err)
	}
	sock := listen(t, srv)
	out, _, err := runProgram(t, sock, programAt(t, "vecadd", example))
	if err != nil {
		t.Fatalf("vecadd: %v\n%s", err, out)
	}
	for _, want := range []string{"1 device(s); device 0: Stub GPU 1, 8192 MiB", "1048576 of 1048576 sums right"} {
		if !strings.Contains(out, want) {
			t.Errorf("got %q, want %q", out, want)
		}
	}
}

// A process that exits without destroying its context: the session's end
// destroys it on the driver.
func TestTheSessionsEndDestroysItsContextsOnTheDriver(t *testing.T) {
	log := filepath.Join(t.TempDir(), "stub.log")
	t.Setenv("STUB_CUDA_LOG", log)
	drv, err := cudaserver.OpenRealDriver(stubDriver(t))
	if err != nil {
		t.Fatal(err)
	}
	srv, err := cudaserver.New(cudaserver.Config{Devices: []cudaserver.Device{{Index: 0}}, NewBackend: drv.NewBackend})
	if err != nil {
		t.Fatal(err)
	}
	sock := listen(t, srv)
	run(t, sock, "leaveit")
	deadline := time.Now().Add(time.Minute)
	for {
		b, _ := os.ReadFile(log)
		if got := string(b); got == "context created\ncontext destroyed\n" {
			break
		} else if time.Now().After(deadline) {
			t.Fatalf("the stub driver saw %q, want the context created and then destroyed", got)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestOpenRealDriverRefusesWhatIsNotADriver(t *testing.T) {
	for _, tc := range []struct{ name, path, want string }{
		{"a missing library", filepath.Join(t.TempDir(), "nope.so"), "loading"},
		{"a library without cuInit", "libm.so.6", "not a CUDA driver"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := cudaserver.OpenRealDriver(tc.path); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("got %v, want an error containing %q", err, tc.want)
			}
		})
	}
}
