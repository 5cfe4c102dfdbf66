package dataplane

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// echoCudaArg makes this test binary a lease's "CUDA server" that answers
// each connection's lines with its pid, the lease's GPUPOOL_LEASE_ID and
// the line, so tests see which server process of which lease answered.
const echoCudaArg = "dataplane-test-cuda-server"

func TestMain(m *testing.M) {
	if len(os.Args) > 1 && os.Args[1] == echoCudaArg {
		os.Exit(echoCudaServer())
	}
	os.Exit(m.Run())
}

func echoCudaServer() int {
	l, err := net.FileListener(os.Stdin)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	for {
		c, err := l.Accept()
		if err != nil {
			return 1
		}
		go func() {
			defer c.Close()
			lines := bufio.NewScanner(c)
			for lines.Scan() {
				fmt.Fprintf(c, "%d %s %s\n", os.Getpid(), os.Getenv("GPUPOOL_LEASE_ID"), lines.Text())
			}
		}()
	}
}

func echoCuda(t *testing.T) CudaServerFunc {
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	return func(string) ([]string, error) { return []string{self, echoCudaArg}, nil }
}

// cudaSession opens a cuda stream and returns the local end the test
// talks through, and the stream's result.
func cudaSession(t *testing.T, c *Conn, token string) (net.Conn, <-chan error) {
	t.Helper()
	user, local := net.Pipe()
	t.Cleanup(func() { user.Close() })
	done := make(chan error, 1)
	go func() { done <- c.Cuda(t.Context(), token, local) }()
	return user, done
}

// ask sends a line and reads the answer's fields: pid, lease, line.
func ask(t *testing.T, c net.Conn, line string) []string {
	t.Helper()
	c.SetDeadline(time.Now().Add(30 * time.Second))
	if _, err := io.WriteString(c, line+"\n"); err != nil {
		t.Fatalf("writing: %v", err)
	}
	got, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		t.Fatalf("reading the answer: %v", err)
	}
	return strings.Fields(got)
}

func TestTheLeasesCudaServerStartsOnceAndServesEverySession(t *testing.T) {
	a := newTestAgentCuda(t, echoCuda(t))
	c := a.dial(t)
	s1, _ := cudaSession(t, c, testToken)
	first := ask(t, s1, "hello")
	if len(first) != 3 || first[1] != testLease || first[2] != "hello" {
		t.Fatalf("got %q, want the pid, %s and hello", first, testLease)
	}
	if pid := <-a.leases.started; fmt.Sprint(pid) != first[0] {
		t.Errorf("the agent was told of pid %d, want the server's %s", pid, first[0])
	}
	s2, _ := cudaSession(t, c, testToken)
	if second := ask(t, s2, "again"); second[0] != first[0] {
		t.Errorf("the second session reached pid %s, want the lease's one server %s", second[0], first[0])
	}
	// Another lease gets a server of its own.
	s3, _ := cudaSession(t, c, otherToken)
	if other := ask(t, s3, "x"); other[0] == first[0] || other[1] != otherLease {
		t.Errorf("the other lease reached %q, want a server of its own for %s", other, otherLease)
	}
}

func TestRevokingTheLeaseStopsItsCudaServerAndEndsItsSessions(t *testing.T) {
	a := newTestAgentCuda(t, echoCuda(t))
	c := a.dial(t)
	s, done := cudaSession(t, c, testToken)
	var pid int
	fmt.Sscan(ask(t, s, "hi")[0], &pid)
	a.leases.end(testLease)
	a.srv.Revoke(testLease)
	select {
	case err := <-done:
		if !errors.Is(err, ErrLeaseEnded) {
			t.Errorf("the session ended with %v, want ErrLeaseEnded", err)
		}
	case <-time.After(time.Minute):
		t.Fatal("the session outlived its lease")
	}
	if err := syscall.Kill(pid, 0); !errors.Is(err, syscall.ESRCH) {
		t.Errorf("the lease's CUDA server %d: kill 0 = %v, want it gone (ESRCH)", pid, err)
	}
	_, err := c.Exec(t.Context(), testToken, &gpupoolv1.ExecStart{Argv: []string{"true"}}, ExecIO{})
	wantRefused(t, err, gpupoolv1.AcceptCode_ACCEPT_CODE_PERMISSION_DENIED, "not enforced")
}

func TestCudaIsRefusedWhereTheAgentServesNone(t *testing.T) {
	a := newTestAgent(t)
	c := a.dial(t)
	_, done := cudaSession(t, c, testToken)
	wantRefused(t, <-done, gpupoolv1.AcceptCode_ACCEPT_CODE_NOT_FOUND, "does not serve CUDA")
}

func TestCudaWithAStaleTokenIsRefused(t *testing.T) {
	a := newTestAgentCuda(t, echoCuda(t))
	c := a.dial(t)
	_, done := cudaSession(t, c, "expired")
	wantRefused(t, <-done, gpupoolv1.AcceptCode_ACCEPT_CODE_UNAUTHENTICATED, "token expired")
}
