package cudaserver

import (
	"fmt"
	"log/slog"

	"github.com/gpupool/gpupool/cuda/wire"
)

// Pointer attributes the session answers (the driver's numbering).
const (
	attrContext       = 1
	attrMemoryType    = 2
	attrDevicePointer = 3
	attrHostPointer   = 4
	attrBufferID      = 7
	attrIsManaged     = 8
	attrDeviceOrdinal = 9
	attrRangeStart    = 11
	attrRangeSize     = 12

	memoryTypeDevice = 2
)

// What one session may hold, so that the server's own memory stays
// bounded whatever a client does: contexts, modules, functions, streams,
// events and libraries together, and allocations. SessionLimits bound
// each kind on its own, within maxHandles.
var (
	maxHandles     = MaxSessionLimit
	maxAllocations = 1 << 16
)

// allocation is device memory the session holds.
type allocation struct {
	ctx     uint64
	dev     int32 // client ordinal
	id      uint64
	counted bool // cuMemAlloc'd, so part of the lease's memory
}

// session is one client process. It implements Calls by embedding its
// Backend and overriding the calls the lease rules change, and guard for
// dispatch. It is used by one goroutine at a time.
type session struct {
	Backend
	srv *Server
	log *slog.Logger

	initialized bool
	bound       uint64                // the context of the call running
	handles     map[uint64]HandleKind // what the backend gave this session
	primary     map[int32]uint64      // client device -> its primary context
	retains     map[int32]int         // backend device -> primary retains not yet released
	devices     []int32               // client ordinal -> backend device; filled on first use
	known       []bool
	mem         spans[allocation]
	nextID      uint64
	refusals    int
	held        [numLimits]int  // the handles each limit counts
	limitLogged [numLimits]bool // whether the limit has refused (and logged it)
	// owner is what each object came from: the context of a stream,
	// event or module, the module or library of a function, kernel or
	// library module. Destroying or unloading it frees theirs. A library
	// has no owner: as in CUDA 12, it belongs to no context and survives
	// cuCtxDestroy and cuDevicePrimaryCtxReset, until cuLibraryUnload or
	// the session's end.
	owner map[uint64]uint64
	// sticky is the failure of an asynchronous call (opAsync): the shim
	// did not wait for its answer, so, as with CUDA's sticky errors, every
	// later call returns it and runs nothing. Success while there is none.
	sticky Result
}

func newSession(srv *Server, b Backend, log *slog.Logger) *session {
	return &session{
		Backend: b, srv: srv, log: log,
		handles: map[uint64]HandleKind{},
		owner:   map[uint64]uint64{},
		primary: map[int32]uint64{},
		retains: map[int32]int{},
		devices: make([]int32, len(srv.cfg.Devices)),
		known:   make([]bool, len(srv.cfg.Devices)),
	}
}

// close destroys the contexts the session made, unloads its libraries,
// releases the primary contexts it retained, returns its memory to the
// lease and closes the backend.
func (s *session) close() {
	for h, k := range s.handles {
		switch {
		case k == HandleContext && !s.isPrimary(h):
			s.Backend.CuCtxDestroyV2(h)
		case k == HandleLibrary:
			s.Backend.CuLibraryUnload(h)
		}
	}
	for dev, n := range s.retains {
		for range n {
			s.Backend.CuDevicePrimaryCtxReleaseV2(dev)
		}
	}
	for _, a := range s.mem.s {
		if a.v.counted {
			s.srv.release(a.v.dev, a.size)
		}
	}
	s.mem.s = nil
	if err := s.Backend.Close(); err != nil {
		s.log.Warn("closing the cuda backend", "err", err)
	}
}

// call runs one request and encodes its out arguments into e. An error is a
// malformed frame.
func (s *session) call(h wire.Header, p []byte, e *wire.Encoder) (Result, error) {
	if h.Flags&wire.FlagReply != 0 {
		return 0, fmt.Errorf("%w: a reply frame from the client", errMalformed)
	}
	if h.Op == wire.OpHello {
		return 0, fmt.Errorf("%w: a second handshake", errMalformed)
	}
	if s.sticky != Success {
		return s.sticky, nil
	}
	r, err := s.run(h, p, e)
	if err == nil && r != Success && opAsync[h.Op] {
		s.sticky = r
		s.log.Info("an asynchronous cuda call failed: the session returns its error from now on", "op", opNames[h.Op], "result", r.String())
	}
	return r, err
}

// run runs one call of a session without a sticky error.
func (s *session) run(h wire.Header, p []byte, e *wire.Encoder) (Result, error) {
	if !s.initialized && h.Op != opCuInit && h.Op != opCuDriverGetVersion {
		if _, known := opNames[h.Op]; known {
			return ErrorNotInitialized, nil
		}
	}
	if opCreates[h.Op] && len(s.handles) >= maxHandles {
		return s.refuse(ErrorOutOfMemory, "%d handles: a session may hold at most %d", len(s.handles), maxHandles), nil
	}
	if s.overLimit(h.Op) {
		return ErrorOutOfMemory, nil
	}
	if h.Word != 0 && s.handles[h.Word] != HandleContext {
		return s.refuse(ErrorInvalidContext, "context %#x is not this session's", h.Word), nil
	}
	if h.Word != s.bound {
		if r := s.Backend.Bind(h.Word); r != Success {
			return r, nil
		}
		s.bound = h.Word
	}
	return dispatch(s, s, h.Op, wire.NewDecoder(p), e)
}

func (s *session) refuse(r Result, format string, args ...any) Result {
	s.refusals++
	if s.refusals <= 20 {
		s.log.Info("cuda call refused", "result", r.String(), "why", fmt.Sprintf(format, args...))
	}
	return r
}

// limit is the memory the client sees on its device dev (a client
// ordinal), whose backend total is backendTotal.
func (s *session) limit(dev int32, backendTotal uint64) uint64 {
	if dev < 0 || int(dev) >= len(s.srv.cfg.Devices) {
		return 0
	}
	if l := s.srv.cfg.Devices[dev].MemoryBytes; l != 0 && l < backendTotal {
		return l
	}
	return backendTotal
}

// --- guard

func (s *session) inDevice(d int32) (int32, Result) {
	if d < 0 || int(d) >= len(s.devices) {
		return 0, s.refuse(ErrorInvalidDevice, "device %d: the lease has %d", d, len(s.devices))
	}
	if !s.known[d] {
		bd, r := s.Backend.CuDeviceGet(int32(s.srv.cfg.Devices[d].Index))
		if r != Success {
			return 0, r
		}
		s.devices[d], s.known[d] = bd, true
	}
	return s.devices[d], Success
}

func (s *session) outDevice(bd int32) int32 {
	for i := range s.devices {
		if _, r := s.inDevice(int32(i)); r == Success && s.devices[i] == bd {
			return int32(i)
		}
	}
	return -1 // not the lease's: the client cannot name it back
}

func (s *session) inHandle(kind HandleKind, h uint64) Result {
	if h == 0 || kind == HandleStream && h <= 2 { // NULL, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD
		return Success
	}
	got, ok := s.handles[h]
	if ok && (got == kind || isFunction(got) && isFunction(kind)) {
		return Success
	}
	if kind == HandleContext {
		return s.refuse(ErrorInvalidContext, "context %#x is not this session's", h)
	}
	return s.refuse(ErrorInvalidHandle, "%v %#x is not this session's", kind, h)
}

func isFunction(k HandleKind) bool { return k == HandleFunction || k == HandleKernel }

func (s *session) outHandle(kind HandleKind, h uint64) {
	if h == 0 {
		return
	}
	got, ok := s.handles[h]
	if ok && isFunction(got) && isFunction(kind) {
		return
	}
	if ok {
		s.uncount(got, h)
	}
	s.handles[h] = kind
	if k, ok := s.limitOf(kind, h); ok {
		s.held[k]++
	}
}

func (s *session) dropHandle(kind HandleKind, h uint64) {
	if got, ok := s.handles[h]; ok && got == kind {
		s.uncount(got, h)
		delete(s.handles, h)
		delete(s.owner, h)
	}
}

// uncount takes h, of kind, off its limit's count.
func (s *session) uncount(kind HandleKind, h uint64) {
	if k, ok := s.limitOf(kind, h); ok {
		s.held[k]--
	}
}

// dropOwned forgets what came from parent, a module or library the
// backend has unloaded, and what came from that in turn.
func (s *session) dropOwned(parent uint64) {
	for h, p := range s.owner {
		if p != parent {
			continue
		}
		s.dropOwned(h)
		s.dropHandle(s.handles[h], h) // uncounts h while its owner is known
		delete(s.owner, h)
	}
}

func (s *session) inDevptr(p, n uint64) Result {
	if n == 0 {
		n = 1
	}
	if !s.mem.contains(p, n) {
		return s.refuse(ErrorInvalidValue, "device range [%#x, +%d) is not inside one of this session's allocations", p, n)
	}
	return Success
}

func (s *session) outDevptr(p, n uint64) {
	if _, ok := s.mem.find(p); ok || n == 0 {
		return // known (cuMemAlloc registered it; cuMemGetAddressRange names a base)
	}
	s.forgetStale(p, n)
	s.nextID++
	s.mem.add(p, n, allocation{ctx: s.bound, dev: s.currentDevice(), id: s.nextID})
}

// currentDevice is the client ordinal of the bound context's device.
func (s *session) currentDevice() int32 {
	if s.bound == 0 {
		return 0
	}
	bd, r := s.Backend.CuCtxGetDevice()
	if r != Success {
		return 0
	}
	if d := s.outDevice(bd); d >= 0 {
		return d
	}
	return 0
}

// forgetStale drops what the session still records in [p, p+n), which the
// backend has just handed out again: it was freed behind the session's back.
func (s *session) forgetStale(p, n uint64) {
	for _, a := range s.mem.dropOverlapping(p, n) {
		if a.v.counted {
			s.srv.release(a.v.dev, a.size)
		}
	}
}

// dropContextMemory forgets the allocations of a context the backend freed.
func (s *session) dropContextMemory(ctx uint64) {
	for _, a := range s.mem.removeIf(func(a span[allocation]) bool { return a.v.ctx == ctx }) {
		if a.v.counted {
			s.srv.release(a.v.dev, a.size)
		}
	}
}

// --- the calls the lease rules change

// CuInit initialises the backend once.
func (s *session) CuInit(flags uint32) Result {
	if flags != 0 {
		return ErrorInvalidValue
	}
	if s.initialized {
		return Success
	}
	r := s.Backend.CuInit(0)
	s.initialized = r == Success
	return r
}

// CuDeviceGetCount is the lease's device count.
func (s *session) CuDeviceGetCount() (int32, Result) { return int32(len(s.devices)), Success }

// CuDeviceGet maps a lease ordinal to the backend's device.
func (s *session) CuDeviceGet(ordinal int32) (int32, Result) {
	bd, r := s.inDevice(ordinal)
	return bd, r
}

// CuDeviceTotalMemV2 is the lease's memory.
func (s *session) CuDeviceTotalMemV2(dev int32) (uint64, Result) {
	total, r := s.Backend.CuDeviceTotalMemV2(dev)
	return s.limit(s.outDevice(dev), total), r
}

// CuMemGetInfoV2 shows the lease's memory and what the lease has left.
func (s *session) CuMemGetInfoV2() (free, total uint64, r Result) {
	free, total, r = s.Backend.CuMemGetInfoV2()
	if r != Success {
		return
	}
	dev := s.currentDevice()
	total = s.limit(dev, total)
	used := s.srv.usedOn(dev)
	left := uint64(0)
	if used < total {
		left = total - used
	}
	return min(free, left), total, Success
}

// CuMemAllocV2 allocates within the lease's memory.
func (s *session) CuMemAllocV2(bytesize uint64) (uint64, Result) {
	if bytesize == 0 {
		return 0, ErrorInvalidValue
	}
	if s.bound == 0 {
		return 0, ErrorInvalidContext
	}
	if len(s.mem.s) >= maxAllocations {
		return 0, s.refuse(ErrorOutOfMemory, "%d allocations: a session may hold at most %d", len(s.mem.s), maxAllocations)
	}
	dev := s.currentDevice()
	total, r := s.CuDeviceTotalMemV2(s.devices[dev])
	if r != Success {
		return 0, r
	}
	if !s.srv.reserve(dev, bytesize, total) {
		return 0, s.refuse(ErrorOutOfMemory, "%d bytes: the lease has %d of %d bytes free", bytesize, total-min(total, s.srv.usedOn(dev)), total)
	}
	p, r := s.Backend.CuMemAllocV2(bytesize)
	if r != Success {
		s.srv.release(dev, bytesize)
		return 0, r
	}
	s.forgetStale(p, bytesize)
	s.nextID++
	s.mem.add(p, bytesize, allocation{ctx: s.bound, dev: dev, id: s.nextID, counted: true})
	return p, Success
}

// CuMemFreeV2 frees an allocation the session made.
func (s *session) CuMemFreeV2(p uint64) Result {
	a, ok := s.mem.find(p)
	if !ok || a.base != p || !a.v.counted {
		return s.refuse(ErrorInvalidValue, "%#x is not the start of one of this session's allocations", p)
	}
	if r := s.Backend.CuMemFreeV2(p); r != Success {
		return r
	}
	gone, _ := s.mem.remove(p)
	s.srv.release(gone.v.dev, gone.size)
	return Success
}

// CuMemGetAddressRangeV2 answers from the session's allocations.
func (s *session) CuMemGetAddressRangeV2(p uint64) (base, size uint64, r Result) {
	a, ok := s.mem.find(p)
	if !ok {
		return 0, 0, ErrorNotFound
	}
	return a.base, a.size, Success
}

// GpupoolPointerGetAttribute answers from the session's allocations.
func (s *session) GpupoolPointerGetAttribute(attribute uint32, p uint64) (uint64, Result) {
	a, ok := s.mem.find(p)
	if !ok {
		return 0, ErrorInvalidValue
	}
	switch attribute {
	case attrContext:
		return a.v.ctx, Success
	case attrMemoryType:
		return memoryTypeDevice, Success
	case attrDevicePointer:
		return p, Success
	case attrBufferID:
		return a.v.id, Success
	case attrIsManaged:
		return 0, Success
	case attrDeviceOrdinal:
		return uint64(a.v.dev), Success
	case attrRangeStart:
		return a.base, Success
	case attrRangeSize:
		return a.size, Success
	case attrHostPointer:
		return 0, ErrorInvalidValue
	}
	return 0, ErrorNotSupported
}

// CuCtxSetCurrent checks ctx (dispatch did); the shim keeps the stack.
func (s *session) CuCtxSetCurrent(ctx uint64) Result { return Success }

// CuCtxPushCurrentV2 checks ctx (dispatch did); the shim keeps the stack.
func (s *session) CuCtxPushCurrentV2(ctx uint64) Result { return Success }

// CuCtxDestroyV2 destroys a context and forgets its memory.
func (s *session) CuCtxDestroyV2(ctx uint64) Result {
	if ctx == 0 {
		return ErrorInvalidValue
	}
	if s.isPrimary(ctx) {
		return s.refuse(ErrorInvalidContext, "context %#x is a primary context: release it instead", ctx)
	}
	if r := s.Backend.CuCtxDestroyV2(ctx); r != Success {
		return r
	}
	s.dropContextMemory(ctx)
	s.dropOwned(ctx)
	if s.bound == ctx {
		s.bound = 0
		s.Backend.Bind(0)
	}
	return Success
}

// CuDevicePrimaryCtxRetain remembers the device's primary context.
func (s *session) CuDevicePrimaryCtxRetain(dev int32) (uint64, Result) {
	ctx, r := s.Backend.CuDevicePrimaryCtxRetain(dev)
	if r == Success {
		s.primary[s.outDevice(dev)] = ctx
		s.retains[dev]++
	}
	return ctx, r
}

// CuDevicePrimaryCtxReleaseV2 counts the release.
func (s *session) CuDevicePrimaryCtxReleaseV2(dev int32) Result {
	r := s.Backend.CuDevicePrimaryCtxReleaseV2(dev)
	if r == Success && s.retains[dev] > 0 {
		s.retains[dev]--
	}
	return r
}

func (s *session) isPrimary(ctx uint64) bool {
	for _, p := range s.primary {
		if p == ctx {
			return true
		}
	}
	return false
}

// CuDevicePrimaryCtxResetV2 forgets the memory the reset freed.
func (s *session) CuDevicePrimaryCtxResetV2(dev int32) Result {
	r := s.Backend.CuDevicePrimaryCtxResetV2(dev)
	if ctx, ok := s.primary[s.outDevice(dev)]; ok && r == Success {
		s.dropContextMemory(ctx)
		s.dropOwned(ctx)
	}
	return r
}

// CuDeviceGetByPCIBusId finds only the lease's devices.
func (s *session) CuDeviceGetByPCIBusId(id string) (int32, Result) {
	bd, r := s.Backend.CuDeviceGetByPCIBusId(id)
	if r != Success {
		return 0, r
	}
	if s.outDevice(bd) < 0 {
		return 0, s.refuse(ErrorInvalidDevice, "PCI bus id %s is not one of the lease's devices", id)
	}
	return bd, Success
}

// ownedByContext remembers that h, if r is success, is the bound
// context's.
func (s *session) ownedByContext(h uint64, r Result) (uint64, Result) {
	if r == Success {
		s.owner[h] = s.bound
	}
	return h, r
}

// CuStreamCreate remembers the stream's context.
func (s *session) CuStreamCreate(flags uint32) (uint64, Result) {
	return s.ownedByContext(s.Backend.CuStreamCreate(flags))
}

// CuStreamCreateWithPriority remembers the stream's context.
func (s *session) CuStreamCreateWithPriority(flags uint32, priority int32) (uint64, Result) {
	return s.ownedByContext(s.Backend.CuStreamCreateWithPriority(flags, priority))
}

// CuEventCreate remembers the event's context.
func (s *session) CuEventCreate(flags uint32) (uint64, Result) {
	return s.ownedByContext(s.Backend.CuEventCreate(flags))
}

// CuModuleLoadData remembers the module's context.
func (s *session) CuModuleLoadData(image []byte) (uint64, Result) {
	return s.ownedByContext(s.Backend.CuModuleLoadData(image))
}

// CuModuleGetFunction remembers the function's module.
func (s *session) CuModuleGetFunction(hmod uint64, name string) (uint64, Result) {
	f, r := s.Backend.CuModuleGetFunction(hmod, name)
	if r == Success {
		s.owner[f] = hmod
	}
	return f, r
}

// CuLibraryGetKernel remembers the kernel's library.
func (s *session) CuLibraryGetKernel(library uint64, name string) (uint64, Result) {
	k, r := s.Backend.CuLibraryGetKernel(library, name)
	if r == Success {
		s.owner[k] = library
	}
	return k, r
}

// CuLibraryGetModule remembers the module's library, whose Modules slot
// it shares: it is not counted on its own.
func (s *session) CuLibraryGetModule(library uint64) (uint64, Result) {
	m, r := s.Backend.CuLibraryGetModule(library)
	if r == Success {
		s.owner[m] = library
	}
	return m, r
}

// CuKernelGetFunction remembers the function's library, the kernel's.
func (s *session) CuKernelGetFunction(kernel uint64) (uint64, Result) {
	f, r := s.Backend.CuKernelGetFunction(kernel)
	if r == Success && f != kernel {
		s.owner[f] = s.owner[kernel]
	}
	return f, r
}

// CuModuleUnload frees the slots of the module's functions.
func (s *session) CuModuleUnload(hmod uint64) Result {
	r := s.Backend.CuModuleUnload(hmod)
	if r == Success {
		s.dropOwned(hmod)
	}
	return r
}

// CuLibraryUnload frees the slots of the library's kernels, functions and
// module.
func (s *session) CuLibraryUnload(library uint64) Result {
	r := s.Backend.CuLibraryUnload(library)
	if r == Success {
		s.dropOwned(library)
	}
	return r
}
