package main

import (
	"bytes"
	"testing"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

func TestQuotaCommandsRefuseBadInput(t *testing.T) {
	checkUsageErrors(t, []usageCase{
		{"set without a tenant", []string{"operator", "quota", "set", "--gpus", "8"}, []string{"accepts 1 arg(s), received 0", "set TENANT"}},
		{"set without any limit", []string{"operator", "quota", "set", "sim"}, []string{"say what to limit: --gpus, --memory and/or --compute", "quota rm sim"}},
		{"set with every limit 0", []string{"operator", "quota", "set", "sim", "--gpus", "0", "--memory", "0", "--compute", "0"}, []string{"a quota of 0 in every dimension limits nothing", "quota rm sim"}},
		{"set with only a 0 limit", []string{"operator", "quota", "set", "sim", "--memory", "0GiB"}, []string{"limits nothing", "quota rm sim"}},
		{"set with a bad tenant name", []string{"operator", "quota", "set", "Sim Team", "--gpus", "1"}, []string{`TENANT "Sim Team": must be 1-63 lowercase`}},
		{"set with negative gpus", []string{"operator", "quota", "set", "sim", "--gpus", "-1"}, []string{"--gpus -1: must be 0 (unlimited) or more"}},
		{"set with gpus that are not a number", []string{"operator", "quota", "set", "sim", "--gpus", "eight"}, []string{`"eight"`, "--gpus"}},
		{"set with negative memory", []string{"operator", "quota", "set", "sim", "--memory", "-1GiB"}, []string{`--memory "-1GiB": must not be negative`}},
		{"set with decimal memory units", []string{"operator", "quota", "set", "sim", "--memory", "320GB"}, []string{`--memory "320GB"`, "GiB"}},
		{"set with negative compute", []string{"operator", "quota", "set", "sim", "--compute", "-100"}, []string{`--compute "-100": must be a whole percent, 0 (unlimited) or more`}},
		{"set with a fractional compute", []string{"operator", "quota", "set", "sim", "--compute", "12.5%"}, []string{`--compute "12.5%"`}},
		{"ls with two tenants", []string{"operator", "quota", "ls", "a", "b"}, []string{"accepts at most 1 arg(s), received 2"}},
		{"ls with a bad tenant name", []string{"operator", "quota", "ls", "x_"}, []string{`TENANT "x_"`}},
		{"rm without a tenant", []string{"operator", "quota", "rm"}, []string{"accepts 1 arg(s), received 0", "rm TENANT"}},
		{"an unknown quota subcommand", []string{"operator", "quota", "delete", "sim"}, []string{`unknown command "delete"`, "choose one of: ls, rm, set"}},
	})
}

func TestPrintQuotas(t *testing.T) {
	var buf bytes.Buffer
	err := printQuotas(&buf, []*gpupoolv1.QuotaStatus{
		{Quota: &gpupoolv1.Quota{Tenant: "sim", Gpus: 8, MemoryMib: 320 << 10, ComputePercent: 800},
			Usage: &gpupoolv1.TenantUsage{Tenant: "sim", Gpus: 3, MemoryMib: 300 << 10, ComputePercent: 350, Leases: 7}},
		{Quota: &gpupoolv1.Quota{Tenant: "notebooks", MemoryMib: 64 << 10},
			Usage: &gpupoolv1.TenantUsage{Tenant: "notebooks", MemoryMib: 80 << 10, ComputePercent: 40, Leases: 4}},
	})
	if err != nil {
		t.Fatal(err)
	}
	want := "TENANT     GPUS  MEMORY              COMPUTE    LEASES\n" +
		"sim        3/8   300GiB/320GiB       350%/800%  7\n" +
		"notebooks  0/-   80GiB/64GiB (over)  40%/-      4\n"
	if buf.String() != want {
		t.Errorf("got\n%s\nwant\n%s", buf.String(), want)
	}
}
