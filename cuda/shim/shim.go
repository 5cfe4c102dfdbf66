// Package shim builds gpupool's libcuda.so.1, the CUDA driver API shim in
// csrc/, with the flags the project holds it to. `make build` runs it
// through mkshim; tests build their own copy with Build.
package shim

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
)

// SOName is the library's soname: what programs linked with -lcuda load.
const SOName = "libcuda.so.1"

// CFlags are the compiler flags of every build of the shim: warnings are
// errors, and only the driver API's symbols are exported.
var CFlags = []string{
	"-std=gnu11", "-O2", "-g", "-fPIC", "-shared", "-pthread",
	"-Wall", "-Wextra", "-Werror", "-fvisibility=hidden",
	"-Wl,-soname," + SOName, "-Wl,--no-undefined",
}

// Sources are the C files of the shim, in SourceDir: the transport, the
// hand-written calls, and the stubs generated from cuda/api/cuda.api.
var Sources = []string{"transport.c", "calls.c", "stubs_gen.c"}

// SourceDir is the directory of the C sources: next to this file, or,
// in a build without source paths (-trimpath), cuda/shim/csrc under the
// working directory (the repository root, where make runs).
func SourceDir() string {
	_, file, _, _ := runtime.Caller(0)
	dir := filepath.Join(filepath.Dir(file), "csrc")
	if _, err := os.Stat(filepath.Join(dir, Sources[0])); err != nil {
		return filepath.Join("cuda", "shim", "csrc")
	}
	return dir
}

// SourcePaths are the paths of Sources.
func SourcePaths() []string {
	dir := SourceDir()
	paths := make([]string, len(Sources))
	for i, f := range Sources {
		paths[i] = filepath.Join(dir, f)
	}
	return paths
}

// IncludeDir holds cuda.h for programs built against the shim.
func IncludeDir() string { return SourceDir() }

// Build compiles the shim into dir/libcuda.so.1, with a libcuda.so link
// for -lcuda, and returns the library's path. It needs gcc.
func Build(dir string) (string, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	out := filepath.Join(dir, SOName)
	args := append([]string{}, CFlags...)
	args = append(args, "-o", out+".tmp")
	args = append(args, SourcePaths()...)
	cmd := exec.Command("gcc", args...)
	if b, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("gcc %v: %v\n%s", args, err, b)
	}
	if err := os.Rename(out+".tmp", out); err != nil {
		return "", err
	}
	link := filepath.Join(dir, "libcuda.so")
	_ = os.Remove(link)
	if err := os.Symlink(SOName, link); err != nil {
		return "", err
	}
	return out, nil
}
