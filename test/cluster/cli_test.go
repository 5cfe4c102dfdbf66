package cluster_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// gpupool runs the built binary and returns stdout, stderr and exit code.
func gpupool(t *testing.T, args ...string) (string, string, int) {
	t.Helper()
	cmd := exec.Command(binary, args...)
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	err := cmd.Run()
	code := 0
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		code = ee.ExitCode()
	} else if err != nil {
		t.Fatal(err)
	}
	return out.String(), errOut.String(), code
}

func TestCLIAgainstARealCluster(t *testing.T) {
	if testing.Short() {
		t.Skip("starts real processes")
	}
	cl := newCluster(t, 1)
	addr := "--addr=" + strings.Join(cl.addrs, ",")

	out, stderr, code := gpupool(t, "lease", "acquire", "--memory", "20GiB", "--compute", "25", "-o", "json", addr)
	if code != 0 {
		t.Fatalf("acquire: exit %d: %s", code, stderr)
	}
	var lease map[string]any
	if err := json.Unmarshal([]byte(out), &lease); err != nil {
		t.Fatalf("acquire -o json: %v\n%s", err, out)
	}
	for _, k := range []string{"id", "state", "fencing_token", "slices"} {
		if _, ok := lease[k]; !ok {
			t.Fatalf("lease JSON lacks %q: %s", k, out)
		}
	}
	slice := lease["slices"].([]any)[0].(map[string]any)
	for _, k := range []string{"host", "device", "memory_mib", "compute_percent"} {
		if _, ok := slice[k]; !ok {
			t.Fatalf("slice JSON lacks %q: %s", k, out)
		}
	}
	id := lease["id"].(string)

	tests := []struct {
		name     string
		args     []string
		wantCode int
		want     string // in stdout+stderr
	}{
		{"ls shows the lease", []string{"lease", "ls"}, 0, id},
		{"get shows the lease", []string{"lease", "get", id}, 0, "granted"},
		{"keepalive --once renews it", []string{"lease", "keepalive", id, "--once"}, 0, "renewed " + id},
		{"status counts it", []string{"status"}, 0, "granted 1"},
		{"host ls shows the host", []string{"host", "ls"}, 0, "host-1"},
		{"raft peers shows three servers", []string{"operator", "raft", "peers"}, 0, "broker-3"},
		{"an unknown model is a usage error", []string{"lease", "acquire", "--memory", "1GiB", "--compute", "5", "--model", "H200*"}, 2, `constraints.model "H200*": matches no GPU in the pool`},
		{"more memory than any GPU fails", []string{"lease", "acquire", "--memory", "100GiB", "--compute", "5"}, 1, "can never fit"},
		{"more GPUs than free fails", []string{"lease", "acquire", "--gpus", "8", "--exclusive", "--topology", "same-host"}, 1, "no capacity now"},
		{"releasing an unknown lease fails", []string{"lease", "release", "l-0000000000000000"}, 1, "not found"},
		{"getting an unknown lease fails", []string{"lease", "get", "l-0000000000000000"}, 1, "not found"},
		{"renewing an unknown lease fails", []string{"lease", "keepalive", "l-0000000000000000", "--once"}, 1, "not found"},
		{"compute over 100 is a usage error", []string{"lease", "acquire", "--memory", "1GiB", "--compute", "101"}, 2, "--compute"},
		{"exclusive with memory is a usage error", []string{"lease", "acquire", "--exclusive", "--memory", "1GiB"}, 2, "--exclusive"},
		{"draining an unknown host fails", []string{"host", "drain", "host-9"}, 1, `host "host-9": not found`},
		{"drain marks the host draining", []string{"host", "drain", "host-1", "--reason", "kernel upgrade"}, 0, "host host-1: draining, eligible=no, 1 lease on it"},
		{"a draining host takes no new lease", []string{"lease", "acquire", "--memory", "1GiB", "--compute", "5"}, 1, "draining"},
		{"cancel makes it ready again", []string{"host", "drain", "host-1", "--cancel"}, 0, "host host-1: ready, eligible=yes"},
		{"release shows the ending", []string{"lease", "release", id}, 0, "released " + id},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			out, stderr, code := gpupool(t, append(tt.args, addr)...)
			if code != tt.wantCode || !strings.Contains(out+stderr, tt.want) {
				t.Fatalf("exit %d, want %d; output lacks %q?\nstdout: %s\nstderr: %s", code, tt.wantCode, tt.want, out, stderr)
			}
		})
	}

	// Leadership moves to a follower on request, and a transfer to the
	// leader itself is a no-op.
	leader := fmt.Sprintf("broker-%d", cl.leader()+1)
	to := "broker-1"
	if leader == to {
		to = "broker-2"
	}
	for _, target := range []string{to, to} {
		out, stderr, code := gpupool(t, "operator", "raft", "transfer-leadership", "--to", target, addr)
		if code != 0 || !strings.Contains(out, target) {
			t.Fatalf("transfer to %s: exit %d\n%s%s", target, code, out, stderr)
		}
	}
	eventually(t, to+" to lead", 10*time.Second, func() error {
		if got := fmt.Sprintf("broker-%d", cl.leader()+1); got != to {
			return fmt.Errorf("%s leads", got)
		}
		return nil
	})

	// A snapshot saved, then restored, brings the state back.
	file := filepath.Join(t.TempDir(), "pool.snap")
	if out, stderr, code := gpupool(t, "operator", "snapshot", "save", file, addr); code != 0 {
		t.Fatalf("snapshot save: exit %d\n%s%s", code, out, stderr)
	}
	if _, stderr, code := gpupool(t, "lease", "acquire", "--memory", "1GiB", "--compute", "1", "--request-id", "after-snapshot", addr); code != 0 {
		t.Fatalf("acquire after snapshot: %s", stderr)
	}
	if out, stderr, code := gpupool(t, "operator", "snapshot", "restore", file, "--yes", addr); code != 0 {
		t.Fatalf("snapshot restore: exit %d\n%s%s", code, out, stderr)
	}
	out, _, _ = gpupool(t, "lease", "ls", "--all", "-o", "json", addr)
	if strings.Contains(out, "after-snapshot") || !strings.Contains(out, id) {
		t.Fatalf("after restore: want %s and not the later lease:\n%s", id, out)
	}
}

func TestDevDemoRunsAndStopsByItself(t *testing.T) {
	if testing.Short() {
		t.Skip("starts real processes")
	}
	// dev lays out its ports from --base-port; ask the kernel for one and
	// check the few it will use.
	ip := "127.0.0.5"
	base := 0
	for range 20 {
		_, p, _ := net.SplitHostPort(freePort(t, ip))
		n, _ := strconv.Atoi(p)
		if n+200 < 65535 && n > 1024 {
			base = n
			break
		}
	}
	out, stderr, code := gpupool(t, "dev", "--demo", "--exit-after-demo", "--hosts", "2", "--ip", ip, "--base-port", strconv.Itoa(base))
	if code != 0 {
		t.Fatalf("dev --demo: exit %d\n%s\n%s", code, out, stderr)
	}
	for _, want := range []string{"The pool is up", "Console (open: no ACL in dev): http://" + ip + ":" + strconv.Itoa(base+60) + "/", "$ gpupool lease acquire --memory 20GiB --compute 25", "granted", "released l-", "demo done"} {
		if !strings.Contains(out, want) {
			t.Fatalf("dev output lacks %q:\n%s", want, out)
		}
	}
}
