package dataplane

import (
	"context"
	"errors"
	"io"
	"net"
	"testing"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// echoServer listens on the loopback and echoes each connection until its
// client half-closes, then half-closes too. It returns its port.
func echoServer(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				io.Copy(c, c)
				c.(*net.TCPConn).CloseWrite()
			}()
		}
	}()
	return ln.Addr().(*net.TCPAddr).Port
}

// tcpPair is two ends of a loopback TCP connection.
func tcpPair(t *testing.T) (user, local *net.TCPConn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, _ := ln.Accept()
		accepted <- c
	}()
	u, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	l := <-accepted
	if l == nil {
		t.Fatal("accept failed")
	}
	t.Cleanup(func() { u.Close(); l.Close() })
	return u.(*net.TCPConn), l.(*net.TCPConn)
}

func TestForwardCarriesBytesBothWaysAndHalfCloses(t *testing.T) {
	a := newTestAgent(t)
	c := a.dial(t)
	port := echoServer(t)
	user, local := tcpPair(t)
	done := make(chan error, 1)
	go func() { done <- c.Forward(t.Context(), testToken, port, local) }()

	// Several round trips, then a half-close: the echo server sees the
	// end of data only if the half-close crosses the stream.
	for _, msg := range []string{"hello", "world, a little longer"} {
		if _, err := user.Write([]byte(msg)); err != nil {
			t.Fatal(err)
		}
		got := make([]byte, len(msg))
		if _, err := io.ReadFull(user, got); err != nil {
			t.Fatal(err)
		}
		if string(got) != msg {
			t.Fatalf("got %q back, want %q", got, msg)
		}
	}
	if _, err := user.Write([]byte("last")); err != nil {
		t.Fatal(err)
	}
	if err := user.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	rest, err := io.ReadAll(user)
	if err != nil {
		t.Fatal(err)
	}
	if string(rest) != "last" {
		t.Fatalf("got %q before the end, want %q", rest, "last")
	}
	if err := <-done; err != nil {
		t.Fatalf("Forward: %v", err)
	}
}

func TestForwardRefusals(t *testing.T) {
	a := newTestAgent(t)
	c := a.dial(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closedPort := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	tests := []struct {
		name string
		port int
		code gpupoolv1.AcceptCode
		msg  string
	}{
		{"a port nothing listens on", closedPort, gpupoolv1.AcceptCode_ACCEPT_CODE_NOT_FOUND, "nothing accepts connections"},
		{"port 0", 0, gpupoolv1.AcceptCode_ACCEPT_CODE_INVALID_ARGUMENT, "port 0: must be between 1 and 65535"},
		{"a port beyond 65535", 70000, gpupoolv1.AcceptCode_ACCEPT_CODE_INVALID_ARGUMENT, "must be between 1 and 65535"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, local := tcpPair(t)
			err := c.Forward(t.Context(), testToken, tt.port, local)
			wantRefused(t, err, tt.code, tt.msg)
		})
	}
}

func TestForwardEndsWhenItsContextDoes(t *testing.T) {
	a := newTestAgent(t)
	c := a.dial(t)
	port := echoServer(t)
	user, local := tcpPair(t)
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- c.Forward(ctx, testToken, port, local) }()
	// One round trip: the forward is up.
	user.Write([]byte("x"))
	io.ReadFull(user, make([]byte, 1))
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("got %v, want context.Canceled", err)
	}
	if _, err := io.ReadAll(user); err != nil {
		t.Logf("the user's connection ended with %v", err)
	}
}
