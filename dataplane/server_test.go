package dataplane

import (
	"bytes"
	"errors"
	"io"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

func TestRevokeEndsEveryStreamOfTheLeaseAndOnlyThose(t *testing.T) {
	a := newTestAgent(t)
	c := a.dial(t)
	results := make(chan error, 3)

	// An exec, a forward and a usage stream of the lease, each up and
	// running before the revocation.
	execOut := newWatchWriter("ready")
	go func() {
		_, err := c.Exec(t.Context(), testToken, &gpupoolv1.ExecStart{
			Argv: []string{"sh", "-c", "echo ready; exec sleep 1000"},
		}, ExecIO{Stdout: execOut})
		results <- err
	}()
	<-a.leases.started
	<-execOut.seen

	user, local := tcpPair(t)
	go func() { results <- c.Forward(t.Context(), testToken, echoServer(t), local) }()
	user.Write([]byte("x"))
	if _, err := io.ReadFull(user, make([]byte, 1)); err != nil {
		t.Fatal(err)
	}

	sampled := make(chan struct{}, 1)
	go func() {
		results <- c.Usage(t.Context(), testToken, 0, func(*gpupoolv1.LeaseUsage) {
			select {
			case sampled <- struct{}{}:
			default:
			}
		})
	}()
	<-sampled

	// A process of another lease, which must go on.
	stdinR, stdinW := io.Pipe()
	var otherOut bytes.Buffer
	otherDone := make(chan error, 1)
	go func() {
		_, err := c.Exec(t.Context(), otherToken, &gpupoolv1.ExecStart{Argv: []string{"cat"}}, ExecIO{Stdin: stdinR, Stdout: &otherOut})
		otherDone <- err
	}()
	<-a.leases.started

	a.leases.end(testLease)
	a.srv.Revoke(testLease)
	for range 3 {
		if err := <-results; !errors.Is(err, ErrLeaseEnded) {
			t.Errorf("got %v, want ErrLeaseEnded", err)
		}
	}

	stdinW.Write([]byte("still here"))
	stdinW.Close()
	if err := <-otherDone; err != nil {
		t.Fatalf("the other lease's exec: %v", err)
	}
	if otherOut.String() != "still here" {
		t.Fatalf("got %q from the other lease's exec, want %q", otherOut.String(), "still here")
	}
}

func TestRefusedErrorMapsToGRPCCodes(t *testing.T) {
	tests := []struct {
		code gpupoolv1.AcceptCode
		want codes.Code
	}{
		{gpupoolv1.AcceptCode_ACCEPT_CODE_UNAUTHENTICATED, codes.Unauthenticated},
		{gpupoolv1.AcceptCode_ACCEPT_CODE_PERMISSION_DENIED, codes.PermissionDenied},
		{gpupoolv1.AcceptCode_ACCEPT_CODE_INVALID_ARGUMENT, codes.InvalidArgument},
		{gpupoolv1.AcceptCode_ACCEPT_CODE_NOT_FOUND, codes.NotFound},
		{gpupoolv1.AcceptCode_ACCEPT_CODE_INTERNAL, codes.Internal},
	}
	for _, tt := range tests {
		t.Run(tt.code.String(), func(t *testing.T) {
			err := error(&RefusedError{Code: tt.code, Message: "why"})
			if got := status.Code(err); got != tt.want {
				t.Fatalf("got %v, want %v", got, tt.want)
			}
		})
	}
}

func TestAStreamWithoutAnOperationIsRefused(t *testing.T) {
	a := newTestAgent(t)
	c := a.dial(t)
	cs := rawStream(t, c)
	if err := cs.send(&gpupoolv1.StreamOpen{Token: testToken}); err != nil {
		t.Fatal(err)
	}
	acc := readAccept(t, cs)
	wantRefused(t, &RefusedError{Code: acc.Code, Message: acc.Error}, gpupoolv1.AcceptCode_ACCEPT_CODE_INVALID_ARGUMENT, "op: must be one of exec, put, get, forward, usage")
}

func TestNewServerNamesTheMissingField(t *testing.T) {
	tests := []struct {
		name string
		cfg  ServerConfig
		want string
	}{
		{"no authorizer", ServerConfig{Leases: &fakeLeases{}}, "ServerConfig.Auth: must be set"},
		{"no leases", ServerConfig{Auth: &fakeAuth{}}, "ServerConfig.Leases: must be set"},
		{"no certificate", ServerConfig{Auth: &fakeAuth{}, Leases: &fakeLeases{}}, "ServerConfig.Cert: must hold a certificate"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := NewServer(tt.cfg)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("got %v, want an error with %q", err, tt.want)
			}
		})
	}
}
