package shimtest

import (
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/gpupool/gpupool/agent/cudaserver"
)

// TestRealGPU runs the C programs against the real backend on this
// machine's driver (make test-gpu). It skips unless GPUPOOL_TEST_GPU=1, and
// with a message where there is no driver or no GPU.
func TestRealGPU(t *testing.T) {
	if os.Getenv("GPUPOOL_TEST_GPU") != "1" {
		t.Skip("set GPUPOOL_TEST_GPU=1 (make test-gpu) to run against a real GPU")
	}
	drv, err := cudaserver.OpenRealDriver("libcuda.so.1")
	if err != nil {
		t.Skipf("no CUDA driver on this machine: %v", err)
	}
	const limit = 1 << 30
	srv, err := cudaserver.New(cudaserver.Config{Devices: []cudaserver.Device{{Index: 0, MemoryBytes: limit}}, NewBackend: drv.NewBackend})
	if err != nil {
		t.Fatal(err)
	}
	sock := listen(t, srv)
	if out, stderr, err := runErr(t, sock, "init"); err != nil || strings.TrimSpace(out) != "CUDA_SUCCESS" {
		t.Skipf("cuInit on this machine's driver: %q %v %s", out, err, stderr)
	}
	var rows []string
	for _, tc := range []struct {
		prog string
		args []string
	}{
		{"devices", []string{fmt.Sprint(limit)}},
		{"memory", []string{fmt.Sprint(limit)}},
		{"kernels", []string{ptxPath(t), "real"}},
		{"streams", []string{ptxPath(t)}},
		{"threads", []string{ptxPath(t)}},
		{"pipeline", []string{ptxPath(t)}},
		{"fork", nil},
		{"misc", []string{ptxPath(t)}},
	} {
		t.Run(tc.prog, func(t *testing.T) {
			out, stderr, err := runErr(t, sock, tc.prog, tc.args...)
			res := "ok"
			if err != nil {
				res = fmt.Sprintf("FAILED: %v: %s", err, strings.TrimSpace(stderr))
				t.Errorf("%s: %s", tc.prog, res)
			}
			rows = append(rows, fmt.Sprintf("| %s | %s | %s |", tc.prog, strings.Join(strings.Fields(strings.TrimSpace(out)), " "), res))
		})
	}
	// The table the docs quote (make test-gpu prints it with -v).
	t.Logf("\n| program | output | result |\n|---|---|---|\n%s", strings.Join(rows, "\n"))
}
