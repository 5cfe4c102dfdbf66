package main

import (
	"bytes"
	"fmt"
	"strings"

	"github.com/gpupool/gpupool/cuda/api"
)

// realFuncs are the functions the real backend forwards to the driver
// through generated trampolines: every wire function except the gpupool
// helpers, which real.go implements by hand.
func realFuncs(a *api.API) []*api.Func {
	var fs []*api.Func
	for _, f := range a.Funcs {
		if f.Wire() && !f.Internal {
			fs = append(fs, f)
		}
	}
	return fs
}

// cDriverType is the C type the driver's function takes for a.
func cDriverType(a api.Arg) string {
	var t string
	switch a.Kind {
	case api.KindI32, api.KindDevice:
		t = "int"
	case api.KindU32:
		t = "unsigned int"
	case api.KindU16:
		t = "unsigned short"
	case api.KindU8:
		t = "unsigned char"
	case api.KindU64:
		if a.Type == "size_t" {
			t = "size_t"
		} else {
			t = "unsigned long long"
		}
	case api.KindDevptr:
		t = "unsigned long long"
	case api.KindHandle:
		t = "void *"
	case api.KindF32:
		t = "float"
	case api.KindCstr:
		return "const char *"
	case api.KindImage, api.KindBuffer, api.KindUUID:
		return "void *"
	}
	if a.Out {
		return t + " *"
	}
	return t
}

// cTrampType is the portable type the trampoline takes from Go.
func cTrampType(a api.Arg) string {
	if a.Out || a.Kind == api.KindCstr || a.Kind == api.KindImage || a.Kind == api.KindBuffer || a.Kind == api.KindUUID {
		return cDriverType(a)
	}
	switch a.Kind {
	case api.KindHandle:
		return "uintptr_t"
	case api.KindU64, api.KindDevptr:
		return "uint64_t"
	}
	return cDriverType(a)
}

func genRealBackend(a *api.API) []byte {
	fs := realFuncs(a)
	var c bytes.Buffer
	c.WriteString("#include <stddef.h>\n#include <stdint.h>\n#include <stdlib.h>\n\n")
	for _, f := range fs {
		var ftypes, params, args []string
		for i, arg := range f.Args {
			ftypes = append(ftypes, cDriverType(arg))
			params = append(params, fmt.Sprintf("%s a%d", cTrampType(arg), i))
			if arg.Kind == api.KindHandle && !arg.Out {
				args = append(args, fmt.Sprintf("(void *)a%d", i))
			} else {
				args = append(args, fmt.Sprintf("(%s)a%d", cDriverType(arg), i))
			}
		}
		if len(ftypes) == 0 {
			ftypes = []string{"void"}
		}
		fmt.Fprintf(&c, "static int gp_%s(void *fn%s) {\n\treturn ((int (*)(%s))fn)(%s);\n}\n",
			f.Name, prefixComma(strings.Join(params, ", ")), strings.Join(ftypes, ", "), strings.Join(args, ", "))
	}

	var b bytes.Buffer
	fmt.Fprintf(&b, "// %s\n\npackage cudaserver\n\n/*\n%s*/\nimport \"C\"\n\nimport \"unsafe\"\n\n", banner, c.String())
	b.WriteString("// realSymbols are the driver symbols the real backend resolves, in the\n// order of the sym* indexes.\nvar realSymbols = []string{\n")
	for _, f := range fs {
		fmt.Fprintf(&b, "\t%q,\n", f.Name)
	}
	b.WriteString("}\n\nconst (\n")
	for i, f := range fs {
		if i == 0 {
			fmt.Fprintf(&b, "\tsym%s = iota\n", GoName(f.Name))
		} else {
			fmt.Fprintf(&b, "\tsym%s\n", GoName(f.Name))
		}
	}
	b.WriteString(")\n\n")
	for _, f := range fs {
		genRealMethod(&b, f)
	}
	return b.Bytes()
}

func prefixComma(s string) string {
	if s == "" {
		return ""
	}
	return ", " + s
}

func genRealMethod(b *bytes.Buffer, f *api.Func) {
	p, r := goSig(f)
	fmt.Fprintf(b, "// %s calls the driver's %s.\nfunc (rb *realBackend) %s(%s) %s {\n", GoName(f.Name), f.Name, GoName(f.Name), p, r)
	fmt.Fprintf(b, "\tfn := rb.syms[sym%s]\n\tif fn == nil {\n\t\tr = rb.missing(%q)\n\t\treturn\n\t}\n", GoName(f.Name), f.Name)
	var args []string
	var post []string
	for i, a := range f.Args {
		v := goVar(a.Name)
		switch {
		case a.Kind == api.KindCstr:
			fmt.Fprintf(b, "\tc%d := C.CString(%s)\n\tdefer C.free(unsafe.Pointer(c%d))\n", i, v, i)
			args = append(args, fmt.Sprintf("c%d", i))
		case a.Kind == api.KindImage || a.Kind == api.KindBuffer:
			args = append(args, fmt.Sprintf("bytesPtr(%s)", v))
		case a.Kind == api.KindUUID:
			args = append(args, fmt.Sprintf("unsafe.Pointer(&%s[0])", v))
		case a.Out:
			ct := cgoType(a)
			fmt.Fprintf(b, "\tvar o%d %s\n", i, ct)
			args = append(args, fmt.Sprintf("&o%d", i))
			if a.Kind == api.KindHandle {
				post = append(post, fmt.Sprintf("\t%s = uint64(uintptr(o%d))\n", v, i))
			} else {
				post = append(post, fmt.Sprintf("\t%s = %s(o%d)\n", v, goType(a), i))
			}
		case a.Kind == api.KindHandle:
			args = append(args, fmt.Sprintf("C.uintptr_t(%s)", v))
		case a.Kind == api.KindU64 || a.Kind == api.KindDevptr:
			args = append(args, fmt.Sprintf("C.uint64_t(%s)", v))
		default:
			args = append(args, fmt.Sprintf("%s(%s)", cgoType(a), v))
		}
	}
	fmt.Fprintf(b, "\tr = Result(C.gp_%s(fn%s))\n", f.Name, prefixComma(strings.Join(args, ", ")))
	for _, s := range post {
		b.WriteString(s)
	}
	b.WriteString("\treturn\n}\n\n")
}

// cgoNames are the cgo spellings of the driver's scalar C types.
var cgoNames = map[string]string{
	"int":                "C.int",
	"unsigned int":       "C.uint",
	"unsigned short":     "C.ushort",
	"unsigned char":      "C.uchar",
	"size_t":             "C.size_t",
	"unsigned long long": "C.ulonglong",
	"void *":             "unsafe.Pointer",
	"float":              "C.float",
}

// cgoType is the cgo spelling of the driver's scalar type for a: the
// type cDriverType gives a passed by value.
func cgoType(a api.Arg) string {
	a.Out = false
	if t, ok := cgoNames[cDriverType(a)]; ok {
		return t
	}
	panic("cgoType " + a.Name)
}
