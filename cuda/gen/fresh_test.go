package main

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"
)

// TestGeneratedFilesAreFresh fails when a committed generated file is not
// what cuda/api/cuda.api gives: run `go generate ./cuda/api` and commit.
func TestGeneratedFilesAreFresh(t *testing.T) {
	files, err := Generate(filepath.Join("..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	for path, want := range files {
		got, err := os.ReadFile(filepath.Join("..", "..", path))
		if err != nil {
			t.Errorf("%s: %v; run 'go generate ./cuda/api'", path, err)
			continue
		}
		if !bytes.Equal(got, want) {
			t.Errorf("%s is stale: run 'go generate ./cuda/api' and commit the result", path)
		}
	}
}

func TestGoNameCapitalisesEachPart(t *testing.T) {
	for in, want := range map[string]string{"cuMemAlloc_v2": "CuMemAllocV2", "gpupoolFuncParams": "GpupoolFuncParams"} {
		if got := GoName(in); got != want {
			t.Errorf("GoName(%q) = %q, want %q", in, got, want)
		}
	}
}
