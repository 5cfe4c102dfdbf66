package main

import (
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

func TestK8sNodePluginRefusesBadInput(t *testing.T) {
	dir := t.TempDir()
	t.Setenv("HOME", dir) // no ~/.kube/config
	t.Setenv("KUBECONFIG", "")
	t.Setenv("KUBERNETES_SERVICE_HOST", "") // not in a pod
	t.Setenv("NODE_NAME", "")
	absent := filepath.Join(dir, "absent")
	ok := []string{"k8s-node-plugin", "--node-name", "node-1", "--registrar-dir", dir, "--state-dir", filepath.Join(dir, "state"),
		"--cdi-dir", filepath.Join(dir, "cdi"), "--plugin-dir", filepath.Join(dir, "plugin")}
	with := func(extra ...string) []string { return append(append([]string{}, ok...), extra...) }
	checkUsageErrors(t, []usageCase{
		{"no node name", []string{"k8s-node-plugin", "--registrar-dir", dir}, []string{"--node-name is empty", "NODE_NAME"}},
		{"a relative state dir", with("--state-dir", "state"), []string{`--state-dir "state"`, "absolute path"}},
		{"a relative CDI dir", with("--cdi-dir", "cdi"), []string{`--cdi-dir "cdi"`, "absolute path"}},
		{"an empty plugin dir", with("--plugin-dir", ""), []string{`--plugin-dir ""`, "absolute path"}},
		{"a registrar dir that does not exist", with("--registrar-dir", absent), []string{"--registrar-dir " + absent, "plugins_registry"}},
		{"a kubeconfig that does not exist", with("--kubeconfig", absent), []string{"--kubeconfig " + absent}},
		{"no Kubernetes configuration at all", ok, []string{"no Kubernetes configuration", "--kubeconfig"}},
		{"a bad log level", with("--log-level", "loud"), []string{`--log-level "loud"`}},
		{"a positional argument", with("node-1"), []string{"takes no arguments"}},
	})
}

func TestK8sNodePluginHelpTeaches(t *testing.T) {
	code, stdout, _ := runOffline(t, "k8s-node-plugin", "--help")
	if code != 0 {
		t.Fatalf("--help exited %d", code)
	}
	for _, want := range []string{"GPUPOOL_TOKEN_FILE       /var/run/gpupool/token.json", "gpu.gpupool.dev/claim=<claim uid>", "--state-dir",
		"/var/lib/gpupool/k8s", "/var/run/cdi", "/var/lib/kubelet/plugins/gpu.gpupool.dev", "/var/lib/kubelet/plugins_registry", "Examples:"} {
		if !strings.Contains(stdout, want) {
			t.Errorf("--help lacks %q", want)
		}
	}
}

func TestK8sNodePluginServesTheKubeletUntilSIGTERM(t *testing.T) {
	dir := t.TempDir()
	sockets, err := os.MkdirTemp("", "gpnp")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(sockets) })
	kubeconfig := filepath.Join(dir, "kubeconfig")
	if err := os.WriteFile(kubeconfig, []byte(`apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://127.0.0.1:1"}}]
contexts: [{name: c, context: {cluster: c, user: u}}]
users: [{name: u, user: {token: t}}]
current-context: c
`), 0o600); err != nil {
		t.Fatal(err)
	}
	registrar := filepath.Join(sockets, "registry")
	if err := os.Mkdir(registrar, 0o755); err != nil {
		t.Fatal(err)
	}
	done := make(chan int, 1)
	var stderr string
	go func() {
		var code int
		code, _, stderr = runOffline(t, "k8s-node-plugin", "--node-name", "node-1", "--kubeconfig", kubeconfig,
			"--state-dir", filepath.Join(dir, "state"), "--cdi-dir", filepath.Join(dir, "cdi"),
			"--plugin-dir", filepath.Join(sockets, "plugin"), "--registrar-dir", registrar, "--log-level", "error")
		done <- code
	}()
	// Once the registration socket is there the command is serving, and
	// its signal handler is in place.
	deadline := time.Now().Add(20 * time.Second)
	for {
		if _, err := os.Stat(filepath.Join(registrar, "gpu.gpupool.dev-reg.sock")); err == nil {
			break
		}
		select {
		case code := <-done:
			t.Fatalf("exited %d before serving: %s", code, stderr)
		case <-time.After(10 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatal("no registration socket after 20s")
		}
	}
	if err := syscall.Kill(os.Getpid(), syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case code := <-done:
		if code != 0 {
			t.Fatalf("exit %d after SIGTERM, want 0: %s", code, stderr)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("still running 20s after SIGTERM")
	}
}
