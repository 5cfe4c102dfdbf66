// Package plot draws benchmark and example results as PNG line charts, a
// thin layer over gonum.org/v1/plot that fixes the look every chart in
// bench/results shares: 800x400 pixels, white background, grid, legend.
//
// A chart is checked before anything is drawn or written: a series with no
// points, X and Y of different lengths, or a NaN or infinite value is
// refused with an error naming the series.
package plot

import (
	"bytes"
	"errors"
	"fmt"
	"image"
	"image/color"
	"io"
	"math"
	"path/filepath"
	"strings"

	gonumplot "gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"

	"github.com/gpupool/gpupool/internal/atomicfile"
)

// The size of every chart, in pixels.
const (
	Width  = 800
	Height = 400
)

// legendRowHeadroom is how much the Y axis is stretched above the data
// per legend row, as a fraction of its range, to make room for the legend.
const legendRowHeadroom = 0.075

// ErrNoSeries is returned for a chart without any series.
var ErrNoSeries = errors.New("plot: no series to draw: give at least one")

// SeriesError reports a series that cannot be drawn. Read it with
// errors.As to find which series and why.
type SeriesError struct {
	// Index is the series' position in the chart, from 0.
	Index int
	// Name is the series' name as given, possibly empty.
	Name string
	// Reason says what is wrong and what is allowed.
	Reason string
}

func (e *SeriesError) Error() string {
	if e.Name == "" {
		return fmt.Sprintf("plot: series %d (unnamed): %s", e.Index, e.Reason)
	}
	return fmt.Sprintf("plot: series %q: %s", e.Name, e.Reason)
}

// Series is one line of a chart: the points (X[i], Y[i]), joined in the
// order given.
type Series struct {
	// Name labels the series in the legend; an unnamed series has no
	// legend entry.
	Name string
	X, Y []float64
	// Step draws the series as a step function: Y[i] holds from X[i]
	// until X[i+1], for counts that change at instants (slices held,
	// leases granted) rather than vary continuously.
	Step bool
}

// Chart is a line chart. The zero value is an untitled chart with no
// series.
type Chart struct {
	Title, XLabel, YLabel string
	// ZeroY starts the Y axis at 0 (or lower, for negative values)
	// instead of at the smallest value, so that the height of a line
	// reads as its size.
	ZeroY  bool
	Series []Series
}

// Lines writes a chart of series to path as a PNG of Width x Height
// pixels, with its axes starting at the data. path must end in .png; its
// directory must exist. The file is replaced whole or not at all.
func Lines(path, title, xLabel, yLabel string, series ...Series) error {
	return Chart{Title: title, XLabel: xLabel, YLabel: yLabel, Series: series}.Save(path)
}

// Save writes the chart to path as a PNG of Width x Height pixels. path
// must end in .png; its directory must exist. The file is replaced whole
// or not at all: a chart that cannot be drawn leaves it untouched.
func (c Chart) Save(path string) error {
	if !strings.EqualFold(filepath.Ext(path), ".png") {
		return fmt.Errorf("plot: %s: charts are written as PNG: name the file *.png", path)
	}
	var buf bytes.Buffer
	if err := c.WritePNG(&buf); err != nil {
		return err
	}
	if err := atomicfile.WriteMode(path, buf.Bytes(), 0o644); err != nil {
		return fmt.Errorf("plot: write %s: %w", path, err)
	}
	return nil
}

// WritePNG writes the chart to w as a PNG of Width x Height pixels. It
// writes nothing when the chart cannot be drawn.
func (c Chart) WritePNG(w io.Writer) error {
	if err := c.check(); err != nil {
		return err
	}
	p := gonumplot.New()
	p.Title.Text = c.Title
	p.X.Label.Text = c.XLabel
	p.Y.Label.Text = c.YLabel
	p.X.Tick.Marker = plainTicks
	p.Y.Tick.Marker = plainTicks
	p.Add(plotter.NewGrid())
	p.Legend.Top = true
	named := 0
	for i, s := range c.Series {
		line, err := plotter.NewLine(points(s))
		if err != nil {
			return &SeriesError{Index: i, Name: s.Name, Reason: err.Error()}
		}
		line.Color = seriesColor(i)
		if i >= len(palette) {
			line.Dashes = []vg.Length{vg.Points(4), vg.Points(2)} // colours repeat: dash the second round
		}
		line.Width = vg.Points(1.5)
		if s.Step {
			line.StepStyle = plotter.PostStep
		}
		p.Add(line)
		if s.Name != "" {
			p.Legend.Add(s.Name, line)
			named++
		}
	}
	if c.ZeroY {
		p.Y.Min = math.Min(p.Y.Min, 0)
	}
	if named > 0 {
		// Headroom above the data, so that the legend does not hide it.
		p.Y.Max += legendRowHeadroom * float64(max(named, 2)) * (p.Y.Max - p.Y.Min)
	}
	canvas := vgimg.NewWith(vgimg.UseImage(image.NewRGBA(image.Rect(0, 0, Width, Height))))
	p.Draw(draw.New(canvas))
	if _, err := (vgimg.PngCanvas{Canvas: canvas}).WriteTo(w); err != nil {
		return fmt.Errorf("plot: write PNG: %w", err)
	}
	return nil
}

// check reports the first series that cannot be drawn.
func (c Chart) check() error {
	if len(c.Series) == 0 {
		return ErrNoSeries
	}
	for i, s := range c.Series {
		fail := func(format string, a ...any) error {
			return &SeriesError{Index: i, Name: s.Name, Reason: fmt.Sprintf(format, a...)}
		}
		switch {
		case len(s.X) != len(s.Y):
			return fail("%d X values but %d Y values: every point needs both", len(s.X), len(s.Y))
		case len(s.X) == 0:
			return fail("no points: give at least one (X, Y) pair")
		}
		for j := range s.X {
			if bad(s.X[j]) || bad(s.Y[j]) {
				return fail("point %d is (%v, %v): values must be finite numbers", j, s.X[j], s.Y[j])
			}
		}
	}
	return nil
}

// plainTicks are gonum's default ticks, labelled without trailing zeros:
// 25 rather than 25.00.
var plainTicks = gonumplot.TickerFunc(func(min, max float64) []gonumplot.Tick {
	ticks := gonumplot.DefaultTicks{}.Ticks(min, max)
	for i, t := range ticks {
		if strings.Contains(t.Label, ".") && !strings.ContainsAny(t.Label, "eE") {
			ticks[i].Label = strings.TrimRight(strings.TrimRight(t.Label, "0"), ".")
		}
	}
	return ticks
})

func bad(v float64) bool { return math.IsNaN(v) || math.IsInf(v, 0) }

func points(s Series) plotter.XYs {
	xys := make(plotter.XYs, len(s.X))
	for i := range s.X {
		xys[i] = plotter.XY{X: s.X[i], Y: s.Y[i]}
	}
	return xys
}

// palette has one distinct colour per series for up to 12 series; more
// reuse them, dashed.
var palette = []color.RGBA{
	{0xe6, 0x19, 0x4b, 0xff}, {0x3c, 0xb4, 0x4b, 0xff}, {0x43, 0x63, 0xd8, 0xff}, {0xf5, 0x82, 0x31, 0xff},
	{0x91, 0x1e, 0xb4, 0xff}, {0x42, 0xd4, 0xf4, 0xff}, {0xf0, 0x32, 0xe6, 0xff}, {0x9a, 0x63, 0x24, 0xff},
	{0x46, 0x99, 0x90, 0xff}, {0x80, 0x00, 0x00, 0xff}, {0x00, 0x00, 0x75, 0xff}, {0x80, 0x80, 0x00, 0xff},
}

func seriesColor(i int) color.Color { return palette[i%len(palette)] }
