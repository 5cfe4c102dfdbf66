package cudabench

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"

	"github.com/gpupool/gpupool/agent/cudaserver"
	"github.com/gpupool/gpupool/cuda/proxy"
	"github.com/gpupool/gpupool/cuda/shim"
	"github.com/gpupool/gpupool/dataplane"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

//go:embed csrc/cudabench.c
var programSource []byte

// The PTX the launches run: saxpy, which the simulated backend runs.
//
//go:embed csrc/saxpy.ptx
var saxpyPTX []byte

// The one lease the benchmark's agent serves, its token, host and GPU.
const (
	benchLease = "bench-cuda"
	benchToken = "bench-cuda-token"
	benchHost  = "bench-host"
	benchGPU   = "GPU-0b9c2f4e-5a1d-4c3b-9e8f-7a6b5c4d3e2f"
	sliceMiB   = 2048
)

// stack is the path under test: the data plane's server with the lease's
// CUDA server behind it, a client connection, and the local proxy the
// program's shim connects to.
type stack struct {
	dp      *dataplane.Server
	conn    *dataplane.Conn
	px      *proxy.Proxy
	dir     string
	gpupool string // the gpupool binary
	arg     string // the lease's argument of 'gpupool agent cuda-server'
	prog    string // the C program, built against the shim
	ptx     string
	stop    context.CancelFunc
	served  chan error
	proxied chan error
}

func startStack(ctx context.Context, opts options, dir string) (*stack, error) {
	cert, fp, err := dataplane.LoadOrCreateCert(filepath.Join(dir, "cert"))
	if err != nil {
		return nil, err
	}
	arg, err := cudaserver.LeaseServer{
		Lease:     &gpupoolv1.Lease{Id: benchLease, Slices: []*gpupoolv1.Slice{{Host: benchHost, Device: benchGPU, MemoryMib: sliceMiB}}},
		HostID:    benchHost,
		Inventory: []*gpupoolv1.Device{{Uuid: benchGPU, Index: 0, Model: "A100-SXM4-40GB", MemoryMib: 40960, SmCount: 108}},
		Backend:   cudaserver.BackendSimulated,
	}.Arg()
	if err != nil {
		return nil, err
	}
	gpupool, err := filepath.Abs(opts.gpupool)
	if err != nil {
		return nil, err
	}
	leaseDir := filepath.Join(dir, "lease")
	if err := os.Mkdir(leaseDir, 0o755); err != nil {
		return nil, err
	}
	dp, err := dataplane.NewServer(dataplane.ServerConfig{
		Addr: "127.0.0.1:0", Cert: cert, Auth: tokenAuth{}, Leases: oneLease{dir: leaseDir},
		CudaServer: func(string) ([]string, error) {
			return []string{gpupool, "agent", "cuda-server", "--lease", arg}, nil
		},
	})
	if err != nil {
		return nil, err
	}
	serveCtx, stop := context.WithCancel(context.Background())
	s := &stack{dp: dp, dir: dir, gpupool: gpupool, arg: arg, stop: stop, served: make(chan error, 1), proxied: make(chan error, 1)}
	go func() { s.served <- dp.Serve(serveCtx) }()
	if s.conn, err = dataplane.Dial(ctx, dp.Addr().String(), fp); err != nil {
		s.close()
		return nil, err
	}
	if s.px, err = proxy.Listen(filepath.Join(dir, "cuda.sock"), func(ctx context.Context, local net.Conn) error {
		return s.conn.Cuda(ctx, benchToken, local)
	}); err != nil {
		s.close()
		return nil, err
	}
	go func() { s.proxied <- s.px.Serve(serveCtx) }()
	if s.prog, err = buildProgram(dir); err != nil {
		s.close()
		return nil, err
	}
	s.ptx = filepath.Join(dir, "saxpy.ptx")
	if err := os.WriteFile(s.ptx, saxpyPTX, 0o644); err != nil {
		s.close()
		return nil, err
	}
	return s, nil
}

// buildProgram builds the shim and the C program against it in dir.
func buildProgram(dir string) (string, error) {
	if _, err := exec.LookPath("gcc"); err != nil {
		return "", errors.New("gcc is not installed: the benchmark's program and the shim are C (make cc installs it)")
	}
	lib := filepath.Join(dir, "lib")
	if _, err := shim.Build(lib); err != nil {
		return "", err
	}
	src := filepath.Join(dir, "cudabench.c")
	if err := os.WriteFile(src, programSource, 0o644); err != nil {
		return "", err
	}
	out := filepath.Join(dir, "cudabench")
	b, err := exec.Command("gcc", "-std=gnu11", "-O2", "-Wall", "-Wextra", "-Werror", "-I", shim.IncludeDir(),
		"-o", out, src, "-L", lib, "-Wl,-rpath,"+lib, "-lcuda").CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("gcc: %v\n%s", err, b)
	}
	return out, nil
}

// command is the program with args, its shim pointed at the proxy.
func (s *stack) command(ctx context.Context, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, s.prog, args...)
	cmd.Env = append(os.Environ(), "GPUPOOL_CUDA_SOCKET="+s.px.Path())
	cmd.Stderr = os.Stderr
	return cmd
}

func (s *stack) close() {
	if s.px != nil {
		s.px.Close()
	}
	if s.conn != nil {
		s.conn.Close()
	}
	s.stop()
	<-s.served
	if s.px != nil {
		<-s.proxied
	}
}

// tokenAuth accepts benchToken, for benchLease, and nothing else.
type tokenAuth struct{}

func (tokenAuth) Authorize(token string) (string, error) {
	if token != benchToken {
		return "", errors.New("not the benchmark's token")
	}
	return benchLease, nil
}

// oneLease is the agent's view of benchLease, with dir as its directory.
type oneLease struct{ dir string }

func (oneLease) Env(id string) ([]string, bool) {
	return []string{"GPUPOOL_LEASE_ID=" + id}, id == benchLease
}
func (l oneLease) Dir(id string) (string, error) {
	if id != benchLease {
		return "", errors.New("no such lease: " + id)
	}
	return l.dir, nil
}
func (oneLease) Started(string, int)             {}
func (oneLease) Sandbox(string, *exec.Cmd) error { return nil }
func (oneLease) Listens(string, int) bool        { return true }
func (oneLease) Usage(id string) (*gpupoolv1.LeaseUsage, bool) {
	return &gpupoolv1.LeaseUsage{LeaseId: id}, id == benchLease
}
