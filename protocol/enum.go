package protocol

import (
	"strconv"
	"strings"

	"google.golang.org/protobuf/reflect/protoreflect"
)

// Enum is a generated protobuf enum type.
type Enum interface {
	~int32
	Descriptor() protoreflect.EnumDescriptor
}

// EnumLabel is the name people read and type for an enum value, the one
// spelling the CLI, the SDK and the Kubernetes driver use:
// LEASE_STATE_GRANTED is "granted", TOPOLOGY_SAME_PCIE_ROOT is
// "same-pcie-root". The zero (unspecified) value is "-", a value the
// enum does not declare its number.
func EnumLabel[T Enum](v T) string {
	if v == 0 {
		return "-"
	}
	d := v.Descriptor()
	ev := d.Values().ByNumber(protoreflect.EnumNumber(v))
	if ev == nil {
		return strconv.Itoa(int(v))
	}
	return EnumNameLabel(d, string(ev.Name()))
}

// EnumNameLabel is the label of the value of d named name, as EnumLabel
// spells it: the prefix the enum's names share cut off, lower case, - for
// _.
func EnumNameLabel(d protoreflect.EnumDescriptor, name string) string {
	prefix := ""
	if zero := d.Values().ByNumber(0); zero != nil {
		prefix = strings.TrimSuffix(string(zero.Name()), "UNSPECIFIED")
	}
	return strings.ReplaceAll(strings.ToLower(strings.TrimPrefix(name, prefix)), "_", "-")
}

// EnumLabels lists the labels of every value of T but the zero one, in
// declaration order.
func EnumLabels[T Enum]() []string {
	var zero T
	d := zero.Descriptor()
	var out []string
	for i := 0; i < d.Values().Len(); i++ {
		if v := d.Values().Get(i); v.Number() != 0 {
			out = append(out, EnumNameLabel(d, string(v.Name())))
		}
	}
	return out
}

// ParseEnumLabel reads s as one of T's labels (see EnumLabel), ignoring
// case and accepting _ for -; false when it is none of them. The zero
// value is never one.
func ParseEnumLabel[T Enum](s string) (T, bool) {
	var zero T
	d := zero.Descriptor()
	want := strings.ReplaceAll(strings.ToLower(strings.TrimSpace(s)), "_", "-")
	for i := 0; i < d.Values().Len(); i++ {
		v := d.Values().Get(i)
		if v.Number() != 0 && EnumNameLabel(d, string(v.Name())) == want {
			return T(v.Number()), true
		}
	}
	return zero, false
}
