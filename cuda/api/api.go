// Package api reads cuda.api, the one description of the CUDA driver API
// calls gpupool remotes. The generator in cuda/gen turns it into the shim's
// C stubs and the server's Go dispatch, so the two halves of a call cannot
// disagree on the wire.
//
// Invariants: op numbers are the order of wire functions in the file,
// starting at 1 (0 is the handshake); every SIZE names an argument of the
// same function; a local function never reaches the wire.
package api

import (
	_ "embed"
	"fmt"
	"regexp"
	"strconv"
	"strings"
)

//go:generate go run ../gen

// Source is the text of cuda.api.
//
//go:embed cuda.api
var Source string

// Kind is how an argument travels on the wire.
type Kind int

// Argument kinds.
const (
	KindI32    Kind = iota + 1 // int, CUdevice-free 32-bit signed
	KindU32                    // unsigned int and enums
	KindU16                    // unsigned short
	KindU8                     // unsigned char
	KindU64                    // size_t, cuuint64_t
	KindF32                    // float
	KindDevice                 // CUdevice: a lease-relative ordinal on the client side
	KindDevptr                 // CUdeviceptr
	KindHandle                 // an opaque driver object
	KindCstr                   // const char*, NUL-terminated
	KindImage                  // a module image: PTX text, cubin or fatbin
	KindBuffer                 // void/char with a SIZE
	KindUUID                   // CUuuid, 16 bytes
)

// Arg is one argument of a function.
type Arg struct {
	Name  string
	Type  string // as written in cuda.api
	Out   bool
	Kind  Kind
	Size  string // argument holding the size (buffers, checked device ranges)
	Scale int    // Size is multiplied by Scale (1 when absent)
}

// Func is one function line.
type Func struct {
	Name     string
	Op       int // wire op; 0 for local functions
	Args     []Arg
	Local    bool
	Custom   bool
	Internal bool
	Chunk    string // argument split into frames of at most the chunk size
	Since    int
	Destroys string
	// Async marks a call CUDA itself makes asynchronous (stream work): the
	// shim sends it without waiting for its answer, and a failure becomes
	// the session's sticky error, returned by the next synchronising call
	// and every call after it.
	Async   bool
	Line    int
	Section string // the `# --- name` comment above it
}

// Exported reports whether the shim exports the function.
func (f *Func) Exported() bool { return !f.Internal }

// Wire reports whether the function travels to the server.
func (f *Func) Wire() bool { return !f.Local }

// Base is the name cuGetProcAddress callers ask for: Name without a _vN
// suffix.
func (f *Func) Base() string { return BaseName(f.Name) }

var versionSuffix = regexp.MustCompile(`_v[0-9]+$`)

// BaseName strips a _vN suffix.
func BaseName(name string) string { return versionSuffix.ReplaceAllString(name, "") }

// Arg returns the argument named name, or nil.
func (f *Func) Arg(name string) *Arg {
	for i := range f.Args {
		if f.Args[i].Name == name {
			return &f.Args[i]
		}
	}
	return nil
}

// Error is one CUresult value.
type Error struct {
	Name  string
	Value int
	Text  string
}

// API is the parsed description.
type API struct {
	Protocol    int
	Funcs       []*Func
	Unsupported []string
	Errors      []Error
}

// Handles are the opaque object types.
var Handles = map[string]bool{
	"CUcontext": true, "CUmodule": true, "CUfunction": true, "CUstream": true,
	"CUevent": true, "CUlibrary": true, "CUkernel": true,
}

var scalarKinds = map[string]Kind{
	"int": KindI32, "uint": KindU32, "ushort": KindU16, "uchar": KindU8,
	"size_t": KindU64, "u64": KindU64, "float": KindF32,
	"CUdevice": KindDevice, "CUdeviceptr": KindDevptr, "cstr": KindCstr,
	"image": KindImage, "CUuuid": KindUUID, "CUresult": KindU32,
}

var (
	funcLine = regexp.MustCompile(`^([A-Za-z_][A-Za-z0-9_]*)\((.*)\)\s*(.*)$`)
	argRe    = regexp.MustCompile(`^(out\s+)?([A-Za-z_][A-Za-z0-9_]*)\s+([A-Za-z_][A-Za-z0-9_]*)(?:\[([A-Za-z_][A-Za-z0-9_]*)(?:\*([0-9]+))?\])?$`)
	errLine  = regexp.MustCompile(`^error\s+(CUDA_[A-Z0-9_]+)\s+([0-9]+)\s+"([^"]*)"$`)
)

// Parse reads a description.
func Parse(src string) (*API, error) {
	a := &API{}
	op := 0
	section := ""
	names := map[string]bool{}
	for i, line := range strings.Split(src, "\n") {
		n := i + 1
		line = strings.TrimSpace(line)
		if name, ok := strings.CutPrefix(line, "# --- "); ok {
			section = name
			continue
		}
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		fields := strings.Fields(line)
		switch fields[0] {
		case "protocol":
			v, err := strconv.Atoi(fields[len(fields)-1])
			if err != nil || len(fields) != 2 || v < 1 {
				return nil, fmt.Errorf("line %d: protocol wants one positive number", n)
			}
			a.Protocol = v
			continue
		case "unsupported":
			for _, name := range fields[1:] {
				if names[name] {
					return nil, fmt.Errorf("line %d: %s listed twice", n, name)
				}
				names[name] = true
				a.Unsupported = append(a.Unsupported, name)
			}
			continue
		case "error":
			m := errLine.FindStringSubmatch(line)
			if m == nil {
				return nil, fmt.Errorf("line %d: want error NAME VALUE \"text\"", n)
			}
			v, _ := strconv.Atoi(m[2])
			a.Errors = append(a.Errors, Error{Name: m[1], Value: v, Text: m[3]})
			continue
		}
		m := funcLine.FindStringSubmatch(line)
		if m == nil {
			return nil, fmt.Errorf("line %d: want NAME(ARGS) ATTRS: %q", n, line)
		}
		f := &Func{Name: m[1], Line: n, Section: section}
		if names[f.Name] {
			return nil, fmt.Errorf("line %d: %s listed twice", n, f.Name)
		}
		names[f.Name] = true
		if err := parseAttrs(f, strings.Fields(m[3])); err != nil {
			return nil, fmt.Errorf("line %d: %s: %w", n, f.Name, err)
		}
		if strings.TrimSpace(m[2]) != "" {
			for _, s := range strings.Split(m[2], ",") {
				arg, err := parseArg(strings.TrimSpace(s), f.Local)
				if err != nil {
					return nil, fmt.Errorf("line %d: %s: %w", n, f.Name, err)
				}
				f.Args = append(f.Args, arg)
			}
		}
		if err := check(f); err != nil {
			return nil, fmt.Errorf("line %d: %s: %w", n, f.Name, err)
		}
		if f.Wire() {
			op++
			f.Op = op
		}
		a.Funcs = append(a.Funcs, f)
	}
	if a.Protocol == 0 {
		return nil, fmt.Errorf("no protocol line")
	}
	return a, nil
}

func parseAttrs(f *Func, attrs []string) error {
	for _, at := range attrs {
		k, v, _ := strings.Cut(at, "=")
		switch k {
		case "local":
			f.Local = true
		case "custom":
			f.Custom = true
		case "internal":
			f.Internal = true
		case "chunk":
			f.Chunk = v
		case "destroys":
			f.Destroys = v
		case "async":
			f.Async = true
		case "since":
			s, err := strconv.Atoi(v)
			if err != nil || s <= 0 {
				return fmt.Errorf("since=%q: want a CUDA version such as 12040", v)
			}
			f.Since = s
		default:
			return fmt.Errorf("unknown attribute %q; want local, custom, internal, async, chunk=, since= or destroys=", at)
		}
	}
	return nil
}

func parseArg(s string, local bool) (Arg, error) {
	m := argRe.FindStringSubmatch(s)
	if m == nil {
		return Arg{}, fmt.Errorf("argument %q: want [out] TYPE NAME[SIZE]", s)
	}
	a := Arg{Out: m[1] != "", Type: m[2], Name: m[3], Size: m[4], Scale: 1}
	if m[5] != "" {
		a.Scale, _ = strconv.Atoi(m[5])
	}
	switch {
	case m[2] == "void" || m[2] == "char":
		a.Kind = KindBuffer
		if a.Size == "" && !local {
			return Arg{}, fmt.Errorf("argument %s: a %s buffer needs a [SIZE]", a.Name, m[2])
		}
	case Handles[m[2]]:
		a.Kind = KindHandle
	case scalarKinds[m[2]] != 0:
		a.Kind = scalarKinds[m[2]]
	case strings.HasPrefix(m[2], "CU"):
		a.Kind = KindU32 // an enum
	default:
		return Arg{}, fmt.Errorf("argument %s: unknown type %q", a.Name, m[2])
	}
	return a, nil
}

func check(f *Func) error {
	if n := btoi(f.Local) + btoi(f.Custom) + btoi(f.Internal); n > 1 {
		return fmt.Errorf("local, custom and internal exclude each other")
	}
	if f.Local {
		if f.Async {
			return fmt.Errorf("async: a local function never reaches the wire")
		}
		return nil
	}
	for _, a := range f.Args {
		if a.Size != "" {
			s := f.Arg(a.Size)
			if s == nil || s.Out && s.Kind != KindU64 || s.Kind != KindU64 && s.Kind != KindU32 && s.Kind != KindI32 {
				return fmt.Errorf("argument %s: size %s must name an integer argument", a.Name, a.Size)
			}
		}
		if a.Kind == KindBuffer && a.Out && f.Arg(a.Size).Out {
			return fmt.Errorf("argument %s: an out buffer's size must be an in argument", a.Name)
		}
		if (a.Kind == KindCstr || a.Kind == KindImage) && a.Out {
			return fmt.Errorf("argument %s: %s is in only", a.Name, a.Type)
		}
	}
	if f.Chunk != "" {
		if s := f.Arg(f.Chunk); s == nil || s.Out || s.Kind != KindU64 {
			return fmt.Errorf("chunk=%s must name a size_t in argument", f.Chunk)
		}
	}
	if f.Async {
		outs := 0
		for _, a := range f.Args {
			if a.Out {
				outs++
				if a.Kind != KindBuffer {
					return fmt.Errorf("async: argument %s: an asynchronous call's only out argument may be one buffer, filled when its answer arrives", a.Name)
				}
			}
			if a.Kind == KindHandle && a.Out || a.Kind == KindImage {
				return fmt.Errorf("async: argument %s: an asynchronous call creates nothing and loads nothing", a.Name)
			}
		}
		if outs > 1 {
			return fmt.Errorf("async: %d out arguments; at most one buffer", outs)
		}
		if f.Destroys != "" {
			return fmt.Errorf("async and destroys= exclude each other")
		}
	}
	if f.Destroys != "" {
		if d := f.Arg(f.Destroys); d == nil || d.Kind != KindHandle || d.Out {
			return fmt.Errorf("destroys=%s must name a handle in argument", f.Destroys)
		}
	}
	return nil
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}

// Load parses the embedded description.
func Load() (*API, error) { return Parse(Source) }
