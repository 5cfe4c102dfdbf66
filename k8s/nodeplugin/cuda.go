package nodeplugin

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"runtime"

	"github.com/gpupool/gpupool/cuda/proxy"
	"github.com/gpupool/gpupool/dataplane"
)

// Remote CUDA in a claim's containers. When the node plugin has the CUDA
// shim (Config.CUDAShim), every claim's CDI device also
//
//   - bind-mounts the shim read-only as libcuda.so.1 into the directories
//     the dynamic loader searches by default (ShimContainerPaths), so an
//     unmodified program in any image finds it with no LD_LIBRARY_PATH;
//   - sets EnvCUDASocket to ContainerCUDASocket, in the claim's directory
//     the spec already mounts at ContainerDir.
//
// The socket is served by the node plugin itself: a per-claim proxy that
// carries each connection of the shim over the data plane to the CUDA
// server of the claim's first lease, with the lease's current token. The
// node plugin already holds and renews that token; no process in the pod
// needs it, and nothing runs in the pod besides the program.
const (
	EnvCUDASocket       = "GPUPOOL_CUDA_SOCKET"
	cudaSocketName      = "cuda.sock"
	ContainerCUDASocket = ContainerDir + "/" + cudaSocketName
	shimName            = "libcuda.so.1"
)

// ShimContainerPaths are where a claim's containers see the shim: the
// default library directories of glibc on Debian and Ubuntu (multiarch),
// of the Red Hat and SUSE families, and of musl and the rest.
func ShimContainerPaths() []string {
	paths := []string{"/usr/lib64/" + shimName, "/usr/lib/" + shimName}
	if triplet := multiarch[runtime.GOARCH]; triplet != "" {
		paths = append([]string{"/usr/lib/" + triplet + "/" + shimName}, paths...)
	}
	return paths
}

var multiarch = map[string]string{"amd64": "x86_64-linux-gnu", "arm64": "aarch64-linux-gnu", "ppc64le": "powerpc64le-linux-gnu"}

// installShim copies the shim at src to StateDir/lib/libcuda.so.1, a path
// on the node the container runtime can mount (src may be inside the
// plugin's own image), and returns that path.
func installShim(src, stateDir string) (string, error) {
	if src == "" {
		return "", nil
	}
	in, err := os.Open(src)
	if err != nil {
		return "", fmt.Errorf("CUDA shim: %w", err)
	}
	defer in.Close()
	if st, err := in.Stat(); err != nil || !st.Mode().IsRegular() {
		return "", fmt.Errorf("CUDA shim %s: not a regular file", src)
	}
	dir := filepath.Join(stateDir, "lib")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", fmt.Errorf("CUDA shim: %w", err)
	}
	tmp, err := os.CreateTemp(dir, "."+shimName+"-*")
	if err != nil {
		return "", fmt.Errorf("CUDA shim: %w", err)
	}
	defer os.Remove(tmp.Name())
	if _, err := io.Copy(tmp, in); err != nil {
		tmp.Close()
		return "", fmt.Errorf("CUDA shim: %w", err)
	}
	if err := tmp.Chmod(0o755); err != nil {
		tmp.Close()
		return "", fmt.Errorf("CUDA shim: %w", err)
	}
	if err := tmp.Close(); err != nil {
		return "", fmt.Errorf("CUDA shim: %w", err)
	}
	dst := filepath.Join(dir, shimName)
	if err := os.Rename(tmp.Name(), dst); err != nil {
		return "", fmt.Errorf("CUDA shim: %w", err)
	}
	return dst, nil
}

// cudaProxy is a claim's CUDA socket: it carries each connection to the
// CUDA server of the claim's first lease, on that lease's first host.
type cudaProxy struct {
	px   *proxy.Proxy
	stop context.CancelFunc
	done chan struct{}
}

// startCUDAProxy serves dir/cuda.sock for lease l until stopCUDA.
func startCUDAProxy(ctx context.Context, dir string, l *followedLease, log *slog.Logger) (*cudaProxy, error) {
	path := filepath.Join(dir, cudaSocketName)
	_ = os.Remove(path) // a previous run's
	px, err := proxy.Listen(path, func(ctx context.Context, local net.Conn) error {
		return carryCUDA(ctx, l, local)
	})
	if err != nil {
		return nil, err
	}
	// The container's user, whoever it is, connects.
	if err := os.Chmod(path, 0o666); err != nil {
		px.Close()
		return nil, err
	}
	px.OnError = func(err error) { log.Warn("a CUDA connection of the claim ended", "lease", l.id, "err", err) }
	ctx, cancel := context.WithCancel(ctx)
	c := &cudaProxy{px: px, stop: cancel, done: make(chan struct{})}
	go func() {
		defer close(c.done)
		_ = px.Serve(ctx)
	}()
	return c, nil
}

// carryCUDA carries one connection of the shim with l's current token.
func carryCUDA(ctx context.Context, l *followedLease, local net.Conn) error {
	l.mu.Lock()
	ended := l.ended
	var addr, pin, token string
	if len(l.tokens) > 0 {
		t := l.tokens[0]
		addr, pin, token = t.GetAddress(), t.GetCertSha256(), t.GetToken()
	}
	l.mu.Unlock()
	switch {
	case ended != nil:
		local.Close()
		return fmt.Errorf("lease %s: %w", l.id, ended)
	case addr == "":
		local.Close()
		return errors.New("lease " + l.id + ": its host has no data-plane address")
	}
	conn, err := dataplane.Dial(ctx, addr, pin)
	if err != nil {
		local.Close()
		return err
	}
	defer conn.Close()
	return conn.Cuda(ctx, token, local)
}

// close stops accepting, ends the connections being carried and removes
// the socket.
func (c *cudaProxy) close() {
	if c == nil {
		return
	}
	c.stop()
	<-c.done
	c.px.Close()
}
