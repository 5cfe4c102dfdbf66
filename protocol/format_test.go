package protocol

import (
	"testing"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

func TestActorsAndTokenKindsReadAsTheCLIShowsThem(t *testing.T) {
	for _, tc := range []struct {
		name string
		got  string
		want string
	}{
		{"no actor recorded", ActorText(nil), "unknown"},
		{"the broker itself", ActorText(&gpupoolv1.Actor{Name: "broker"}), "broker"},
		{"a token", ActorText(&gpupoolv1.Actor{Name: "ci", AccessorId: "a-1"}), "ci (a-1)"},
		{"a management token", TokenKindName(gpupoolv1.TokenKind_TOKEN_KIND_MANAGEMENT), "management"},
		{"a client token", TokenKindName(gpupoolv1.TokenKind_TOKEN_KIND_CLIENT), "client"},
	} {
		if tc.got != tc.want {
			t.Errorf("%s: got %q, want %q", tc.name, tc.got, tc.want)
		}
	}
}
