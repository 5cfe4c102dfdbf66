package main

import (
	"bytes"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/spf13/cobra"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

func TestHostDrainRefusesBadInputAndConflictingFlags(t *testing.T) {
	checkUsageErrors(t, []usageCase{
		{"no host and no selector", []string{"host", "drain", "--force"}, []string{"accepts 1 arg(s), received 0", "--selector"}},
		{"a host and a selector", []string{"host", "drain", "h1", "--selector", "rack=r2"}, []string{`HOST_ID "h1" and --selector "rack=r2": give one or the other`}},
		{"a selector without =", []string{"host", "drain", "--selector", "rack"}, []string{`--selector "rack": must be key=value`}},
		{"force with a deadline", []string{"host", "drain", "h1", "--force", "--deadline", "10m"}, []string{"--force revokes every lease now and --deadline 10m0s gives them time: give one or the other"}},
		{"force with no deadline", []string{"host", "drain", "h1", "--force", "--no-deadline"}, []string{"--force", "--no-deadline", "give one or the other"}},
		{"a deadline and no deadline", []string{"host", "drain", "h1", "--deadline", "1h", "--no-deadline"}, []string{"--deadline 1h0m0s and --no-deadline"}},
		{"a negative deadline", []string{"host", "drain", "h1", "--deadline", "-5m"}, []string{"--deadline -5m0s: must be positive", "--force", "--no-deadline"}},
		{"a zero deadline", []string{"host", "drain", "h1", "--deadline", "0s"}, []string{"--deadline 0s: must be positive"}},
		{"a deadline over 30 days", []string{"host", "drain", "h1", "--deadline", "800h"}, []string{"--deadline 800h0m0s: must be at most 720h0m0s"}},
		{"a deadline that is no duration", []string{"host", "drain", "h1", "--deadline", "soon"}, []string{"--deadline"}},
		{"monitor and detach", []string{"host", "drain", "h1", "--monitor", "--detach"}, []string{"--monitor and --detach: give one or the other"}},
		{"cancel with force", []string{"host", "drain", "h1", "--cancel", "--force"}, []string{"--cancel ends the drain: it takes no --force"}},
		{"cancel with monitor", []string{"host", "drain", "h1", "--cancel", "--monitor"}, []string{"nothing to --monitor"}},
		{"eligibility without a flag", []string{"host", "eligibility", "h1"}, []string{"exactly one of --enable and --disable"}},
		{"eligibility with both flags", []string{"host", "eligibility", "h1", "--enable", "--disable"}, []string{"exactly one of --enable and --disable"}},
		{"eligibility without a host", []string{"host", "eligibility", "--enable"}, []string{"accepts 1 arg(s), received 0", "gpupool host eligibility HOST_ID"}},
	})
}

func TestResolveDrainTargetsByNamePrefixAndSelector(t *testing.T) {
	hosts := []*gpupoolv1.Host{
		{Id: "gpu-1", Labels: map[string]string{"rack": "r1"}},
		{Id: "gpu-10", Labels: map[string]string{"rack": "r2"}},
		{Id: "gpu-11", Labels: map[string]string{"rack": "r2", "zone": "b"}},
		{Id: "cpu-1"},
	}
	for _, tc := range []struct {
		name, id, selector string
		want               []string
		prefix             string
		err                string
	}{
		{"an exact name wins over the hosts it prefixes", "gpu-1", "", []string{"gpu-1"}, "", ""},
		{"a prefix of one host names it", "cpu", "", []string{"cpu-1"}, "", ""},
		{"a prefix of several hosts needs confirmation", "gpu-", "", []string{"gpu-1", "gpu-10", "gpu-11"}, "gpu-", ""},
		{"an unknown host", "tpu", "", nil, "", `host "tpu": not found; see 'gpupool host ls'`},
		{"a selector", "", "rack=r2", []string{"gpu-10", "gpu-11"}, "", ""},
		{"a selector with two labels", "", "rack=r2,zone=b", []string{"gpu-11"}, "", ""},
		{"a selector matching nothing", "", "rack=r9", nil, "", `--selector "rack=r9": matches no host`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := resolveDrainTargets(hosts, tc.id, tc.selector)
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("got %v, want error %q", err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if ids := hostIDs(got.hosts); strings.Join(ids, ",") != strings.Join(tc.want, ",") || got.prefix != tc.prefix {
				t.Fatalf("got %v prefix %q, want %v prefix %q", ids, got.prefix, tc.want, tc.prefix)
			}
		})
	}
}

func TestAPrefixMatchingSeveralHostsIsConfirmedOrRefused(t *testing.T) {
	targets := drainTargets{prefix: "gpu-", hosts: []*gpupoolv1.Host{{Id: "gpu-1"}, {Id: "gpu-2"}}}
	for _, tc := range []struct {
		name     string
		yes, tty bool
		answer   string
		err      string
	}{
		{"--yes does not confirm a prefix", true, true, "", `HOST_ID "gpu-" matches 2 hosts (gpu-1, gpu-2): --yes does not confirm a prefix`},
		{"no terminal to ask on", false, false, "", "stdin is not a terminal to confirm"},
		{"the operator says no", false, true, "n\n", "not confirmed; nothing changed"},
		{"the operator says yes", false, true, "y\n", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			prev := stdinIsTerminal
			stdinIsTerminal = func(io.Reader) bool { return tc.tty }
			t.Cleanup(func() { stdinIsTerminal = prev })
			cmd := &cobra.Command{}
			var errOut bytes.Buffer
			cmd.SetIn(strings.NewReader(tc.answer))
			cmd.SetErr(&errOut)
			err := confirmPrefix(cmd, &drainOpts{yes: tc.yes}, targets)
			if (tc.err == "") != (err == nil) || (err != nil && !strings.Contains(err.Error(), tc.err)) {
				t.Fatalf("got %v, want %q", err, tc.err)
			}
			if tc.tty && !tc.yes && !strings.Contains(errOut.String(), "Drain all 2? [y/N]") {
				t.Fatalf("prompt: got %q", errOut.String())
			}
		})
	}
}

func TestDrainProgressLines(t *testing.T) {
	now := time.Date(2026, 1, 2, 13, 0, 0, 0, time.UTC)
	host := func(s gpupoolv1.HostStatus, d *gpupoolv1.HostDrain) *gpupoolv1.Host {
		return &gpupoolv1.Host{Id: "gpu-3", Status: s, Drain: d}
	}
	deadline := &gpupoolv1.HostDrain{DeadlineMs: now.Add(58*time.Minute + 20*time.Second).UnixMilli()}
	for _, tc := range []struct {
		name string
		p    drainProgress
		want string
		done bool
	}{
		{"draining with a deadline", drainProgress{resp: &gpupoolv1.GetHostResponse{Host: host(gpupoolv1.HostStatus_HOST_STATUS_DRAINING, deadline), Leases: make([]*gpupoolv1.Lease, 2)}},
			"gpu-3: draining, 2 leases left, deadline in 58m (13:58:20 UTC)", false},
		{"draining without a deadline", drainProgress{resp: &gpupoolv1.GetHostResponse{Host: host(gpupoolv1.HostStatus_HOST_STATUS_DRAINING, &gpupoolv1.HostDrain{}), Leases: make([]*gpupoolv1.Lease, 1)}},
			"gpu-3: draining, 1 leases left, no deadline", false},
		{"drained", drainProgress{resp: &gpupoolv1.GetHostResponse{Host: host(gpupoolv1.HostStatus_HOST_STATUS_DRAINED, deadline)}}, "gpu-3: drained", true},
		{"down with nothing left", drainProgress{resp: &gpupoolv1.GetHostResponse{Host: host(gpupoolv1.HostStatus_HOST_STATUS_DOWN, deadline)}},
			"gpu-3: down, 0 leases left", true},
		{"cancelled meanwhile", drainProgress{resp: &gpupoolv1.GetHostResponse{Host: host(gpupoolv1.HostStatus_HOST_STATUS_READY, nil)}}, "gpu-3: drain cancelled (ready)", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := tc.p.line("gpu-3", now); !strings.HasPrefix(got, tc.want) {
				t.Fatalf("got %q, want %q", got, tc.want)
			}
			if got := tc.p.done(); got != tc.done {
				t.Fatalf("done: got %t, want %t", got, tc.done)
			}
		})
	}
}

func TestPrintHostDetailShowsTheDrain(t *testing.T) {
	now := time.Date(2026, 1, 1, 12, 5, 0, 0, time.UTC)
	h := sampleHost()
	h.Status = gpupoolv1.HostStatus_HOST_STATUS_DRAINING
	h.Drain = &gpupoolv1.HostDrain{Reason: "kernel upgrade", StartedAtMs: now.Add(-5 * time.Minute).UnixMilli(), DeadlineMs: now.Add(55 * time.Minute).UnixMilli()}
	var buf bytes.Buffer
	if err := printHostDetail(&buf, &gpupoolv1.GetHostResponse{Host: h}, now); err != nil {
		t.Fatal(err)
	}
	if want := "DRAIN      kernel upgrade; started 5m ago; deadline in 55m (13:00:00 UTC)"; !strings.Contains(buf.String(), want) {
		t.Fatalf("printHostDetail output lacks %q:\n%s", want, buf.String())
	}
}
