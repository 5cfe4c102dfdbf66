package broker

import (
	"io"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// callerSide is the caller's stream as a follower serves it: Recv returns
// recvErr after the messages in msgs.
type callerSide struct {
	grpc.ServerStream
	msgs    chan *int
	recvErr error
}

func (c *callerSide) Recv() (*int, error) {
	if m, ok := <-c.msgs; ok {
		return m, nil
	}
	return nil, c.recvErr
}
func (c *callerSide) Send(*int) error { return nil }

// leaderSide is the follower's stream to the leader: it ends (EOF) once
// the follower closes its send direction, as a leader's handler does when
// its requests end.
type leaderSide struct {
	grpc.ClientStream
	closed chan struct{}
}

func (l *leaderSide) Send(*int) error { return nil }
func (l *leaderSide) Recv() (*int, error) {
	<-l.closed
	return nil, io.EOF
}
func (l *leaderSide) CloseSend() error { close(l.closed); return nil }

func TestAFollowerPassesTheCallersStreamErrorThroughUnchanged(t *testing.T) {
	tests := []struct {
		name     string
		recvErr  error
		wantCode codes.Code
	}{
		{"a revoked token", status.Error(codes.PermissionDenied, "token t-1 was revoked"), codes.PermissionDenied},
		{"an unauthenticated caller", status.Error(codes.Unauthenticated, "no ACL token"), codes.Unauthenticated},
		{"the caller closing its side", io.EOF, codes.OK},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			for range 50 { // the leader's EOF races the caller's error
				in := &callerSide{msgs: make(chan *int, 1), recvErr: tt.recvErr}
				one := 1
				in.msgs <- &one
				close(in.msgs)
				err := proxyBidi[int, int](in, &leaderSide{closed: make(chan struct{})})
				if status.Code(err) != tt.wantCode || (tt.wantCode != codes.OK && err.Error() != tt.recvErr.Error()) {
					t.Fatalf("got %v, want %v", err, tt.recvErr)
				}
			}
		})
	}
}
