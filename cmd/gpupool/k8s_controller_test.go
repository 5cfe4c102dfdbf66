package main

import (
	"fmt"
	"path/filepath"
	"strings"
	"testing"
)

func TestK8sControllerRefusesBadInput(t *testing.T) {
	dir := t.TempDir()
	t.Setenv("HOME", dir) // no ~/.kube/config
	t.Setenv("KUBECONFIG", "")
	t.Setenv("KUBERNETES_SERVICE_HOST", "") // not in a pod
	absent := filepath.Join(dir, "absent")
	cmd := func(extra ...string) []string { return append([]string{"k8s-controller"}, extra...) }
	checkUsageErrors(t, []usageCase{
		{"an uppercase tenant", cmd("--tenant", "K8s"), []string{`--tenant "K8s"`, "lowercase letters, digits"}},
		{"an empty tenant", cmd("--tenant", ""), []string{"--tenant is empty", "e.g. k8s"}},
		{"a lease TTL below the brokers' minimum", cmd("--lease-ttl", "500ms"), []string{"--lease-ttl 500ms", "between 1s and 24h0m0s"}},
		{"a lease TTL above the brokers' maximum", cmd("--lease-ttl", "48h"), []string{"--lease-ttl 48h0m0s", "between 1s and 24h0m0s"}},
		{"a lease TTL that is no duration", cmd("--lease-ttl", "60"), []string{`"60"`, "--lease-ttl"}},
		{"a lease TTL shorter than a leader failover", cmd("--lease-ttl", "20s"), []string{"--lease-ttl 20s", "at least 40s with --leader-elect"}},
		{"a zero apiserver rate", cmd("--kube-api-qps", "0"), []string{"--kube-api-qps 0", "must be above 0"}},
		{"a node selector without =", cmd("--node-selector", "gpu"), []string{`--node-selector "gpu"`, "KEY=VALUE[,KEY=VALUE]"}},
		{"a node selector with an empty key", cmd("--node-selector", "=true"), []string{`--node-selector "=true"`, "KEY=VALUE"}},
		{"a node selector key that is no label key", cmd("--node-selector", "bad key=true"), []string{`label key "bad key"`}},
		{"a node selector value that is no label value", cmd("--node-selector", "zone=eu 1"), []string{`label value "eu 1"`}},
		{"a node selector with a label twice", cmd("--node-selector", "zone=a,zone=b"), []string{`label "zone" is given as "a" and "b"`}},
		{"a namespace without leader election", cmd("--leader-elect=false", "--leader-elect-namespace", "gpupool"), []string{"--leader-elect-namespace needs --leader-elect"}},
		{"a namespace that cannot be one", cmd("--leader-elect-namespace", "GPU_Pool"), []string{`--leader-elect-namespace "GPU_Pool"`, "namespace name"}},
		{"a kubeconfig that does not exist", cmd("--kubeconfig", absent), []string{"--kubeconfig " + absent}},
		{"no Kubernetes configuration at all", cmd(), []string{"no Kubernetes configuration", "--kubeconfig"}},
		{"a bad log level", cmd("--log-level", "loud"), []string{`--log-level "loud"`}},
		{"a positional argument", cmd("run"), []string{"takes no arguments"}},
	})
}

func TestParseNodeSelector(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"gpu.gpupool.dev/client=true", "map[gpu.gpupool.dev/client:true]"},
		{"a=1, b=2", "map[a:1 b:2]"},
		{"a=", "map[a:]"},
		{"a=1,a=1", "map[a:1]"},
		{"", "map[]"},
	} {
		got, err := parseNodeSelector(tc.in)
		if err != nil || fmt.Sprint(got) != tc.want {
			t.Errorf("parseNodeSelector(%q) = %v, %v; want %s", tc.in, got, err, tc.want)
		}
	}
}

func TestK8sControllerHelpTeaches(t *testing.T) {
	code, stdout, _ := runOffline(t, "k8s-controller", "--help")
	if code != 0 {
		t.Fatalf("--help exited %d", code)
	}
	for _, want := range []string{"gpu.gpupool.dev/client=true", "--tenant", "Leased=True", "LeaseFailed=True", "<claim uid>/<share id>",
		"gpu.gpupool.dev/busy", "NoExecute", "resourceclaims/driver", "arbitrary-node:update", "--leader-elect", "--lease-ttl", "Examples:"} {
		if !strings.Contains(stdout, want) {
			t.Errorf("--help lacks %q", want)
		}
	}
}
