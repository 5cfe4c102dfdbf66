package proxy

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
)

// Attach runs cmd with its CUDA calls carried by carry: it serves a proxy
// on a unix socket in a private temporary directory, runs cmd with
// GPUPOOL_CUDA_SOCKET naming it and libDir (where libcuda.so.1, the shim,
// is) first on LD_LIBRARY_PATH, sends cmd every signal that arrives on
// signals (which may be nil), and stops the proxy when cmd ends. It
// returns the error of cmd's Start or Wait. This is the core of `gpupool
// attach`.
func Attach(ctx context.Context, carry Carrier, libDir string, cmd *exec.Cmd, signals <-chan os.Signal) error {
	if _, err := os.Stat(filepath.Join(libDir, "libcuda.so.1")); err != nil {
		return fmt.Errorf("proxy: the CUDA shim: %w (make build puts it in bin/lib)", err)
	}
	dir, err := os.MkdirTemp("", "gpupool-cuda-")
	if err != nil {
		return fmt.Errorf("proxy: %w", err)
	}
	defer os.RemoveAll(dir)
	p, err := Listen(filepath.Join(dir, "cuda.sock"), carry)
	if err != nil {
		return err
	}
	defer p.Close()
	ctx, cancel := context.WithCancel(ctx)
	served := make(chan error, 1)
	go func() { served <- p.Serve(ctx) }()
	defer func() { cancel(); <-served }()

	env := cmd.Env
	if env == nil {
		env = os.Environ()
	}
	cmd.Env = withEnv(env, "GPUPOOL_CUDA_SOCKET", p.Path(), "LD_LIBRARY_PATH", libDir)
	if err := cmd.Start(); err != nil {
		return err
	}
	exited := make(chan struct{})
	go func() {
		for {
			select {
			case s := <-signals:
				cmd.Process.Signal(s)
			case <-exited:
				return
			}
		}
	}()
	err = cmd.Wait()
	close(exited)
	return err
}

// withEnv sets GPUPOOL_CUDA_SOCKET and puts libDir first on
// LD_LIBRARY_PATH in env.
func withEnv(env []string, sockKey, sock, pathKey, libDir string) []string {
	out := make([]string, 0, len(env)+2)
	path := libDir
	for _, kv := range env {
		k, v, _ := strings.Cut(kv, "=")
		switch k {
		case sockKey:
			continue
		case pathKey:
			if v != "" {
				path = libDir + ":" + v
			}
			continue
		}
		out = append(out, kv)
	}
	return append(out, sockKey+"="+sock, pathKey+"="+path)
}

// DialUnix is a Carrier to a CUDA server on this machine's unix socket at
// path (cuda/simserver, tests): it splices each connection to it.
func DialUnix(path string) Carrier {
	return func(ctx context.Context, local net.Conn) error {
		defer local.Close()
		var d net.Dialer
		remote, err := d.DialContext(ctx, "unix", path)
		if err != nil {
			return fmt.Errorf("proxy: the CUDA server at %s: %w", path, err)
		}
		defer remote.Close()
		stop := context.AfterFunc(ctx, func() { local.Close(); remote.Close() })
		defer stop()
		var wg sync.WaitGroup
		var errs [2]error
		pipe := func(i int, dst, src net.Conn) {
			_, errs[i] = io.Copy(dst, src)
			if cw, ok := dst.(interface{ CloseWrite() error }); ok {
				cw.CloseWrite()
			}
		}
		wg.Go(func() { pipe(0, remote, local) })
		wg.Go(func() { pipe(1, local, remote) })
		wg.Wait()
		if err := errors.Join(errs[0], errs[1]); err != nil && ctx.Err() == nil && !errors.Is(err, net.ErrClosed) {
			return err
		}
		return nil
	}
}
