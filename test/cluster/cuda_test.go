package cluster_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/gpupool/gpupool/cuda/shim"
	"github.com/gpupool/gpupool/dataplane"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// The CUDA programs of cuda/shimtest, run by 'gpupool attach' through the
// real pieces: the shim, the proxy, the QUIC data plane, and the agent's
// per-lease CUDA server with the simulated backend.

var (
	shimOnce sync.Once
	shimErr  error
	progMu   sync.Mutex
	progs    = map[string]string{}
)

const shimTestData = "../../cuda/shimtest/testdata"

// cudaProgram builds the shim into ../lib next to the gpupool binary, where
// attach looks for it, and the C program testdata/name.c against it.
func cudaProgram(t *testing.T, name string) string {
	t.Helper()
	if _, err := exec.LookPath("gcc"); err != nil {
		t.Skip("no gcc: make test installs it")
	}
	lib := filepath.Join(filepath.Dir(filepath.Dir(binary)), "lib")
	shimOnce.Do(func() { _, shimErr = shim.Build(lib) })
	if shimErr != nil {
		t.Fatal(shimErr)
	}
	progMu.Lock()
	defer progMu.Unlock()
	if p, ok := progs[name]; ok {
		return p
	}
	out := filepath.Join(filepath.Dir(binary), "cuda-"+name)
	args := []string{"-std=gnu11", "-O1", "-Wall", "-Wextra", "-Werror", "-pthread", "-I", shim.IncludeDir(),
		"-o", out, filepath.Join(shimTestData, name+".c"), "-L", lib, "-lcuda", "-lm"}
	if b, err := exec.Command("gcc", args...).CombinedOutput(); err != nil {
		t.Fatalf("gcc %s: %v\n%s", name, err, b)
	}
	progs[name] = out
	return out
}

// attach runs 'gpupool attach ARGS' and returns its stdout, stderr and
// exit code.
func attach(t *testing.T, cl *cluster, args ...string) (string, string, int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, binary, append([]string{"attach", "--addr=" + strings.Join(cl.addrs, ",")}, args...)...)
	var out, errOut strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &errOut
	cmd.Run()
	return out.String(), errOut.String(), cmd.ProcessState.ExitCode()
}

func TestAttachRunsCUDAProgramsOnTheLeasedSlice(t *testing.T) {
	if testing.Short() {
		t.Skip("starts real processes")
	}
	cl := newCluster(t, 1)
	ptx, err := filepath.Abs(filepath.Join(shimTestData, "kernels.ptx"))
	if err != nil {
		t.Fatal(err)
	}
	const slice = 1 << 30 // --memory 1GiB
	lease := []string{"--memory", "1GiB", "--compute", "10"}
	for _, tc := range []struct {
		name string
		prog string
		args []string
		want []string // in stdout
	}{
		{"it sees only the leased device, with the slice's memory", "devices", []string{fmt.Sprint(slice)},
			[]string{"devices=1 name=NVIDIA A100-SXM4-80GB cc=8.0 total=1073741824"}},
		{"256 MiB go in and out intact, and allocating past the slice runs out of memory", "memory", []string{fmt.Sprint(slice)},
			[]string{"copied=268435456 checksum="}},
		{"PTX vecadd, saxpy and a reduction run with their parameters", "kernels", []string{ptx, "sim"},
			[]string{"vecadd ok saxpy ok reduce_sum=1000"}},
		{"streams and events order the work", "streams", []string{ptx}, []string{"streams ok"}},
		{"two threads call at once", "threads", []string{ptx}, []string{"threads ok"}},
		{"a child forked after cuInit fails cleanly and the parent goes on", "fork", nil, []string{"fork ok"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			prog := cudaProgram(t, tc.prog)
			out, errOut, code := attach(t, cl, append(append(lease, "--"), append([]string{prog}, tc.args...)...)...)
			if code != 0 {
				t.Fatalf("gpupool attach -- %s exited %d, want 0\nstdout:\n%s\nstderr:\n%s", tc.prog, code, out, errOut)
			}
			for _, want := range tc.want {
				if !strings.Contains(out, want) {
					t.Errorf("got %q, want %q\nstderr:\n%s", out, want, errOut)
				}
			}
		})
	}
	t.Run("attach releases the leases it acquired", func(t *testing.T) {
		for _, l := range cl.listAll(false, cl.c) {
			if l.State == gpupoolv1.LeaseState_LEASE_STATE_GRANTED {
				t.Errorf("lease %s still granted after attach ended", l.Id)
			}
		}
	})
	t.Run("SIGTERM to attach reaches the program", func(t *testing.T) {
		cmd := exec.Command(binary, append(append([]string{"attach", "--addr=" + strings.Join(cl.addrs, ",")}, lease...),
			"--", "sh", "-c", `trap 'exit 42' TERM; echo ready; while :; do sleep 0.1; done`)...)
		stdout, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		var errOut syncBuffer
		cmd.Stderr = &errOut
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		done := make(chan struct{})
		go func() {
			lines := bufio.NewScanner(stdout)
			for lines.Scan() {
				if lines.Text() == "ready" {
					cmd.Process.Signal(syscall.SIGTERM)
				}
			}
			cmd.Wait()
			close(done)
		}()
		select {
		case <-done:
		case <-time.After(2 * time.Minute):
			cmd.Process.Kill()
			<-done
			t.Fatalf("attach did not end after SIGTERM\nstderr:\n%s", errOut.String())
		}
		if code := cmd.ProcessState.ExitCode(); code != 42 {
			t.Errorf("got exit code %d, want the program's 42 from its SIGTERM trap\nstderr:\n%s", code, errOut.String())
		}
	})
	t.Run("a program's exit code is attach's", func(t *testing.T) {
		out, errOut, code := attach(t, cl, append(lease, "--", "sh", "-c", "exit 7")...)
		if code != 7 {
			t.Errorf("got exit code %d, want 7\nstdout:\n%s\nstderr:\n%s", code, out, errOut)
		}
	})
}

func TestReleasingTheLeaseDuringAnAttachFailsTheNextCUDACall(t *testing.T) {
	if testing.Short() {
		t.Skip("starts real processes")
	}
	cl := newCluster(t, 1)
	prog := cudaProgram(t, "leaseend")
	ctx := ctxFor(t, time.Minute)
	acq, err := cl.c.Lease.Acquire(ctx, &gpupoolv1.AcquireRequest{Request: &gpupoolv1.LeaseRequest{Count: 1, MemoryMib: 1024, ComputePercent: 10, TtlMs: 60_000}})
	if err != nil {
		t.Fatal(err)
	}
	id := acq.Lease.Id
	cmd := exec.Command(binary, "attach", "--addr="+strings.Join(cl.addrs, ","), "--lease", id, "--", prog)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var errOut syncBuffer
	cmd.Stderr = &errOut
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	t.Cleanup(func() { cmd.Process.Kill(); <-done })
	lines := bufio.NewScanner(stdout)
	if !lines.Scan() || lines.Text() != "ready" {
		go func() { cmd.Wait(); close(done) }()
		t.Fatalf("got %q, want ready; stderr:\n%s", lines.Text(), errOut.String())
	}
	// The lease's CUDA server runs in the lease's sandbox, as an exec does:
	// as the lease's user, in the lease's cgroup.
	pid := cudaServerPID(t, id)
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	uid := regexp.MustCompile(`(?m)^Uid:\s+(\d+)`).FindStringSubmatch(string(status))
	if uid == nil || uid[1] == fmt.Sprint(os.Getuid()) {
		t.Errorf("the lease's CUDA server %d runs as uid %v, want the lease's own user, not the agent's %d", pid, uid, os.Getuid())
	}
	if cg, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid)); err != nil || !strings.Contains(string(cg), id) {
		t.Errorf("the lease's CUDA server %d is in cgroups %q (%v), want the lease's", pid, cg, err)
	}
	if _, err := cl.c.Lease.Release(ctx, &gpupoolv1.ReleaseRequest{LeaseId: id, Reason: "test: the lease ends under a CUDA program"}); err != nil {
		t.Fatal(err)
	}
	// The agent stops the lease's CUDA server once it hears of the
	// release; the program's next call fails then.
	eventually(t, "the agent to stop the lease's CUDA server", 30*time.Second, func() error {
		if pid := findCudaServer(id); pid != 0 {
			return fmt.Errorf("pid %d still runs", pid)
		}
		return nil
	})
	io.WriteString(stdin, "go\n")
	stdin.Close()
	rest, _ := io.ReadAll(stdout)
	go func() { cmd.Wait(); close(done) }()
	<-done
	if code := cmd.ProcessState.ExitCode(); code != 0 || !strings.Contains(string(rest), "lease ended") {
		t.Errorf("got exit code %d and %q, want 0 and lease ended (the next calls failing with CUDA_ERROR_DEVICE_UNAVAILABLE)\nstderr:\n%s", code, rest, errOut.String())
	}
	if !strings.Contains(errOut.String(), "connection to the lease's GPU server is lost") {
		t.Errorf("the shim did not say why its calls fail:\n%s", errOut.String())
	}
}

func TestTheAgentRefusesAStaleTokenForCUDA(t *testing.T) {
	if testing.Short() {
		t.Skip("starts real processes")
	}
	cl := newCluster(t, 1)
	ctx := ctxFor(t, time.Minute)
	acq, err := cl.c.Lease.Acquire(ctx, &gpupoolv1.AcquireRequest{Request: &gpupoolv1.LeaseRequest{Count: 1, MemoryMib: 1024, ComputePercent: 10, TtlMs: 60_000}})
	if err != nil {
		t.Fatal(err)
	}
	tok := acq.Tokens[0]
	if _, err := cl.c.Lease.Release(ctx, &gpupoolv1.ReleaseRequest{LeaseId: acq.Lease.Id, Reason: "test: make its token stale"}); err != nil {
		t.Fatal(err)
	}
	conn, err := dataplane.Dial(ctx, tok.Address, tok.CertSha256)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	eventually(t, "the agent to refuse the released lease's token", 30*time.Second, func() error {
		local, remote := net.Pipe()
		defer remote.Close()
		err := conn.Cuda(ctx, tok.Token, local)
		var refused *dataplane.RefusedError
		if !errors.As(err, &refused) || refused.Code != gpupoolv1.AcceptCode_ACCEPT_CODE_UNAUTHENTICATED {
			return fmt.Errorf("Cuda with the released lease's token: %v, want UNAUTHENTICATED", err)
		}
		return nil
	})
}

// findCudaServer returns the pid of lease id's CUDA server, 0 if none runs.
func findCudaServer(id string) int {
	b, _ := exec.Command("ps", "-eo", "pid=,args=").Output()
	for _, line := range strings.Split(string(b), "\n") {
		// The server itself, not the sandbox's init that started it.
		var pid int
		if f := strings.Fields(line); len(f) > 3 && f[1] == "/proc/self/exe" && f[2] == "agent" && f[3] == "cuda-server" && strings.Contains(line, id) {
			fmt.Sscan(f[0], &pid)
			return pid
		}
	}
	return 0
}

// cudaServerPID waits for lease id's CUDA server and returns its pid.
func cudaServerPID(t *testing.T, id string) int {
	t.Helper()
	var pid int
	eventually(t, "the lease's CUDA server to run", 30*time.Second, func() error {
		if pid = findCudaServer(id); pid == 0 {
			return errors.New("not found")
		}
		return nil
	})
	return pid
}
