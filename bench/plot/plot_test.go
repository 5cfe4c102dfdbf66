package plot

import (
	"bytes"
	"errors"
	"image/png"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestLinesWritesAPNGOfTheChartSize(t *testing.T) {
	tests := []struct {
		name   string
		series []Series
	}{
		{"one step series", []Series{{Name: "slices", X: []float64{0, 1, 2, 5}, Y: []float64{2, 8, 8, 2}, Step: true}}},
		{"two named series, one step and one line", []Series{
			{Name: "slices", X: []float64{0, 1, 2}, Y: []float64{2, 4, 3}, Step: true},
			{Name: "rate", X: []float64{0, 1, 2}, Y: []float64{10.5, 40, 31}},
		}},
		{"an unnamed series of one point", []Series{{X: []float64{3}, Y: []float64{7}}}},
		{"a flat series", []Series{{Name: "flat", X: []float64{0, 10}, Y: []float64{4, 4}}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "chart.png")
			if err := Lines(path, "title", "time (s)", "count", tt.series...); err != nil {
				t.Fatalf("Lines: %v", err)
			}
			f, err := os.Open(path)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { f.Close() })
			cfg, err := png.DecodeConfig(f)
			if err != nil {
				t.Fatalf("the file is not a PNG: %v", err)
			}
			if cfg.Width != Width || cfg.Height != Height {
				t.Errorf("got %dx%d pixels, want %dx%d", cfg.Width, cfg.Height, Width, Height)
			}
		})
	}
}

func TestWritePNGWithZeroYDecodes(t *testing.T) {
	var buf bytes.Buffer
	c := Chart{Title: "slices held", ZeroY: true, Series: []Series{{Name: "slices", X: []float64{0, 1}, Y: []float64{5, 6}, Step: true}}}
	if err := c.WritePNG(&buf); err != nil {
		t.Fatalf("WritePNG: %v", err)
	}
	img, err := png.Decode(&buf)
	if err != nil {
		t.Fatalf("not a PNG: %v", err)
	}
	if b := img.Bounds(); b.Dx() != Width || b.Dy() != Height {
		t.Errorf("got %dx%d pixels, want %dx%d", b.Dx(), b.Dy(), Width, Height)
	}
}

func TestLinesRefusesWhatCannotBeDrawn(t *testing.T) {
	good := Series{Name: "good", X: []float64{0, 1}, Y: []float64{1, 2}}
	tests := []struct {
		name   string
		series []Series
		index  int      // the SeriesError's Index, or -1 for no SeriesError
		want   []string // substrings of the message
	}{
		{"no series at all is refused", nil, -1, []string{"no series"}},
		{"a series with no points is refused by name", []Series{good, {Name: "empty"}}, 1,
			[]string{`series "empty"`, "no points"}},
		{"more X than Y is refused by name", []Series{{Name: "slices", X: []float64{0, 1, 2}, Y: []float64{1, 2}}}, 0,
			[]string{`series "slices"`, "3 X values but 2 Y values"}},
		{"more Y than X is refused by name", []Series{good, good, {Name: "rate", X: []float64{0}, Y: []float64{1, 2}}}, 2,
			[]string{`series "rate"`, "1 X values but 2 Y values"}},
		{"an unnamed series is named by its position", []Series{good, {X: []float64{0}}}, 1,
			[]string{"series 1 (unnamed)", "1 X values but 0 Y values"}},
		{"a NaN is refused with the point", []Series{{Name: "nan", X: []float64{0, 1}, Y: []float64{1, math.NaN()}}}, 0,
			[]string{`series "nan"`, "point 1", "finite"}},
		{"an infinite X is refused with the point", []Series{{Name: "inf", X: []float64{math.Inf(1)}, Y: []float64{1}}}, 0,
			[]string{`series "inf"`, "point 0", "finite"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "chart.png")
			err := Lines(path, "t", "x", "y", tt.series...)
			if err == nil {
				t.Fatal("got no error, want one")
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("got error %q, want it to contain %q", err, w)
				}
			}
			var se *SeriesError
			switch {
			case tt.index < 0 && !errors.Is(err, ErrNoSeries):
				t.Errorf("got %v, want ErrNoSeries", err)
			case tt.index >= 0 && !errors.As(err, &se):
				t.Errorf("got %T, want a *SeriesError", err)
			case tt.index >= 0 && se.Index != tt.index:
				t.Errorf("got series index %d, want %d", se.Index, tt.index)
			}
			if _, statErr := os.Stat(path); !errors.Is(statErr, os.ErrNotExist) {
				t.Errorf("a refused chart left a file behind (stat: %v)", statErr)
			}
		})
	}
}

func TestLinesRefusesAPathThatIsNotPNG(t *testing.T) {
	path := filepath.Join(t.TempDir(), "chart.svg")
	err := Lines(path, "t", "x", "y", Series{Name: "s", X: []float64{0}, Y: []float64{1}})
	if err == nil || !strings.Contains(err.Error(), "*.png") {
		t.Fatalf("got %v, want an error asking for a *.png name", err)
	}
}

func TestAFailedChartLeavesTheOldFileAlone(t *testing.T) {
	path := filepath.Join(t.TempDir(), "chart.png")
	if err := os.WriteFile(path, []byte("old"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := Lines(path, "t", "x", "y", Series{Name: "bad", X: []float64{0}}); err == nil {
		t.Fatal("got no error for a series without Y, want one")
	}
	got, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if string(got) != "old" {
		t.Errorf("got file %q, want the old content kept", got)
	}
}

func TestTickLabelsHaveNoTrailingZeros(t *testing.T) {
	for _, tick := range plainTicks.Ticks(0, 120) {
		if strings.HasSuffix(tick.Label, ".00") || strings.HasSuffix(tick.Label, ".") {
			t.Errorf("got tick label %q, want it without trailing zeros", tick.Label)
		}
	}
	var labels []string
	for _, tick := range plainTicks.Ticks(0, 1) {
		if tick.Label != "" {
			labels = append(labels, tick.Label)
		}
	}
	if got := strings.Join(labels, " "); !strings.Contains(got, "0.5") {
		t.Errorf("got labels %q for 0 to 1, want fractions such as 0.5 kept", got)
	}
}
