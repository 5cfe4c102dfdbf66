package main

import (
	"bytes"
	"strings"
	"testing"
)

func TestBenchRefusesMissingAndUnknownBenchmarks(t *testing.T) {
	for _, tc := range []struct {
		name string
		args []string
		code int
		want string
	}{
		{"no benchmark", []string{}, 2, "name a benchmark: placement, lease, failover, scale, churn, dataplane, cuda, console, slowdisk, flood"},
		{"an unknown benchmark", []string{"nope"}, 2, `unknown benchmark "nope": must be one of placement, lease, failover, scale, churn, dataplane, cuda, console, slowdisk, flood`},
		{"a benchmark's own bad flag", []string{"dataplane", "--size", "1x"}, 2, `unknown unit "x"`},
		{"an unknown placement policy", []string{"placement", "--policy", "bogus"}, 2, "bogus"},
		{"help", []string{"--help"}, 0, ""},
		{"a bad client list", []string{"lease", "--clients", "0"}, 2, "--clients"},
		{"a console bench of no hosts", []string{"console", "--hosts", "0"}, 2, "--hosts 0: must be between 1 and 100000"},
		{"a console bench of 17 GPUs a host", []string{"console", "--gpus", "17"}, 2, "--gpus 17: must be between 1 and 16"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var out, errb bytes.Buffer
			if code := run(tc.args, &out, &errb); code != tc.code || !strings.Contains(errb.String(), tc.want) {
				t.Fatalf("exit %d (want %d), stderr %q, want %q in it", code, tc.code, errb.String(), tc.want)
			}
		})
	}
}
