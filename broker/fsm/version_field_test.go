package fsm

import (
	"testing"

	"google.golang.org/protobuf/proto"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

func TestFieldVersion(t *testing.T) {
	for _, tc := range []struct {
		name string
		cmd  proto.Message
		want uint32
	}{
		{"a token revocation that keeps the leases needs version 1", &gpupoolv1.RevokeAclTokenCommand{AccessorId: "a"}, 1},
		{"a token revocation that revokes the leases needs version 2", &gpupoolv1.RevokeAclTokenCommand{AccessorId: "a", RevokeLeases: true}, 2},
		{"a command without new fields needs version 1", &gpupoolv1.SetQuotaCommand{}, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := FieldVersion(tc.cmd); got != tc.want {
				t.Errorf("got %d, want %d", got, tc.want)
			}
		})
	}
}
