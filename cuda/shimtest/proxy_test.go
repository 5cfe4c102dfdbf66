package shimtest

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gpupool/gpupool/agent/cudaserver"
	"github.com/gpupool/gpupool/cuda/proxy"
	"github.com/gpupool/gpupool/dataplane"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

const (
	proxyLease = "lease-cuda"
	proxyToken = "token-cuda"
)

// oneLease lets one token in, for one lease the agent enforces.
type oneLease struct{ dir string }

func (oneLease) Authorize(token string) (string, error) {
	if token != proxyToken {
		return "", errors.New("token not signed by a known broker key")
	}
	return proxyLease, nil
}
func (oneLease) Env(string) ([]string, bool)                { return nil, true }
func (l oneLease) Dir(string) (string, error)               { return l.dir, nil }
func (oneLease) Started(string, int)                        {}
func (oneLease) Usage(string) (*gpupoolv1.LeaseUsage, bool) { return &gpupoolv1.LeaseUsage{}, true }
func (oneLease) Sandbox(string, *exec.Cmd) error            { return nil }
func (oneLease) Listens(string, int) bool                   { return true }

// remoteLease is the pool host's side: a real QUIC data-plane server
// whose cuda operation starts the lease's CUDA server as the agent does,
// a process with the listening socket as its stdin: this test binary in
// the role of 'gpupool agent cuda-server' (see TestMain).
func remoteLease(t *testing.T) (addr, fingerprint string) {
	t.Helper()
	cert, fp, err := dataplane.LoadOrCreateCert(filepath.Join(t.TempDir(), "cert"))
	if err != nil {
		t.Fatal(err)
	}
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	dp, err := dataplane.NewServer(dataplane.ServerConfig{Addr: "127.0.0.1:0", Cert: cert, Auth: oneLease{}, Leases: oneLease{dir: t.TempDir()},
		CudaServer: func(string) ([]string, error) { return []string{self, cudaServerArg}, nil }})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan struct{})
	go func() { defer close(served); _ = dp.Serve(ctx) }()
	t.Cleanup(func() { cancel(); <-served })
	return dp.Addr().String(), fp
}

// cudaServerArg makes this test binary a lease's CUDA server.
const cudaServerArg = "shimtest-cuda-server"

// serveCudaOnStdin is the lease's CUDA server: one simulated device with
// the slice's memory, on the listening socket the data plane passes as
// stdin, until SIGTERM.
func serveCudaOnStdin() int {
	l, err := net.FileListener(os.Stdin)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	dev := cudaserver.DefaultSimDevice([16]byte{7})
	srv, err := cudaserver.New(cudaserver.Config{Devices: []cudaserver.Device{{Index: 0, MemoryBytes: slice}},
		NewBackend: func() (cudaserver.Backend, error) {
			return cudaserver.NewSimBackend([]cudaserver.SimDevice{dev}, nil), nil
		}})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	context.AfterFunc(ctx, func() { srv.Close(); l.Close() })
	_ = srv.Serve(l)
	return 0
}

// localProxy is the user's side: the proxy on a unix socket, carrying each
// connection over the data-plane connection with token.
func localProxy(t *testing.T, addr, fp, token string) (*proxy.Proxy, <-chan error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	conn, err := dataplane.Dial(ctx, addr, fp)
	if err != nil {
		t.Fatal(err)
	}
	dir, err := os.MkdirTemp("", "cuda")
	if err != nil {
		t.Fatal(err)
	}
	p, err := proxy.Listen(filepath.Join(dir, "s"), func(ctx context.Context, local net.Conn) error { return conn.Cuda(ctx, token, local) })
	if err != nil {
		t.Fatal(err)
	}
	errs := make(chan error, 16)
	p.OnError = func(err error) {
		select {
		case errs <- err:
		default:
		}
	}
	served := make(chan struct{})
	go func() { defer close(served); _ = p.Serve(ctx) }()
	t.Cleanup(func() {
		cancel()
		<-served
		p.Close()
		conn.Close()
		os.RemoveAll(dir)
	})
	return p, errs
}

func TestTheShimReachesTheLeasesServerOverTheDataPlane(t *testing.T) {
	addr, fp := remoteLease(t)
	p, _ := localProxy(t, addr, fp, proxyToken)
	out, stderr, err := runProgram(t, p.Path(), programAt(t, "vecadd", example))
	if err != nil {
		t.Fatalf("vecadd: %v\n%s\n%s", err, out, stderr)
	}
	for _, want := range []string{"device 0: NVIDIA A100-SXM4-40GB, 8192 MiB", "1048576 of 1048576 sums right"} {
		if !strings.Contains(out, want) {
			t.Errorf("got %q, want %q", out, want)
		}
	}
}

func TestAStaleTokenGetsNoGPU(t *testing.T) {
	addr, fp := remoteLease(t)
	p, errs := localProxy(t, addr, fp, "token-expired")
	out, stderr := run(t, p.Path(), "init")
	if strings.TrimSpace(out) != "CUDA_ERROR_DEVICE_UNAVAILABLE" {
		t.Errorf("got %q, want CUDA_ERROR_DEVICE_UNAVAILABLE", out)
	}
	if !strings.Contains(stderr, "connection to the lease's GPU server is lost") {
		t.Errorf("stderr does not say why:\n%s", stderr)
	}
	select {
	case err := <-errs:
		if !strings.Contains(err.Error(), "not signed by a known broker key") {
			t.Errorf("the proxy heard %v, want the agent's refusal of the token", err)
		}
	case <-time.After(time.Minute):
		t.Error("the proxy never heard why the connection ended")
	}
}

func TestAttachRunsACommandWithTheShimAndTheProxy(t *testing.T) {
	sock, _ := serve(t, slice)
	lib := buildShim(t)
	var out strings.Builder
	cmd := exec.Command(programAt(t, "vecadd", example))
	cmd.Stdout = &out
	cmd.Env = append(os.Environ(), "GPUPOOL_CUDA_SOCKET=/nonexistent", "LD_LIBRARY_PATH=/usr/lib")
	if err := proxy.Attach(context.Background(), proxy.DialUnix(sock), lib, cmd, nil); err != nil {
		t.Fatalf("attach: %v\n%s", err, out.String())
	}
	if !strings.Contains(out.String(), "1048576 of 1048576 sums right") {
		t.Errorf("got %q, want every sum right", out.String())
	}
	if !slices.Contains(cmd.Env, "LD_LIBRARY_PATH="+lib+":/usr/lib") {
		t.Errorf("the command's environment %v does not put the shim first on LD_LIBRARY_PATH", cmd.Env)
	}
}

func TestAttachWithoutTheShimSaysWhereItComesFrom(t *testing.T) {
	err := proxy.Attach(context.Background(), proxy.DialUnix("/nonexistent"), t.TempDir(), exec.Command("true"), nil)
	if err == nil || !strings.Contains(err.Error(), "make build puts it in bin/lib") {
		t.Errorf("got %v, want an error saying make build builds the shim", err)
	}
}
