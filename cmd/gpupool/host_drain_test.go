package main

import (
	"bytes"
	"context"
	"io"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spf13/cobra"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/gpupool/gpupool/client"
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
		{"a deadline under a second", []string{"host", "drain", "h1", "--deadline", "500us"}, []string{"--deadline 500µs: must be at least 1s"}},
		{"a deadline of 999ms", []string{"host", "drain", "h1", "--deadline", "999ms"}, []string{"--deadline 999ms: must be at least 1s"}},
		{"a deadline over 30 days", []string{"host", "drain", "h1", "--deadline", "800h"}, []string{"--deadline 800h0m0s: must be at most 720h0m0s"}},
		{"a deadline that is no duration", []string{"host", "drain", "h1", "--deadline", "soon"}, []string{"--deadline"}},
		{"monitor and detach", []string{"host", "drain", "h1", "--monitor", "--detach"}, []string{"--monitor and --detach: give one or the other"}},
		{"cancel with force", []string{"host", "drain", "h1", "--cancel", "--force"}, []string{"--cancel ends the drain: it takes no --force"}},
		{"cancel with monitor", []string{"host", "drain", "h1", "--cancel", "--monitor"}, []string{"nothing to --monitor"}},
		{"eligibility without a flag", []string{"host", "eligibility", "h1"}, []string{"exactly one of --enable and --disable"}},
		{"eligibility with both flags", []string{"host", "eligibility", "h1", "--enable", "--disable"}, []string{"exactly one of --enable and --disable"}},
		{"eligibility without a host", []string{"host", "eligibility", "--enable"}, []string{"accepts 1 arg(s), received 0", "gpupool host eligibility HOST_ID"}},
		{"reset-identity without a host", []string{"host", "reset-identity"}, []string{"accepts 1 arg(s), received 0", "gpupool host reset-identity HOST_ID"}},
		{"reset-identity of a malformed host id", []string{"host", "reset-identity", "../h1"}, []string{`HOST_ID "../h1": must be 1 to 253 letters`}},
		{"reset-identity with a reason too long", []string{"host", "reset-identity", "h1", "--reason", strings.Repeat("x", 257)}, []string{"--reason: 257 bytes, must be at most 256"}},
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
		{"a prefix of one host needs confirmation too", "cpu", "", []string{"cpu-1"}, "cpu", ""},
		{"gpu-1 is not gpu-10", "gpu-10", "", []string{"gpu-10"}, "", ""},
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

func TestAPrefixIsConfirmedOrRefused(t *testing.T) {
	several := drainTargets{prefix: "gpu-", hosts: []*gpupoolv1.Host{{Id: "gpu-1"}, {Id: "gpu-2"}}}
	one := drainTargets{prefix: "gpu-1", hosts: []*gpupoolv1.Host{{Id: "gpu-10"}}}
	for _, tc := range []struct {
		name     string
		targets  drainTargets
		yes, tty bool
		answer   string
		err      string
		prompt   string
	}{
		{"--yes does not confirm a prefix", several, true, true, "", `HOST_ID "gpu-" matches 2 hosts (gpu-1, gpu-2): --yes does not confirm a prefix`, ""},
		{"no terminal to ask on", several, false, false, "", "stdin is not a terminal to confirm", ""},
		{"the operator says no", several, false, true, "n\n", "not confirmed; nothing changed", "Drain all 2? [y/N]"},
		{"the operator says yes", several, false, true, "y\n", "", "Drain all 2? [y/N]"},
		{"--yes does not confirm a prefix of one host", one, true, true, "", `HOST_ID "gpu-1" is no host; it is a prefix of gpu-10: --yes does not confirm a prefix`, ""},
		{"no terminal to ask about a prefix of one host", one, false, false, "", `HOST_ID "gpu-1" is no host; it is a prefix of gpu-10 and stdin is not a terminal`, ""},
		{"the operator is asked about a prefix of one host", one, false, true, "n\n", "not confirmed; nothing changed", `HOST_ID "gpu-1" is no host; it is a prefix of gpu-10. Drain gpu-10? [y/N]`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			prev := stdinIsTerminal
			stdinIsTerminal = func(io.Reader) bool { return tc.tty }
			t.Cleanup(func() { stdinIsTerminal = prev })
			cmd := &cobra.Command{}
			var errOut bytes.Buffer
			cmd.SetIn(strings.NewReader(tc.answer))
			cmd.SetErr(&errOut)
			err := confirmPrefix(cmd, &drainOpts{yes: tc.yes}, tc.targets)
			if (tc.err == "") != (err == nil) || (err != nil && !strings.Contains(err.Error(), tc.err)) {
				t.Fatalf("got %v, want %q", err, tc.err)
			}
			if !strings.Contains(errOut.String(), tc.prompt) || (tc.prompt == "") != (errOut.Len() == 0) {
				t.Fatalf("prompt: got %q, want %q", errOut.String(), tc.prompt)
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
		p    client.DrainProgress
		want string
		done bool
	}{
		{"draining with a deadline", client.DrainProgress{Host: "gpu-3", Resp: &gpupoolv1.GetHostResponse{Host: host(gpupoolv1.HostStatus_HOST_STATUS_DRAINING, deadline), Leases: make([]*gpupoolv1.Lease, 2)}},
			"gpu-3: draining, 2 leases left, deadline in 58m (13:58:20 UTC)", false},
		{"draining without a deadline", client.DrainProgress{Host: "gpu-3", Resp: &gpupoolv1.GetHostResponse{Host: host(gpupoolv1.HostStatus_HOST_STATUS_DRAINING, &gpupoolv1.HostDrain{}), Leases: make([]*gpupoolv1.Lease, 1)}},
			"gpu-3: draining, 1 lease left, no deadline", false},
		{"past the deadline, before the revocation lands", client.DrainProgress{Host: "gpu-3", Resp: &gpupoolv1.GetHostResponse{Host: host(gpupoolv1.HostStatus_HOST_STATUS_DRAINING,
			&gpupoolv1.HostDrain{DeadlineMs: now.Add(-300 * time.Millisecond).UnixMilli()}), Leases: make([]*gpupoolv1.Lease, 1)}},
			"gpu-3: draining, 1 lease left, deadline passed (12:59:59 UTC): revoking", false},
		{"drained", client.DrainProgress{Host: "gpu-3", Resp: &gpupoolv1.GetHostResponse{Host: host(gpupoolv1.HostStatus_HOST_STATUS_DRAINED, deadline)}}, "gpu-3: drained", true},
		{"down with nothing left", client.DrainProgress{Host: "gpu-3", Resp: &gpupoolv1.GetHostResponse{Host: host(gpupoolv1.HostStatus_HOST_STATUS_DOWN, deadline)}},
			"gpu-3: down, 0 leases left", true},
		{"cancelled meanwhile", client.DrainProgress{Host: "gpu-3", Resp: &gpupoolv1.GetHostResponse{Host: host(gpupoolv1.HostStatus_HOST_STATUS_READY, nil)}}, "gpu-3: drain cancelled (ready)", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := drainLine(tc.p, now); !strings.HasPrefix(got, tc.want) {
				t.Fatalf("got %q, want %q", got, tc.want)
			}
			if got := tc.p.Done(); got != tc.done {
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

// fakePool is a PoolService that lists hosts and records drain requests.
type fakePool struct {
	gpupoolv1.UnimplementedPoolServiceServer
	hosts []*gpupoolv1.Host

	mu     sync.Mutex
	drains []*gpupoolv1.DrainHostRequest // guarded by mu
}

func (f *fakePool) ListHosts(context.Context, *gpupoolv1.ListHostsRequest) (*gpupoolv1.ListHostsResponse, error) {
	return &gpupoolv1.ListHostsResponse{Hosts: f.hosts}, nil
}

func (f *fakePool) DrainHost(_ context.Context, req *gpupoolv1.DrainHostRequest) (*gpupoolv1.DrainHostResponse, error) {
	f.mu.Lock()
	f.drains = append(f.drains, req)
	f.mu.Unlock()
	for _, h := range f.hosts {
		if h.Id != req.HostId {
			continue
		}
		if req.Cancel && h.Drain == nil {
			return nil, status.Errorf(codes.FailedPrecondition, "host %s is not draining", h.Id)
		}
		return &gpupoolv1.DrainHostResponse{Host: h}, nil
	}
	return nil, status.Errorf(codes.NotFound, "host %q: not found", req.HostId)
}

// startFakePool serves a fakePool of hosts and returns it and its address.
func startFakePool(t *testing.T, hosts []*gpupoolv1.Host) (*fakePool, string) {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	f := &fakePool{hosts: hosts}
	srv := grpc.NewServer()
	gpupoolv1.RegisterPoolServiceServer(srv, f)
	go srv.Serve(lis)
	t.Cleanup(srv.Stop)
	return f, lis.Addr().String()
}

func TestHostDrainSendsWhatTheFlagsMeanForEachHost(t *testing.T) {
	prev := stdinIsTerminal
	stdinIsTerminal = func(io.Reader) bool { return false }
	t.Cleanup(func() { stdinIsTerminal = prev })
	hour := time.Hour.Milliseconds()
	draining := func(id, rack string) *gpupoolv1.Host {
		return &gpupoolv1.Host{Id: id, Labels: map[string]string{"rack": rack}, Status: gpupoolv1.HostStatus_HOST_STATUS_DRAINING,
			Drain: &gpupoolv1.HostDrain{DeadlineMs: 1_800_000_000_000, Reason: "kernel"}}
	}
	hosts := []*gpupoolv1.Host{
		draining("gpu-1", "r1"),
		{Id: "gpu-2", Labels: map[string]string{"rack": "r1"}, Status: gpupoolv1.HostStatus_HOST_STATUS_READY},
		draining("gpu-3", "r2"),
		{Id: "cpu-10", Status: gpupoolv1.HostStatus_HOST_STATUS_READY},
	}
	for _, tc := range []struct {
		name   string
		args   []string
		code   int
		want   []*gpupoolv1.DrainHostRequest
		stderr string
	}{
		{"--reason on a draining host keeps its deadline", []string{"gpu-1", "--reason", "firmware"}, 0,
			[]*gpupoolv1.DrainHostRequest{{HostId: "gpu-1", Reason: "firmware", DeadlineAfterMs: hour, KeepDeadline: true}}, ""},
		{"--selector --reason keeps the deadlines too", []string{"--selector", "rack=r1", "--reason", "firmware"}, 0,
			[]*gpupoolv1.DrainHostRequest{
				{HostId: "gpu-1", Reason: "firmware", DeadlineAfterMs: hour, KeepDeadline: true},
				{HostId: "gpu-2", Reason: "firmware", DeadlineAfterMs: hour, KeepDeadline: true},
			}, ""},
		{"--deadline replaces a deadline", []string{"gpu-1", "--deadline", "10m"}, 0,
			[]*gpupoolv1.DrainHostRequest{{HostId: "gpu-1", DeadlineAfterMs: 600_000}}, ""},
		{"--no-deadline removes it", []string{"gpu-1", "--no-deadline"}, 0,
			[]*gpupoolv1.DrainHostRequest{{HostId: "gpu-1"}}, ""},
		{"--force", []string{"gpu-1", "--force"}, 0,
			[]*gpupoolv1.DrainHostRequest{{HostId: "gpu-1", Force: true}}, ""},
		{"no flags on a draining host only watches it", []string{"gpu-1"}, 0, nil, ""},
		{"--selector --cancel skips the hosts not draining", []string{"--selector", "rack=r1", "--cancel"}, 0,
			[]*gpupoolv1.DrainHostRequest{{HostId: "gpu-1", Cancel: true}}, "host gpu-2: not draining; skipped"},
		{"--cancel of a host not draining fails", []string{"gpu-2", "--cancel"}, 1,
			[]*gpupoolv1.DrainHostRequest{{HostId: "gpu-2", Cancel: true}}, "host gpu-2 is not draining"},
		{"a prefix of one host is refused under --yes", []string{"cpu-1", "--yes"}, 2, nil,
			`HOST_ID "cpu-1" is no host; it is a prefix of cpu-10: --yes does not confirm a prefix`},
		{"a prefix of one host is refused without a terminal", []string{"cpu-1"}, 2, nil,
			`HOST_ID "cpu-1" is no host; it is a prefix of cpu-10 and stdin is not a terminal`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f, addr := startFakePool(t, hosts)
			var out, errOut bytes.Buffer
			code := run(append(append([]string{"host", "drain"}, tc.args...), "--detach", "--addr", addr, "--timeout", "5s"), &out, &errOut)
			if code != tc.code || !strings.Contains(errOut.String(), tc.stderr) {
				t.Fatalf("exit %d, want %d; stderr %q, want %q", code, tc.code, errOut.String(), tc.stderr)
			}
			f.mu.Lock()
			defer f.mu.Unlock()
			if len(f.drains) != len(tc.want) {
				t.Fatalf("requests: got %v, want %v", f.drains, tc.want)
			}
			for i, r := range f.drains {
				if !proto.Equal(r, tc.want[i]) {
					t.Fatalf("request %d: got %v, want %v", i, r, tc.want[i])
				}
			}
		})
	}
}
