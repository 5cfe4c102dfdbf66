package main

import (
	"slices"
	"strings"
	"testing"

	"github.com/gpupool/gpupool/protocol"
)

// The CLI keeps no rules of its own: the protocol's refuse the request, and
// each refusal must reach the user under the flag that set the field.
func TestEveryFieldTheProtocolRefusesIsReportedUnderItsFlag(t *testing.T) {
	// Fields no flag of 'lease acquire' sets.
	noFlag := []string{"request", "constraints.devices"}
	for _, field := range protocol.RequestFields {
		if _, ok := acquireFlagOf[field]; !ok && !slices.Contains(noFlag, field) {
			t.Errorf("field %q the protocol may refuse has no flag in acquireFlagOf", field)
		}
	}
	slice := []string{"lease", "acquire", "--memory", "20GiB", "--compute", "25"}
	with := func(extra ...string) []string { return append(append([]string{}, slice...), extra...) }
	elastic := func(extra ...string) []string { return with(append([]string{"--elastic", "2..6"}, extra...)...) }
	for _, tc := range []struct {
		field string
		args  []string
		want  string // how stderr begins, after "error: "
	}{
		{"count", with("--gpus", "0"), "--gpus 0: must be between 1 and 256 GPUs"},
		{"count", with("--gpus", "300"), "--gpus 300: must be between 1 and 256 GPUs"},
		{"exclusive", []string{"lease", "acquire", "--exclusive", "--memory", "20GiB"}, "--exclusive true: cannot be combined with --memory (20480) or --compute (0)"},
		{"exclusive", []string{"lease", "acquire", "--exclusive", "--compute", "25"}, "--exclusive true: cannot be combined with --memory (0) or --compute (25)"},
		{"host_cpu_millicores", with("--host-cpu", "-1"), "--host-cpu -1: must be 0 or more (millicores: 1000 = one CPU)"},
		{"host_memory_mib", elastic("--host-memory", "16GiB"), "--host-memory 16GiB: host cpu and memory must be unset for an elastic lease"},
		{"ttl_ms", with("--ttl", "500ms"), "--ttl 500ms: must be between 1000 (1s) and 86400000 (24h)"},
		{"constraints.model", with("--model", "A100["), "--model A100[: must be a valid glob"},
		{"topology", elastic("--topology", "same-host"), "--topology same-host: must be unset for an elastic lease"},
		{"class", elastic("--class", "preemptible"), "--class preemptible: an elastic lease must be guaranteed"},
		{"priority", with("--priority", "1001"), "--priority 1001: must be between 0 and 1000"},
		{"elastic_max", with("--elastic", "1..300"), "--elastic 1..300: must be between count (1, the guaranteed slices) and 256"},
		{"tenant", with("--tenant", "Bad Tenant"), `--tenant Bad Tenant: must be 1-63 lowercase letters`},
		{"request_id", with("--request-id", strings.Repeat("r", 129)), "--request-id " + strings.Repeat("r", 129) + ": must be at most 128 bytes"},
		{"holder", with("--holder", strings.Repeat("h", 257)), "--holder " + strings.Repeat("h", 257) + ": must be at most 256 bytes"},
		{"wait_ms", with("--wait", "25h"), "--wait 25h0m0s: must be between 0 (fail at once) and 86400000 (24h)"},
	} {
		t.Run(tc.field+" "+strings.Join(tc.args[2:], " "), func(t *testing.T) {
			code, stdout, stderr := runOffline(t, tc.args...)
			if code != 2 || stdout != "" || !strings.HasPrefix(stderr, "error: "+tc.want) {
				t.Fatalf("exit %d, stderr %q; want exit 2 and stderr beginning %q", code, stderr, "error: "+tc.want)
			}
		})
	}
}
