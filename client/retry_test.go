package client_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/gpupool/gpupool/client"
)

// When the deadline passes while a retry is on the wire, the caller hears
// the brokers' last answer (here a full disk), not the interrupted
// attempt's DeadlineExceeded: the error does not depend on where in the
// retry loop the deadline fell.
func TestARetryCutShortByTheDeadlineReturnsTheLastAnswer(t *testing.T) {
	for _, tc := range []struct {
		name string
		// answer is the nth attempt's outcome; ctx is the call's.
		answer func(ctx context.Context, n int) error
		want   codes.Code
		says   string
	}{
		{"the deadline falls during the second attempt", func(ctx context.Context, n int) error {
			if n == 1 {
				return status.Error(codes.Unavailable, "broker data dir /d: disk full")
			}
			<-ctx.Done()
			return status.FromContextError(ctx.Err()).Err()
		}, codes.Unavailable, "disk full"},
		{"the first attempt runs out the deadline: nothing to report but that", func(ctx context.Context, n int) error {
			<-ctx.Done()
			return status.FromContextError(ctx.Err()).Err()
		}, codes.DeadlineExceeded, "deadline"},
		{"another answer after an Unavailable one is returned as it is", func(ctx context.Context, n int) error {
			if n == 1 {
				return status.Error(codes.Unavailable, "no leader")
			}
			return status.Error(codes.ResourceExhausted, "no GPU fits")
		}, codes.ResourceExhausted, "no GPU fits"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
			defer cancel()
			n := 0
			invoker := func(ctx context.Context, _ string, _, _ any, _ *grpc.ClientConn, _ ...grpc.CallOption) error {
				n++
				return tc.answer(ctx, n)
			}
			err := client.RetryUnavailable(ctx, "/m", nil, nil, nil, invoker)
			if status.Code(err) != tc.want || !strings.Contains(err.Error(), tc.says) {
				t.Fatalf("got %v after %d attempts, want %s saying %q", err, n, tc.want, tc.says)
			}
		})
	}
}
