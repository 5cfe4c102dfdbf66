package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestAttachRefusesBadInput(t *testing.T) {
	shim := t.TempDir()
	if err := os.WriteFile(filepath.Join(shim, "libcuda.so.1"), []byte("not really"), 0o644); err != nil {
		t.Fatal(err)
	}
	empty := t.TempDir()
	t.Setenv(shimDirEnv, "")
	checkUsageErrors(t, []usageCase{
		{"no command", []string{"attach", "--memory", "4GiB", "--compute", "25", "--shim-dir", shim}, []string{"give the command after --"}},
		{"a command without --", []string{"attach", "--exclusive", "--shim-dir", shim, "./vecadd"}, []string{"give the command after --"}},
		{"an unknown flag", []string{"attach", "--gpu", "1", "--", "./vecadd"}, []string{"unknown flag: --gpu"}},
		{"a held lease and acquire flags", []string{"attach", "--lease", "l-1", "--memory", "4GiB", "--compute", "25", "--shim-dir", shim, "--", "./vecadd"},
			[]string{"--lease l-1", "conflicts with --compute, --memory"}},
		{"a shim directory without the shim", []string{"attach", "--exclusive", "--shim-dir", empty, "--", "./vecadd"},
			[]string{"--shim-dir " + empty + ": no libcuda.so.1 there"}},
		{"no shim next to the binary", []string{"attach", "--exclusive", "--", "./vecadd"},
			[]string{"--shim-dir: not given, and no libcuda.so.1 in", "next to the gpupool binary", "make build"}},
		{"neither slice nor whole GPU", []string{"attach", "--shim-dir", shim, "--", "./vecadd"}, []string{"--exclusive for whole GPUs, or --memory and --compute"}},
		{"a bad memory quantity", []string{"attach", "--memory", "lots", "--compute", "25", "--shim-dir", shim, "--", "./vecadd"}, []string{"--memory"}},
		{"the CUDA server without its lease", []string{"agent", "cuda-server"}, []string{"--lease: required"}},
		{"the CUDA server with a bad lease", []string{"agent", "cuda-server", "--lease", "{"}, []string{"--lease: cudaserver: the lease's description"}},
	})
}

func TestAttachFindsTheShimFromTheEnvironment(t *testing.T) {
	empty := t.TempDir()
	t.Setenv(shimDirEnv, empty)
	code, _, stderr := runOffline(t, "attach", "--exclusive", "--", "./vecadd")
	if code != 2 || !strings.Contains(stderr, shimDirEnv+" "+empty+": no libcuda.so.1 there") {
		t.Errorf("got exit code %d and %q, want 2 naming %s", code, stderr, shimDirEnv)
	}
}

func TestAttachHelpShowsExamples(t *testing.T) {
	code, stdout, _ := runOffline(t, "attach", "--help")
	for _, want := range []string{"gpupool attach --memory 8GiB --compute 25 -- bin/examples/vecadd", "--lease l-5f0c2a9e1b7d3c48", "--shim-dir"} {
		if code != 0 || !strings.Contains(stdout, want) {
			t.Errorf("got exit code %d, help without %q:\n%s", code, want, stdout)
		}
	}
}
