package cudaserver

import (
	"errors"
	"fmt"
	"sort"

	"github.com/gpupool/gpupool/cuda/wire"
)

// Result is a CUresult.
type Result uint32

// String is the CUresult's name, as cuGetErrorName gives it.
func (r Result) String() string {
	if n, ok := resultNames[r]; ok {
		return n
	}
	return fmt.Sprintf("CUresult(%d)", uint32(r))
}

// HandleKind is the type of a driver object.
type HandleKind int

func (k HandleKind) String() string { return handleKindNames[k] }

// maxOut bounds an out buffer a call may ask for: one frame's data.
const maxOut = wire.Chunk

// errMalformed wraps what ends a session for a bad frame.
var errMalformed = errors.New("cudaserver: malformed call")

func errBufferLength(arg string, got int, want uint64) error {
	return fmt.Errorf("%w: %s carries %d bytes, its size argument says %d", errMalformed, arg, got, want)
}

// sizeOf is n*scale as a byte count; false for a negative or overflowing
// size.
func sizeOf(n int64, scale uint64) (uint64, bool) {
	if n < 0 {
		return 0, false
	}
	if scale != 0 && uint64(n) > ^uint64(0)/scale {
		return 0, false
	}
	return uint64(n) * scale, true
}

// guard is what dispatch asks of the session around each call.
type guard interface {
	// inDevice maps a client device ordinal to the backend's device.
	inDevice(d int32) (int32, Result)
	// outDevice maps a backend device to the client's ordinal.
	outDevice(d int32) int32
	// inHandle accepts 0, the session's own handles of kind, and the
	// special streams.
	inHandle(kind HandleKind, h uint64) Result
	outHandle(kind HandleKind, h uint64)
	dropHandle(kind HandleKind, h uint64)
	// inDevptr accepts [p, p+n) inside one of the session's allocations.
	inDevptr(p, n uint64) Result
	outDevptr(p, n uint64)
}

// span is one address range and what it holds.
type span[T any] struct {
	base, size uint64
	v          T
}

// spans is a set of disjoint address ranges, sorted by base.
type spans[T any] struct{ s []span[T] }

func (m *spans[T]) index(p uint64) int {
	return sort.Search(len(m.s), func(i int) bool { return m.s[i].base+m.s[i].size > p })
}

// find returns the range holding p.
func (m *spans[T]) find(p uint64) (*span[T], bool) {
	i := m.index(p)
	if i < len(m.s) && m.s[i].base <= p && p < m.s[i].base+m.s[i].size {
		return &m.s[i], true
	}
	return nil, false
}

// contains reports whether [p, p+n) lies in one range.
func (m *spans[T]) contains(p, n uint64) bool {
	r, ok := m.find(p)
	return ok && n <= r.base+r.size-p
}

func (m *spans[T]) add(base, size uint64, v T) {
	i := sort.Search(len(m.s), func(i int) bool { return m.s[i].base >= base })
	m.s = append(m.s, span[T]{})
	copy(m.s[i+1:], m.s[i:])
	m.s[i] = span[T]{base: base, size: size, v: v}
}

// remove drops the range starting at base.
func (m *spans[T]) remove(base uint64) (span[T], bool) {
	i := sort.Search(len(m.s), func(i int) bool { return m.s[i].base >= base })
	if i == len(m.s) || m.s[i].base != base {
		return span[T]{}, false
	}
	r := m.s[i]
	m.s = append(m.s[:i], m.s[i+1:]...)
	return r, true
}

// removeIf drops every range whose value matches.
func (m *spans[T]) removeIf(match func(span[T]) bool) []span[T] {
	var gone []span[T]
	kept := m.s[:0]
	for _, r := range m.s {
		if match(r) {
			gone = append(gone, r)
		} else {
			kept = append(kept, r)
		}
	}
	m.s = kept
	return gone
}

// dropOverlapping removes the ranges that overlap [base, base+size): stale
// ones, when the backend reuses addresses the session did not see freed
// (a module's globals after cuModuleUnload).
func (m *spans[T]) dropOverlapping(base, size uint64) []span[T] {
	return m.removeIf(func(r span[T]) bool { return r.base < base+size && base < r.base+r.size })
}
