package main

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/gpupool/gpupool/internal/pki"
	"github.com/gpupool/gpupool/internal/pki/pkitest"
)

func TestAgentCommandRefusesBadInput(t *testing.T) {
	sim := []string{"agent", "--insecure", "--broker", "127.0.0.1:1", "--host-id", "sim-1", "--simulate", "8xA100-80GB"}
	with := func(extra ...string) []string { return append(append([]string{}, sim...), extra...) }
	// TLS as in production, so that the token checks are what refuses.
	f := pkitest.NewCA(t).Issue(t, "sim-1", pki.RoleAgent)
	secure := []string{"agent", "--broker", "127.0.0.1:1", "--host-id", "sim-1", "--tls-ca", f.CA, "--tls-cert", f.Cert, "--tls-key", f.Key}
	withTLS := func(extra ...string) []string { return append(append([]string{}, secure...), extra...) }
	checkUsageErrors(t, []usageCase{
		{"a label without =", with("--label", "foo"), []string{`--label "foo"`, "key=value"}},
		{"a label without a key", with("--label", "=x"), []string{`--label "=x"`, "key=value"}},
		{"a zero count of simulated GPUs", []string{"agent", "--insecure", "--broker", "127.0.0.1:1", "--simulate", "0xA100-80GB"}, []string{`--simulate "0xA100-80GB"`, "count 0 must be between 1 and 64"}},
		{"an unknown simulated model", []string{"agent", "--insecure", "--broker", "127.0.0.1:1", "--simulate", "8xB200"}, []string{`model "B200"`, "A100-40GB, A100-80GB, H100-80GB"}},
		{"an empty simulation spec", []string{"agent", "--insecure", "--broker", "127.0.0.1:1", "--simulate", ""}, []string{`--simulate ""`, "NxMODEL"}},
		{"a host id with a space", with("--host-id", "gpu 7"), []string{`--host-id "gpu 7"`, "letters, digits"}},
		{"negative host CPU", with("--cpu", "-5"), []string{"--cpu -5", "0 or more"}},
		{"negative host memory", with("--host-memory", "-1"), []string{"--host-memory -1", "0 or more"}},
		{"a CPU floor under 10 millicores", with("--cpu", "8000", "--default-cpu-floor", "5"), []string{"--default-cpu-floor 5", "between 10 and 8000 millicores (--cpu)"}},
		{"a CPU floor over the offer", with("--cpu", "8000", "--default-cpu-floor", "9000"), []string{"--default-cpu-floor 9000", "between 10 and 8000 millicores (--cpu)"}},
		{"a memory floor over the offer", with("--host-memory", "4096", "--default-memory-floor", "8192"), []string{"--default-memory-floor 8192", "between 64 and 4096 MiB (--host-memory)"}},
		{"a zero memory floor on a host that offers none", with("--host-memory", "0", "--default-memory-floor", "0"), []string{"--default-memory-floor 0", "must be 64 MiB or more"}},
		{"an empty broker list", []string{"agent", "--insecure", "--broker", " , ", "--simulate", "1xA100-80GB"}, []string{"--broker is empty"}},
		{"a positional argument", with("extra"), []string{"takes no arguments", `"extra"`}},
		{"an unknown --mps mode", with("--mps", "maybe"), []string{`--mps "maybe"`, "auto, on or off"}},
		{"a cgroup parent that climbs", with("--cgroup-parent", "../x"), []string{`--cgroup-parent "../x": must be a relative path`}},
		{"an absolute cgroup parent", with("--cgroup-parent", "/gpupool"), []string{`--cgroup-parent "/gpupool": must be a relative path`}},
		{"metrics over TLS without TLS files", with("--metrics-tls"), []string{"--metrics-tls needs the agent's TLS files"}},
		{"a sandbox user range of system users", with("--sandbox-users", "0-999"), []string{`--sandbox-users "0-999"`, "ids below 1000 belong to the system"}},
		{"a sandbox user range that is no range", with("--sandbox-users", "lots"), []string{`--sandbox-users "lots"`, "want FIRST-LAST"}},
		{"--mps on without the binary", append(with("--mps", "on"), "--data-dir", "/nonexistent"), []string{"--mps on", "nvidia-cuda-mps-control is not on PATH"}},
		{"a zero watchdog poll", with("--watchdog-poll", "0s"), []string{"--watchdog-poll 0s", "must be positive"}},
		{"a negative grace", with("--watchdog-grace", "-1s"), []string{"--watchdog-grace -1s", "must be positive"}},
		{"a zero kill-after", with("--kill-after", "0s"), []string{"--kill-after 0s"}},
		{"a zero expiry grace", with("--expiry-grace", "0s"), []string{"--expiry-grace 0s"}},
		{"a zero healthy time", with("--healthy-after", "0s"), []string{"--healthy-after 0s"}},
		{"an empty data dir", with("--data-dir", ""), []string{"--data-dir is empty"}},
		{"a control socket without simulation", []string{"agent", "--insecure", "--broker", "127.0.0.1:1", "--sim-control", "/tmp/x.sock"}, []string{"--sim-control needs --simulate"}},
		{"an unknown flag", with("--watchdog", "1s"), []string{"unknown flag: --watchdog"}},
		{"no CUDA contexts per session", with("--limit-cuda-session-contexts", "0"), []string{"--limit-cuda-session-contexts 0", "between 1 and 65536"}},
		{"negative CUDA streams per session", with("--limit-cuda-session-streams", "-1"), []string{"--limit-cuda-session-streams -1", "between 1 and 65536"}},
		{"more CUDA events per session than a session has handles", with("--limit-cuda-session-events", "65537"), []string{"--limit-cuda-session-events 65537", "between 1 and 65536"}},
		{"no CUDA modules per session", with("--limit-cuda-session-modules", "0"), []string{"--limit-cuda-session-modules 0", "between 1 and 65536"}},
		{"no CUDA functions per session", with("--limit-cuda-session-functions", "0"), []string{"--limit-cuda-session-functions 0", "between 1 and 65536"}},
		{"a CUDA limit that is no number", with("--limit-cuda-session-streams", "many"), []string{"--limit-cuda-session-streams", "many"}},
		{"neither TLS nor --insecure", []string{"agent", "--broker", "127.0.0.1:1", "--host-id", "sim-1", "--simulate", "8xA100-80GB"},
			[]string{"needs TLS", "--tls-ca", "--insecure"}},
		{"a token with --insecure", with("--token", "abc"), []string{"--token with --insecure"}},
		{"a missing token file", withTLS("--token-file", filepath.Join(t.TempDir(), "absent")),
			[]string{"--token-file", "no such file"}},
		{"an empty token file", withTLS("--token-file", emptyFile(t)),
			[]string{"--token-file", "the file is empty"}},
		{"a token file and a token", withTLS("--token-file", emptyFile(t), "--token", "abc"),
			[]string{"--token-file with --token"}},
	})
}

func TestAgentSimulateRefusesBadInput(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "absent.sock")
	checkUsageErrors(t, []usageCase{
		{"no socket", []string{"agent", "simulate", "lost"}, []string{"--socket is required"}},
		{"a process without a pid", []string{"agent", "simulate", "--socket", sock, "process", "--memory", "1GiB"}, []string{"--pid 0", "positive"}},
		{"a process with a bad size", []string{"agent", "simulate", "--socket", sock, "process", "--pid", "1", "--memory", "lots"}, []string{"--memory", "lots"}},
		{"an Xid without a code", []string{"agent", "simulate", "--socket", sock, "xid", "--gpu", "1"}, []string{"--code is required"}},
		{"an unknown subcommand", []string{"agent", "simulate", "--socket", sock, "melt"}, []string{"melt"}},
	})
}

func TestDefaultHostIDIsTheStartOfTheMachineID(t *testing.T) {
	for _, tc := range []struct {
		name      string
		machineID string // "" leaves no file
		want      string // "" means the hostname
	}{
		{"a machine id gives its first 12 characters", "3d1219c7c4c54f0e8a7b1c2d3e4f5a6b\n", "3d1219c7c4c5"},
		{"a short machine id falls back to the hostname", "abc\n", ""},
		{"no machine id falls back to the hostname", "", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "machine-id")
			if tc.machineID != "" {
				if err := os.WriteFile(path, []byte(tc.machineID), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			old := machineIDFile
			machineIDFile = path
			t.Cleanup(func() { machineIDFile = old })

			want := tc.want
			if want == "" {
				want, _ = os.Hostname()
			}
			if got, err := defaultHostID(); err != nil || got != want {
				t.Errorf("defaultHostID() = %q, %v; want %q", got, err, want)
			}
		})
	}
}

// emptyFile returns the path of a new empty file.
func emptyFile(t *testing.T) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "empty")
	if err := os.WriteFile(p, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}
