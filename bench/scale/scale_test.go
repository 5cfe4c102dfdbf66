package scale

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestFlagsAreValidated(t *testing.T) {
	tests := []struct {
		name string
		args []string
		want string
	}{
		{"zero hosts are refused", []string{"--hosts", "0"}, "--hosts 0: must be between 1 and 1000000"},
		{"more GPUs per host than the simulator allows are refused", []string{"--gpus-per-host", "65"}, "--gpus-per-host 65: must be between 1 and 64"},
		{"zero leases are refused", []string{"--leases", "0"}, "--leases 0: must be between 1"},
		{"more leases than the pool holds are refused", []string{"--hosts", "1", "--gpus-per-host", "2", "--leases", "11"}, "--leases 11: must be at most 10 (2 GPUs × 5 slices"},
		{"zero clients are refused", []string{"--clients", "0"}, "--clients 0: must be between 1 and 1024"},
		{"a negative grant budget is refused", []string{"--grant-budget", "-1s"}, "--grant-budget -1s: must be 0"},
		{"a negative snapshot wait is refused", []string{"--snapshot-wait", "-1s"}, "--snapshot-wait -1s: must be 0 or more"},
		{"an empty --out is refused", []string{"--out", ""}, "--out: must name a directory"},
		{"a missing binary is refused", []string{"--gpupool", "/nonexistent/gpupool"}, "--gpupool /nonexistent/gpupool: not a file"},
		{"a positional argument is refused", []string{"extra"}, `unexpected argument "extra"`},
		{"a non-number is refused", []string{"--hosts", "many"}, "invalid value"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			if code := Run(t.Context(), tt.args, &stdout, &stderr); code != 2 {
				t.Fatalf("got exit code %d, want 2; stderr:\n%s", code, stderr.String())
			}
			if !strings.Contains(stderr.String(), tt.want) {
				t.Errorf("got stderr %q, want it to contain %q", stderr.String(), tt.want)
			}
		})
	}
}

func TestHelpPrintsTheUsageAndSucceeds(t *testing.T) {
	var stdout, stderr bytes.Buffer
	if code := Run(t.Context(), []string{"--help"}, &stdout, &stderr); code != 0 {
		t.Fatalf("got exit code %d, want 0", code)
	}
	for _, want := range []string{"Usage: scale", "--hosts", "--gpus-per-host", "--leases", "--heartbeat-ttl 1h"} {
		if !strings.Contains(stdout.String(), want) {
			t.Errorf("the usage lacks %q:\n%s", want, stdout.String())
		}
	}
}

func TestDefaultsAreTheIssuesSizes(t *testing.T) {
	o, err := parseFlags(nil, &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	if o.hosts != 10000 || o.gpusPerHost != 8 || o.leases != 100000 {
		t.Errorf("got %d hosts × %d GPUs, %d leases; want 10000 × 8, 100000", o.hosts, o.gpusPerHost, o.leases)
	}
}

func TestParseStatusReadsRSSAndPeak(t *testing.T) {
	tests := []struct {
		name    string
		status  string
		want    memory
		wantErr string
	}{
		{"both lines are read in MiB", "Name:\tgpupool\nVmHWM:\t  2048 kB\nVmRSS:\t  1024 kB\nThreads:\t9\n", memory{RSSMiB: 1, HWMMiB: 2}, ""},
		{"a status without them is refused", "Name:\tkthreadd\nThreads:\t1\n", memory{}, "no VmRSS and VmHWM"},
		{"a unit other than kB is refused", "VmRSS:\t1 MB\nVmHWM:\t1 MB\n", memory{}, `VmRSS: "1 MB": want a number of kB`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := parseStatus(strings.NewReader(tt.status))
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("got error %v, want one containing %q", err, tt.wantErr)
				}
				return
			}
			if err != nil || got != tt.want {
				t.Errorf("got %+v, %v; want %+v", got, err, tt.want)
			}
		})
	}
}

func TestPercentileIsNearestRank(t *testing.T) {
	tests := []struct {
		name   string
		sorted []float64
		q      int
		want   float64
	}{
		{"p50 of four values is the second", []float64{1, 2, 3, 4}, 50, 2},
		{"p99 of a hundred values is the 99th", func() []float64 {
			v := make([]float64, 100)
			for i := range v {
				v[i] = float64(i + 1)
			}
			return v
		}(), 99, 99},
		{"no values give 0", nil, 50, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := percentile(tt.sorted, tt.q); got != tt.want {
				t.Errorf("got %v, want %v", got, tt.want)
			}
		})
	}
}

func TestLeaseRequestsAreSeededAndUnique(t *testing.T) {
	a, b := leaseRequest(1, 7), leaseRequest(1, 7)
	if a.MemoryMib != b.MemoryMib || a.ComputePercent != b.ComputePercent || a.RequestId != b.RequestId {
		t.Errorf("the same seed and index gave %v and %v", a, b)
	}
	if leaseRequest(1, 8).RequestId == a.RequestId || leaseRequest(2, 7).RequestId == a.RequestId {
		t.Error("different leases share a request id")
	}
	sizes := map[int64]bool{}
	for i := range 200 {
		sizes[leaseRequest(1, i).MemoryMib] = true
	}
	if len(sizes) != len(sliceMiB) {
		t.Errorf("200 leases drew %d of the %d sizes", len(sizes), len(sliceMiB))
	}
}

func TestHostHasItsGPUsWithUniqueIDs(t *testing.T) {
	h := host(3, 8)
	seen := map[string]bool{}
	for _, d := range h.Devices {
		if d.HostId != h.Id || d.MemoryMib != gpuMiB || seen[d.Uuid] {
			t.Errorf("device %+v: want host %s, %d MiB, a unique uuid", d, h.Id, gpuMiB)
		}
		seen[d.Uuid] = true
	}
	if len(h.Devices) != 8 || host(4, 8).Id == h.Id {
		t.Errorf("got %d devices and host ids %s, %s; want 8 and distinct ids", len(h.Devices), h.Id, host(4, 8).Id)
	}
}

func TestNewestSnapshotSkipsUnfinishedOnes(t *testing.T) {
	dir := t.TempDir()
	created := time.UnixMilli(1_700_000_000_000)
	write := func(name, meta string, mtime time.Time) {
		t.Helper()
		d := filepath.Join(dir, name)
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
		if meta == "" {
			return
		}
		p := filepath.Join(d, "meta.json")
		if err := os.WriteFile(p, []byte(meta), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.Chtimes(p, mtime, mtime); err != nil {
			t.Fatal(err)
		}
	}
	write("2-100-1700000000000", `{"Index":100,"Term":2,"Size":5000}`, created.Add(1500*time.Millisecond))
	write("2-50-1699999999000", `{"Index":50,"Term":2,"Size":10}`, created)
	write("2-200-1700000001000.tmp", `{"Index":200,"Term":2,"Size":1}`, created)
	write("2-300-1700000002000", "", created) // no meta.json yet
	s, err := newestSnapshot(dir)
	if err != nil {
		t.Fatal(err)
	}
	if s.Index != 100 || s.Size != 5000 || s.WriteSeconds != 1.5 {
		t.Errorf("got %+v; want index 100, 5000 bytes, written in 1.5s", s)
	}
	if _, err := newestSnapshot(t.TempDir()); err == nil {
		t.Error("an empty directory gave a snapshot")
	}
}
