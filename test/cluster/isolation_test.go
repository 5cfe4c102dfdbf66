package cluster_test

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// perlEcho listens on 127.0.0.1 port 0 in the lease, prints the port and
// echoes what each connection sends.
const perlEcho = `use IO::Socket::INET; $|=1; my $s=IO::Socket::INET->new(LocalAddr=>"127.0.0.1",LocalPort=>0,Listen=>5) or die "listen: $!"; ` +
	`print $s->sockport, "\n"; while (my $c=$s->accept) { while (sysread($c,my $b,4096)) { syswrite($c,$b) } close $c }`

// TestALeaseCannotReachAnotherLeaseOrTheAgentOnAPoolHost runs the attacks
// of a tenant with exec on a pool host against another lease on the same
// GPU and against the agent. The agent runs as root, as in CI, so every
// lease is sandboxed.
func TestALeaseCannotReachAnotherLeaseOrTheAgentOnAPoolHost(t *testing.T) {
	if testing.Short() {
		t.Skip("starts real processes")
	}
	cl := newCluster(t, 1)
	addr := "--addr=" + strings.Join(cl.addrs, ",")
	acqA, err := cl.c.Lease.Acquire(ctxFor(t, 10*time.Second), fractional(1024, 10, "iso-a"))
	if err != nil {
		t.Fatal(err)
	}
	a := acqA.Lease
	// B names A's GPU, as the attacker of the security test did.
	reqB := fractional(1024, 10, "iso-b")
	reqB.Request.Constraints = &gpupoolv1.Constraints{Devices: []string{a.Slices[0].Device}}
	acqB, err := cl.c.Lease.Acquire(ctxFor(t, 10*time.Second), reqB)
	if err != nil {
		t.Fatal(err)
	}
	b := acqB.Lease
	if b.Slices[0].Device != a.Slices[0].Device || b.FencingToken <= a.FencingToken {
		t.Fatalf("B got %s with fencing token %d, want A's GPU %s with a newer token than %d", b.Slices[0].Device, b.FencingToken, a.Slices[0].Device, a.FencingToken)
	}
	execIn := func(t *testing.T, lease string, script string) (string, string, int) {
		t.Helper()
		return gpupool(t, "exec", addr, lease, "--", "sh", "-c", script)
	}

	t.Run("lease get shows what the lease's processes run in", func(t *testing.T) {
		out, stderr, code := gpupool(t, "lease", "get", a.Id, addr)
		if want := "PROCESSES ON host-1: sandboxed (user, mounts, pid, cgroup, noprivs, cgroup "; code != 0 || !strings.Contains(out, want) {
			t.Fatalf("lease get: exit %d, %s %s; want %q", code, out, stderr, want)
		}
	})

	t.Run("two fractional leases on one GPU can both exec", func(t *testing.T) {
		for _, l := range []*gpupoolv1.Lease{a, b} {
			out, stderr, code := execIn(t, l.Id, "echo ok")
			if code != 0 || out != "ok\n" {
				t.Fatalf("exec on %s: exit %d, stdout %q, stderr %s; want 0 and ok", l.Id, code, out, stderr)
			}
		}
	})

	agentDir := cl.agentDir(0)
	if _, stderr, code := execIn(t, a.Id, "echo A-secret > secret.txt"); code != 0 {
		t.Fatalf("A writing its own file: exit %d, %s", code, stderr)
	}
	attacks := []struct {
		name, script, mustNotSee string
	}{
		{"reading another lease's directory", "cat " + filepath.Join(agentDir, "work", a.Id, "secret.txt"), "A-secret"},
		{"listing the agent's data dir", "ls -a " + agentDir + " " + filepath.Join(agentDir, "leases"), a.Id + ".json"},
		{"reading the agent's data-plane key", "cat " + filepath.Join(agentDir, "tls", "dataplane-key.pem"), "PRIVATE KEY"},
		{"reading the agent's command line", fmt.Sprintf("cat /proc/%d/cmdline", cl.agents[0].cmd.Process.Pid), "--data-dir"},
	}
	for _, at := range attacks {
		t.Run(at.name+" from a lease's exec is refused", func(t *testing.T) {
			out, stderr, code := execIn(t, b.Id, at.script)
			if code == 0 || strings.Contains(out, at.mustNotSee) {
				t.Fatalf("exit %d, stdout %q (stderr %q); want a failure that shows nothing of %q", code, out, stderr, at.mustNotSee)
			}
		})
	}

	t.Run("a process that sets or unsets GPUPOOL_LEASE_ID stays in its own lease", func(t *testing.T) {
		// Inside the lease, the variable is the process's own business:
		// the agent counts the process in B's cgroup either way.
		script := fmt.Sprintf("GPUPOOL_LEASE_ID=%s sleep 6031 & env -u GPUPOOL_LEASE_ID sleep 6032 & sleep 6033", a.Id)
		bg := exec.Command(binary, "exec", addr, b.Id, "--", "sh", "-c", script)
		if err := bg.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { bg.Process.Kill(); bg.Wait() })
		eventually(t, "B's sleeps to run", 20*time.Second, func() error {
			if out, _ := exec.Command("pgrep", "-f", "^sleep 603[12]$").Output(); strings.Count(string(out), "\n") != 2 {
				return fmt.Errorf("pgrep found %q", out)
			}
			return nil
		})
		if _, err := cl.c.Lease.Release(ctxFor(t, 10*time.Second), &gpupoolv1.ReleaseRequest{LeaseId: b.Id, Reason: "the test"}); err != nil {
			t.Fatal(err)
		}
		eventually(t, "B's processes, labelled or not, to be gone with B", 20*time.Second, func() error {
			if out, _ := exec.Command("pgrep", "-f", "^sleep 603[123]$").Output(); len(out) > 0 {
				return fmt.Errorf("still running: %q", out)
			}
			return nil
		})
		if out, stderr, code := execIn(t, a.Id, "cat secret.txt"); code != 0 || out != "A-secret\n" {
			t.Fatalf("A after B's release: exit %d, stdout %q, stderr %s; want A untouched", code, out, stderr)
		}
	})

	t.Run("forward reaches the lease's own listener and no other", func(t *testing.T) {
		acqC, err := cl.c.Lease.Acquire(ctxFor(t, 10*time.Second), fractional(1024, 10, "iso-c"))
		if err != nil {
			t.Fatal(err)
		}
		c := acqC.Lease
		srv := exec.Command(binary, "exec", addr, c.Id, "--", "perl", "-e", perlEcho)
		out, err := srv.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := srv.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { srv.Process.Kill(); srv.Wait() })
		line, err := bufio.NewReader(out).ReadString('\n')
		if err != nil {
			t.Fatalf("reading the echo server's port: %v", err)
		}
		port := strings.TrimSpace(line)
		forward := func(lease string) (string, *syncBuffer) {
			fwd := exec.Command(binary, "forward", addr, lease, "127.0.0.1:0:"+port)
			var fwdErr syncBuffer
			fwd.Stderr = &fwdErr
			if err := fwd.Start(); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { fwd.Process.Kill(); fwd.Wait() })
			re := regexp.MustCompile(`forwarding (127\.0\.0\.1:\d+) to port`)
			var local string
			eventually(t, "forward to listen", 20*time.Second, func() error {
				m := re.FindStringSubmatch(fwdErr.String())
				if m == nil {
					return fmt.Errorf("stderr so far: %q", fwdErr.String())
				}
				local = m[1]
				return nil
			})
			return local, &fwdErr
		}
		// A's forward to C's listener is refused.
		localA, errA := forward(a.Id)
		connA, err := net.Dial("tcp", localA)
		if err != nil {
			t.Fatal(err)
		}
		io.WriteString(connA, "hello\n")
		connA.SetReadDeadline(time.Now().Add(20 * time.Second))
		if n, _ := connA.Read(make([]byte, 16)); n > 0 {
			t.Fatalf("A's forward reached C's listener: read %d bytes", n)
		}
		connA.Close()
		eventually(t, "A's forward to say why", 20*time.Second, func() error {
			if !strings.Contains(errA.String(), "no process of lease "+a.Id+" listens on it") {
				return fmt.Errorf("stderr so far: %q", errA.String())
			}
			return nil
		})
		// C's own forward carries bytes both ways.
		local, fwdErr := forward(c.Id)
		conn, err := net.Dial("tcp", local)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		msg := "bytes both ways\n"
		io.WriteString(conn, msg)
		got := make([]byte, len(msg))
		conn.SetReadDeadline(time.Now().Add(20 * time.Second))
		if _, err := io.ReadFull(conn, got); err != nil || string(got) != msg {
			t.Fatalf("through C's forward: got %q, %v; want the echo %q (forward stderr %s)", got, err, msg, fwdErr.String())
		}
	})
}

// TestReRegisteringAHostWithANewFingerprintUnderLiveLeasesIsRefused plays
// a tenant who got hold of the agent's join secret and registers the host
// with its own data-plane certificate while another tenant's lease is
// live.
func TestReRegisteringAHostWithANewFingerprintUnderLiveLeasesIsRefused(t *testing.T) {
	if testing.Short() {
		t.Skip("starts real processes")
	}
	cl := newCluster(t, 1)
	addr := "--addr=" + strings.Join(cl.addrs, ",")
	if _, err := cl.c.Lease.Acquire(ctxFor(t, 10*time.Second), fractional(1024, 10, "victim")); err != nil {
		t.Fatal(err)
	}
	got, err := cl.c.Pool.GetHost(ctxFor(t, 10*time.Second), &gpupoolv1.GetHostRequest{HostId: "host-1"})
	if err != nil {
		t.Fatal(err)
	}
	forged := proto.CloneOf(got.Host)
	forged.CertSha256 = strings.Repeat("ab", 32)
	forged.Address = "127.0.0.1:1"
	register := func() error {
		_, err := cl.c.Agent.Register(ctxFor(t, 10*time.Second), &gpupoolv1.RegisterRequest{Host: forged})
		return err
	}
	err = register()
	if status.Code(err) != codes.FailedPrecondition || !strings.Contains(status.Convert(err).Message(), "while it holds 1 live lease: refused") {
		t.Fatalf("re-registering with a new fingerprint: got %v, want FailedPrecondition naming the live lease", err)
	}
	if h, _ := cl.c.Pool.GetHost(ctxFor(t, 10*time.Second), &gpupoolv1.GetHostRequest{HostId: "host-1"}); h.Host.CertSha256 != got.Host.CertSha256 || h.Host.Address != got.Host.Address {
		t.Fatalf("after the refusal host-1 is at %s with %s, want its own %s with %s", h.Host.Address, h.Host.CertSha256, got.Host.Address, got.Host.CertSha256)
	}
	// Any broker answers, and a follower may not have applied the entry
	// yet.
	auditHas := func(kind, want string) {
		t.Helper()
		eventually(t, "a "+kind+" audit entry", 20*time.Second, func() error {
			out, stderr, code := gpupool(t, "operator", "audit", addr, "--kind", kind, "-o", "json")
			if code != 0 || !strings.Contains(out, "host-1") || !strings.Contains(out, want) {
				return fmt.Errorf("exit %d, %s %s", code, out, stderr)
			}
			return nil
		})
	}
	auditHas("host-identity-refused", "refused: 1 live lease")

	// Bad input, then the operator's consent.
	for _, tc := range []struct {
		args     []string
		code     int
		inStderr string
	}{
		{[]string{"host", "reset-identity", "no-such-host"}, 1, `host "no-such-host": not found`},
		{[]string{"host", "reset-identity"}, 2, "accepts 1 arg(s)"},
	} {
		if _, stderr, code := gpupool(t, append(tc.args, addr)...); code != tc.code || !strings.Contains(stderr, tc.inStderr) {
			t.Errorf("gpupool %s: exit %d, %q; want %d and %q", strings.Join(tc.args, " "), code, stderr, tc.code, tc.inStderr)
		}
	}
	if _, stderr, code := gpupool(t, "host", "reset-identity", "host-1", "--reason", "the test", addr); code != 0 {
		t.Fatalf("reset-identity: exit %d, %s", code, stderr)
	}
	if err := register(); err != nil {
		t.Fatalf("registering after the operator's reset: %v", err)
	}
	auditHas("host-identity-reset", "the test")
	auditHas("host-identity-changed", "after an operator's reset")
}
