package shimtest

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gpupool/gpupool/agent/cudaserver"
	"github.com/gpupool/gpupool/cuda/shim"
	"github.com/gpupool/gpupool/cuda/wire"
)

const slice = 8 << 30 // the lease's memory: 8 GiB of a 40 GiB GPU

var (
	buildOnce sync.Once
	shimDir   string
	buildErr  error
	progMu    sync.Mutex
	progs     = map[string]string{}
)

func TestMain(m *testing.M) {
	if len(os.Args) > 1 && os.Args[1] == cudaServerArg {
		os.Exit(serveCudaOnStdin())
	}
	dir, err := os.MkdirTemp("", "gpupool-shimtest-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	shimDir = dir
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// needGCC skips when there is no C compiler: `make test` installs one.
func needGCC(t *testing.T) {
	t.Helper()
	if _, err := exec.LookPath("gcc"); err != nil {
		t.Skip("gcc is not installed: the shim and its test programs are C")
	}
}

// buildShim builds libcuda.so.1 once per test binary.
func buildShim(t *testing.T) string {
	t.Helper()
	needGCC(t)
	buildOnce.Do(func() { _, buildErr = shim.Build(filepath.Join(shimDir, "lib")) })
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return filepath.Join(shimDir, "lib")
}

// program builds testdata/name.c against the shim.
func program(t *testing.T, name string) string {
	t.Helper()
	return programAt(t, name, filepath.Join("testdata", name+".c"))
}

// programAt builds the C program src, as name, against the shim.
func programAt(t *testing.T, name, src string) string {
	t.Helper()
	lib := buildShim(t)
	progMu.Lock()
	defer progMu.Unlock()
	if p, ok := progs[name]; ok {
		return p
	}
	out := filepath.Join(shimDir, name)
	args := []string{"-std=gnu11", "-O1", "-Wall", "-Wextra", "-Werror", "-pthread",
		"-I", shim.IncludeDir(), "-o", out, src,
		"-L", lib, "-Wl,-rpath," + lib, "-lcuda", "-lm"}
	if b, err := exec.Command("gcc", args...).CombinedOutput(); err != nil {
		t.Fatalf("gcc %s: %v\n%s", name, err, b)
	}
	progs[name] = out
	return out
}

func ptxPath(t *testing.T) string {
	p, err := filepath.Abs(filepath.Join("testdata", "kernels.ptx"))
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// serve starts a CUDA server for a lease of one simulated 40 GiB GPU with
// limit bytes of memory, on a unix socket, and returns the socket's path.
func serve(t *testing.T, limit uint64) (string, *cudaserver.Server) {
	t.Helper()
	dev := cudaserver.DefaultSimDevice([16]byte{0x6c, 1, 2, 3})
	srv, err := cudaserver.New(cudaserver.Config{
		Devices: []cudaserver.Device{{Index: 1, MemoryBytes: limit}},
		NewBackend: func() (cudaserver.Backend, error) {
			return cudaserver.NewSimBackend([]cudaserver.SimDevice{dev, dev}, nil), nil
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	return listen(t, srv), srv
}

func listen(t *testing.T, srv *cudaserver.Server) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "cuda")
	if err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(dir, "s")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { defer close(done); _ = srv.Serve(l) }()
	t.Cleanup(func() {
		srv.Close()
		l.Close()
		<-done
		os.RemoveAll(dir)
	})
	return sock
}

// run runs a test program with the shim pointed at sock and fails the test
// unless it exits 0; it returns stdout and stderr.
func run(t *testing.T, sock, name string, args ...string) (string, string) {
	t.Helper()
	stdout, stderr, err := runErr(t, sock, name, args...)
	if err != nil {
		t.Fatalf("%s %v: %v\nstdout:\n%s\nstderr:\n%s", name, args, err, stdout, stderr)
	}
	return stdout, stderr
}

func runErr(t *testing.T, sock, name string, args ...string) (string, string, error) {
	t.Helper()
	return runProgram(t, sock, program(t, name), args...)
}

// runProgram runs the built program path with the shim pointed at sock.
func runProgram(t *testing.T, sock, path string, args ...string) (string, string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, path, args...)
	cmd.Env = append(os.Environ(), "GPUPOOL_CUDA_SOCKET="+sock)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	return out.String(), errb.String(), err
}

func TestTheShimExportsOnlyDriverSymbols(t *testing.T) {
	lib := buildShim(t)
	out, err := exec.Command("nm", "-D", "--defined-only", filepath.Join(lib, shim.SOName)).Output()
	if err != nil {
		t.Skipf("nm: %v", err)
	}
	var names []string
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		f := strings.Fields(line)
		if len(f) == 3 && f[1] == "T" {
			names = append(names, f[2])
		}
		if len(f) == 3 && !strings.HasPrefix(f[2], "cu") {
			t.Errorf("the shim exports %s, want only cu* symbols", f[2])
		}
	}
	sort.Strings(names)
	for _, want := range []string{"cuInit", "cuGetProcAddress", "cuGetProcAddress_v2", "cuMemAlloc_v2", "cuLaunchKernel", "cuMemAllocManaged"} {
		if i := sort.SearchStrings(names, want); i == len(names) || names[i] != want {
			t.Errorf("the shim does not export %s", want)
		}
	}
}

func TestAProgramSeesOnlyTheLeasedDeviceWithTheSlicesMemory(t *testing.T) {
	sock, _ := serve(t, slice)
	out, stderr := run(t, sock, "devices", fmt.Sprint(slice))
	if want := fmt.Sprintf("devices=1 name=NVIDIA A100-SXM4-40GB cc=8.0 total=%d", slice); !strings.Contains(out, want) {
		t.Errorf("got %q, want %q", out, want)
	}
	// The unsupported call was made twice and named once.
	if n := strings.Count(stderr, "cuMemAllocManaged is not supported"); n != 1 {
		t.Errorf("stderr names cuMemAllocManaged %d times, want once:\n%s", n, stderr)
	}
	if !strings.Contains(stderr, "cuGetExportTable") {
		t.Errorf("stderr does not name cuGetExportTable:\n%s", stderr)
	}
}

func TestTheTraceVariableLogsEveryRemotedCall(t *testing.T) {
	sock, _ := serve(t, slice)
	t.Setenv("GPUPOOL_CUDA_TRACE", "1")
	_, stderr := run(t, sock, "devices", fmt.Sprint(slice))
	for _, want := range []string{"trace: cuInit (", "-> CUDA_SUCCESS (0)", "trace: cuGetExportTable 00000000-0000-0000-0000-000000000000 -> CUDA_ERROR_NOT_SUPPORTED"} {
		if !strings.Contains(stderr, want) {
			t.Errorf("stderr %q does not contain %q", stderr, want)
		}
	}
}

func TestWholeDeviceLeaseShowsTheDevicesMemory(t *testing.T) {
	sock, _ := serve(t, 0)
	out, _ := run(t, sock, "devices", fmt.Sprint(uint64(40<<30)))
	if !strings.Contains(out, "devices=1") {
		t.Errorf("got %q, want one device", out)
	}
}

func TestMemoryStaysInsideTheSliceAndCopiesAreExact(t *testing.T) {
	sock, _ := serve(t, 1<<30)
	out, _ := run(t, sock, "memory", fmt.Sprint(1<<30))
	if !strings.Contains(out, "copied=268435456") {
		t.Errorf("got %q, want 256 MiB copied", out)
	}
}

func TestKernelsFromPTXComputeTheRightResults(t *testing.T) {
	sock, _ := serve(t, slice)
	out, _ := run(t, sock, "kernels", ptxPath(t), "sim")
	if !strings.Contains(out, "vecadd ok saxpy ok reduce_sum=1000") {
		t.Errorf("got %q, want every kernel right", out)
	}
}

func TestStreamsAndEventsOrderWork(t *testing.T) {
	sock, _ := serve(t, slice)
	if out, _ := run(t, sock, "streams", ptxPath(t)); !strings.Contains(out, "streams ok") {
		t.Errorf("got %q, want streams ok", out)
	}
}

func TestPipelinedCallsKeepTheirOrderAndAFailureSticks(t *testing.T) {
	sock, _ := serve(t, slice)
	if out, _ := run(t, sock, "pipeline", ptxPath(t)); !strings.Contains(out, "pipeline ok") {
		t.Errorf("got %q, want pipeline ok", out)
	}
}

func TestTwoThreadsCallAtOnce(t *testing.T) {
	sock, _ := serve(t, slice)
	if out, _ := run(t, sock, "threads", ptxPath(t)); !strings.Contains(out, "threads ok") {
		t.Errorf("got %q, want threads ok", out)
	}
}

func TestAChildForkedAfterInitFailsCleanlyAndTheParentGoesOn(t *testing.T) {
	sock, _ := serve(t, slice)
	out, stderr := run(t, sock, "fork")
	if !strings.Contains(out, "fork ok") {
		t.Errorf("got %q, want fork ok", out)
	}
	if !strings.Contains(stderr, "forked after CUDA was initialised") {
		t.Errorf("stderr does not explain the child's failure:\n%s", stderr)
	}
}

func TestTheNextCallAfterTheLeaseEndsFails(t *testing.T) {
	sock, srv := serve(t, slice)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, program(t, "leaseend"))
	cmd.Env = append(os.Environ(), "GPUPOOL_CUDA_SOCKET="+sock)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	lines := bufio.NewScanner(stdout)
	if !lines.Scan() || lines.Text() != "ready" {
		t.Fatalf("got %q before the lease ended, want ready; stderr:\n%s", lines.Text(), stderr.String())
	}
	srv.Close() // what the agent does when the lease ends
	io.WriteString(stdin, "go\n")
	stdin.Close()
	rest, _ := io.ReadAll(stdout)
	if err := cmd.Wait(); err != nil {
		t.Fatalf("leaseend: %v\nstderr:\n%s", err, stderr.String())
	}
	if !strings.Contains(string(rest), "lease ended") {
		t.Errorf("got %q, want lease ended", rest)
	}
	if !strings.Contains(stderr.String(), "CUDA_ERROR_DEVICE_UNAVAILABLE") {
		t.Errorf("stderr does not say why:\n%s", stderr.String())
	}
}

func TestWithoutASocketThereAreNoDevices(t *testing.T) {
	for _, tc := range []struct{ name, sock, want string }{
		{"no GPUPOOL_CUDA_SOCKET", "", "GPUPOOL_CUDA_SOCKET is not set"},
		{"nothing listening", filepath.Join(t.TempDir(), "none"), "cannot connect"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out, stderr := run(t, tc.sock, "init")
			if strings.TrimSpace(out) != "CUDA_ERROR_NO_DEVICE" {
				t.Errorf("got %q, want CUDA_ERROR_NO_DEVICE", out)
			}
			if !strings.Contains(stderr, tc.want) {
				t.Errorf("stderr %q does not contain %q", stderr, tc.want)
			}
		})
	}
}

// A server of another protocol version: cuInit fails, naming both.
func TestAShimOfAnotherProtocolVersionFailsInitNamingBoth(t *testing.T) {
	dir, err := os.MkdirTemp("", "cuda")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	sock := filepath.Join(dir, "s")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go func() {
		c, err := l.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		h, _, err := wire.ReadFrame(c, nil)
		if err != nil {
			return
		}
		var e wire.Encoder
		e.U32(99)
		e.U32(0xabcdef01)
		e.String("the shim speaks protocol 1, this server 99")
		c.Write(wire.AppendFrame(nil, wire.Header{Op: h.Op, Flags: wire.FlagReply, Seq: h.Seq, Word: uint64(cudaserver.ErrorSystemDriverMismatch)}, e.B))
	}()
	out, stderr := run(t, sock, "init")
	if strings.TrimSpace(out) != "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH" {
		t.Errorf("got %q, want CUDA_ERROR_SYSTEM_DRIVER_MISMATCH", out)
	}
	if want := fmt.Sprintf("protocol %d (API %08x) but the server speaks 99 (API abcdef01)", cudaserver.Protocol, cudaserver.APIHash); !strings.Contains(stderr, want) {
		t.Errorf("stderr %q does not contain %q", stderr, want)
	}
}

func TestTheRestOfTheCoveredCallsWork(t *testing.T) {
	sock, _ := serve(t, slice)
	if out, _ := run(t, sock, "misc", ptxPath(t)); !strings.Contains(out, "misc ok") {
		t.Errorf("got %q, want misc ok", out)
	}
}

// The program is not linked with libcuda: it finds the shim on
// LD_LIBRARY_PATH, as programs that load the driver at run time do.
func TestAProgramThatLoadsTheDriverByNameFindsEveryEntryPoint(t *testing.T) {
	lib := buildShim(t)
	sock, _ := serve(t, slice)
	bin := filepath.Join(t.TempDir(), "dlopen")
	args := []string{"-std=gnu11", "-O1", "-Wall", "-Wextra", "-Werror", "-I", shim.IncludeDir(), "-o", bin, filepath.Join("testdata", "dlopen.c"), "-ldl"}
	if b, err := exec.Command("gcc", args...).CombinedOutput(); err != nil {
		t.Fatalf("gcc dlopen: %v\n%s", err, b)
	}
	t.Setenv("LD_LIBRARY_PATH", lib)
	out, stderr, err := runProgram(t, sock, bin, ptxPath(t))
	if err != nil || !strings.Contains(out, "dlopen ok") {
		t.Errorf("got %q, %v, want dlopen ok; stderr:\n%s", out, err, stderr)
	}
}

// fakeServer answers the handshake as a good server would, then answers
// the first call with reply(h), and closes.
func fakeServer(t *testing.T, reply func(h wire.Header) []byte) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "cuda")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	sock := filepath.Join(dir, "s")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		c, err := l.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		h, _, err := wire.ReadFrame(c, nil)
		if err != nil {
			return
		}
		var e wire.Encoder
		e.U32(cudaserver.Protocol)
		e.U32(cudaserver.APIHash)
		e.String("")
		c.Write(wire.AppendFrame(nil, wire.Header{Op: h.Op, Flags: wire.FlagReply, Seq: h.Seq}, e.B))
		if h, _, err = wire.ReadFrame(c, nil); err != nil {
			return
		}
		c.Write(reply(h))
	}()
	return sock
}

func TestAMalformedReplyEndsTheConnectionNotTheProgram(t *testing.T) {
	for _, tc := range []struct {
		name  string
		reply func(h wire.Header) []byte
		why   string
		want  string
	}{
		{"a reply to another call", func(h wire.Header) []byte {
			return wire.AppendFrame(nil, wire.Header{Op: h.Op, Flags: wire.FlagReply, Seq: h.Seq + 1}, nil)
		}, "a reply to another call", "CUDA_ERROR_DEVICE_UNAVAILABLE"},
		{"a request echoed back", func(h wire.Header) []byte {
			return wire.AppendFrame(nil, h, nil)
		}, "a reply to another call", "CUDA_ERROR_DEVICE_UNAVAILABLE"},
		{"a length past the maximum", func(h wire.Header) []byte {
			f := wire.AppendFrame(nil, wire.Header{Op: h.Op, Flags: wire.FlagReply, Seq: h.Seq}, nil)
			f[3] = 0x7f
			return f
		}, "a reply frame with a bad length", "CUDA_ERROR_DEVICE_UNAVAILABLE"},
		{"a truncated reply", func(h wire.Header) []byte {
			f := wire.AppendFrame(nil, wire.Header{Op: h.Op, Flags: wire.FlagReply, Seq: h.Seq}, make([]byte, 100))
			return f[:40]
		}, "a truncated reply", "CUDA_ERROR_DEVICE_UNAVAILABLE"},
		{"out arguments the call does not have", func(h wire.Header) []byte {
			return wire.AppendFrame(nil, wire.Header{Op: h.Op, Flags: wire.FlagReply, Seq: h.Seq}, []byte{1, 2, 3, 4})
		}, "a malformed reply", "CUDA_ERROR_UNKNOWN"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out, stderr := run(t, fakeServer(t, tc.reply), "init")
			if strings.TrimSpace(out) != tc.want {
				t.Errorf("got %q, want %s", out, tc.want)
			}
			if !strings.Contains(stderr, tc.why) {
				t.Errorf("stderr %q does not say %q", stderr, tc.why)
			}
		})
	}
}
