package cudaserver

import (
	"encoding/binary"
	"testing"
)

// contextEnds are the two ways a context ends and frees what it holds.
var contextEnds = []struct {
	name    string
	context func(t *testing.T, tc *testClient) uint64
	end     func(t *testing.T, tc *testClient, ctx uint64)
}{
	{"a created context, destroyed", func(t *testing.T, tc *testClient) uint64 {
		r, d := tc.call(opCuCtxCreateV2, uint32(0), int32(0))
		return created(t, "cuCtxCreate", r, d.U64())
	}, func(t *testing.T, tc *testClient, ctx uint64) {
		tc.ctx = 0
		if r, _ := tc.call(opCuCtxDestroyV2, ctx); r != Success {
			t.Fatalf("cuCtxDestroy: got %v, want success", r)
		}
	}},
	{"a primary context, reset", func(t *testing.T, tc *testClient) uint64 {
		r, d := tc.call(opCuDevicePrimaryCtxRetain, int32(0))
		return created(t, "cuDevicePrimaryCtxRetain", r, d.U64())
	}, func(t *testing.T, tc *testClient, _ uint64) {
		if r, _ := tc.call(opCuDevicePrimaryCtxResetV2, int32(0)); r != Success {
			t.Fatalf("cuDevicePrimaryCtxReset: got %v, want success", r)
		}
	}},
}

// As in CUDA 12, a library belongs to no context: the runtime keeps its
// library handles across cudaDeviceReset and uses them in the next
// context.
func TestALibraryOutlivesTheContextItWasLoadedUnder(t *testing.T) {
	for _, tt := range contextEnds {
		t.Run(tt.name, func(t *testing.T) {
			tc := dial(t, newTestServer(t, testLimit))
			if r, _ := tc.call(opCuInit, uint32(0)); r != Success {
				t.Fatalf("cuInit: got %v, want success", r)
			}
			ctx := tt.context(t, tc)
			tc.ctx = ctx
			r, d := tc.call(opGpupoolLibraryLoadData, testPTX(t))
			lib := created(t, "cuLibraryLoadData", r, d.U64())
			r, d = tc.call(opCuLibraryGetKernel, lib, "vecadd")
			kernel := created(t, "cuLibraryGetKernel", r, d.U64())
			tt.end(t, tc, ctx)
			tc.ctx = tt.context(t, tc)

			r, d = tc.call(opCuLibraryGetKernel, lib, "vecadd")
			if r != Success {
				t.Fatalf("cuLibraryGetKernel after the context ended: got %v, want success", r)
			}
			if got := d.U64(); got == 0 {
				t.Fatalf("cuLibraryGetKernel after the context ended: got a NULL kernel")
			}
			const n = 16
			p := make([]byte, 28)
			for i := range 3 {
				buf, r := tc.alloc(4 * n)
				binary.LittleEndian.PutUint64(p[8*i:], created(t, "cuMemAlloc", r, buf))
			}
			binary.LittleEndian.PutUint32(p[24:], n)
			if r, _ := tc.call(opGpupoolLaunchKernel, kernel, uint32(1), uint32(1), uint32(1), uint32(n), uint32(1), uint32(1), uint32(0), uint64(0), p, uint32(len(p))); r != Success {
				t.Errorf("launching the kernel resolved before the context ended: got %v, want success", r)
			}
			if r, _ := tc.call(opCuLibraryUnload, lib); r != Success {
				t.Errorf("cuLibraryUnload: got %v, want success", r)
			}
		})
	}
}

// A library's slot is freed by unloading it, not by ending the context it
// was loaded under, so a loop of contexts cannot load libraries past the
// modules limit.
func TestLoadingLibrariesInContextsThatEndStillHitsTheModulesLimit(t *testing.T) {
	for _, tt := range contextEnds {
		t.Run(tt.name, func(t *testing.T) {
			const max = 3
			srv, _ := newLimitedServer(t, SessionLimits{Contexts: 1, Streams: 1, Events: 1, Modules: max, Functions: 1})
			tc := dial(t, srv)
			if r, _ := tc.call(opCuInit, uint32(0)); r != Success {
				t.Fatalf("cuInit: got %v, want success", r)
			}
			ptx := testPTX(t)
			for i := range max + 1 {
				ctx := tt.context(t, tc)
				tc.ctx = ctx
				want := Success
				if i == max {
					want = ErrorOutOfMemory
				}
				if r, _ := tc.call(opGpupoolLibraryLoadData, ptx); r != want {
					t.Fatalf("library %d under a modules limit of %d: got %v, want %v", i+1, max, r, want)
				}
				tt.end(t, tc, ctx)
			}
		})
	}
}

// cuLibraryGetModule returns the module that is the library's: it takes
// no modules slot of its own.
func TestALibrarysModuleTakesNoModulesSlot(t *testing.T) {
	srv, _ := newLimitedServer(t, SessionLimits{Contexts: 1, Streams: 1, Events: 1, Modules: 2, Functions: 1})
	tc := dial(t, srv)
	tc.session()
	ptx := testPTX(t)
	r, d := tc.call(opGpupoolLibraryLoadData, ptx)
	lib := created(t, "cuLibraryLoadData", r, d.U64())
	r, d = tc.call(opCuLibraryGetModule, lib)
	created(t, "cuLibraryGetModule", r, d.U64())
	if r, _ := tc.call(opCuModuleLoadData, ptx); r != Success {
		t.Errorf("cuModuleLoadData with a library and its module held under a limit of 2: got %v, want success", r)
	}
}
