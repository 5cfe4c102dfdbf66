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
	// otherGPUs is how many GPUs the pool's other guaranteed leases held
	// at the latest reading (see otherGuaranteedGPUs); meaningless unless
	// otherKnown, which is false with --show-pool=false and before the
	// pool has been read.
	otherGPUs  float64
	otherKnown bool
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
// slices, leaving, units_done, other_guaranteed_gpus. The last column is
// a decimal (0.75 for three quarter-GPU slices), empty where the pool's
// load is not known. It creates path's directory.
func writeCSV(path string, samples []sample) error {
	var buf bytes.Buffer
	w := csv.NewWriter(&buf)
	w.Write([]string{"t_seconds", "slices", "leaving", "units_done", "other_guaranteed_gpus"})
	for _, s := range samples {
		other := ""
		if s.otherKnown {
			other = strconv.FormatFloat(s.otherGPUs, 'f', -1, 64)
		}
		w.Write([]string{
			strconv.FormatFloat(s.at.Seconds(), 'f', 3, 64),
			strconv.Itoa(s.slices), strconv.Itoa(s.leaving), strconv.FormatInt(s.done, 10), other,
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

// chart is the step chart of samples: the slices held, those leaving
// and, where it is known, the GPUs the pool's other guaranteed leases
// hold, all on one Y axis, since a slice and a GPU are both counted in
// ones.
func chart(title string, samples []sample) plot.Chart {
	held := plot.Series{Name: "slices held", Step: true}
	leaving := plot.Series{Name: "of which leaving", Step: true}
	other := plot.Series{Name: "other guaranteed GPUs", Step: true}
	for _, s := range samples {
		t := s.at.Seconds()
		held.X, held.Y = append(held.X, t), append(held.Y, float64(s.slices))
		leaving.X, leaving.Y = append(leaving.X, t), append(leaving.Y, float64(s.leaving))
		if s.otherKnown {
			other.X, other.Y = append(other.X, t), append(other.Y, s.otherGPUs)
		}
	}
	c := plot.Chart{Title: title, XLabel: "time since the lease was granted (s)", YLabel: "slices", ZeroY: true,
		Series: []plot.Series{held, leaving}}
	if len(other.X) > 0 {
		c.YLabel = "slices / GPUs"
		c.Series = append(c.Series, other)
	}
	return c
}

// writePlot draws chart(title, samples) in the PNG path. It creates
// path's directory.
func writePlot(path, title string, samples []sample) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	return chart(title, samples).Save(path)
}
