package cudaserver

/*
#cgo LDFLAGS: -ldl
#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>

static void *gp_dlopen(const char *path) { return dlopen(path, RTLD_NOW | RTLD_LOCAL); }
static const char *gp_dlerror(void) { const char *e = dlerror(); return e ? e : "unknown error"; }

static int gp_set_current(void *fn, uintptr_t ctx) {
	return ((int (*)(void *))fn)((void *)ctx);
}

static int gp_param_info(void *fn, uintptr_t f, size_t i, size_t *off, size_t *size) {
	return ((int (*)(void *, size_t, size_t *, size_t *))fn)((void *)f, i, off, size);
}

// gp_launch points each kernel parameter into blob at its offset.
static int gp_launch(void *fn, uintptr_t f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                     unsigned bz, unsigned shared, uintptr_t stream, char *blob, uint32_t *offsets, int n) {
	void **params = calloc(n > 0 ? n : 1, sizeof(void *));
	int r;
	if (!params)
		return 2;
	for (int i = 0; i < n; i++)
		params[i] = blob + offsets[i];
	r = ((int (*)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *, void **,
	              void **))fn)((void *)f, gx, gy, gz, bx, by, bz, shared, (void *)stream, params, NULL);
	free(params);
	return r;
}

static int gp_library_load(void *fn, void **lib, void *code) {
	return ((int (*)(void **, const void *, void *, void *, unsigned, void *, void *, unsigned))fn)(
		lib, code, NULL, NULL, 0, NULL, NULL, 0);
}

static int gp_max_block(void *fn, int *minGrid, int *block, uintptr_t f, size_t smem, int limit) {
	return ((int (*)(int *, int *, void *, void *, size_t, int))fn)(minGrid, block, (void *)f, NULL, smem, limit);
}
*/
import "C"

import (
	"fmt"
	"sync"
	"unsafe"
)

// RealDriver is a libcuda loaded at run time: no CUDA headers or toolkit
// are needed to build gpupool.
type RealDriver struct {
	path  string
	syms  []unsafe.Pointer // by the sym* indexes of real_gen.go
	extra map[string]unsafe.Pointer

	mu     sync.Mutex
	warned map[string]bool // guarded by mu
}

// The driver symbols the hand-written calls below use.
var realExtraSymbols = []string{"cuCtxSetCurrent", "cuFuncGetParamInfo", "cuLaunchKernel", "cuLibraryLoadData", "cuOccupancyMaxPotentialBlockSize"}

// OpenRealDriver loads the driver library at path (for example
// libcuda.so.1, found by the loader) and resolves the calls gpupool
// remotes. A call whose symbol the library lacks fails with
// CUDA_ERROR_NOT_SUPPORTED.
func OpenRealDriver(path string) (*RealDriver, error) {
	cpath := C.CString(path)
	defer C.free(unsafe.Pointer(cpath))
	h := C.gp_dlopen(cpath)
	if h == nil {
		return nil, fmt.Errorf("cudaserver: loading %s: %s", path, C.GoString(C.gp_dlerror()))
	}
	d := &RealDriver{path: path, extra: map[string]unsafe.Pointer{}, warned: map[string]bool{}}
	sym := func(name string) unsafe.Pointer {
		cname := C.CString(name)
		defer C.free(unsafe.Pointer(cname))
		return C.dlsym(h, cname)
	}
	for _, name := range realSymbols {
		d.syms = append(d.syms, sym(name))
	}
	for _, name := range realExtraSymbols {
		d.extra[name] = sym(name)
	}
	if d.syms[symCuInit] == nil || d.extra["cuCtxSetCurrent"] == nil {
		return nil, fmt.Errorf("cudaserver: %s has no cuInit or cuCtxSetCurrent: not a CUDA driver", path)
	}
	return d, nil
}

// NewBackend opens a backend on the driver for one session.
func (d *RealDriver) NewBackend() (Backend, error) {
	return &realBackend{d: d, syms: d.syms, layouts: map[uint64][]Param{}}, nil
}

// realBackend forwards calls to the driver. Its generated methods are in
// real_gen.go; the gpupool helpers are here.
type realBackend struct {
	NotSupported
	d       *RealDriver
	syms    []unsafe.Pointer
	layouts map[uint64][]Param
}

func (rb *realBackend) missing(name string) Result {
	rb.d.mu.Lock()
	defer rb.d.mu.Unlock()
	rb.d.warned[name] = true
	return ErrorNotSupported
}

// Bind makes ctx current on the session's OS thread.
func (rb *realBackend) Bind(ctx uint64) Result {
	return Result(C.gp_set_current(rb.d.extra["cuCtxSetCurrent"], C.uintptr_t(ctx)))
}

// Close frees nothing itself: the session destroys the contexts it made,
// which frees their memory, modules, streams and events.
func (rb *realBackend) Close() error { return nil }

func (rb *realBackend) layout(f uint64) ([]Param, Result) {
	if l, ok := rb.layouts[f]; ok {
		return l, Success
	}
	fn := rb.d.extra["cuFuncGetParamInfo"]
	if fn == nil {
		return nil, rb.missing("cuFuncGetParamInfo")
	}
	var l []Param
	for i := 0; ; i++ {
		var off, size C.size_t
		r := Result(C.gp_param_info(fn, C.uintptr_t(f), C.size_t(i), &off, &size))
		if r == ErrorInvalidValue {
			break
		}
		if r != Success {
			return nil, r
		}
		l = append(l, Param{Offset: uint32(off), Size: uint32(size)})
		if i > 4096 {
			return nil, ErrorInvalidValue
		}
	}
	rb.layouts[f] = l
	return l, Success
}

// GpupoolFuncParams asks the driver for f's parameter layout.
func (rb *realBackend) GpupoolFuncParams(f uint64, info []byte, _ uint32) (uint32, Result) {
	l, r := rb.layout(f)
	if r != Success {
		return 0, r
	}
	if len(info) < 8*len(l) {
		return 0, ErrorInvalidValue
	}
	for i, p := range l {
		putLE32(info[8*i:], p.Offset)
		putLE32(info[8*i+4:], p.Size)
	}
	return uint32(len(l)), Success
}

func putLE32(b []byte, v uint32) {
	b[0], b[1], b[2], b[3] = byte(v), byte(v>>8), byte(v>>16), byte(v>>24)
}

// GpupoolLaunchKernel launches f with its parameters laid out in params.
func (rb *realBackend) GpupoolLaunchKernel(f uint64, gx, gy, gz, bx, by, bz, shared uint32, s uint64, params []byte, _ uint32) Result {
	fn := rb.d.extra["cuLaunchKernel"]
	if fn == nil {
		return rb.missing("cuLaunchKernel")
	}
	l, r := rb.layout(f)
	if r != Success {
		return r
	}
	offsets := make([]uint32, len(l)+1)
	for i, p := range l {
		if uint64(p.Offset)+uint64(p.Size) > uint64(len(params)) {
			return ErrorInvalidValue
		}
		offsets[i] = p.Offset
	}
	blob := C.CBytes(append(params, 0))
	defer C.free(blob)
	return Result(C.gp_launch(fn, C.uintptr_t(f), C.uint(gx), C.uint(gy), C.uint(gz), C.uint(bx), C.uint(by), C.uint(bz),
		C.uint(shared), C.uintptr_t(s), (*C.char)(blob), (*C.uint32_t)(unsafe.Pointer(&offsets[0])), C.int(len(l))))
}

// GpupoolLibraryLoadData loads a library without options.
func (rb *realBackend) GpupoolLibraryLoadData(code []byte) (uint64, Result) {
	fn := rb.d.extra["cuLibraryLoadData"]
	if fn == nil {
		return 0, rb.missing("cuLibraryLoadData")
	}
	c := C.CBytes(code)
	defer C.free(c)
	var lib unsafe.Pointer
	r := Result(C.gp_library_load(fn, &lib, c))
	return uint64(uintptr(lib)), r
}

// GpupoolOccupancyMaxPotentialBlockSize asks without a callback.
func (rb *realBackend) GpupoolOccupancyMaxPotentialBlockSize(f uint64, smem uint64, limit int32) (int32, int32, Result) {
	fn := rb.d.extra["cuOccupancyMaxPotentialBlockSize"]
	if fn == nil {
		return 0, 0, rb.missing("cuOccupancyMaxPotentialBlockSize")
	}
	var minGrid, block C.int
	r := Result(C.gp_max_block(fn, &minGrid, &block, C.uintptr_t(f), C.size_t(smem), C.int(limit)))
	return int32(minGrid), int32(block), r
}

func bytesPtr(b []byte) unsafe.Pointer {
	if len(b) == 0 {
		return nil
	}
	return unsafe.Pointer(&b[0])
}
