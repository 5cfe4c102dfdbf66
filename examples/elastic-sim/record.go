package main

import (
	"bytes"
	"encoding/csv"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"github.com/gpupool/gpupool/bench/plot"
	"github.com/gpupool/gpupool/internal/atomicfile"
)

// sample is how the job stood at one tick.
type sample struct {
	at      time.Duration // since the lease was granted
	slices  int           // slices held, leaving ones included
	leaving int           // slices given notice
	done    int64         // units completed so far
}

// line is the tick's progress line; prev is the tick before (the zero
// sample for the first).
func (s sample) line(prev sample) string {
	rate := 0.0
	if d := s.at - prev.at; d > 0 {
		rate = float64(s.done-prev.done) / d.Seconds()
	}
	return fmt.Sprintf("%6s  slices %d (%d leaving)  units %d  rate %.0f/s",
		s.at.Round(100*time.Millisecond), s.slices, s.leaving, s.done, rate)
}

// writeCSV writes samples to path as CSV, one row a tick: t_seconds,
// slices, leaving, units_done. It creates path's directory.
func writeCSV(path string, samples []sample) error {
	var buf bytes.Buffer
	w := csv.NewWriter(&buf)
	w.Write([]string{"t_seconds", "slices", "leaving", "units_done"})
	for _, s := range samples {
		w.Write([]string{
			strconv.FormatFloat(s.at.Seconds(), 'f', 3, 64),
			strconv.Itoa(s.slices), strconv.Itoa(s.leaving), strconv.FormatInt(s.done, 10),
		})
	}
	w.Flush()
	if err := w.Error(); err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	return atomicfile.WriteMode(path, buf.Bytes(), 0o644)
}

// writePlot draws the slices held, and those leaving, over time as a step
// chart in the PNG path. It creates path's directory.
func writePlot(path, title string, samples []sample) error {
	held := plot.Series{Name: "slices held", Step: true}
	leaving := plot.Series{Name: "of which leaving", Step: true}
	for _, s := range samples {
		t := s.at.Seconds()
		held.X, held.Y = append(held.X, t), append(held.Y, float64(s.slices))
		leaving.X, leaving.Y = append(leaving.X, t), append(leaving.Y, float64(s.leaving))
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	return plot.Chart{Title: title, XLabel: "time since the lease was granted (s)", YLabel: "slices", ZeroY: true,
		Series: []plot.Series{held, leaving}}.Save(path)
}
