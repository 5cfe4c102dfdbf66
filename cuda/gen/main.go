// Command gen writes the code generated from cuda/api/cuda.api: the shim's
// C header and stubs (cuda/shim/csrc) and the server's Go dispatch
// (agent/cudaserver). Run it with `go generate ./cuda/api` from the
// repository root; TestGeneratedFilesAreFresh fails when the committed files
// differ from what it writes.
package main

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"sort"
)

func main() {
	root := flag.String("root", "", "repository root (default: two levels above the working directory)")
	flag.Parse()
	if *root == "" {
		wd, err := os.Getwd()
		if err != nil {
			fail(err)
		}
		*root = filepath.Join(wd, "..", "..")
	}
	files, err := Generate(*root)
	if err != nil {
		fail(err)
	}
	names := make([]string, 0, len(files))
	for n := range files {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		if err := os.WriteFile(filepath.Join(*root, n), files[n], 0o644); err != nil {
			fail(err)
		}
	}
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "cuda/gen:", err)
	os.Exit(1)
}
