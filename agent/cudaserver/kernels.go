package cudaserver

import (
	"encoding/binary"
	"math"
)

// simKernel is a kernel the simulated backend runs in Go, by the name of a
// PTX entry. Kernels are one-dimensional: thread i is
// blockIdx.x*blockDim.x + threadIdx.x.
type simKernel struct {
	params []uint32 // parameter sizes the entry must declare
	run    func(l *launch) Result
}

// launch is one kernel launch on the simulated device.
type launch struct {
	threads uint64 // gridDim.x * blockDim.x
	args    [][]byte
	mem     *simMemory
}

func (l *launch) ptr(i int) uint64 { return binary.LittleEndian.Uint64(l.args[i]) }
func (l *launch) i32(i int) int32  { return int32(binary.LittleEndian.Uint32(l.args[i])) }
func (l *launch) f32(i int) float32 {
	return math.Float32frombits(binary.LittleEndian.Uint32(l.args[i]))
}
func (l *launch) count(n int32) uint64 { return min(uint64(max(n, 0)), l.threads) }

// simKernels are the kernels the simulated backend knows.
var simKernels = map[string]simKernel{
	// vecadd(const float *a, const float *b, float *c, int n): c = a + b.
	"vecadd": {params: []uint32{8, 8, 8, 4}, run: func(l *launch) Result {
		n := l.count(l.i32(3))
		a, r := l.mem.floats(l.ptr(0), n)
		if r != Success {
			return r
		}
		b, r := l.mem.floats(l.ptr(1), n)
		if r != Success {
			return r
		}
		c := make([]float32, n)
		for i := range c {
			c[i] = a[i] + b[i]
		}
		return l.mem.putFloats(l.ptr(2), c)
	}},
	// saxpy(float a, const float *x, float *y, int n): y = a*x + y.
	"saxpy": {params: []uint32{4, 8, 8, 4}, run: func(l *launch) Result {
		n := l.count(l.i32(3))
		a := l.f32(0)
		x, r := l.mem.floats(l.ptr(1), n)
		if r != Success {
			return r
		}
		y, r := l.mem.floats(l.ptr(2), n)
		if r != Success {
			return r
		}
		for i := range y {
			y[i] = a*x[i] + y[i]
		}
		return l.mem.putFloats(l.ptr(2), y)
	}},
	// reduce_sum(const float *in, float *out, int n): out[0] += the sum of
	// in[0..n), as each thread's atomicAdd would.
	"reduce_sum": {params: []uint32{8, 8, 4}, run: func(l *launch) Result {
		n := l.count(l.i32(2))
		in, r := l.mem.floats(l.ptr(0), n)
		if r != Success {
			return r
		}
		out, r := l.mem.floats(l.ptr(1), 1)
		if r != Success {
			return r
		}
		for _, v := range in {
			out[0] += v
		}
		return l.mem.putFloats(l.ptr(1), out)
	}},
}
