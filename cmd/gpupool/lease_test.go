package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/spf13/cobra"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/prototext"
	"google.golang.org/protobuf/proto"

	"github.com/gpupool/gpupool/client"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

func TestLeaseCommandsRefuseBadInput(t *testing.T) {
	slice := []string{"lease", "acquire", "--memory", "20GiB", "--compute", "25"}
	with := func(extra ...string) []string { return append(append([]string{}, slice...), extra...) }
	checkUsageErrors(t, []usageCase{
		{"acquire with --exclusive and --memory", []string{"lease", "acquire", "--exclusive", "--memory", "20GiB"}, []string{"--exclusive", "--memory", "--compute"}},
		{"acquire with --exclusive and --compute", []string{"lease", "acquire", "--exclusive", "--compute", "25"}, []string{"--exclusive", "--compute"}},
		{"acquire with neither form explains both", []string{"lease", "acquire"}, []string{"--exclusive for whole GPUs", "--memory and --compute", "--memory 20GiB --compute 25"}},
		{"acquire with --memory alone", []string{"lease", "acquire", "--memory", "20GiB"}, []string{"--memory needs --compute"}},
		{"acquire with --compute alone", []string{"lease", "acquire", "--compute", "25"}, []string{"--compute needs --memory"}},
		{"acquire with no GPUs", with("--gpus", "0"), []string{"--gpus 0", "between 1 and 256"}},
		{"acquire with negative GPUs", with("--gpus", "-2"), []string{"--gpus -2", "between 1 and 256"}},
		{"acquire with decimal GB", []string{"lease", "acquire", "--memory", "20GB", "--compute", "25"}, []string{`--memory "20GB"`, "decimal", "GiB"}},
		{"acquire with zero memory", []string{"lease", "acquire", "--memory", "0", "--compute", "25"}, []string{`--memory "0"`, "at least 1 MiB"}},
		{"acquire with a fraction of a MiB", []string{"lease", "acquire", "--memory", "0.0001GiB", "--compute", "25"}, []string{`--memory "0.0001GiB"`, "whole number of MiB"}},
		{"acquire with zero compute", []string{"lease", "acquire", "--memory", "1GiB", "--compute", "0"}, []string{`--compute "0"`, "1 to 100"}},
		{"acquire with compute over 100", []string{"lease", "acquire", "--memory", "1GiB", "--compute", "150%"}, []string{`--compute "150%"`, "1 to 100"}},
		{"acquire with fractional compute", []string{"lease", "acquire", "--memory", "1GiB", "--compute", "12.5"}, []string{`--compute "12.5"`, "whole percent"}},
		{"acquire with an unknown topology", with("--topology", "same-rack"), []string{`--topology "same-rack"`, "same-host, distinct-gpus, same-nvlink, same-pcie-root"}},
		{"acquire with an unknown class", with("--class", "besteffort"), []string{`--class "besteffort"`, "guaranteed, preemptible"}},
		{"acquire with a TTL under a second", with("--ttl", "500ms"), []string{"--ttl 500ms", "between 1000 (1s) and 86400000 (24h)"}},
		{"acquire with a TTL over a day", with("--ttl", "25h"), []string{"--ttl 25h0m0s", "between 1000 (1s) and 86400000 (24h)"}},
		{"acquire with a label missing =", with("--label", "gpu"), []string{`--label "gpu"`, "key=value"}},
		{"acquire with a label missing its key", with("--label", "=x"), []string{`--label "=x"`, "key=value"}},
		{"acquire with two values for one label", with("--label", "zone=a", "--label", "zone=b"), []string{`--label "zone=b"`, `"zone"`, `already given as "a"`}},
		{"acquire with an empty tenant", with("--tenant", ""), []string{"--tenant is empty"}},
		{"acquire with negative host CPU", with("--host-cpu", "-1"), []string{"--host-cpu -1", "0 or more", "millicores"}},
		{"acquire with decimal host memory", with("--host-memory", "16GB"), []string{`--host-memory "16GB"`, "GiB"}},
		{"acquire with negative min memory", with("--min-memory", "-1GiB"), []string{`--min-memory "-1GiB"`, "negative"}},
		{"acquire with a positional argument", with("extra"), []string{"accepts 0 arg(s)", "usage: gpupool lease acquire"}},
		{"acquire with an unknown flag", with("--gpu", "2"), []string{"--gpu"}},
		{"acquire with a non-number for --gpus", with("--gpus", "two"), []string{"--gpus"}},
		{"acquire with a bad --ttl", with("--ttl", "5"), []string{"--ttl"}},
		{"acquire with a negative wait", with("--wait", "-1s"), []string{"--wait -1s", "between 0 (fail at once) and 86400000 (24h)"}},
		{"acquire with a wait over a day", with("--wait", "25h"), []string{"--wait 25h0m0s", "between 0"}},
		{"acquire with a wait that is not a duration", with("--wait", "10"), []string{"--wait"}},
		{"acquire with an elastic range without ..", with("--elastic", "2-6"), []string{`--elastic "2-6"`, "MIN..MAX", "--elastic 2..6"}},
		{"acquire with an elastic range missing its MAX", with("--elastic", "2.."), []string{`--elastic "2.."`, "MIN..MAX"}},
		{"acquire with an elastic range of words", with("--elastic", "two..six"), []string{`--elastic "two..six"`, "MIN..MAX"}},
		{"acquire with an elastic MIN of 0", with("--elastic", "0..4"), []string{"--elastic 0..4: MIN (0) must be at least 1"}},
		{"acquire with an elastic MAX under its MIN", with("--elastic", "5..2"), []string{"--elastic 5..2: MAX (2) must be at least MIN (5)"}},
		{"acquire with --elastic and --gpus", with("--elastic", "2..6", "--gpus", "3"), []string{"--elastic 2..6", "--gpus 3", "keep --elastic", "keep --gpus"}},
		{"acquire with --elastic and the default --gpus given", with("--gpus", "1", "--elastic", "2..6"), []string{"conflicts with --gpus 1"}},
		{"acquire of a preemptible elastic lease", with("--elastic", "2..6", "--class", "preemptible"), []string{"--class preemptible", "an elastic lease must be guaranteed (its extra slices are preemptible)", "drop class or --elastic"}},
		{"acquire of an elastic lease with a topology", with("--elastic", "2..6", "--topology", "same-host"), []string{"--topology same-host", "must be unset for an elastic lease"}},
		{"acquire of an elastic lease with host memory", with("--elastic", "2..6", "--host-memory", "16GiB"), []string{"--host-memory 16GiB", "must be unset for an elastic lease", "other hosts"}},
		{"run with a wait over a day", []string{"run", "--exclusive", "--wait", "25h", "--", "true"}, []string{"--wait 25h0m0s", "between 0"}},
		{"run has no --elastic", []string{"run", "--exclusive", "--elastic", "1..2", "--", "true"}, []string{"--elastic"}},
		{"keepalive without a lease", []string{"lease", "keepalive"}, []string{"requires at least 1 arg(s)", "LEASE_ID..."}},
		{"keepalive --once with --interval", []string{"lease", "keepalive", "l-1", "--once", "--interval", "5s"}, []string{"--interval", "--once"}},
		{"keepalive with a tiny --interval", []string{"lease", "keepalive", "l-1", "--interval", "1ms"}, []string{"--interval 1ms", "at least 100ms"}},
		{"keepalive with a bad -o", []string{"lease", "keepalive", "l-1", "-o", "yaml"}, []string{`--output "yaml"`, "json or name"}},
		{"get without a lease", []string{"lease", "get"}, []string{"accepts 1 arg(s), received 0", "gpupool lease get LEASE_ID"}},
		{"get with two leases", []string{"lease", "get", "l-1", "l-2"}, []string{"accepts 1 arg(s), received 2"}},
		{"get with a bad -o", []string{"lease", "get", "l-1", "-o", "yaml"}, []string{`--output "yaml"`, "json or name"}},
		{"ls with an unknown state", []string{"lease", "ls", "--state", "granted,bogus"}, []string{`--state "bogus"`, "pending, granted, releasing, released, expired, revoked"}},
		{"ls with a positional argument", []string{"lease", "ls", "l-1"}, []string{"accepts 0 arg(s)"}},
		{"ls --pending with --state", []string{"lease", "ls", "--pending", "--state", "granted"}, []string{"--pending", "conflicts with --state granted", "keep --pending", "or keep --state"}},
		{"ls --pending with --all", []string{"lease", "ls", "--pending", "--all"}, []string{"--pending", "conflicts with --all", "keep one"}},
		{"release without a lease", []string{"lease", "release"}, []string{"requires at least 1 arg(s), only received 0", "gpupool lease release LEASE_ID..."}},
	})
}

// parseAcquire parses args as 'lease acquire' flags and builds the request.
func parseAcquire(t *testing.T, args ...string) (*gpupoolv1.LeaseRequest, error) {
	t.Helper()
	var f acquireFlags
	cmd := &cobra.Command{}
	f.register(cmd)
	f.registerQueue(cmd)
	if err := cmd.ParseFlags(args); err != nil {
		t.Fatalf("parse %v: %v", args, err)
	}
	return f.leaseRequest()
}

func TestAcquireBuildsTheRequest(t *testing.T) {
	tests := []struct {
		name string
		args []string
		want *gpupoolv1.LeaseRequest
	}{
		{
			name: "a slice gets the defaults, and no request id (the SDK makes one)",
			args: []string{"--memory", "20GiB", "--compute", "25%", "--holder", "me@box"},
			want: &gpupoolv1.LeaseRequest{
				Count: 1, MemoryMib: 20480, ComputePercent: 25, TtlMs: 300000,
				Holder: "me@box", // no request id: the SDK makes one
				Class:  gpupoolv1.LeaseClass_LEASE_CLASS_GUARANTEED, Constraints: &gpupoolv1.Constraints{},
			},
		},
		{
			name: "whole GPUs with every constraint",
			args: []string{"--gpus", "2", "--exclusive", "--model", "A100*", "--min-memory", "40Gi", "--host", "h1",
				"--label", "zone=eu-1", "--label", "rack=r2", "--topology", "same-nvlink", "--ttl", "90s",
				"--tenant", "team-a", "--holder", "job-7", "--request-id", "req-1", "--class", "preemptible",
				"--priority", "5", "--host-cpu", "2000", "--host-memory", "16GiB"},
			want: &gpupoolv1.LeaseRequest{
				Count: 2, Exclusive: true, TtlMs: 90000, RequestId: "req-1", Tenant: "team-a", Holder: "job-7",
				Class: gpupoolv1.LeaseClass_LEASE_CLASS_PREEMPTIBLE, Priority: 5, Topology: gpupoolv1.Topology_TOPOLOGY_SAME_NVLINK,
				HostCpuMillicores: 2000, HostMemoryMib: 16384,
				Constraints: &gpupoolv1.Constraints{Model: "A100*", MinMemoryMib: 40960, Host: "h1",
					Labels: map[string]string{"zone": "eu-1", "rack": "r2"}},
			},
		},
		{
			name: "an elastic lease guarantees MIN slices and grows up to MAX",
			args: []string{"--memory", "20GiB", "--compute", "25", "--elastic", "2..6", "--holder", "me@box", "--wait", "10m"},
			want: &gpupoolv1.LeaseRequest{
				Count: 2, ElasticMax: 6, MemoryMib: 20480, ComputePercent: 25, TtlMs: 300000,
				Holder: "me@box", // no request id: the SDK makes one
				Class:  gpupoolv1.LeaseClass_LEASE_CLASS_GUARANTEED, Constraints: &gpupoolv1.Constraints{},
			},
		},
		{
			name: "an elastic range may be fixed",
			args: []string{"--exclusive", "--elastic", " 3..3 ", "--holder", "me@box"},
			want: &gpupoolv1.LeaseRequest{
				Count: 3, ElasticMax: 3, Exclusive: true, TtlMs: 300000,
				Holder: "me@box", // no request id: the SDK makes one
				Class:  gpupoolv1.LeaseClass_LEASE_CLASS_GUARANTEED, Constraints: &gpupoolv1.Constraints{},
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := parseAcquire(t, tt.args...)
			if err != nil {
				t.Fatal(err)
			}
			if !proto.Equal(got, tt.want) {
				t.Errorf("got  %v\nwant %v", prototext.Format(got), prototext.Format(tt.want))
			}
		})
	}
}

func TestAcquireHolderDefaultsToUserAtHost(t *testing.T) {
	t.Setenv("USER", "alice")
	req, err := parseAcquire(t, "--exclusive")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(req.GetHolder(), "alice@") || len(req.GetHolder()) == len("alice@") {
		t.Errorf("holder %q, want alice@HOSTNAME", req.GetHolder())
	}
}

func TestListRequest(t *testing.T) {
	f := listFlags{tenant: "t", host: "h", states: []string{"granted", "RELEASING"}, all: true, stale: true}
	got, err := f.listRequest()
	if err != nil {
		t.Fatal(err)
	}
	want := &gpupoolv1.ListLeasesRequest{Tenant: "t", Host: "h", IncludeEnded: true, Stale: true,
		States: []gpupoolv1.LeaseState{gpupoolv1.LeaseState_LEASE_STATE_GRANTED, gpupoolv1.LeaseState_LEASE_STATE_RELEASING}}
	if !proto.Equal(got, want) {
		t.Errorf("got %v, want %v", got, want)
	}
}

func TestListPendingAsksForPendingLeasesOnly(t *testing.T) {
	f := listFlags{tenant: "sim", pending: true}
	got, err := f.listRequest()
	if err != nil {
		t.Fatal(err)
	}
	want := &gpupoolv1.ListLeasesRequest{Tenant: "sim", States: []gpupoolv1.LeaseState{gpupoolv1.LeaseState_LEASE_STATE_PENDING}}
	if !proto.Equal(got, want) {
		t.Errorf("got %v, want %v", got, want)
	}
}

// pendingLease is a lease waiting in the queue since created.
func pendingLease(id string, priority int32, created time.Time, req *gpupoolv1.LeaseRequest, why string) *gpupoolv1.Lease {
	return &gpupoolv1.Lease{Id: id, Tenant: "sim", Holder: "bob@box", State: gpupoolv1.LeaseState_LEASE_STATE_PENDING,
		Priority: priority, CreatedAtMs: created.UnixMilli(), Request: req, RequestId: "req-" + id, PendingReason: why}
}

func TestPrintPendingLeasesInQueueOrderWithWhy(t *testing.T) {
	now := time.Date(2026, 1, 1, 12, 5, 0, 0, time.UTC)
	slice := &gpupoolv1.LeaseRequest{Count: 2, MemoryMib: 40960, ComputePercent: 50}
	whole := &gpupoolv1.LeaseRequest{Count: 1, Exclusive: true}
	elastic := &gpupoolv1.LeaseRequest{Count: 2, ElasticMax: 6, MemoryMib: 20480, ComputePercent: 25}
	leases := []*gpupoolv1.Lease{
		pendingLease("l-late", 0, now.Add(-30*time.Second), whole, "host gpu-07 draining"),
		pendingLease("l-early", 0, now.Add(-3*time.Minute), slice, "no A100 with 40 GiB free (12 have 20 GiB)"),
		pendingLease("l-urgent", 5, now.Add(-10*time.Second), elastic, "tenant sim at 90% of memory quota"),
		pendingLease("l-quiet", 0, now.Add(-time.Minute), nil, ""),
	}
	var buf bytes.Buffer
	if err := printPendingLeases(&buf, leases, now); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimRight(buf.String(), "\n"), "\n")
	want := [][]string{
		{"ID", "TENANT", "HOLDER", "PRIORITY", "WANTS", "WAITING", "WHY"},
		{"l-urgent", "sim", "bob@box", "5", "2..6× 20GiB 25%", "10s", "tenant sim at 90% of memory quota"},
		{"l-early", "0", "2× 40GiB 50%", "3m", "no A100 with 40 GiB free (12 have 20 GiB)"},
		{"l-quiet", "0", "-", "60s", "-"},
		{"l-late", "0", "1× exclusive", "30s", "host gpu-07 draining"},
	}
	if len(lines) != len(want) {
		t.Fatalf("got %d lines, want %d:\n%s", len(lines), len(want), buf.String())
	}
	for i, cols := range want {
		if !strings.HasPrefix(lines[i], cols[0]) {
			t.Errorf("line %d = %q, want it to start with %q (queue order: priority, then arrival)", i, lines[i], cols[0])
		}
		for _, c := range cols[1:] {
			if !strings.Contains(lines[i], c) {
				t.Errorf("line %d = %q, want it to contain %q", i, lines[i], c)
			}
		}
	}
	if !strings.HasSuffix(lines[1], "tenant sim at 90% of memory quota") {
		t.Errorf("line 1 = %q, want WHY last so long reasons do not push columns", lines[1])
	}
}

func TestPrintPendingLeasesJSONIsTheListWithReasons(t *testing.T) {
	setOutput(t, "json")
	var buf bytes.Buffer
	resp := &gpupoolv1.ListLeasesResponse{Leases: []*gpupoolv1.Lease{
		pendingLease("l-1", 3, time.UnixMilli(1000), &gpupoolv1.LeaseRequest{Count: 1, Exclusive: true}, "host gpu-07 draining")}}
	if err := render(&buf, resp, func(io.Writer) error { t.Error("printed a table under -o json"); return nil }); err != nil {
		t.Fatal(err)
	}
	var got struct {
		Leases []map[string]any `json:"leases"`
	}
	if err := json.Unmarshal(buf.Bytes(), &got); err != nil {
		t.Fatalf("output is not JSON: %v\n%s", err, buf.String())
	}
	if len(got.Leases) != 1 || got.Leases[0]["pending_reason"] != "host gpu-07 draining" || got.Leases[0]["state"] != "LEASE_STATE_PENDING" {
		t.Errorf("JSON leases = %v, want l-1 pending with its pending_reason", got.Leases)
	}
}

func TestPrintLeaseShowsQueueElasticAndPreemption(t *testing.T) {
	tests := []struct {
		name  string
		lease func(l *gpupoolv1.Lease)
		want  []string
		not   []string
	}{
		{
			name: "a pending lease says why it waits",
			lease: func(l *gpupoolv1.Lease) {
				l.State, l.Slices, l.PendingReason = gpupoolv1.LeaseState_LEASE_STATE_PENDING, nil, "host gpu-07 draining"
			},
			want: []string{"STATE          pending", "PENDING        host gpu-07 draining"},
			not:  []string{"PARENT", "PREEMPTED", "none reported yet"},
		},
		{
			name: "an elastic lease shows its range",
			lease: func(l *gpupoolv1.Lease) {
				l.Request = &gpupoolv1.LeaseRequest{Count: 2, ElasticMax: 6}
			},
			want: []string{"ELASTIC        2..6 slices: 2 guaranteed"},
			not:  []string{"PENDING", "PARENT"},
		},
		{
			name: "an extra names its parent",
			lease: func(l *gpupoolv1.Lease) {
				l.Parent, l.Class = "l-100", gpupoolv1.LeaseClass_LEASE_CLASS_PREEMPTIBLE
			},
			want: []string{"PARENT         l-100 (this lease is an extra of that elastic lease)", "CLASS          preemptible"},
		},
		{
			name: "a preempted lease says when and for whom",
			lease: func(l *gpupoolv1.Lease) {
				l.PreemptAtMs, l.PreemptedFor = time.Date(2026, 1, 1, 12, 30, 0, 0, time.UTC).UnixMilli(), "l-900"
			},
			want: []string{"PREEMPTED      at 2026-01-01 12:30:00 UTC for l-900"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			l := sampleLease()
			tt.lease(l)
			var buf bytes.Buffer
			if err := printLease(&buf, l); err != nil {
				t.Fatal(err)
			}
			for _, w := range tt.want {
				if !strings.Contains(buf.String(), w) {
					t.Errorf("printLease output lacks %q:\n%s", w, buf.String())
				}
			}
			for _, n := range tt.not {
				if strings.Contains(buf.String(), n) {
					t.Errorf("printLease output has %q:\n%s", n, buf.String())
				}
			}
		})
	}
}

func TestQueueReporterSaysWhenTheReasonChangesAndEvery10s(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	now := t0
	var buf bytes.Buffer
	q := &queueReporter{w: &buf, until: t0.Add(10 * time.Minute), now: func() time.Time { return now }}
	for _, step := range []struct {
		at  time.Duration
		why string
	}{
		{300 * time.Millisecond, "no A100 with 40 GiB free (12 have 20 GiB)"},
		{2 * time.Second, "no A100 with 40 GiB free (12 have 20 GiB)"}, // same reason, too soon
		{3 * time.Second, "no A100 with 40 GiB free (11 have 20 GiB)"}, // only a number changed
		{4 * time.Second, "host gpu-07 draining"},                      // a new reason
		{6 * time.Second, "host gpu-07 draining"},                      // too soon
		{14 * time.Second, "host gpu-07 draining"},                     // 10s since the last line
		{11 * time.Minute, ""},                                         // past the wait, no reason
	} {
		now = t0.Add(step.at)
		q.report(&gpupoolv1.Lease{Id: "l-1", State: gpupoolv1.LeaseState_LEASE_STATE_PENDING, PendingReason: step.why})
	}
	want := "waiting in queue (9m59s left): no A100 with 40 GiB free (12 have 20 GiB)\n" +
		"waiting in queue (9m56s left): host gpu-07 draining\n" +
		"waiting in queue (9m46s left): host gpu-07 draining\n" +
		"waiting in queue (0s left): the brokers have not said why yet\n"
	if buf.String() != want {
		t.Errorf("got\n%s\nwant\n%s", buf.String(), want)
	}
}

// sampleLease is a granted lease with a fractional slice and a whole GPU.
func sampleLease() *gpupoolv1.Lease {
	return &gpupoolv1.Lease{
		Id: "l-123", Tenant: "team-a", Holder: "alice@box", State: gpupoolv1.LeaseState_LEASE_STATE_GRANTED,
		FencingToken: 42, TtlMs: 600000, Class: gpupoolv1.LeaseClass_LEASE_CLASS_GUARANTEED, RequestId: "req-1",
		CreatedAtMs: time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC).UnixMilli(),
		Slices: []*gpupoolv1.Slice{
			{Host: "host-1", Device: "GPU-aaaa", DeviceIndex: 0, Model: "A100-SXM4-80GB", MemoryMib: 20480, ComputePercent: 25},
			{Host: "host-1", Device: "GPU-bbbb", DeviceIndex: 3, Model: "A100-SXM4-80GB", MemoryMib: 81920, Exclusive: true},
		},
	}
}

func TestPrintLeaseTable(t *testing.T) {
	var buf bytes.Buffer
	if err := printLease(&buf, sampleLease()); err != nil {
		t.Fatal(err)
	}
	out := buf.String()
	for _, want := range []string{
		"LEASE          l-123", "STATE          granted", "FENCING TOKEN  42", "TTL            10m0s",
		"HOLDER         alice@box", "REQUEST ID     req-1",
		"HOST    DEVICE    INDEX  MODEL           MEMORY  COMPUTE",
		"host-1  GPU-aaaa  0      A100-SXM4-80GB  20 GiB  25%",
		"host-1  GPU-bbbb  3      A100-SXM4-80GB  80 GiB  exclusive",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("printLease output lacks %q:\n%s", want, out)
		}
	}
}

func TestPrintLeaseShowsIsolationUsageAndViolations(t *testing.T) {
	l := sampleLease()
	l.Slices[0].Isolation = gpupoolv1.Isolation_ISOLATION_MPS
	l.Slices[1].Isolation = gpupoolv1.Isolation_ISOLATION_EXCLUSIVE
	l.Violations, l.LastViolation = 2, "used 30 GiB of memory on GPU 0, over its slice of 20 GiB for 2s"
	l.Usage = []*gpupoolv1.LeaseUsage{{Host: "host-1", LeaseId: "l-123", Slices: []*gpupoolv1.SliceUsage{
		{Device: "GPU-aaaa", MemoryUsedMib: 12288, UtilizationPercent: 40, Processes: 3}}}}
	var buf bytes.Buffer
	if err := printLease(&buf, l); err != nil {
		t.Fatal(err)
	}
	out := buf.String()
	for _, want := range []string{
		"VIOLATIONS     2, last: used 30 GiB of memory on GPU 0",
		"MEMORY  COMPUTE    ISOLATION  USED    UTIL  PROCS",
		"20 GiB  25%        mps        12 GiB  40%   3",
		"80 GiB  exclusive  exclusive  -       -     -",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("printLease output lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(out, "none reported yet") {
		t.Errorf("printLease says no usage was reported, but one was:\n%s", out)
	}
	l.Usage = nil
	buf.Reset()
	if err := printLease(&buf, l); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(buf.String(), "none reported yet") {
		t.Errorf("printLease of a lease without usage does not say why USED is empty:\n%s", buf.String())
	}
}

func TestPrintLeaseJSONIsTheLeaseWithProtoFieldNames(t *testing.T) {
	setOutput(t, "json")
	var buf bytes.Buffer
	l := sampleLease()
	if err := render(&buf, l, func(io.Writer) error { t.Error("printed a table under -o json"); return nil }); err != nil {
		t.Fatal(err)
	}
	var got map[string]any
	if err := json.Unmarshal(buf.Bytes(), &got); err != nil {
		t.Fatalf("output is not JSON: %v\n%s", err, buf.String())
	}
	for _, k := range []string{"id", "state", "fencing_token", "slices"} {
		if _, ok := got[k]; !ok {
			t.Errorf("JSON lacks %q: %s", k, buf.String())
		}
	}
	if got["id"] != "l-123" || got["state"] != "LEASE_STATE_GRANTED" || got["fencing_token"] != "42" {
		t.Errorf("id, state, fencing_token = %v, %v, %v; want l-123, LEASE_STATE_GRANTED, \"42\"", got["id"], got["state"], got["fencing_token"])
	}
	slices, _ := got["slices"].([]any)
	if len(slices) != 2 {
		t.Fatalf("slices = %v, want 2 of them", got["slices"])
	}
	first, _ := slices[0].(map[string]any)
	for k, want := range map[string]any{"host": "host-1", "device": "GPU-aaaa", "memory_mib": "20480", "compute_percent": 25.0} {
		if first[k] != want {
			t.Errorf("slices[0].%s = %#v, want %#v", k, first[k], want)
		}
	}
}

func TestPrintLeases(t *testing.T) {
	now := time.Date(2026, 1, 1, 12, 5, 0, 0, time.UTC)
	releasing := sampleLease()
	releasing.Id, releasing.State, releasing.EndState, releasing.Lost = "l-124", gpupoolv1.LeaseState_LEASE_STATE_RELEASING, gpupoolv1.LeaseState_LEASE_STATE_EXPIRED, true
	releasing.Slices = releasing.Slices[:1]
	var buf bytes.Buffer
	if err := printLeases(&buf, []*gpupoolv1.Lease{sampleLease(), releasing}, now); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	if len(lines) != 3 {
		t.Fatalf("got %d lines, want a header and 2 rows:\n%s", len(lines), buf.String())
	}
	for i, want := range [][]string{
		{"ID", "TENANT", "HOLDER", "STATE", "SLICES", "FENCING", "AGE"},
		{"l-123", "team-a", "alice@box", "granted", "host-1/0 20GiB 25%, host-1/3 exclusive", "42", "5m"},
		{"l-124", "releasing→expired (lost)", "host-1/0 20GiB 25%"},
	} {
		for _, w := range want {
			if !strings.Contains(lines[i], w) {
				t.Errorf("line %d = %q, want it to contain %q", i, lines[i], w)
			}
		}
	}
}

func TestKeepAliveLine(t *testing.T) {
	tests := []struct {
		name string
		in   *gpupoolv1.KeepAliveResponse
		want string
	}{
		{"a renewal", &gpupoolv1.KeepAliveResponse{LeaseId: "l-123", TtlMs: 600000, State: gpupoolv1.LeaseState_LEASE_STATE_GRANTED}, "renewed l-123: ttl 10m0s"},
		{"an error", &gpupoolv1.KeepAliveResponse{LeaseId: "l-9", Error: "lease l-9 not found"}, "not renewed l-9: lease l-9 not found"},
		{"a lease no longer granted", &gpupoolv1.KeepAliveResponse{LeaseId: "l-9", State: gpupoolv1.LeaseState_LEASE_STATE_EXPIRED}, "not renewed l-9: lease is expired, not granted"},
		{"an event", &gpupoolv1.KeepAliveResponse{Event: &gpupoolv1.LeaseEvent{Type: gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_LOST,
			Lease: &gpupoolv1.Lease{Id: "l-5"}, Message: "host h1 is down"}}, "event l-5: lost: host h1 is down"},
		{"an elastic lease grows", grownResp(extraLease("x-9", "l-5")), "grew l-5: extra x-9 on h2/1 20GiB 25%"},
		{"an extra is to be taken back", extraEvent(gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_PREEMPT_NOTICE, "x-9", "l-5", "room for l-77", noon),
			"shrinking l-5: extra x-9 on h2/1 20GiB 25% is taken back at 2026-01-01 12:00:00 UTC: room for l-77"},
		{"an extra is released", extraEvent(gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_RELEASING, "x-9", "l-5", "preempted", 0),
			"shrinking l-5: extra x-9 is releasing: preempted"},
		{"an extra ends", extraEvent(gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_ENDED, "x-9", "l-5", "revoked", 0), "shrank l-5: extra x-9 ended: revoked"},
		{"a preemptible lease is to be preempted", &gpupoolv1.KeepAliveResponse{LeaseId: "l-5", Event: &gpupoolv1.LeaseEvent{
			Type: gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_PREEMPT_NOTICE, Lease: &gpupoolv1.Lease{Id: "l-5"}, Message: "room for l-77", DeadlineMs: noon}},
			"event l-5: preempt-notice: room for l-77 (revoked at 2026-01-01 12:00:00 UTC)"},
	}
	for _, tt := range tests {
		if got := keepAliveLine(tt.in); got != tt.want {
			t.Errorf("%s: got %q, want %q", tt.name, got, tt.want)
		}
	}
}

var noon = time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC).UnixMilli()

// extraLease is an extra of parent with one slice on h2.
func extraLease(id, parent string) *gpupoolv1.Lease {
	return &gpupoolv1.Lease{Id: id, Parent: parent, State: gpupoolv1.LeaseState_LEASE_STATE_GRANTED, Class: gpupoolv1.LeaseClass_LEASE_CLASS_PREEMPTIBLE,
		Slices: []*gpupoolv1.Slice{{Host: "h2", DeviceIndex: 1, MemoryMib: 20480, ComputePercent: 25}}}
}

// grownResp announces extra x.
func grownResp(x *gpupoolv1.Lease) *gpupoolv1.KeepAliveResponse {
	return &gpupoolv1.KeepAliveResponse{LeaseId: x.Id, State: x.State, Event: &gpupoolv1.LeaseEvent{Type: gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_GROWN, Lease: x}}
}

// extraEvent is an event about extra id of parent.
func extraEvent(typ gpupoolv1.LeaseEventType, id, parent, msg string, deadlineMs int64) *gpupoolv1.KeepAliveResponse {
	return &gpupoolv1.KeepAliveResponse{LeaseId: id, Event: &gpupoolv1.LeaseEvent{Type: typ, Lease: extraLease(id, parent), Message: msg, DeadlineMs: deadlineMs}}
}

// endedResp says lease id ended.
func endedResp(id, msg string) *gpupoolv1.KeepAliveResponse {
	return &gpupoolv1.KeepAliveResponse{LeaseId: id, Event: &gpupoolv1.LeaseEvent{Type: gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_ENDED,
		Lease: &gpupoolv1.Lease{Id: id}, Message: msg}}
}

func granted(id string, ttl time.Duration) *gpupoolv1.KeepAliveResponse {
	return &gpupoolv1.KeepAliveResponse{LeaseId: id, TtlMs: ttl.Milliseconds(), State: gpupoolv1.LeaseState_LEASE_STATE_GRANTED}
}

// received is one scripted result of Recv on a keepalive stream.
type received struct {
	resp *gpupoolv1.KeepAliveResponse
	err  error
}

// fakeStream answers each Send with whatever reply returns for the lease.
type fakeStream struct {
	ctx     context.Context
	reply   func(id string) []received
	sent    []string
	replies chan received
}

func (s *fakeStream) Send(r *gpupoolv1.KeepAliveRequest) error {
	s.sent = append(s.sent, r.GetLeaseId())
	for _, m := range s.reply(r.GetLeaseId()) {
		s.replies <- m
	}
	return nil
}

func (s *fakeStream) Recv() (*gpupoolv1.KeepAliveResponse, error) {
	select {
	case m := <-s.replies:
		return m.resp, m.err
	case <-s.ctx.Done():
		return nil, status.FromContextError(s.ctx.Err()).Err()
	}
}

func (s *fakeStream) CloseSend() error { return nil }

// fakeBroker hands out one scripted stream per KeepAlive call.
type fakeBroker struct {
	scripts []func(id string) []received
	streams []*fakeStream
	openErr error
}

func (b *fakeBroker) open(ctx context.Context) (client.KeepAliveStream, error) {
	if b.openErr != nil {
		return nil, b.openErr
	}
	if len(b.streams) >= len(b.scripts) {
		return nil, errors.New("fakeBroker: no script left for another stream")
	}
	s := &fakeStream{ctx: ctx, reply: b.scripts[len(b.streams)], replies: make(chan received, 16)}
	b.streams = append(b.streams, s)
	return s, nil
}

// testKeepAlive runs 'lease keepalive' as the command does, over the
// fake broker's streams, and returns its result, stdout and stderr.
type testKeepAlive struct {
	b      *fakeBroker
	ids    []string
	opts   client.RenewOptions
	out    bytes.Buffer
	errOut bytes.Buffer
}

func newTestKeepAliver(b *fakeBroker, ids []string, interval time.Duration, once bool) (*testKeepAlive, *bytes.Buffer, *bytes.Buffer) {
	k := &testKeepAlive{b: b, ids: ids}
	k.opts = keepAliveOptions(interval, once, &k.out, &k.errOut)
	k.opts.Stream = b.open
	return k, &k.out, &k.errOut
}

func (k *testKeepAlive) run(ctx context.Context) error {
	return (&client.Client{}).Renew(ctx, k.ids, k.opts)
}

func unavailable(string) []received {
	return []received{{err: status.Error(codes.Unavailable, "leader lost")}}
}

func TestKeepAliveOnceRenewsEveryLease(t *testing.T) {
	setOutput(t, "table")
	b := &fakeBroker{scripts: []func(string) []received{
		func(id string) []received { return []received{{resp: granted(id, 10*time.Minute)}} },
	}}
	k, out, _ := newTestKeepAliver(b, []string{"l-1", "l-2"}, 0, true)
	if err := k.run(context.Background()); err != nil {
		t.Fatalf("run: %v", err)
	}
	if got, want := out.String(), "renewed l-1: ttl 10m0s\nrenewed l-2: ttl 10m0s\n"; got != want {
		t.Errorf("stdout %q, want %q", got, want)
	}
}

func TestKeepAliveOnceFailsWhenARenewalFails(t *testing.T) {
	setOutput(t, "table")
	b := &fakeBroker{scripts: []func(string) []received{
		func(id string) []received {
			if id == "l-2" {
				return []received{{resp: &gpupoolv1.KeepAliveResponse{LeaseId: id, Error: "lease l-2 not found"}}}
			}
			return []received{{resp: granted(id, time.Minute)}}
		},
	}}
	k, out, _ := newTestKeepAliver(b, []string{"l-1", "l-2"}, 0, true)
	err := k.run(context.Background())
	if err == nil || !strings.Contains(err.Error(), "l-2: lease l-2 not found") {
		t.Errorf("run = %v, want the failure of l-2", err)
	}
	if !strings.Contains(out.String(), "not renewed l-2: lease l-2 not found") {
		t.Errorf("stdout %q lacks the failed renewal", out.String())
	}
}

func TestKeepAliveReconnectsAfterTheStreamBreaks(t *testing.T) {
	setOutput(t, "table")
	b := &fakeBroker{scripts: []func(string) []received{
		unavailable,
		unavailable,
		func(id string) []received { return []received{{resp: granted(id, time.Minute)}} },
	}}
	k, out, errOut := newTestKeepAliver(b, []string{"l-1"}, 0, true)
	if err := k.run(context.Background()); err != nil {
		t.Fatalf("run: %v", err)
	}
	if len(b.streams) != 3 {
		t.Errorf("opened %d streams, want 3", len(b.streams))
	}
	if got := strings.Count(errOut.String(), "reconnecting…"); got != 1 {
		t.Errorf("stderr %q: said reconnecting %d times, want once per outage", errOut.String(), got)
	}
	if out.String() != "renewed l-1: ttl 1m0s\n" {
		t.Errorf("stdout %q, want the renewal", out.String())
	}
}

func TestKeepAliveCarriesOnAcrossFailoverUntilNoLeaseIsLeft(t *testing.T) {
	setOutput(t, "table")
	b := &fakeBroker{scripts: []func(string) []received{
		func(id string) []received {
			return []received{{resp: granted(id, 30*time.Second)}, {err: status.Error(codes.Unavailable, "server shutting down")}}
		},
		func(id string) []received {
			return []received{{resp: &gpupoolv1.KeepAliveResponse{LeaseId: id, State: gpupoolv1.LeaseState_LEASE_STATE_EXPIRED}}}
		},
	}}
	k, out, errOut := newTestKeepAliver(b, []string{"l-1"}, 0, false)
	err := k.run(context.Background())
	if err == nil || !strings.Contains(err.Error(), "l-1: lease is expired") {
		t.Errorf("run = %v, want the expiry of l-1", err)
	}
	if !strings.Contains(errOut.String(), "server shutting down (Unavailable); reconnecting…") {
		t.Errorf("stderr %q, want a reconnect notice", errOut.String())
	}
	if want := "renewed l-1: ttl 30s\nnot renewed l-1: lease is expired, not granted\n"; out.String() != want {
		t.Errorf("stdout %q, want %q", out.String(), want)
	}
}

func TestKeepAliveRenewsTheExtrasOfAnElasticLeaseAcrossReconnects(t *testing.T) {
	setOutput(t, "table")
	x := extraLease("x-1", "l-1")
	b := &fakeBroker{scripts: []func(string) []received{
		func(id string) []received {
			if id == "l-1" { // the first renewal of l-1 on a stream announces its extras
				return []received{{resp: granted(id, time.Minute)}, {resp: grownResp(x)}}
			}
			return []received{{err: status.Error(codes.Unavailable, "leader lost")}}
		},
		func(id string) []received {
			if id == "l-1" {
				return []received{{resp: granted(id, time.Minute)}, {resp: grownResp(x)}}
			}
			return []received{{resp: granted(id, time.Minute)},
				{resp: extraEvent(gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_PREEMPT_NOTICE, "x-1", "l-1", "room for l-7", noon)},
				{resp: extraEvent(gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_ENDED, "x-1", "l-1", "revoked", 0)},
				{resp: endedResp("l-1", "released")}}
		},
	}}
	k, out, _ := newTestKeepAliver(b, []string{"l-1"}, 0, false)
	err := k.run(context.Background())
	if err == nil || err.Error() != "1 of 1 leases not renewed: l-1: lease ended: released" {
		t.Errorf("run = %v, want l-1's end alone", err)
	}
	if len(b.streams) != 2 {
		t.Fatalf("opened %d streams, want 2", len(b.streams))
	}
	if got := strings.Join(b.streams[0].sent, ","); got != "l-1,x-1" {
		t.Errorf("first stream renewed %s, want l-1, then x-1 once it grew", got)
	}
	if got := strings.Join(b.streams[1].sent, ","); got != "l-1,x-1" {
		t.Errorf("second stream renewed %s, want l-1 and x-1 at once", got)
	}
	want := "renewed l-1: ttl 1m0s\n" +
		"grew l-1: extra x-1 on h2/1 20GiB 25%\n" +
		"renewed l-1: ttl 1m0s\n" + // x-1 announced again: not printed
		"renewed x-1: ttl 1m0s\n" +
		"shrinking l-1: extra x-1 on h2/1 20GiB 25% is taken back at 2026-01-01 12:00:00 UTC: room for l-7\n" +
		"shrank l-1: extra x-1 ended: revoked\n" +
		"event l-1: ended: released\n"
	if out.String() != want {
		t.Errorf("stdout\n%s\nwant\n%s", out.String(), want)
	}
}

func TestKeepAliveStopsCleanlyWhenCancelled(t *testing.T) {
	setOutput(t, "json")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var sends, printed atomic.Int32
	b := &fakeBroker{scripts: []func(string) []received{
		func(id string) []received {
			// Renewed at a fixed 1ms pace; Ctrl-C once a renewal was
			// printed and the timer sent another one.
			if sends.Add(1) >= 2 && printed.Load() >= 1 {
				cancel()
				return nil
			}
			return []received{{resp: granted(id, time.Minute)}}
		},
	}}
	k, out, _ := newTestKeepAliver(b, []string{"l-1"}, time.Millisecond, false)
	print := k.opts.OnAnswer
	k.opts.OnAnswer = func(r *gpupoolv1.KeepAliveResponse) error { printed.Add(1); return print(r) }
	if err := k.run(ctx); err != nil {
		t.Errorf("run after cancel = %v, want nil (Ctrl-C exits 0)", err)
	}
	if !strings.Contains(out.String(), `"lease_id": "l-1"`) || !strings.Contains(out.String(), `"ttl_ms": "60000"`) {
		t.Errorf("stdout %q, want the KeepAliveResponse as JSON", out.String())
	}
}

func TestKeepAliveGivesUpOnErrorsRetryingCannotFix(t *testing.T) {
	b := &fakeBroker{openErr: status.Error(codes.Unimplemented, "unknown service")}
	k, _, _ := newTestKeepAliver(b, []string{"l-1"}, 0, false)
	if err := k.run(context.Background()); status.Code(err) != codes.Unimplemented {
		t.Errorf("run = %v, want Unimplemented", err)
	}
}

func TestKeepAliveOnceReportsLeasesLeftUnanswered(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	b := &fakeBroker{scripts: []func(string) []received{
		func(string) []received { cancel(); return nil },
	}}
	k, _, _ := newTestKeepAliver(b, []string{"l-1"}, 0, true)
	err := k.run(ctx)
	if err == nil || !strings.Contains(err.Error(), "no answer for l-1") {
		t.Errorf("run = %v, want an error naming l-1", err)
	}
}

func TestRunRefusesBadInput(t *testing.T) {
	checkUsageErrors(t, []usageCase{
		{"no command", []string{"run", "--memory", "4GiB", "--compute", "25"}, []string{"give the command after --"}},
		{"a command without --", []string{"run", "--memory", "4GiB", "--compute", "25", "nvidia-smi"}, []string{"give the command after --"}},
		{"nothing after --", []string{"run", "--exclusive", "--"}, []string{"give the command after --"}},
		{"neither slice nor whole GPU", []string{"run", "--", "true"}, []string{"--exclusive for whole GPUs, or --memory and --compute"}},
		{"an upload that is not a file", []string{"run", "--exclusive", "--upload", "/nonexistent/x", "--", "true"}, []string{"--upload /nonexistent/x: not a readable regular file"}},
		{"an absolute download", []string{"run", "--exclusive", "--download", "/etc/passwd", "--", "true"}, []string{"--download /etc/passwd", "relative to the lease directory"}},
		{"exec without a command", []string{"exec", "l-1"}, []string{"want LEASE_ID -- CMD"}},
		{"exec with two leases", []string{"exec", "l-1", "l-2", "--", "true"}, []string{"want LEASE_ID -- CMD"}},
		{"forward without ports", []string{"forward", "l-1"}, []string{`"l-1": want LOCAL_PORT:REMOTE_PORT`}},
		{"forward with one port", []string{"forward", "l-1", "8000"}, []string{`"8000": want LOCAL_PORT:REMOTE_PORT`}},
		{"forward to port 0", []string{"forward", "l-1", "8000:0"}, []string{"the remote one 1-65535"}},
		{"forward with a word for a port", []string{"forward", "l-1", "web:8000"}, []string{"ports must be numbers"}},
	})
}
