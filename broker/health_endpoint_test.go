package broker

import (
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

func TestClearDeviceHealthRefusesBadInput(t *testing.T) {
	ts := startServer(t)
	for _, tc := range []struct {
		name     string
		req      *gpupoolv1.ClearDeviceHealthRequest
		wantCode codes.Code
		wantMsg  string
	}{
		{"no host", &gpupoolv1.ClearDeviceHealthRequest{Device: "0"}, codes.InvalidArgument, "host_id: is required"},
		{"no device", &gpupoolv1.ClearDeviceHealthRequest{HostId: "h1"}, codes.InvalidArgument, "device: is required"},
		{"an unknown host", &gpupoolv1.ClearDeviceHealthRequest{HostId: "h9", Device: "0"}, codes.NotFound, `host "h9": not found`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := ts.c.Pool.ClearDeviceHealth(ctx(t), tc.req)
			if status.Code(err) != tc.wantCode || !strings.Contains(err.Error(), tc.wantMsg) {
				t.Fatalf("got %v, want %v %q", err, tc.wantCode, tc.wantMsg)
			}
		})
	}
}
