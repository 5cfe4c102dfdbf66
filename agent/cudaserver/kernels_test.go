package cudaserver

import (
	"encoding/binary"
	"math"
	"os"
	"runtime"
	"testing"
)

// A launch's grid is the client's to choose: a kernel that would reach
// past its buffers fails with CUDA_ERROR_ILLEGAL_ADDRESS, as on a real
// GPU, and the server allocates nothing in proportion to the grid on the
// way (a probe once grew a server to 4 GB with one launch over 4 KiB).
func TestAHugeGridOverASmallBufferFailsIllegalAddressWithoutGrowingTheServer(t *testing.T) {
	const buffer = 4 << 10
	const maxGrowth = 1 << 20 // the server's own bookkeeping for a few calls
	ptx, err := os.ReadFile("../../cuda/shimtest/testdata/kernels.ptx")
	if err != nil {
		t.Fatal(err)
	}
	// params lays out a kernel's parameters: pointers at the offsets
	// kernels.ptx gives them, n = MaxInt32 last.
	params := func(size int, ptrs map[int]uint64, nAt int) []byte {
		p := make([]byte, size)
		for off, v := range ptrs {
			binary.LittleEndian.PutUint64(p[off:], v)
		}
		binary.LittleEndian.PutUint32(p[nAt:], math.MaxInt32)
		return p
	}
	for _, tc := range []struct {
		name   string
		kernel string
		params func(a, b uint64) []byte
	}{
		{"vecadd reading past both inputs", "vecadd", func(a, b uint64) []byte {
			return params(28, map[int]uint64{0: a, 8: b, 16: b}, 24)
		}},
		{"saxpy reading and writing past its vectors", "saxpy", func(a, b uint64) []byte {
			return params(28, map[int]uint64{8: a, 16: b}, 24)
		}},
		{"reduce_sum reading past its input", "reduce_sum", func(a, b uint64) []byte {
			return params(20, map[int]uint64{0: a, 8: b}, 16)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc0 := dial(t, newTestServer(t, testLimit))
			tc0.session()
			a, r := tc0.alloc(buffer)
			if r != Success {
				t.Fatalf("cuMemAlloc: got %v, want success", r)
			}
			b, r := tc0.alloc(buffer)
			if r != Success {
				t.Fatalf("cuMemAlloc: got %v, want success", r)
			}
			r, d := tc0.call(opCuModuleLoadData, ptx)
			if r != Success {
				t.Fatalf("cuModuleLoadData: got %v, want success", r)
			}
			r, d = tc0.call(opCuModuleGetFunction, d.U64(), tc.kernel)
			if r != Success {
				t.Fatalf("cuModuleGetFunction: got %v, want success", r)
			}
			f := d.U64()
			p := tc.params(a, b)

			var before, after runtime.MemStats
			runtime.GC()
			runtime.ReadMemStats(&before)
			r, _ = tc0.call(opGpupoolLaunchKernel, f, uint32(math.MaxInt32), uint32(1), uint32(1), uint32(1024), uint32(1), uint32(1), uint32(0), uint64(0), p, uint32(len(p)))
			runtime.ReadMemStats(&after)

			if r != ErrorIllegalAddress {
				t.Errorf("the launch: got %v, want CUDA_ERROR_ILLEGAL_ADDRESS", r)
			}
			if grew := after.TotalAlloc - before.TotalAlloc; grew > maxGrowth {
				t.Errorf("the server allocated %d bytes for the launch, want at most %d", grew, maxGrowth)
			}
			if r, _ := tc0.call(opCuCtxSynchronize); r != ErrorIllegalAddress {
				t.Errorf("the next call: got %v, want the launch's CUDA_ERROR_ILLEGAL_ADDRESS, sticky", r)
			}
		})
	}
}

func TestALaunchWithAGridWiderThanTheDevicesFailsInvalidValue(t *testing.T) {
	tc := dial(t, newTestServer(t, testLimit))
	tc.session()
	ptx, err := os.ReadFile("../../cuda/shimtest/testdata/kernels.ptx")
	if err != nil {
		t.Fatal(err)
	}
	r, d := tc.call(opCuModuleLoadData, ptx)
	if r != Success {
		t.Fatalf("cuModuleLoadData: got %v, want success", r)
	}
	r, d = tc.call(opCuModuleGetFunction, d.U64(), "vecadd")
	if r != Success {
		t.Fatalf("cuModuleGetFunction: got %v, want success", r)
	}
	p := make([]byte, 28)
	r, _ = tc.call(opGpupoolLaunchKernel, d.U64(), uint32(math.MaxInt32)+1, uint32(1), uint32(1), uint32(1), uint32(1), uint32(1), uint32(0), uint64(0), p, uint32(len(p)))
	if r != ErrorInvalidValue {
		t.Errorf("gridDim.x 2^31: got %v, want CUDA_ERROR_INVALID_VALUE", r)
	}
}
