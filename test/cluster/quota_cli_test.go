package cluster_test

import (
	"encoding/json"
	"strings"
	"testing"
)

func TestQuotaCLIAgainstARealCluster(t *testing.T) {
	if testing.Short() {
		t.Skip("starts real processes")
	}
	cl := newCluster(t, 1)
	addr := "--addr=" + strings.Join(cl.addrs, ",")
	tests := []struct {
		name     string
		args     []string
		wantCode int
		want     string // in stdout+stderr
	}{
		{"set prints the quota", []string{"operator", "quota", "set", "sim", "--gpus", "2", "--memory", "100GiB", "--compute", "150"}, 0, "0/2"},
		{"a whole GPU within the quota", []string{"lease", "acquire", "--exclusive", "--tenant", "sim"}, 0, "granted"},
		{"a slice within the rest of the quota", []string{"lease", "acquire", "--memory", "10GiB", "--compute", "40", "--tenant", "sim"}, 0, "granted"},
		// 1 + 0.4 GPUs used counts 2: a second whole GPU would make 3.
		{"a second whole GPU is over the GPU quota", []string{"lease", "acquire", "--exclusive", "--tenant", "sim"}, 1,
			"tenant sim: gpus 2 of 2 quota used, the lease needs 1"},
		{"a quota without a limit is a usage error", []string{"operator", "quota", "set", "sim", "--gpus", "0", "--memory", "0", "--compute", "0"}, 2,
			"'gpupool operator quota rm sim'"},
		{"a slice over the compute quota", []string{"lease", "acquire", "--memory", "1GiB", "--compute", "20", "--tenant", "sim"}, 1,
			"tenant sim: compute 140% of 150% quota used, the lease needs 20%"},
		{"another tenant is not limited", []string{"lease", "acquire", "--exclusive", "--tenant", "train"}, 0, "granted"},
		{"ls shows usage against quota", []string{"operator", "quota", "ls"}, 0, "sim     2/2   90GiB/100GiB  140%/150%  2"},
		{"a quota below usage warns what is over", []string{"operator", "quota", "set", "sim", "--memory", "50GiB"}, 0,
			"warning: tenant sim: memory 90 GiB used is over the new 50 GiB quota by 40 GiB"},
		{"a negative quota is a usage error", []string{"operator", "quota", "set", "sim", "--gpus", "-1"}, 2, "--gpus -1"},
		{"rm of a tenant without a quota fails", []string{"operator", "quota", "rm", "nobody"}, 1, `tenant "nobody": has no quota (tenants with a quota: sim)`},
		{"rm removes the quota", []string{"operator", "quota", "rm", "sim"}, 0, "removed the quota of tenant sim"},
		{"without a quota the tenant is unlimited", []string{"lease", "acquire", "--exclusive", "--tenant", "sim"}, 0, "granted"},
		{"ls with no quotas says so", []string{"operator", "quota", "ls"}, 0, "no quotas"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			out, stderr, code := gpupool(t, append(tt.args, addr)...)
			if code != tt.wantCode || !strings.Contains(out+stderr, tt.want) {
				t.Fatalf("exit %d, want %d; output lacks %q?\nstdout: %s\nstderr: %s", code, tt.wantCode, tt.want, out, stderr)
			}
		})
	}

	if _, stderr, code := gpupool(t, "operator", "quota", "set", "sim", "--gpus", "4", addr); code != 0 {
		t.Fatalf("set: exit %d: %s", code, stderr)
	}
	out, stderr, code := gpupool(t, "operator", "quota", "ls", "sim", "-o", "json", addr)
	if code != 0 {
		t.Fatalf("ls -o json: exit %d: %s", code, stderr)
	}
	var resp struct {
		Quotas []struct {
			Quota struct {
				Tenant string `json:"tenant"`
				Gpus   int    `json:"gpus"`
			} `json:"quota"`
			Usage struct {
				Gpus   int `json:"gpus"`
				Leases int `json:"leases"`
			} `json:"usage"`
		} `json:"quotas"`
	}
	if err := json.Unmarshal([]byte(out), &resp); err != nil {
		t.Fatalf("ls -o json: %v\n%s", err, out)
	}
	if len(resp.Quotas) != 1 || resp.Quotas[0].Quota.Gpus != 4 || resp.Quotas[0].Usage.Gpus != 3 || resp.Quotas[0].Usage.Leases != 3 {
		t.Fatalf("ls -o json: got %+v, want sim with 3 of 4 GPUs (1 + 0.4 + 1, rounded up) in 3 leases\n%s", resp, out)
	}
}
