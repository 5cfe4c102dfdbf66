package shimtest

import (
	"os"
	"path/filepath"
	"regexp"
	"testing"

	"github.com/gpupool/gpupool/cuda/api"
)

// TestEveryCoveredCallIsExercised fails when a call of cuda.api that the
// shim exports is made by none of the C programs: each covered call is
// run, with its result checked, against the server.
func TestEveryCoveredCallIsExercised(t *testing.T) {
	a, err := api.Load()
	if err != nil {
		t.Fatal(err)
	}
	files, _ := filepath.Glob(filepath.Join("testdata", "*.c"))
	files = append(files, example)
	var src []byte
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		src = append(src, b...)
	}
	for _, f := range a.Funcs {
		if f.Internal {
			continue
		}
		re := regexp.MustCompile(`\b(` + regexp.QuoteMeta(f.Name) + `|` + regexp.QuoteMeta(f.Base()) + `)\s*\(`)
		if !re.Match(src) {
			t.Errorf("%s is covered but no C program calls it: add it to a program in testdata", f.Name)
		}
	}
}
