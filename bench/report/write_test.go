package report

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

func TestWriteWritesTheJSONAndTheMarkdownAndEchoesTheMarkdown(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "results")
	var echo strings.Builder
	paths, err := Write(Results{Dir: dir, Name: "demo", JSON: map[string]int{"n": 1}, Markdown: "# demo\n", Echo: &echo})
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{filepath.Join(dir, "demo.json"), filepath.Join(dir, "demo.md")}; !slices.Equal(paths, want) {
		t.Errorf("got paths %q, want %q", paths, want)
	}
	for path, want := range map[string]string{paths[0]: "{\n  \"n\": 1\n}\n", paths[1]: "# demo\n"} {
		b, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		if string(b) != want {
			t.Errorf("%s: got %q, want %q", path, b, want)
		}
	}
	if echo.String() != "# demo\n" {
		t.Errorf("echoed %q, want the markdown", echo.String())
	}
}

func TestWriteWithoutMarkdownWritesOnlyTheJSON(t *testing.T) {
	dir := t.TempDir()
	paths, err := Write(Results{Dir: dir, Name: "demo", JSON: []int{1}})
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{filepath.Join(dir, "demo.json")}; !slices.Equal(paths, want) {
		t.Errorf("got paths %q, want %q", paths, want)
	}
}
