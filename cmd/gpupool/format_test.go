package main

import (
	"bytes"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/spf13/cobra"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// offlineFlags point the CLI at an address where no broker listens, so a
// test that got past validation by mistake fails fast instead of reaching
// a real cluster.
var offlineFlags = []string{"--addr", "127.0.0.1:1", "--timeout", "1s"}

// runOffline runs the CLI in-process with args plus offlineFlags and
// returns its exit code, stdout and stderr.
func runOffline(t *testing.T, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errOut bytes.Buffer
	// Global flags go before a "--", after which args belong to a remote
	// command.
	i := slices.Index(args, "--")
	if i < 0 {
		i = len(args)
	}
	all := append(append(append([]string{}, args[:i]...), offlineFlags...), args[i:]...)
	code = run(all, &out, &errOut)
	return code, out.String(), errOut.String()
}

// usageCase is a command line the CLI must refuse before contacting any
// broker, and what its message must mention.
type usageCase struct {
	name string
	args []string
	want []string // substrings of stderr: the flag, the value, what is allowed
}

// checkUsageErrors runs each case and checks it exits 2 with a message
// naming what is wrong.
func checkUsageErrors(t *testing.T, cases []usageCase) {
	t.Helper()
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			code, stdout, stderr := runOffline(t, tc.args...)
			if code != 2 {
				t.Errorf("gpupool %s: exit code %d, want 2 (stderr %q)", strings.Join(tc.args, " "), code, stderr)
			}
			if stdout != "" {
				t.Errorf("gpupool %s: stdout %q, want nothing", strings.Join(tc.args, " "), stdout)
			}
			if strings.Contains(stderr, "no broker reachable") {
				t.Errorf("gpupool %s: contacted the brokers; want the mistake caught up front", strings.Join(tc.args, " "))
			}
			for _, w := range tc.want {
				if !strings.Contains(stderr, w) {
					t.Errorf("gpupool %s: stderr %q, want it to mention %q", strings.Join(tc.args, " "), stderr, w)
				}
			}
		})
	}
}

// setOutput sets -o for a test that calls a printer directly.
func setOutput(t *testing.T, format string) {
	t.Helper()
	prev := global.output
	global.output = format
	t.Cleanup(func() { global.output = prev })
}

func TestGroupCommandsRefuseUnknownSubcommands(t *testing.T) {
	checkUsageErrors(t, []usageCase{
		{"an unknown lease subcommand lists the choices", []string{"lease", "bogus"}, []string{`unknown command "bogus"`, "acquire, get, keepalive, ls, release"}},
		{"a misspelt subcommand gets a suggestion", []string{"lease", "aquire"}, []string{`did you mean "acquire"`}},
		{"an unknown host subcommand lists the choices", []string{"host", "bogus"}, []string{"get, gpu-health, ls"}},
		{"an unknown operator subcommand lists the choices", []string{"operator", "bogus"}, []string{"raft, snapshot"}},
		{"an unknown raft subcommand lists the choices", []string{"operator", "raft", "bogus"}, []string{"peers, remove-peer, transfer-leadership"}},
		{"an unknown snapshot subcommand lists the choices", []string{"operator", "snapshot", "bogus"}, []string{"restore, save"}},
	})
}

func TestGroupCommandsPrintHelpWhenRunBare(t *testing.T) {
	for _, args := range [][]string{{"lease"}, {"host"}, {"operator"}, {"operator", "raft"}, {"operator", "snapshot"}} {
		code, stdout, stderr := runOffline(t, args...)
		if code != 0 || !strings.Contains(stdout, "Available Commands") {
			t.Errorf("gpupool %s: exit %d, stdout %q, stderr %q; want exit 0 and the help", strings.Join(args, " "), code, stdout, stderr)
		}
	}
}

func TestEveryClientCommandTeaches(t *testing.T) {
	root := newRootCmd()
	for _, name := range []string{"lease", "host", "status", "operator"} {
		cmd, _, err := root.Find([]string{name})
		if err != nil {
			t.Fatalf("find %s: %v", name, err)
		}
		stack := []*cobra.Command{cmd}
		for len(stack) > 0 {
			c := stack[len(stack)-1]
			stack = stack[:len(stack)-1]
			if c.Short == "" || c.Long == "" || c.Example == "" {
				t.Errorf("%s: Short, Long and Example must all be set (got %q, %d bytes, %d bytes)", c.CommandPath(), c.Short, len(c.Long), len(c.Example))
			}
			if c.Args == nil {
				t.Errorf("%s: has no argument check", c.CommandPath())
			}
			stack = append(stack, c.Commands()...)
		}
	}
}

func TestEnumLabels(t *testing.T) {
	tests := []struct {
		got, want string
	}{
		{enumLabel(gpupoolv1.LeaseState_LEASE_STATE_GRANTED), "granted"},
		{enumLabel(gpupoolv1.Topology_TOPOLOGY_SAME_PCIE_ROOT), "same-pcie-root"},
		{enumLabel(gpupoolv1.HostStatus_HOST_STATUS_DOWN), "down"},
		{enumLabel(gpupoolv1.LeaseState_LEASE_STATE_UNSPECIFIED), "-"},
		{enumLabel(gpupoolv1.LeaseState(99)), "99"},
		{strings.Join(enumLabels[gpupoolv1.Topology](), ","), "same-host,distinct-gpus,same-nvlink,same-pcie-root"},
		{strings.Join(enumLabels[gpupoolv1.LeaseClass](), ","), "guaranteed,preemptible"},
	}
	for _, tt := range tests {
		if tt.got != tt.want {
			t.Errorf("got %q, want %q", tt.got, tt.want)
		}
	}
}

func TestParseEnumFlagAcceptsCaseAndUnderscores(t *testing.T) {
	for _, in := range []string{"same-nvlink", "SAME-NVLINK", "same_nvlink", " same-nvlink "} {
		got, err := parseEnumFlag[gpupoolv1.Topology]("topology", in)
		if err != nil || got != gpupoolv1.Topology_TOPOLOGY_SAME_NVLINK {
			t.Errorf("parseEnumFlag(%q) = %v, %v; want TOPOLOGY_SAME_NVLINK", in, got, err)
		}
	}
	if _, err := parseEnumFlag[gpupoolv1.Topology]("topology", "unspecified"); err == nil {
		t.Errorf("parseEnumFlag(unspecified) succeeded; the zero value is not a choice")
	}
}

func TestHumanDuration(t *testing.T) {
	tests := []struct {
		in   time.Duration
		want string
	}{
		{-time.Second, "0s"},
		{850 * time.Millisecond, "850ms"},
		{42 * time.Second, "42s"},
		{119 * time.Second, "119s"},
		{12 * time.Minute, "12m"},
		{5 * time.Hour, "5h"},
		{72 * time.Hour, "3d"},
	}
	for _, tt := range tests {
		if got := humanDuration(tt.in); got != tt.want {
			t.Errorf("humanDuration(%s) = %q, want %q", tt.in, got, tt.want)
		}
	}
}

func TestLeaseGetShowsWhatTheProcessesRunInPerHost(t *testing.T) {
	var buf bytes.Buffer
	err := printLeaseAndIsolation(&buf, &gpupoolv1.GetLeaseResponse{Lease: &gpupoolv1.Lease{Id: "l-1"}, HostIsolation: map[string]string{
		"h2": "reduced (no user: the agent does not run as root)", "h1": "sandboxed (user, mounts, pid, cgroup, noprivs, cgroup v2)", "h3": "",
	}})
	if err != nil {
		t.Fatal(err)
	}
	got := buf.String()
	want := "PROCESSES ON h1: sandboxed (user, mounts, pid, cgroup, noprivs, cgroup v2)\nPROCESSES ON h2: reduced (no user: the agent does not run as root)\nPROCESSES ON h3: unknown"
	if !strings.Contains(got, want) {
		t.Fatalf("got\n%s\nwant it to contain\n%s", got, want)
	}
}
