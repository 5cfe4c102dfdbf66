package cluster_test

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gpupool/gpupool/dataplane"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

func TestRunExecutesOnTheLeasedSliceAndExitsWithItsCode(t *testing.T) {
	if testing.Short() {
		t.Skip("starts real processes")
	}
	cl := newCluster(t, 1)
	addr := "--addr=" + strings.Join(cl.addrs, ",")
	dir := t.TempDir()
	in := filepath.Join(dir, "input.txt")
	if err := os.WriteFile(in, []byte("hello from the client\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(binary, "run", addr, "--memory", "4GiB", "--compute", "25", "--upload", in, "--download", "out.txt", "--",
		"sh", "-c", `echo $CUDA_VISIBLE_DEVICES; tr a-z A-Z < input.txt > out.txt; exit 3`)
	cmd.Dir = dir
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	err := cmd.Run()
	code := cmd.ProcessState.ExitCode()
	if code != 3 {
		t.Fatalf("gpupool run exited %d (%v), want the remote code 3\nstdout: %s\nstderr: %s", code, err, out.String(), errOut.String())
	}
	uuid := strings.TrimSpace(out.String())
	var found bool
	for _, d := range cl.devices() {
		found = found || d.Uuid == uuid
	}
	if !found {
		t.Fatalf("the command printed %q, want a leased GPU's UUID\nstderr: %s", uuid, errOut.String())
	}
	if b, err := os.ReadFile(filepath.Join(dir, "out.txt")); err != nil || string(b) != "HELLO FROM THE CLIENT\n" {
		t.Fatalf("downloaded out.txt: %q %v", b, err)
	}
	// run releases its lease.
	for _, l := range cl.listAll(false, cl.c) {
		if l.State == gpupoolv1.LeaseState_LEASE_STATE_GRANTED {
			t.Fatalf("lease %s still granted after run ended", l.Id)
		}
	}
}

func TestRevokingTheLeaseEndsARunningCommand(t *testing.T) {
	if testing.Short() {
		t.Skip("starts real processes")
	}
	cl := newCluster(t, 1)
	cmd := exec.Command(binary, "run", "--addr="+strings.Join(cl.addrs, ","), "--memory", "1GiB", "--compute", "10", "--", "sleep", "601")
	var errOut syncBuffer
	cmd.Stderr = &errOut
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { cmd.Wait(); close(done) }()
	t.Cleanup(func() { cmd.Process.Kill(); <-done })
	idRE := regexp.MustCompile(`lease (l-[0-9a-f]+) on`)
	var id string
	eventually(t, "run to print its lease", 20*time.Second, func() error {
		m := idRE.FindStringSubmatch(errOut.String())
		if m == nil {
			return os.ErrNotExist
		}
		id = m[1]
		return nil
	})
	// Wait until the remote command runs (on this machine: the pool host).
	eventually(t, "the remote sleep to start", 20*time.Second, func() error {
		out, _ := exec.Command("pgrep", "-f", "^sleep 601$").Output()
		if len(out) == 0 {
			return os.ErrNotExist
		}
		return nil
	})
	if _, err := cl.c.Lease.Release(ctxFor(t, 10*time.Second), &gpupoolv1.ReleaseRequest{LeaseId: id, Reason: "revoked by the test"}); err != nil {
		t.Fatal(err)
	}
	// The run keeps renewing its lease, so it ends only because it heard the
	// release; how fast is for bench/, not for a test on a busy machine.
	select {
	case <-done:
	case <-time.After(60 * time.Second):
		t.Fatalf("gpupool run still runs 60s after its lease was released; stderr:\n%s", errOut.String())
	}
	if cmd.ProcessState.ExitCode() == 0 {
		t.Fatalf("run exited 0 after its lease was revoked; stderr:\n%s", errOut.String())
	}
}

// syncBuffer is a bytes.Buffer safe for a writing process and a reading
// test.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func TestExecAndForwardOnAHeldLease(t *testing.T) {
	if testing.Short() {
		t.Skip("starts real processes")
	}
	cl := newCluster(t, 1)
	addr := "--addr=" + strings.Join(cl.addrs, ",")
	acq, err := cl.c.Lease.Acquire(ctxFor(t, 10*time.Second), fractional(1024, 10, "exec-1"))
	if err != nil {
		t.Fatal(err)
	}
	id := acq.Lease.Id
	out, stderr, code := gpupool(t, "exec", addr, id, "--", "sh", "-c", "echo $GPUPOOL_LEASE_ID; exit 4")
	if code != 4 || strings.TrimSpace(out) != id {
		t.Fatalf("exec: exit %d, stdout %q (stderr %s); want 4 and the lease id", code, out, stderr)
	}

	// An echo server of the lease: forward reaches only the lease's own
	// listeners.
	srv := exec.Command(binary, "exec", addr, id, "--", "perl", "-e", perlEcho)
	srvOut, err := srv.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := srv.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Process.Kill(); srv.Wait() })
	line, err := bufio.NewReader(srvOut).ReadString('\n')
	if err != nil {
		t.Fatalf("reading the echo server's port: %v", err)
	}
	port, err := strconv.Atoi(strings.TrimSpace(line))
	if err != nil {
		t.Fatalf("the echo server printed %q, want its port", line)
	}
	fwd := exec.Command(binary, "forward", addr, id, fmt.Sprintf("127.0.0.1:0:%d", port))
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
	c, err := net.Dial("tcp", local)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	msg := []byte("bytes both ways\n")
	if _, err := c.Write(msg); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len(msg))
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.ReadFull(c, got); err != nil || !bytes.Equal(got, msg) {
		t.Fatalf("through the forward: got %q, %v; want the echo %q", got, err, msg)
	}
	if l := cl.getLease(id); l.State != gpupoolv1.LeaseState_LEASE_STATE_GRANTED {
		t.Fatalf("exec and forward left the lease %v, want granted", l.State)
	}
}

func TestTheAgentRefusesForgedAndForeignTokens(t *testing.T) {
	if testing.Short() {
		t.Skip("starts real processes")
	}
	cl := newCluster(t, 2)
	ctx := ctxFor(t, 30*time.Second)
	acq, err := cl.c.Lease.Acquire(ctx, &gpupoolv1.AcquireRequest{Request: &gpupoolv1.LeaseRequest{
		Count: 1, MemoryMib: 1024, ComputePercent: 10, TtlMs: 60_000, Constraints: &gpupoolv1.Constraints{Host: "host-1"}}})
	if err != nil {
		t.Fatal(err)
	}
	good := acq.Tokens[0]
	other, err := cl.c.Lease.Acquire(ctx, &gpupoolv1.AcquireRequest{Request: &gpupoolv1.LeaseRequest{
		Count: 1, MemoryMib: 1024, ComputePercent: 10, TtlMs: 60_000, Constraints: &gpupoolv1.Constraints{Host: "host-2"}}})
	if err != nil {
		t.Fatal(err)
	}
	conn, err := dataplane.Dial(ctx, good.Address, good.CertSha256)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	sig := strings.LastIndexByte(good.Token, '.')
	forged := good.Token[:sig+1] + strings.Repeat("A", len(good.Token)-sig-1)
	for _, tc := range []struct {
		name, token, want string
	}{
		{"a forged signature", forged, "bad signature"},
		{"another host's token", other.Tokens[0].Token, "is for host host-2, this is host host-1"},
		{"no token at all", "", "malformed"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := conn.Exec(ctx, tc.token, &gpupoolv1.ExecStart{Argv: []string{"true"}}, dataplane.ExecIO{})
			var refused *dataplane.RefusedError
			if !errors.As(err, &refused) || refused.Code != gpupoolv1.AcceptCode_ACCEPT_CODE_UNAUTHENTICATED || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Exec with %s: %v, want unauthenticated mentioning %q", tc.name, err, tc.want)
			}
		})
	}
	if st, err := conn.Exec(ctx, good.Token, &gpupoolv1.ExecStart{Argv: []string{"true"}}, dataplane.ExecIO{}); err != nil || st.Code != 0 {
		t.Fatalf("Exec with the lease's own token: %v %v", st, err)
	}
	// A pinned fingerprint that is not the agent's certificate.
	if _, err := dataplane.Dial(ctx, good.Address, strings.Repeat("0", 64)); err == nil {
		t.Fatal("Dial accepted an agent whose certificate does not match the pinned fingerprint")
	}
}
