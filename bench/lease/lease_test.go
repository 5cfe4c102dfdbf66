package leasebench

import (
	"bytes"
	"context"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"
)

func TestParseFlags(t *testing.T) {
	defaults := options{clients: []int{1, 16, 64, 256}, duration: 10 * time.Second, warmup: 2 * time.Second,
		out: "bench/results", etcd: "/usr/bin/etcd", burst: 10000, others: 16}
	tests := []struct {
		name    string
		args    []string
		want    options
		wantErr string
	}{
		{name: "no flags give the defaults", want: defaults},
		{name: "every flag is read", args: []string{"--clients", "2, 8", "--duration", "3s", "--warmup", "0s", "--out", "/tmp/r",
			"--gpupool", "/tmp/gpupool", "--etcd", "/opt/etcd", "--tmpdir", "/var/tmp", "--profile", "/tmp/p", "--burst", "5", "--burst-clients", "3"},
			want: options{clients: []int{2, 8}, duration: 3 * time.Second, out: "/tmp/r", gpupool: "/tmp/gpupool", etcd: "/opt/etcd", tmp: "/var/tmp",
				profile: "/tmp/p", burst: 5, others: 3}},
		{name: "a level that is not a number is refused", args: []string{"--clients", "1,x"}, wantErr: `level "x" is not a whole number`},
		{name: "an empty level is refused", args: []string{"--clients", "1,,4"}, wantErr: "empty level"},
		{name: "no level at all is refused", args: []string{"--clients", ""}, wantErr: "empty level"},
		{name: "zero clients are refused", args: []string{"--clients", "0"}, wantErr: "level 0 must be between 1 and 1024"},
		{name: "too many clients are refused", args: []string{"--clients", "5000"}, wantErr: "level 5000 must be between 1 and 1024"},
		{name: "a level given twice is refused", args: []string{"--clients", "4,4"}, wantErr: "level 4 is given twice"},
		{name: "a tiny duration is refused", args: []string{"--duration", "1ms"}, wantErr: "--duration 1ms: must be at least 100ms"},
		{name: "a negative warm-up is refused", args: []string{"--warmup", "-1s"}, wantErr: "--warmup -1s: must not be negative"},
		{name: "a negative burst is refused", args: []string{"--burst", "-1"}, wantErr: "--burst -1: must be between 0 (no burst) and 100000"},
		{name: "no other clients beside the burst are refused", args: []string{"--burst-clients", "0"}, wantErr: "--burst-clients 0: must be between 1 and 1024"},
		{name: "an empty --out is refused", args: []string{"--out", ""}, wantErr: "--out: must name a directory"},
		{name: "an empty --etcd is refused", args: []string{"--etcd", ""}, wantErr: "--etcd: must name the etcd binary"},
		{name: "a positional argument is refused", args: []string{"now"}, wantErr: `unexpected argument "now"`},
		{name: "an unknown flag is refused", args: []string{"--nope"}, wantErr: "flag provided but not defined: -nope"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := parseFlags(tt.args, &bytes.Buffer{})
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("got error %v, want one containing %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatalf("got error %v, want none", err)
			}
			if !slices.Equal(got.clients, tt.want.clients) {
				t.Errorf("got clients %v, want %v", got.clients, tt.want.clients)
			}
			got.clients, tt.want.clients = nil, nil
			if !reflect.DeepEqual(got, tt.want) {
				t.Errorf("got %+v, want %+v", got, tt.want)
			}
		})
	}
}

func TestRunExitCodes(t *testing.T) {
	tests := []struct {
		name       string
		args       []string
		want       int
		wantStdout string
		wantStderr string
	}{
		{name: "help prints the usage and succeeds", args: []string{"--help"}, want: 0, wantStdout: "Usage: gpupool-bench lease"},
		{name: "a bad flag is a usage error", args: []string{"--clients", "0"}, want: 2, wantStderr: "Run with --help"},
		{name: "a missing etcd is a failure that says how to install it", args: []string{"--etcd", "/nonexistent/etcd"}, want: 1,
			wantStderr: "install-etcd.sh"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			got := Run(context.Background(), tt.args, &stdout, &stderr)
			if got != tt.want {
				t.Errorf("got exit code %d, want %d (stderr: %s)", got, tt.want, stderr.String())
			}
			if !strings.Contains(stdout.String(), tt.wantStdout) {
				t.Errorf("got stdout %q, want it to contain %q", stdout.String(), tt.wantStdout)
			}
			if !strings.Contains(stderr.String(), tt.wantStderr) {
				t.Errorf("got stderr %q, want it to contain %q", stderr.String(), tt.wantStderr)
			}
		})
	}
}

func TestPercentile(t *testing.T) {
	ms := func(ns ...int) []time.Duration {
		var ds []time.Duration
		for _, n := range ns {
			ds = append(ds, time.Duration(n)*time.Millisecond)
		}
		return ds
	}
	hundred := make([]int, 100)
	for i := range hundred {
		hundred[i] = i + 1
	}
	tests := []struct {
		name string
		ds   []time.Duration
		want latency
	}{
		{name: "no samples give zeros", want: latency{}},
		{name: "one sample is every percentile", ds: ms(7), want: latency{P50: 7, P99: 7, Mean: 7, Max: 7}},
		{name: "unsorted samples are sorted first", ds: ms(3, 1, 2), want: latency{P50: 2, P99: 3, Mean: 2, Max: 3}},
		{name: "1 to 100 ms have the nearest-rank p50 and p99", ds: ms(hundred...), want: latency{P50: 50, P99: 99, Mean: 50.5, Max: 100}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := summarize(tt.ds); got != tt.want {
				t.Errorf("got %+v, want %+v", got, tt.want)
			}
		})
	}
}

func TestPoolNeverFillsAtTheLargestLevel(t *testing.T) {
	if got, want := poolSlices(), 10*256; got != want {
		t.Errorf("got %d slices in the pool, want %d (ten times the largest default level)", got, want)
	}
	if got := len(simulatedPool()); got != hosts*gpusPerHost {
		t.Errorf("got %d devices, want %d", got, hosts*gpusPerHost)
	}
}
