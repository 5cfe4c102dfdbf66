package main

import "testing"

func TestTopRefusesBadInput(t *testing.T) {
	checkUsageErrors(t, []usageCase{
		{"a positional argument", []string{"top", "now"}, []string{"accepts 0 arg(s), received 1"}},
		{"-o json", []string{"top", "-o", "json"}, []string{`--output "json"`, "gpupool status -o json"}},
		{"an unknown sort key", []string{"top", "--sort", "cpu"}, []string{`--sort "cpu"`, "util, reserved, memory, leases, name"}},
		{"an interval below 500ms", []string{"top", "--interval", "10ms"}, []string{"--interval 10ms", "between 500ms and 1h"}},
	})
}
