package api

import (
	"strings"
	"testing"
)

func TestTheDescriptionParses(t *testing.T) {
	a, err := Load()
	if err != nil {
		t.Fatal(err)
	}
	if a.Protocol < 1 || len(a.Funcs) < 60 || len(a.Unsupported) < 50 || len(a.Errors) < 20 {
		t.Errorf("got protocol %d, %d funcs, %d unsupported, %d errors; want a full description",
			a.Protocol, len(a.Funcs), len(a.Unsupported), len(a.Errors))
	}
	seen := map[int]string{}
	for _, f := range a.Funcs {
		if f.Wire() {
			if prev, ok := seen[f.Op]; ok {
				t.Errorf("%s and %s share op %d", prev, f.Name, f.Op)
			}
			seen[f.Op] = f.Name
		}
	}
}

func TestParseRefusesBadLines(t *testing.T) {
	for _, tc := range []struct{ name, src, want string }{
		{"no protocol line", "cuInit(uint Flags)", "no protocol"},
		{"a buffer without a size", "protocol 1\ncuX(void p)", "needs a [SIZE]"},
		{"a size naming no argument", "protocol 1\ncuX(void p[n])", "must name an integer"},
		{"an unknown type", "protocol 1\ncuX(double d)", "unknown type"},
		{"an unknown attribute", "protocol 1\ncuX() fast", "unknown attribute"},
		{"a name listed twice", "protocol 1\ncuX()\ncuX()", "listed twice"},
		{"an out string", "protocol 1\ncuX(out cstr s)", "in only"},
		{"chunk on an out size", "protocol 1\ncuX(out size_t n) chunk=n", "chunk=n"},
		{"destroys on a scalar", "protocol 1\ncuX(int n) destroys=n", "destroys=n"},
		{"an async call with a scalar out", "protocol 1\ncuX(out int n) async", "only out argument may be one buffer"},
		{"an async call that creates a handle", "protocol 1\ncuX(out CUstream s) async", "only out argument"},
		{"an async local call", "protocol 1\ncuX(int n) local async", "never reaches the wire"},
		{"an async call that destroys", "protocol 1\ncuX(CUstream s) async destroys=s", "exclude each other"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Parse(tc.src)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("got %v, want an error containing %q", err, tc.want)
			}
		})
	}
}

func TestBaseNameStripsTheVersionSuffix(t *testing.T) {
	for in, want := range map[string]string{"cuMemAlloc_v2": "cuMemAlloc", "cuInit": "cuInit", "cuCtxCreate_v3": "cuCtxCreate"} {
		if got := BaseName(in); got != want {
			t.Errorf("BaseName(%q) = %q, want %q", in, got, want)
		}
	}
}
