package report

import (
	"encoding/json"
	"io"
	"os"
	"path/filepath"

	"github.com/gpupool/gpupool/bench/plot"
	"github.com/gpupool/gpupool/internal/atomicfile"
)

// Results is what one benchmark run writes to its output directory.
type Results struct {
	// Dir is the output directory (--out); Write creates it.
	Dir string
	// Name is the stem of the files: Name.json and Name.md.
	Name string
	// JSON is written, indented, as Name.json.
	JSON any
	// Markdown, when not empty, is written as Name.md and, when Echo is
	// set, to Echo too.
	Markdown string
	Echo     io.Writer
	// Charts are written as <Chart.Name>.png, in order.
	Charts []Chart
}

// Chart is one PNG of a run.
type Chart struct {
	Name  string // the file's name without ".png", e.g. "placement-scale"
	Chart plot.Chart
}

// Write writes r's files, each replaced whole (a reader never sees half
// a file), and returns their paths in the order written. It stops at the
// first error; the files before it are written.
func Write(r Results) ([]string, error) {
	if err := os.MkdirAll(r.Dir, 0o755); err != nil {
		return nil, err
	}
	b, err := json.MarshalIndent(r.JSON, "", "  ")
	if err != nil {
		return nil, err
	}
	var paths []string
	write := func(path string, data []byte) error {
		if err := atomicfile.WriteMode(path, data, 0o644); err != nil {
			return err
		}
		paths = append(paths, path)
		return nil
	}
	if err := write(filepath.Join(r.Dir, r.Name+".json"), append(b, '\n')); err != nil {
		return paths, err
	}
	if r.Markdown != "" {
		if err := write(filepath.Join(r.Dir, r.Name+".md"), []byte(r.Markdown)); err != nil {
			return paths, err
		}
		if r.Echo != nil {
			if _, err := io.WriteString(r.Echo, r.Markdown); err != nil {
				return paths, err
			}
		}
	}
	for _, c := range r.Charts {
		path := filepath.Join(r.Dir, c.Name+".png")
		if err := c.Chart.Save(path); err != nil {
			return paths, err
		}
		paths = append(paths, path)
	}
	return paths, nil
}
