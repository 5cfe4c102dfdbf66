package protocol_test

import (
	"strings"
	"testing"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
	"github.com/gpupool/gpupool/protocol"
)

func TestEnumLabelsAreTheNamesPeopleType(t *testing.T) {
	cases := []struct {
		name string
		got  string
		want string
	}{
		{"a state loses its prefix and is lower case", protocol.EnumLabel(gpupoolv1.LeaseState_LEASE_STATE_GRANTED), "granted"},
		{"an underscore becomes a dash", protocol.EnumLabel(gpupoolv1.Topology_TOPOLOGY_SAME_HOST), "same-host"},
		{"the zero value is a dash", protocol.EnumLabel(gpupoolv1.LeaseState_LEASE_STATE_UNSPECIFIED), "-"},
		{"an undeclared value is its number", protocol.EnumLabel(gpupoolv1.LeaseState(999)), "999"},
		{"a name is spelled like its value", protocol.EnumNameLabel(gpupoolv1.LeaseState(0).Descriptor(), "LEASE_STATE_EXPIRED"), "expired"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if tc.got != tc.want {
				t.Errorf("got %q, want %q", tc.got, tc.want)
			}
		})
	}
	if got := strings.Join(protocol.EnumLabels[gpupoolv1.Topology](), ","); !strings.Contains(got, "same-host") || strings.Contains(got, "unspecified") {
		t.Errorf("EnumLabels[Topology] = %s, want every label but the zero one", got)
	}
}

func TestParseEnumLabelTakesOnlyALabel(t *testing.T) {
	cases := []struct {
		name string
		in   string
		want gpupoolv1.Topology
		ok   bool
	}{
		{"a label", "same-host", gpupoolv1.Topology_TOPOLOGY_SAME_HOST, true},
		{"upper case and underscores", " SAME_HOST ", gpupoolv1.Topology_TOPOLOGY_SAME_HOST, true},
		{"the zero value is not a label", "unspecified", 0, false},
		{"the full value name is not a label", "TOPOLOGY_SAME_HOST", 0, false},
		{"an empty string", "", 0, false},
		{"a word the enum does not have", "same-rack", 0, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, ok := protocol.ParseEnumLabel[gpupoolv1.Topology](tc.in)
			if got != tc.want || ok != tc.ok {
				t.Errorf("ParseEnumLabel(%q) = %v, %t; want %v, %t", tc.in, got, ok, tc.want, tc.ok)
			}
		})
	}
}
