package cudaserver

import (
	"os"
	"reflect"
	"testing"
)

func TestPTXParamLayoutsFollowTheirAlignment(t *testing.T) {
	src, err := os.ReadFile("../../cuda/shimtest/testdata/kernels.ptx")
	if err != nil {
		t.Fatal(err)
	}
	m, r, err := parsePTX(src)
	if err != nil || r != Success {
		t.Fatalf("got %v, %v", r, err)
	}
	for name, want := range map[string][]Param{
		"vecadd":     {{0, 8}, {8, 8}, {16, 8}, {24, 4}},
		"saxpy":      {{0, 4}, {8, 8}, {16, 8}, {24, 4}},
		"reduce_sum": {{0, 8}, {8, 8}, {16, 4}},
	} {
		if got := m.entries[name]; !reflect.DeepEqual(got, want) {
			t.Errorf("%s: got %v, want %v", name, got, want)
		}
	}
	if m.globals["scale_factor"] != 4 || m.version != 70 {
		t.Errorf("got globals %v, version %d; want scale_factor of 4 bytes, version 70", m.globals, m.version)
	}
}

func TestPTXParserRefusesWhatItCannotRead(t *testing.T) {
	for _, tc := range []struct {
		name, src string
		want      Result
	}{
		{"text that is not PTX", "hello", ErrorInvalidImage},
		{"an unknown parameter type", ".version 7.0\n.entry k(.param .q32 a)\n{}", ErrorInvalidPtx},
		{"a parameter without a type", ".version 7.0\n.entry k(.param a)\n{}", ErrorInvalidPtx},
		{"a bad alignment", ".version 7.0\n.entry k(.param .align 3 .b8 a[4])\n{}", ErrorInvalidPtx},
		{"too many parameter bytes", ".version 7.0\n.entry k(" + manyParams(9000) + ")\n{}", ErrorInvalidPtx},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, r, err := parsePTX([]byte(tc.src)); r != tc.want || err == nil {
				t.Errorf("got %v, %v; want %v and an error", r, err, tc.want)
			}
		})
	}
}

func TestPTXAlignedArrayParameters(t *testing.T) {
	m, _, err := parsePTX([]byte(".version 8.0\n.entry k(.param .u32 n, .param .align 16 .b8 s[20], .param .u8 c)\n{}"))
	if err != nil {
		t.Fatal(err)
	}
	if got, want := m.entries["k"], []Param{{0, 4}, {16, 20}, {36, 1}}; !reflect.DeepEqual(got, want) {
		t.Errorf("got %v, want %v", got, want)
	}
}

func manyParams(n int) string {
	s := ".param .u64 p0"
	for i := 1; i < n; i++ {
		s += ", .param .u64 p"
	}
	return s
}
