package proxy

import (
	"context"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestListenRefusesBadInput(t *testing.T) {
	echo := func(ctx context.Context, c net.Conn) error { return c.Close() }
	for _, tc := range []struct {
		name  string
		path  string
		carry Carrier
		want  string
	}{
		{"no carrier", filepath.Join(t.TempDir(), "s"), nil, "carry: required"},
		{"a path in no directory", filepath.Join(t.TempDir(), "none", "s"), echo, "listening on"},
		{"a path too long for a unix socket", filepath.Join(t.TempDir(), strings.Repeat("x", 120)), echo, "listening on"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := Listen(tc.path, tc.carry); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("got %v, want an error containing %q", err, tc.want)
			}
		})
	}
}

func TestEachConnectionIsCarriedAndTheSocketIsPrivate(t *testing.T) {
	dir, err := os.MkdirTemp("", "proxy")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	// The carrier echoes what it receives, as a server would answer.
	p, err := Listen(filepath.Join(dir, "s"), func(ctx context.Context, c net.Conn) error {
		defer c.Close()
		_, err := io.Copy(c, c)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(p.Path()); err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("socket mode: got %v (%v), want 0600", fi.Mode().Perm(), err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- p.Serve(ctx) }()
	for i := range 2 {
		c, err := net.Dial("unix", p.Path())
		if err != nil {
			t.Fatal(err)
		}
		msg := []byte("call " + string(rune('a'+i)))
		c.Write(msg)
		c.(*net.UnixConn).CloseWrite()
		got, _ := io.ReadAll(c)
		c.Close()
		if string(got) != string(msg) {
			t.Errorf("connection %d: got %q, want %q", i, got, msg)
		}
	}
	cancel()
	if err := <-served; err != nil {
		t.Errorf("Serve: got %v, want nil after its context ended", err)
	}
	p.Close()
	if _, err := os.Stat(p.Path()); !os.IsNotExist(err) {
		t.Errorf("the socket is still there after Close: %v", err)
	}
}

func TestWithEnvPutsTheShimFirstAndTheSocketOnce(t *testing.T) {
	for _, tc := range []struct {
		name string
		env  []string
		want []string
	}{
		{"no library path", []string{"HOME=/h"}, []string{"HOME=/h", "GPUPOOL_CUDA_SOCKET=/s", "LD_LIBRARY_PATH=/lib"}},
		{"an empty library path", []string{"LD_LIBRARY_PATH="}, []string{"GPUPOOL_CUDA_SOCKET=/s", "LD_LIBRARY_PATH=/lib"}},
		{"a library path", []string{"LD_LIBRARY_PATH=/a:/b"}, []string{"GPUPOOL_CUDA_SOCKET=/s", "LD_LIBRARY_PATH=/lib:/a:/b"}},
		{"a socket already set", []string{"GPUPOOL_CUDA_SOCKET=/old"}, []string{"GPUPOOL_CUDA_SOCKET=/s", "LD_LIBRARY_PATH=/lib"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := withEnv(tc.env, "GPUPOOL_CUDA_SOCKET", "/s", "LD_LIBRARY_PATH", "/lib")
			if strings.Join(got, " ") != strings.Join(tc.want, " ") {
				t.Errorf("got %v, want %v", got, tc.want)
			}
		})
	}
}

func TestCloseRemovesOnlyTheSocketItMade(t *testing.T) {
	echo := func(ctx context.Context, c net.Conn) error { return c.Close() }
	for _, tc := range []struct {
		name     string
		takeover func(t *testing.T, path string) func() // what replaces the path; returns its cleanup
		wantGone bool
	}{
		{"still ours", func(*testing.T, string) func() { return func() {} }, true},
		{"a newer proxy listens there now", func(t *testing.T, path string) func() {
			// As a newer instance does: remove the old socket, listen anew.
			if err := os.Remove(path); err != nil {
				t.Fatal(err)
			}
			newer, err := Listen(path, echo)
			if err != nil {
				t.Fatal(err)
			}
			return func() { newer.Close() }
		}, false},
		{"a file replaced it", func(t *testing.T, path string) func() {
			if err := os.Remove(path); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(path, []byte("someone else's"), 0o600); err != nil {
				t.Fatal(err)
			}
			return func() {}
		}, false},
		{"it is gone", func(t *testing.T, path string) func() {
			if err := os.Remove(path); err != nil {
				t.Fatal(err)
			}
			return func() {}
		}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir, err := os.MkdirTemp("", "proxy")
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { os.RemoveAll(dir) })
			path := filepath.Join(dir, "s")
			old, err := Listen(path, echo)
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			served := make(chan error, 1)
			go func() { served <- old.Serve(ctx) }()
			cleanup := tc.takeover(t, path)
			t.Cleanup(cleanup)
			before, _ := os.Lstat(path)
			// The old instance stops: its Serve ends, then Close.
			cancel()
			if err := <-served; err != nil {
				t.Errorf("Serve: %v", err)
			}
			old.Close()
			after, err := os.Lstat(path)
			if tc.wantGone {
				if !os.IsNotExist(err) {
					t.Errorf("the path after Close: %v, want it gone", err)
				}
				return
			}
			if err != nil || !os.SameFile(before, after) {
				t.Fatalf("the path after the old proxy's Close: %v, want the newer file left alone", err)
			}
		})
	}
}
