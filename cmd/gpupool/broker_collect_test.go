package main

import "testing"

func TestBrokerCollectionFlagsRefuseBadValues(t *testing.T) {
	base := []string{"broker", "--data-dir", t.TempDir(), "--bind", "127.0.0.1:0", "--raft-bind", "127.0.0.1:0", "--bootstrap-expect", "1", "--insecure"}
	with := func(args ...string) []string { return append(append([]string{}, base...), args...) }
	checkUsageErrors(t, []usageCase{
		{"a retention below a second", with("--ended-lease-retention", "10ms"), []string{"--ended-lease-retention 10ms: must be between 1s and 720h0m0s"}},
		{"a retention above 30 days", with("--ended-lease-retention", "1000h"), []string{"--ended-lease-retention 1000h0m0s: must be between 1s and 720h0m0s"}},
		{"no ended lease kept", with("--ended-leases-max", "0"), []string{"--ended-leases-max 0: must be between 1 and 10000000"}},
		{"a negative count", with("--ended-leases-max", "-5"), []string{"--ended-leases-max -5: must be between 1 and 10000000"}},
	})
}
