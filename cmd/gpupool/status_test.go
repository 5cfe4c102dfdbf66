package main

import (
	"bytes"
	"strings"
	"testing"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

func TestStatusRefusesBadInput(t *testing.T) {
	checkUsageErrors(t, []usageCase{
		{"a positional argument", []string{"status", "now"}, []string{"accepts 0 arg(s), received 1", "gpupool status"}},
		{"a bad -o", []string{"status", "-o", "yaml"}, []string{`--output "yaml"`, "json or name"}},
	})
}

func TestPrintStatus(t *testing.T) {
	s := &gpupoolv1.StatusResponse{
		Hosts: 3, HostsReady: 2, HostsDown: 1, Gpus: 8, GpusUnhealthy: 1,
		MemoryMib: 655360, AllocatedMemoryMib: 163840, ComputePercent: 800, AllocatedComputePercent: 200,
		LeasesByState: map[string]int32{"LEASE_STATE_RELEASING": 1, "granted": 3},
		LeaderId:      "b1", LeaderAddress: "127.0.0.1:7641", ServerId: "b2", AppliedIndex: 77,
		Models: []*gpupoolv1.ModelCapacity{{Model: "A100-SXM4-80GB", Gpus: 8, FreeGpus: 5, MemoryMib: 655360,
			AllocatedMemoryMib: 163840, ComputePercent: 800, AllocatedComputePercent: 200, LargestFreeMemoryMib: 81920}},
	}
	var buf bytes.Buffer
	if err := printStatus(&buf, s); err != nil {
		t.Fatal(err)
	}
	out := buf.String()
	for _, want := range []string{
		"LEADER       b1 (127.0.0.1:7641)",
		"ANSWERED BY  b2 at index 77",
		"HOSTS        3 (2 ready, 1 down, 0 ineligible)",
		"GPUS         8 (1 unhealthy: see 'gpupool host ls')",
		"MEMORY       160 GiB of 640 GiB allocated (25.0%)",
		"COMPUTE      200% of 800% allocated (25.0%)",
		"LEASES       granted 3, releasing 1",
		"MODEL           GPUS  FREE GPUS  MEMORY FREE  COMPUTE FREE  LARGEST FREE SLICE",
		"A100-SXM4-80GB  8     5          480 GiB      600%          80 GiB",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("printStatus output lacks %q:\n%s", want, out)
		}
	}
}

func TestLeasesByStateOfAnEmptyPool(t *testing.T) {
	if got := leasesByState(nil); got != "none" {
		t.Errorf("got %q, want none", got)
	}
}
