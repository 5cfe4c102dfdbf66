package main

import (
	"errors"
	"flag"
	"image/png"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/gpupool/gpupool/bench/plot"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

func TestParseFlagsRefusesWhatCannotRun(t *testing.T) {
	tests := []struct {
		name string
		args []string
		want string // substring of the error
	}{
		{"a max below the min", []string{"--min", "4", "--max", "2"}, "--max 2: must be between --min (4)"},
		{"no guaranteed slice", []string{"--min", "0"}, "--min 0"},
		{"a decimal memory unit", []string{"--memory", "20GB"}, "--memory"},
		{"compute above 100", []string{"--compute", "150"}, "--compute"},
		{"a plot that is not a PNG", []string{"--plot", "out.svg"}, "--plot out.svg"},
		{"a tick too short", []string{"--tick", "1ms"}, "--tick 1ms"},
		{"negative work", []string{"--work", "-1"}, "--work -1"},
		{"no broker", []string{"--brokers", " , "}, "--brokers is empty"},
		{"an empty tenant", []string{"--tenant", " "}, "--tenant is empty"},
		{"a stray argument", []string{"extra"}, `unexpected argument "extra"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := parseFlags(tt.args, &strings.Builder{})
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("got %v, want an error containing %q", err, tt.want)
			}
		})
	}
}

func TestParseFlagsBuildsTheElasticRequest(t *testing.T) {
	o, err := parseFlags([]string{"--min", "2", "--max", "16", "--memory", "20GiB", "--compute", "25%", "--tenant", "sim", "--ttl", "1m"}, &strings.Builder{})
	if err != nil {
		t.Fatal(err)
	}
	r := o.request()
	if r.Count != 2 || r.ElasticMax != 16 || r.MemoryMib != 20480 || r.ComputePercent != 25 || r.TtlMs != 60_000 || r.Tenant != "sim" {
		t.Errorf("got request %v, want count 2, elastic_max 16, 20480 MiB, 25%%, ttl 60000 ms, tenant sim", r)
	}
	if r.Class != gpupoolv1.LeaseClass_LEASE_CLASS_GUARANTEED {
		t.Errorf("got class %v, want the guaranteed part guaranteed", r.Class)
	}
}

func TestThePoolIsShownUnlessTurnedOff(t *testing.T) {
	tests := []struct {
		name string
		args []string
		want bool
	}{
		{"by default", nil, true},
		{"asked for", []string{"--show-pool"}, true},
		{"turned off", []string{"--show-pool=false"}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			o, err := parseFlags(tt.args, &strings.Builder{})
			if err != nil {
				t.Fatal(err)
			}
			if o.showPool != tt.want {
				t.Errorf("got showPool %v, want %v", o.showPool, tt.want)
			}
		})
	}
}

func TestTheBrokersDefaultToTheCLIs(t *testing.T) {
	t.Setenv("GPUPOOL_ADDR", "10.0.0.5:7641,10.0.0.6:7641")
	o, err := parseFlags(nil, &strings.Builder{})
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(o.brokers, ","); got != "10.0.0.5:7641,10.0.0.6:7641" {
		t.Errorf("got brokers %s, want $GPUPOOL_ADDR's", got)
	}
}

func TestHelpNamesEveryFlag(t *testing.T) {
	var help strings.Builder
	if _, err := parseFlags([]string{"--help"}, &help); !errors.Is(err, flag.ErrHelp) {
		t.Fatalf("got %v, want flag.ErrHelp", err)
	}
	for _, f := range []string{"--brokers", "--min", "--max", "--memory", "--compute", "--tenant", "--duration", "--work", "--csv", "--plot", "--tick", "--show-pool"} {
		if !strings.Contains(help.String(), f+" ") {
			t.Errorf("--help does not mention %s", f)
		}
	}
}

func TestMonteCarloPiIsDeterministicAndRoughlyPi(t *testing.T) {
	if a, b := monteCarloPi(unit{id: 7}), monteCarloPi(unit{id: 7}); a != b {
		t.Errorf("unit 7 gave %v then %v, want the same tally", a, b)
	}
	var total tally
	for id := range uint64(10) {
		total = total.add(monteCarloPi(unit{id: id}))
	}
	if got := total.pi(); math.Abs(got-math.Pi) > 0.01 {
		t.Errorf("got pi %.5f from %d samples, want within 0.01 of %.5f", got, total.samples, math.Pi)
	}
}

func TestSampleLineShowsSlicesUnitsAndRate(t *testing.T) {
	prev := sample{at: 11 * time.Second, slices: 4, done: 1136}
	got := sample{at: 12 * time.Second, slices: 5, leaving: 1, done: 1234}.line(prev)
	if want := "   12s  slices 5 (1 leaving)  units 1234  rate 98/s"; got != want {
		t.Errorf("got %q, want %q", got, want)
	}
}

func TestTheCSVHasARowATickAndTheOtherGuaranteedGPUs(t *testing.T) {
	const header = "t_seconds,slices,leaving,units_done,other_guaranteed_gpus\n"
	tests := []struct {
		name    string
		samples []sample
		want    string // after the header
	}{
		{"without a reading of the pool the last column is empty", []sample{
			{at: 0, slices: 2},
			{at: 1500 * time.Millisecond, slices: 8, done: 100},
			{at: 3 * time.Second, slices: 8, leaving: 6, done: 250},
		}, "0.000,2,0,0,\n1.500,8,0,100,\n3.000,8,6,250,\n"},
		{"readings are written as decimals without trailing zeros", []sample{
			{at: 0, slices: 2, otherGPUs: 0, otherKnown: true},
			{at: time.Second, slices: 8, leaving: 4, done: 50, otherGPUs: 6, otherKnown: true},
			{at: 2 * time.Second, slices: 4, done: 90, otherGPUs: 6.75, otherKnown: true},
		}, "0.000,2,0,0,0\n1.000,8,4,50,6\n2.000,4,0,90,6.75\n"},
		{"a tick before the first reading has an empty cell", []sample{
			{at: 0, slices: 2},
			{at: time.Second, slices: 3, done: 10, otherGPUs: 0.25, otherKnown: true},
		}, "0.000,2,0,0,\n1.000,3,0,10,0.25\n"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "new-dir", "sim.csv")
			if err := writeCSV(path, tt.samples); err != nil {
				t.Fatal(err)
			}
			b, err := os.ReadFile(path)
			if err != nil {
				t.Fatal(err)
			}
			if want := header + tt.want; string(b) != want {
				t.Errorf("got CSV\n%s\nwant\n%s", b, want)
			}
		})
	}
}

func TestTheChartShowsTheOtherGuaranteedGPUsWhenKnown(t *testing.T) {
	tests := []struct {
		name       string
		samples    []sample
		wantSeries []string
		wantY      string
		wantOther  []float64 // Y of the third series, if any
	}{
		{"without readings, the slices alone", []sample{{at: 0, slices: 2}, {at: time.Second, slices: 8}},
			[]string{"slices held", "of which leaving"}, "slices", nil},
		{"with readings, a third line on the same axis", []sample{
			{at: 0, slices: 2, otherKnown: true},
			{at: time.Second, slices: 8, leaving: 4, otherGPUs: 6, otherKnown: true},
		}, []string{"slices held", "of which leaving", "other guaranteed GPUs"}, "slices / GPUs", []float64{0, 6}},
		{"ticks without a reading are left out of the third line", []sample{
			{at: 0, slices: 2},
			{at: time.Second, slices: 8, otherGPUs: 1.5, otherKnown: true},
		}, []string{"slices held", "of which leaving", "other guaranteed GPUs"}, "slices / GPUs", []float64{1.5}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := chart("title", tt.samples)
			var names []string
			for _, s := range c.Series {
				names = append(names, s.Name)
				if !s.Step {
					t.Errorf("series %q is not a step line, want every series one", s.Name)
				}
			}
			if got, want := strings.Join(names, ", "), strings.Join(tt.wantSeries, ", "); got != want {
				t.Errorf("got series %s, want %s", got, want)
			}
			if c.YLabel != tt.wantY {
				t.Errorf("got Y label %q, want %q", c.YLabel, tt.wantY)
			}
			if tt.wantOther != nil && len(c.Series) == 3 && !slices.Equal(c.Series[2].Y, tt.wantOther) {
				t.Errorf("got other guaranteed GPUs %v, want %v", c.Series[2].Y, tt.wantOther)
			}
		})
	}
}

func TestTheChartIsWrittenAsAPNG(t *testing.T) {
	samples := []sample{
		{at: 0, slices: 2, otherKnown: true},
		{at: 1500 * time.Millisecond, slices: 8, done: 100, otherKnown: true},
		{at: 3 * time.Second, slices: 8, leaving: 6, done: 250, otherGPUs: 6, otherKnown: true},
	}
	pngPath := filepath.Join(t.TempDir(), "new-dir", "sim.png")
	if err := writePlot(pngPath, "title", samples); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(pngPath)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	cfg, err := png.DecodeConfig(f)
	if err != nil {
		t.Fatalf("the chart is not a PNG: %v", err)
	}
	if cfg.Width != plot.Width || cfg.Height != plot.Height {
		t.Errorf("got a %dx%d chart, want %dx%d", cfg.Width, cfg.Height, plot.Width, plot.Height)
	}
}
