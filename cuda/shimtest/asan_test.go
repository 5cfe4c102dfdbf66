package shimtest

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/gpupool/gpupool/cuda/shim"
)

// TestTheShimIsCleanUnderTheSanitizers builds the shim and three programs
// with AddressSanitizer and UndefinedBehaviorSanitizer and runs them: any
// report fails the test. (The programs' own leaks are not the shim's, so
// leak checking is off.)
func TestTheShimIsCleanUnderTheSanitizers(t *testing.T) {
	needGCC(t)
	dir := t.TempDir()
	san := []string{"-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer"}
	args := append(append([]string{}, shim.CFlags...), san...)
	args = append(args, "-o", filepath.Join(dir, shim.SOName))
	args = append(args, shim.SourcePaths()...)
	if b, err := exec.Command("gcc", args...).CombinedOutput(); err != nil {
		if strings.Contains(string(b), "asan") || strings.Contains(string(b), "ubsan") {
			t.Skipf("no sanitizer runtime for gcc here: %s", b)
		}
		t.Fatalf("gcc: %v\n%s", err, b)
	}
	if err := os.Symlink(shim.SOName, filepath.Join(dir, "libcuda.so")); err != nil {
		t.Fatal(err)
	}
	sock, _ := serve(t, slice)
	for _, tc := range []struct {
		prog string
		args []string
	}{
		{"kernels", []string{ptxPath(t), "sim"}},
		{"threads", []string{ptxPath(t)}},
		{"pipeline", []string{ptxPath(t)}},
		{"misc", []string{ptxPath(t)}},
		{"fork", nil},
	} {
		t.Run(tc.prog, func(t *testing.T) {
			bin := filepath.Join(dir, tc.prog)
			args := append([]string{"-std=gnu11", "-O1", "-g", "-pthread", "-I", shim.IncludeDir()}, san...)
			args = append(args, "-o", bin, filepath.Join("testdata", tc.prog+".c"), "-L", dir, "-Wl,-rpath,"+dir, "-lcuda", "-lm")
			if b, err := exec.Command("gcc", args...).CombinedOutput(); err != nil {
				t.Fatalf("gcc: %v\n%s", err, b)
			}
			cmd := exec.Command(bin, tc.args...)
			cmd.Env = append(os.Environ(), "GPUPOOL_CUDA_SOCKET="+sock, "ASAN_OPTIONS=detect_leaks=0:abort_on_error=0")
			out, err := cmd.CombinedOutput()
			if err != nil || strings.Contains(string(out), "Sanitizer") || strings.Contains(string(out), "runtime error") {
				t.Errorf("%s under the sanitizers: %v\n%s", tc.prog, err, out)
			}
		})
	}
}
