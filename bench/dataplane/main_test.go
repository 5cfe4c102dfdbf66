package dataplanebench

import (
	"bytes"
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestBenchmarkWritesEveryMetric runs the whole benchmark, small. It checks
// what the run reports, never how fast anything was.
func TestBenchmarkWritesEveryMetric(t *testing.T) {
	dir := t.TempDir()
	out := filepath.Join(dir, "results", "dataplane.json")
	var stdout, stderr bytes.Buffer
	code := run(t.Context(), []string{"--size", "8MiB", "--execs", "5", "--seed", "3", "--out", out, "--tmpdir", dir}, &stdout, &stderr)
	if code != 0 {
		t.Fatalf("got exit code %d, want 0; stderr:\n%s", code, stderr.String())
	}

	b, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	var res results
	if err := json.Unmarshal(b, &res); err != nil {
		t.Fatalf("the results do not parse as JSON: %v\n%s", err, b)
	}
	if res.Config.SizeBytes != 8<<20 || res.Config.Execs != 5 || res.Config.Seed != 3 {
		t.Errorf("got config %+v, want 8 MiB, 5 execs, seed 3", res.Config)
	}
	if len(res.Sides) != 2 {
		t.Errorf("got %d sides, want 2", len(res.Sides))
	}
	got := make(map[string]metric)
	for _, m := range res.Metrics {
		got[m.Name] = m
	}
	for _, name := range []string{"put_throughput", "get_throughput", "exec_p50", "exec_p90", "exec_p99", "exec_mean"} {
		m, ok := got[name]
		if !ok {
			t.Errorf("metric %s: missing from %s", name, out)
			continue
		}
		for side, v := range map[string]float64{"quic": m.QUIC, "tcp_tls": m.TCPTLS, "ratio": m.Ratio} {
			if !(v > 0) || math.IsInf(v, 0) {
				t.Errorf("metric %s: got %s %v, want a measured (positive, finite) value", name, side, v)
			}
		}
	}
	for _, name := range []string{"put_throughput", "exec_p99"} {
		if !strings.Contains(stdout.String(), got[name].Label) {
			t.Errorf("the table has no row %q:\n%s", got[name].Label, stdout.String())
		}
	}
	if entries, err := os.ReadDir(dir); err != nil || len(entries) != 1 {
		t.Errorf("got %v (err %v) in the temporary directory, want only results/: the run's directory must be removed", entries, err)
	}
}

func TestFlagsAreValidated(t *testing.T) {
	tests := []struct {
		name string
		args []string
		want string
	}{
		{"a size in decimal units is refused", []string{"--size", "1GB"}, "GiB"},
		{"zero execs are refused", []string{"--execs", "0"}, "--execs 0: must be between 1"},
		{"a positional argument is refused", []string{"extra"}, `unexpected argument "extra"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			if code := run(t.Context(), tt.args, &stdout, &stderr); code != 2 {
				t.Fatalf("got exit code %d, want 2", code)
			}
			if !strings.Contains(stderr.String(), tt.want) {
				t.Errorf("got stderr %q, want it to contain %q", stderr.String(), tt.want)
			}
		})
	}
}

func TestPercentileIsNearestRank(t *testing.T) {
	ms := func(n ...int) []time.Duration {
		d := make([]time.Duration, len(n))
		for i, x := range n {
			d[i] = time.Duration(x) * time.Millisecond
		}
		return d
	}
	tests := []struct {
		name   string
		sorted []time.Duration
		q      int
		want   time.Duration
	}{
		{"p50 of four values is the second", ms(1, 2, 3, 4), 50, 2 * time.Millisecond},
		{"p99 of five values is the largest", ms(1, 2, 3, 4, 5), 99, 5 * time.Millisecond},
		{"p90 of ten values is the ninth", ms(1, 2, 3, 4, 5, 6, 7, 8, 9, 10), 90, 9 * time.Millisecond},
		{"any percentile of one value is that value", ms(7), 50, 7 * time.Millisecond},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := percentile(tt.sorted, tt.q); got != tt.want {
				t.Errorf("got %v, want %v", got, tt.want)
			}
		})
	}
}
