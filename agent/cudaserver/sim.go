package cudaserver

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math"
	"slices"
	"strings"
	"time"
)

// SimDevice is one simulated GPU as the simulated backend shows it.
type SimDevice struct {
	Name         string
	UUID         [16]byte
	MemoryBytes  uint64
	SMs          int32
	Major, Minor int32
}

// DefaultSimDevice is an A100-SXM4-40GB, as the simulated pool hosts show
// one by default.
func DefaultSimDevice(uuid [16]byte) SimDevice {
	return SimDevice{Name: "NVIDIA A100-SXM4-40GB", UUID: uuid, MemoryBytes: 40 << 30, SMs: 108, Major: 8, Minor: 0}
}

// SimDriverVersion is the driver version the simulated backend reports.
const SimDriverVersion = 12040

// Simulated limits, as an Ampere part has them.
const (
	simMaxThreadsPerBlock = 1024
	simSharedPerBlock     = 48 << 10
	simSharedOptin        = 163 << 10
	simSharedPerSM        = 164 << 10
	simThreadsPerSM       = 2048
	simBlocksPerSM        = 32
	simAlign              = 512
	simBase               = 0x7f0000000000
)

// simAttributes are the device attributes by the driver's numbering; those
// of the device itself (SMs, compute capability) are filled per device.
var simAttributes = map[uint32]int32{
	1: simMaxThreadsPerBlock, 2: 1024, 3: 1024, 4: 64, 5: math.MaxInt32, 6: 65535, 7: 65535,
	8: simSharedPerBlock, 9: 64 << 10, 10: 32, 11: math.MaxInt32, 12: 64 << 10, 13: 1410000, 14: 512,
	15: 1, 17: 0, 18: 0, 19: 1, 20: 0, 31: 1, 32: 1, 34: 0, 35: 0, 36: 1215000, 37: 5120,
	38: 40 << 20, 39: simThreadsPerSM, 40: 3, 41: 1, 50: 0, 81: simSharedPerSM, 82: 64 << 10,
	83: 0, 97: simSharedOptin,
}

// simMemory is the simulated device memory: allocations in a private
// address space, each backed by host memory on its first write.
type simMemory struct {
	spans spans[*simBlock]
	next  uint64
}

type simBlock struct {
	ctx  *simCtx // nil for a library's global, which no context owns
	dev  int32
	data []byte // nil until written
}

func (m *simMemory) alloc(ctx *simCtx, dev int32, n uint64) uint64 {
	if m.next == 0 {
		m.next = simBase
	}
	p := m.next
	m.next += (n + 2*simAlign - 1) &^ (simAlign - 1) // a gap between allocations
	m.spans.add(p, n, &simBlock{ctx: ctx, dev: dev})
	return p
}

// at returns the block and offset for [p, p+n), or ILLEGAL_ADDRESS.
func (m *simMemory) at(p, n uint64) (*span[*simBlock], uint64, Result) {
	s, ok := m.spans.find(p)
	if !ok || n > s.base+s.size-p {
		return nil, 0, ErrorIllegalAddress
	}
	return s, p - s.base, Success
}

func (m *simMemory) read(dst []byte, p uint64) Result {
	s, off, r := m.at(p, uint64(len(dst)))
	if r != Success {
		return r
	}
	if s.v.data == nil {
		clear(dst)
	} else {
		copy(dst, s.v.data[off:])
	}
	return Success
}

func (m *simMemory) write(p uint64, src []byte) Result {
	s, off, r := m.at(p, uint64(len(src)))
	if r != Success {
		return r
	}
	if s.v.data == nil {
		s.v.data = make([]byte, s.size)
	}
	copy(s.v.data[off:], src)
	return Success
}

func (m *simMemory) fill(p uint64, pattern []byte, count uint64) Result {
	s, off, r := m.at(p, count*uint64(len(pattern)))
	if r != Success {
		return r
	}
	if s.v.data == nil {
		if bytes.Count(pattern, []byte{0}) == len(pattern) {
			return Success
		}
		s.v.data = make([]byte, s.size)
	}
	for i := uint64(0); i < count; i++ {
		copy(s.v.data[off+i*uint64(len(pattern)):], pattern)
	}
	return Success
}

// floats reads n floats at p. It checks [p, p+4n) against the allocation
// before it allocates anything, so that what a launch makes the server
// hold is bounded by the allocation it reads, never by its grid.
func (m *simMemory) floats(p, n uint64) ([]float32, Result) {
	if n > math.MaxUint64/4 {
		return nil, ErrorIllegalAddress
	}
	s, off, r := m.at(p, 4*n)
	if r != Success {
		return nil, r
	}
	f := make([]float32, n)
	if s.v.data == nil {
		return f, Success
	}
	b := s.v.data[off:]
	for i := range f {
		f[i] = math.Float32frombits(binary.LittleEndian.Uint32(b[4*i:]))
	}
	return f, Success
}

func (m *simMemory) putFloats(p uint64, f []float32) Result {
	b := make([]byte, 4*len(f))
	for i, v := range f {
		binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(v))
	}
	return m.write(p, b)
}

func (m *simMemory) usedOn(dev int32) uint64 {
	var n uint64
	for _, s := range m.spans.s {
		if s.v.dev == dev {
			n += s.size
		}
	}
	return n
}

type simCtx struct {
	id      uint64
	dev     int32
	flags   uint32
	primary bool
	refs    int
	cache   uint32 // CUfunc_cache
	limits  map[uint32]uint64
}

type simModule struct {
	// ctx is the context a module was loaded in, which frees it; nil for
	// a library, which, as in CUDA 12, belongs to no context and lives
	// until it is unloaded.
	ctx     *simCtx
	dev     int32
	ptx     *ptxModule
	globals map[string]uint64 // name -> device address
}

type simFunc struct {
	module *simModule
	name   string
	params []Param
	kernel simKernel
	attrs  map[uint32]int32
}

type simStream struct {
	ctx      *simCtx
	flags    uint32
	priority int32
}

type simEvent struct {
	ctx      *simCtx
	flags    uint32
	recorded bool
	at       time.Time
}

// simBackend is a simulated GPU: device memory in host memory, PTX entries
// parsed, and the kernels of simKernels run in Go. Work on any stream runs
// when it is issued, so every stream and event is always complete.
type simBackend struct {
	NotSupported
	devs        []SimDevice
	now         func() time.Time
	initialized bool
	next        uint64
	cur         *simCtx
	ctxs        map[uint64]*simCtx
	primary     map[int32]*simCtx
	mem         simMemory
	modules     map[uint64]*simModule
	libraries   map[uint64]*simModule
	funcs       map[uint64]*simFunc
	streams     map[uint64]*simStream
	events      map[uint64]*simEvent
}

// NewSimBackend returns a simulated backend with devs as its devices
// (backend ordinals 0..len-1). now is the clock events read; nil is
// time.Now.
func NewSimBackend(devs []SimDevice, now func() time.Time) Backend {
	if now == nil {
		now = time.Now
	}
	return &simBackend{
		devs: devs, now: now, next: 0x5000,
		ctxs: map[uint64]*simCtx{}, primary: map[int32]*simCtx{},
		modules: map[uint64]*simModule{}, libraries: map[uint64]*simModule{},
		funcs: map[uint64]*simFunc{}, streams: map[uint64]*simStream{}, events: map[uint64]*simEvent{},
	}
}

func (b *simBackend) id() uint64 {
	b.next += 0x10
	return b.next
}

func (b *simBackend) Bind(ctx uint64) Result {
	if ctx == 0 {
		b.cur = nil
		return Success
	}
	c, ok := b.ctxs[ctx]
	if !ok {
		return ErrorInvalidContext
	}
	b.cur = c
	return Success
}

func (b *simBackend) Close() error {
	b.mem = simMemory{}
	clear(b.ctxs)
	clear(b.modules)
	clear(b.funcs)
	return nil
}

func (b *simBackend) dev(d int32) (*SimDevice, Result) {
	if d < 0 || int(d) >= len(b.devs) {
		return nil, ErrorInvalidDevice
	}
	return &b.devs[d], Success
}

// --- init, devices

func (b *simBackend) CuInit(flags uint32) Result {
	if flags != 0 {
		return ErrorInvalidValue
	}
	b.initialized = true
	return Success
}

func (b *simBackend) CuDriverGetVersion() (int32, Result) { return SimDriverVersion, Success }

func (b *simBackend) CuDeviceGet(ordinal int32) (int32, Result) {
	_, r := b.dev(ordinal)
	return ordinal, r
}

func (b *simBackend) CuDeviceGetCount() (int32, Result) { return int32(len(b.devs)), Success }

func (b *simBackend) CuDeviceGetName(name []byte, _ int32, dev int32) Result {
	d, r := b.dev(dev)
	if r != Success {
		return r
	}
	if len(name) == 0 {
		return ErrorInvalidValue
	}
	n := copy(name[:len(name)-1], d.Name)
	name[n] = 0
	return Success
}

func (b *simBackend) CuDeviceGetUuid(dev int32) ([16]byte, Result) {
	d, r := b.dev(dev)
	if r != Success {
		return [16]byte{}, r
	}
	return d.UUID, Success
}

func (b *simBackend) CuDeviceGetUuidV2(dev int32) ([16]byte, Result) { return b.CuDeviceGetUuid(dev) }

func (b *simBackend) CuDeviceTotalMemV2(dev int32) (uint64, Result) {
	d, r := b.dev(dev)
	if r != Success {
		return 0, r
	}
	return d.MemoryBytes, Success
}

func (b *simBackend) CuDeviceGetAttribute(attrib uint32, dev int32) (int32, Result) {
	d, r := b.dev(dev)
	if r != Success {
		return 0, r
	}
	switch attrib {
	case 16:
		return d.SMs, Success
	case 33:
		return dev + 1, Success
	case 75:
		return d.Major, Success
	case 76:
		return d.Minor, Success
	}
	if v, ok := simAttributes[attrib]; ok {
		return v, Success
	}
	if attrib >= 1 && attrib < 140 {
		return 0, Success
	}
	return 0, ErrorInvalidValue
}

func (b *simBackend) CuDeviceComputeCapability(dev int32) (int32, int32, Result) {
	d, r := b.dev(dev)
	if r != Success {
		return 0, 0, r
	}
	return d.Major, d.Minor, Success
}

// --- contexts

func (b *simBackend) newCtx(dev int32, flags uint32, primary bool) *simCtx {
	c := &simCtx{id: b.id(), dev: dev, flags: flags, primary: primary,
		limits: map[uint32]uint64{0: 1024, 1: 1 << 20, 2: 8 << 20}}
	b.ctxs[c.id] = c
	return c
}

func (b *simBackend) CuDevicePrimaryCtxRetain(dev int32) (uint64, Result) {
	if _, r := b.dev(dev); r != Success {
		return 0, r
	}
	c, ok := b.primary[dev]
	if !ok {
		c = b.newCtx(dev, 0, true)
		b.primary[dev] = c
	}
	c.refs++
	return c.id, Success
}

func (b *simBackend) CuDevicePrimaryCtxReleaseV2(dev int32) Result {
	if _, r := b.dev(dev); r != Success {
		return r
	}
	c, ok := b.primary[dev]
	if !ok || c.refs == 0 {
		return ErrorInvalidContext
	}
	c.refs--
	return Success
}

func (b *simBackend) CuDevicePrimaryCtxResetV2(dev int32) Result {
	if _, r := b.dev(dev); r != Success {
		return r
	}
	if c, ok := b.primary[dev]; ok { // its retains stand
		b.freeCtx(c)
	}
	return Success
}

func (b *simBackend) CuDevicePrimaryCtxGetState(dev int32) (flags uint32, active int32, r Result) {
	if _, r := b.dev(dev); r != Success {
		return 0, 0, r
	}
	if c, ok := b.primary[dev]; ok {
		flags = c.flags
		if c.refs > 0 {
			active = 1
		}
	}
	return flags, active, Success
}

func (b *simBackend) CuDevicePrimaryCtxSetFlagsV2(dev int32, flags uint32) Result {
	if _, r := b.dev(dev); r != Success {
		return r
	}
	if flags&^0x1f != 0 {
		return ErrorInvalidValue
	}
	c, ok := b.primary[dev]
	if !ok {
		c = b.newCtx(dev, flags, true)
		b.primary[dev] = c
	}
	c.flags = flags
	return Success
}

func (b *simBackend) CuCtxCreateV2(flags uint32, dev int32) (uint64, Result) {
	if _, r := b.dev(dev); r != Success {
		return 0, r
	}
	if flags&^0x1f != 0 {
		return 0, ErrorInvalidValue
	}
	c := b.newCtx(dev, flags, false)
	b.cur = c
	return c.id, Success
}

// freeCtx frees everything created in c. Libraries, their kernels and
// globals belong to no context and stay.
func (b *simBackend) freeCtx(c *simCtx) {
	b.mem.spans.removeIf(func(s span[*simBlock]) bool { return s.v.ctx == c })
	for id, m := range b.modules {
		if m.ctx == c {
			delete(b.modules, id)
		}
	}
	for id, f := range b.funcs {
		if f.module.ctx == c {
			delete(b.funcs, id)
		}
	}
	for id, s := range b.streams {
		if s.ctx == c {
			delete(b.streams, id)
		}
	}
	for id, e := range b.events {
		if e.ctx == c {
			delete(b.events, id)
		}
	}
}

func (b *simBackend) CuCtxDestroyV2(ctx uint64) Result {
	c, ok := b.ctxs[ctx]
	if !ok || c.primary {
		return ErrorInvalidContext
	}
	b.freeCtx(c)
	delete(b.ctxs, ctx)
	if b.cur == c {
		b.cur = nil
	}
	return Success
}

func (b *simBackend) CuCtxSetCurrent(ctx uint64) Result    { return b.Bind(ctx) }
func (b *simBackend) CuCtxPushCurrentV2(ctx uint64) Result { return b.Bind(ctx) }

func (b *simBackend) CuCtxGetDevice() (int32, Result) {
	if b.cur == nil {
		return 0, ErrorInvalidContext
	}
	return b.cur.dev, Success
}

func (b *simBackend) CuCtxSynchronize() Result {
	if b.cur == nil {
		return ErrorInvalidContext
	}
	return Success
}

func (b *simBackend) CuCtxGetApiVersion(ctx uint64) (uint32, Result) {
	if ctx == 0 && b.cur == nil {
		return 0, ErrorInvalidContext
	}
	return 3020, Success
}

func (b *simBackend) CuCtxGetFlags() (uint32, Result) {
	if b.cur == nil {
		return 0, ErrorInvalidContext
	}
	return b.cur.flags, Success
}

func (b *simBackend) CuCtxGetLimit(limit uint32) (uint64, Result) {
	if b.cur == nil {
		return 0, ErrorInvalidContext
	}
	v, ok := b.cur.limits[limit]
	if !ok {
		return 0, ErrorUnsupportedLimit()
	}
	return v, Success
}

func (b *simBackend) CuCtxSetLimit(limit uint32, value uint64) Result {
	if b.cur == nil {
		return ErrorInvalidContext
	}
	if _, ok := b.cur.limits[limit]; !ok {
		return ErrorUnsupportedLimit()
	}
	b.cur.limits[limit] = value
	return Success
}

// ErrorUnsupportedLimit is CUDA_ERROR_UNSUPPORTED_LIMIT (215), which the
// description's error list does not name.
func ErrorUnsupportedLimit() Result { return 215 }

func (b *simBackend) CuCtxGetStreamPriorityRange() (int32, int32, Result) {
	if b.cur == nil {
		return 0, 0, ErrorInvalidContext
	}
	return 0, -5, Success
}

// --- memory

func (b *simBackend) CuMemAllocV2(bytesize uint64) (uint64, Result) {
	if b.cur == nil {
		return 0, ErrorInvalidContext
	}
	if bytesize == 0 {
		return 0, ErrorInvalidValue
	}
	d := b.devs[b.cur.dev]
	if bytesize > d.MemoryBytes-min(d.MemoryBytes, b.mem.usedOn(b.cur.dev)) {
		return 0, ErrorOutOfMemory
	}
	return b.mem.alloc(b.cur, b.cur.dev, bytesize), Success
}

func (b *simBackend) CuMemFreeV2(p uint64) Result {
	if _, ok := b.mem.spans.remove(p); !ok {
		return ErrorInvalidValue
	}
	return Success
}

func (b *simBackend) CuMemGetInfoV2() (free, total uint64, r Result) {
	if b.cur == nil {
		return 0, 0, ErrorInvalidContext
	}
	total = b.devs[b.cur.dev].MemoryBytes
	return total - min(total, b.mem.usedOn(b.cur.dev)), total, Success
}

func (b *simBackend) stream(h uint64) Result {
	if b.cur == nil {
		return ErrorInvalidContext
	}
	if h <= 2 {
		return Success
	}
	if _, ok := b.streams[h]; !ok {
		return ErrorInvalidHandle
	}
	return Success
}

func (b *simBackend) copyIn(dst uint64, src []byte) Result {
	if b.cur == nil {
		return ErrorInvalidContext
	}
	return b.mem.write(dst, src)
}

func (b *simBackend) copyOut(dst []byte, src uint64) Result {
	if b.cur == nil {
		return ErrorInvalidContext
	}
	return b.mem.read(dst, src)
}

func (b *simBackend) copyDevice(dst, src, n uint64) Result {
	if b.cur == nil {
		return ErrorInvalidContext
	}
	buf := make([]byte, n)
	if r := b.mem.read(buf, src); r != Success {
		return r
	}
	return b.mem.write(dst, buf)
}

func (b *simBackend) CuMemcpyHtoDV2(dst uint64, src []byte, _ uint64) Result {
	return b.copyIn(dst, src)
}

func (b *simBackend) CuMemcpyDtoHV2(dst []byte, src uint64, _ uint64) Result {
	return b.copyOut(dst, src)
}

func (b *simBackend) CuMemcpyDtoDV2(dst, src, n uint64) Result { return b.copyDevice(dst, src, n) }

func (b *simBackend) CuMemcpyHtoDAsyncV2(dst uint64, src []byte, _ uint64, s uint64) Result {
	if r := b.stream(s); r != Success {
		return r
	}
	return b.copyIn(dst, src)
}

func (b *simBackend) CuMemcpyDtoHAsyncV2(dst []byte, src uint64, _ uint64, s uint64) Result {
	if r := b.stream(s); r != Success {
		return r
	}
	return b.copyOut(dst, src)
}

func (b *simBackend) CuMemcpyDtoDAsyncV2(dst, src, n uint64, s uint64) Result {
	if r := b.stream(s); r != Success {
		return r
	}
	return b.copyDevice(dst, src, n)
}

func (b *simBackend) memset(dst uint64, pattern []byte, n uint64, s uint64) Result {
	if r := b.stream(s); r != Success {
		return r
	}
	return b.mem.fill(dst, pattern, n)
}

func (b *simBackend) CuMemsetD8V2(dst uint64, v uint8, n uint64) Result {
	return b.memset(dst, []byte{v}, n, 0)
}

func (b *simBackend) CuMemsetD16V2(dst uint64, v uint16, n uint64) Result {
	return b.memset(dst, binary.LittleEndian.AppendUint16(nil, v), n, 0)
}

func (b *simBackend) CuMemsetD32V2(dst uint64, v uint32, n uint64) Result {
	return b.memset(dst, binary.LittleEndian.AppendUint32(nil, v), n, 0)
}

func (b *simBackend) CuMemsetD8Async(dst uint64, v uint8, n uint64, s uint64) Result {
	return b.memset(dst, []byte{v}, n, s)
}

func (b *simBackend) CuMemsetD16Async(dst uint64, v uint16, n uint64, s uint64) Result {
	return b.memset(dst, binary.LittleEndian.AppendUint16(nil, v), n, s)
}

func (b *simBackend) CuMemsetD32Async(dst uint64, v uint32, n uint64, s uint64) Result {
	return b.memset(dst, binary.LittleEndian.AppendUint32(nil, v), n, s)
}

// --- modules, libraries, functions

// load reads a module image onto the current context's device, for owner
// to free (nil for a library). Only PTX is understood: a cubin or fatbin
// needs the real driver.
func (b *simBackend) load(image []byte, owner *simCtx) (*simModule, Result) {
	if b.cur == nil {
		return nil, ErrorInvalidContext
	}
	if bytes.HasPrefix(image, []byte("\x7fELF")) || len(image) >= 4 && binary.LittleEndian.Uint32(image) == 0xba55ed50 {
		return nil, ErrorNotSupported
	}
	ptx, r, err := parsePTX(image)
	if err != nil {
		return nil, r
	}
	m := &simModule{ctx: owner, dev: b.cur.dev, ptx: ptx, globals: map[string]uint64{}}
	names := make([]string, 0, len(ptx.globals))
	for name := range ptx.globals {
		names = append(names, name)
	}
	slices.Sort(names)
	for _, name := range names {
		m.globals[name] = b.mem.alloc(owner, m.dev, ptx.globals[name])
	}
	return m, Success
}

func (b *simBackend) CuModuleLoadData(image []byte) (uint64, Result) {
	m, r := b.load(image, b.cur)
	if r != Success {
		return 0, r
	}
	id := b.id()
	b.modules[id] = m
	return id, Success
}

func (b *simBackend) unload(m *simModule) {
	for _, p := range m.globals {
		b.mem.spans.remove(p)
	}
	for id, f := range b.funcs {
		if f.module == m {
			delete(b.funcs, id)
		}
	}
}

func (b *simBackend) CuModuleUnload(h uint64) Result {
	m, ok := b.modules[h]
	if !ok {
		return ErrorInvalidHandle
	}
	b.unload(m)
	delete(b.modules, h)
	return Success
}

// function resolves an entry of m to a Go kernel: NOT_FOUND when the
// module has no such entry or the simulator no such kernel, or when the
// entry's parameters are not the kernel's.
func (b *simBackend) function(m *simModule, name string) (uint64, Result) {
	params, ok := m.ptx.entries[name]
	if !ok {
		return 0, ErrorNotFound
	}
	k, ok := simKernels[name]
	if !ok || len(k.params) != len(params) {
		return 0, ErrorNotFound
	}
	for i, p := range params {
		if p.Size != k.params[i] {
			return 0, ErrorNotFound
		}
	}
	id := b.id()
	b.funcs[id] = &simFunc{module: m, name: name, params: params, kernel: k, attrs: map[uint32]int32{}}
	return id, Success
}

func (b *simBackend) CuModuleGetFunction(h uint64, name string) (uint64, Result) {
	m, ok := b.modules[h]
	if !ok {
		return 0, ErrorInvalidHandle
	}
	return b.function(m, name)
}

func (b *simBackend) global(m *simModule, name string) (uint64, uint64, Result) {
	p, ok := m.globals[name]
	if !ok {
		return 0, 0, ErrorNotFound
	}
	return p, m.ptx.globals[name], Success
}

func (b *simBackend) CuModuleGetGlobalV2(h uint64, name string) (uint64, uint64, Result) {
	m, ok := b.modules[h]
	if !ok {
		return 0, 0, ErrorInvalidHandle
	}
	return b.global(m, name)
}

func (b *simBackend) GpupoolLibraryLoadData(code []byte) (uint64, Result) {
	m, r := b.load(code, nil)
	if r != Success {
		return 0, r
	}
	id := b.id()
	b.libraries[id] = m
	return id, Success
}

func (b *simBackend) CuLibraryUnload(h uint64) Result {
	m, ok := b.libraries[h]
	if !ok {
		return ErrorInvalidHandle
	}
	b.unload(m)
	delete(b.libraries, h)
	for id, mm := range b.modules {
		if mm == m {
			delete(b.modules, id)
		}
	}
	return Success
}

func (b *simBackend) CuLibraryGetKernel(h uint64, name string) (uint64, Result) {
	m, ok := b.libraries[h]
	if !ok {
		return 0, ErrorInvalidHandle
	}
	return b.function(m, name)
}

func (b *simBackend) CuLibraryGetModule(h uint64) (uint64, Result) {
	m, ok := b.libraries[h]
	if !ok {
		return 0, ErrorInvalidHandle
	}
	for id, mm := range b.modules {
		if mm == m {
			return id, Success
		}
	}
	id := b.id()
	b.modules[id] = m
	return id, Success
}

func (b *simBackend) CuKernelGetFunction(k uint64) (uint64, Result) {
	if _, ok := b.funcs[k]; !ok {
		return 0, ErrorInvalidHandle
	}
	return k, Success
}

func (b *simBackend) CuLibraryGetGlobal(h uint64, name string) (uint64, uint64, Result) {
	m, ok := b.libraries[h]
	if !ok {
		return 0, 0, ErrorInvalidHandle
	}
	return b.global(m, name)
}

func (b *simBackend) GpupoolFuncParams(f uint64, info []byte, _ uint32) (uint32, Result) {
	fn, ok := b.funcs[f]
	if !ok {
		return 0, ErrorInvalidHandle
	}
	if len(info) < 8*len(fn.params) {
		return 0, ErrorInvalidValue
	}
	for i, p := range fn.params {
		binary.LittleEndian.PutUint32(info[8*i:], p.Offset)
		binary.LittleEndian.PutUint32(info[8*i+4:], p.Size)
	}
	return uint32(len(fn.params)), Success
}

func (b *simBackend) CuFuncGetParamInfo(f uint64, i uint64) (uint64, uint64, Result) {
	fn, ok := b.funcs[f]
	if !ok {
		return 0, 0, ErrorInvalidHandle
	}
	if i >= uint64(len(fn.params)) {
		return 0, 0, ErrorInvalidValue
	}
	return uint64(fn.params[i].Offset), uint64(fn.params[i].Size), Success
}

func (b *simBackend) GpupoolLaunchKernel(f uint64, gx, gy, gz, bx, by, bz, shared uint32, s uint64, params []byte, _ uint32) Result {
	fn, ok := b.funcs[f]
	if !ok {
		return ErrorInvalidHandle
	}
	if r := b.stream(s); r != Success {
		return r
	}
	if gx == 0 || gy == 0 || gz == 0 || bx == 0 || by == 0 || bz == 0 ||
		uint64(bx)*uint64(by)*uint64(bz) > simMaxThreadsPerBlock || bz > 64 || gx > math.MaxInt32 || gy > 65535 || gz > 65535 {
		return ErrorInvalidValue
	}
	if shared > uint32(max(simSharedPerBlock, fn.attrs[8])) {
		return ErrorInvalidValue
	}
	l := &launch{threads: uint64(gx) * uint64(bx), mem: &b.mem}
	for _, p := range fn.params {
		if uint64(p.Offset)+uint64(p.Size) > uint64(len(params)) {
			return ErrorInvalidValue
		}
		l.args = append(l.args, params[p.Offset:p.Offset+p.Size])
	}
	return fn.kernel.run(l)
}

func (b *simBackend) CuFuncGetAttribute(attrib uint32, f uint64) (int32, Result) {
	fn, ok := b.funcs[f]
	if !ok {
		return 0, ErrorInvalidHandle
	}
	if v, ok := fn.attrs[attrib]; ok {
		return v, Success
	}
	d := b.devs[fn.module.dev]
	switch attrib {
	case 0:
		return simMaxThreadsPerBlock, Success
	case 1, 2, 3, 7:
		return 0, Success
	case 4:
		return 32, Success
	case 5:
		return int32(fn.module.ptx.version), Success
	case 6:
		return 10*d.Major + d.Minor, Success
	case 8:
		return simSharedPerBlock, Success
	case 9:
		return -1, Success
	}
	return 0, ErrorInvalidValue
}

func (b *simBackend) CuFuncSetAttribute(f uint64, attrib uint32, value int32) Result {
	fn, ok := b.funcs[f]
	if !ok {
		return ErrorInvalidHandle
	}
	switch {
	case attrib == 8 && value >= 0 && value <= simSharedOptin, attrib == 9 && value >= -1 && value <= 100:
		fn.attrs[attrib] = value
		return Success
	}
	return ErrorInvalidValue
}

func (b *simBackend) CuFuncSetCacheConfig(f uint64, config uint32) Result {
	if _, ok := b.funcs[f]; !ok {
		return ErrorInvalidHandle
	}
	if config > 3 {
		return ErrorInvalidValue
	}
	return Success
}

// blocksPerSM is how many blocks of blockSize threads with smem bytes of
// shared memory fit on one simulated SM.
func blocksPerSM(blockSize int32, smem uint64) int32 {
	warps := (blockSize + 31) / 32
	n := min(int32(simBlocksPerSM), simThreadsPerSM/(32*warps))
	if smem > 0 {
		n = min(n, int32(simSharedPerSM/smem))
	}
	return n
}

func (b *simBackend) CuOccupancyMaxActiveBlocksPerMultiprocessor(f uint64, blockSize int32, smem uint64) (int32, Result) {
	return b.CuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(f, blockSize, smem, 0)
}

func (b *simBackend) CuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(f uint64, blockSize int32, smem uint64, flags uint32) (int32, Result) {
	if _, ok := b.funcs[f]; !ok {
		return 0, ErrorInvalidHandle
	}
	if blockSize <= 0 || blockSize > simMaxThreadsPerBlock || flags > 1 {
		return 0, ErrorInvalidValue
	}
	return blocksPerSM(blockSize, smem), Success
}

func (b *simBackend) GpupoolOccupancyMaxPotentialBlockSize(f uint64, smem uint64, limit int32) (minGrid, block int32, r Result) {
	fn, ok := b.funcs[f]
	if !ok {
		return 0, 0, ErrorInvalidHandle
	}
	if limit <= 0 || limit > simMaxThreadsPerBlock {
		limit = simMaxThreadsPerBlock
	}
	best := int32(0)
	for bs := int32(32); bs <= limit; bs += 32 {
		if n := blocksPerSM(bs, smem) * bs; n > best || n == best {
			best, block = n, bs
		}
	}
	if block == 0 {
		return 0, 0, ErrorInvalidValue
	}
	return blocksPerSM(block, smem) * b.devs[fn.module.dev].SMs, block, Success
}

func (b *simBackend) CuOccupancyAvailableDynamicSMemPerBlock(f uint64, numBlocks, blockSize int32) (uint64, Result) {
	if _, ok := b.funcs[f]; !ok {
		return 0, ErrorInvalidHandle
	}
	if numBlocks <= 0 || blockSize <= 0 || blockSize > simMaxThreadsPerBlock {
		return 0, ErrorInvalidValue
	}
	return min(uint64(simSharedPerSM/numBlocks), simSharedOptin), Success
}

// --- streams and events

func (b *simBackend) CuStreamCreate(flags uint32) (uint64, Result) {
	return b.CuStreamCreateWithPriority(flags, 0)
}

func (b *simBackend) CuStreamCreateWithPriority(flags uint32, priority int32) (uint64, Result) {
	if b.cur == nil {
		return 0, ErrorInvalidContext
	}
	if flags > 1 {
		return 0, ErrorInvalidValue
	}
	id := b.id()
	b.streams[id] = &simStream{ctx: b.cur, flags: flags, priority: min(0, max(priority, -5))}
	return id, Success
}

func (b *simBackend) CuStreamDestroyV2(s uint64) Result {
	if _, ok := b.streams[s]; !ok {
		return ErrorInvalidHandle
	}
	delete(b.streams, s)
	return Success
}

func (b *simBackend) CuStreamSynchronize(s uint64) Result { return b.stream(s) }
func (b *simBackend) CuStreamQuery(s uint64) Result       { return b.stream(s) }

func (b *simBackend) CuStreamWaitEvent(s, e uint64, flags uint32) Result {
	if r := b.stream(s); r != Success {
		return r
	}
	if _, ok := b.events[e]; !ok {
		return ErrorInvalidHandle
	}
	if flags > 1 {
		return ErrorInvalidValue
	}
	return Success
}

func (b *simBackend) CuStreamGetFlags(s uint64) (uint32, Result) {
	if r := b.stream(s); r != Success {
		return 0, r
	}
	if st, ok := b.streams[s]; ok {
		return st.flags, Success
	}
	return 0, Success
}

func (b *simBackend) CuStreamGetPriority(s uint64) (int32, Result) {
	if r := b.stream(s); r != Success {
		return 0, r
	}
	if st, ok := b.streams[s]; ok {
		return st.priority, Success
	}
	return 0, Success
}

func (b *simBackend) CuStreamGetCtx(s uint64) (uint64, Result) {
	if r := b.stream(s); r != Success {
		return 0, r
	}
	if st, ok := b.streams[s]; ok {
		return st.ctx.id, Success
	}
	return b.cur.id, Success
}

func (b *simBackend) CuEventCreate(flags uint32) (uint64, Result) {
	if b.cur == nil {
		return 0, ErrorInvalidContext
	}
	if flags&^0x7 != 0 {
		return 0, ErrorInvalidValue
	}
	id := b.id()
	b.events[id] = &simEvent{ctx: b.cur, flags: flags}
	return id, Success
}

func (b *simBackend) CuEventDestroyV2(e uint64) Result {
	if _, ok := b.events[e]; !ok {
		return ErrorInvalidHandle
	}
	delete(b.events, e)
	return Success
}

func (b *simBackend) CuEventRecord(e, s uint64) Result { return b.CuEventRecordWithFlags(e, s, 0) }

func (b *simBackend) CuEventRecordWithFlags(e, s uint64, flags uint32) Result {
	ev, ok := b.events[e]
	if !ok {
		return ErrorInvalidHandle
	}
	if r := b.stream(s); r != Success {
		return r
	}
	if flags > 1 {
		return ErrorInvalidValue
	}
	ev.recorded, ev.at = true, b.now()
	return Success
}

func (b *simBackend) CuEventSynchronize(e uint64) Result {
	if _, ok := b.events[e]; !ok {
		return ErrorInvalidHandle
	}
	return Success
}

func (b *simBackend) CuEventQuery(e uint64) Result { return b.CuEventSynchronize(e) }

func (b *simBackend) CuEventElapsedTime(start, end uint64) (float32, Result) {
	s, ok1 := b.events[start]
	e, ok2 := b.events[end]
	if !ok1 || !ok2 {
		return 0, ErrorInvalidHandle
	}
	if s.flags&2 != 0 || e.flags&2 != 0 { // CU_EVENT_DISABLE_TIMING
		return 0, ErrorInvalidHandle
	}
	if !s.recorded || !e.recorded {
		return 0, ErrorNotReady
	}
	return float32(e.at.Sub(s.at).Seconds() * 1000), Success
}

// pciBusID is a simulated device's PCI address: bus dev+1, as
// CU_DEVICE_ATTRIBUTE_PCI_BUS_ID says.
func pciBusID(dev int32) string { return fmt.Sprintf("00000000:%02X:00.0", dev+1) }

func (b *simBackend) CuDeviceGetPCIBusId(id []byte, _ int32, dev int32) Result {
	if _, r := b.dev(dev); r != Success {
		return r
	}
	if len(id) == 0 {
		return ErrorInvalidValue
	}
	n := copy(id[:len(id)-1], pciBusID(dev))
	id[n] = 0
	return Success
}

func (b *simBackend) CuDeviceGetByPCIBusId(id string) (int32, Result) {
	for i := range b.devs {
		if strings.EqualFold(id, pciBusID(int32(i))) || strings.EqualFold("0000"+id, pciBusID(int32(i))) {
			return int32(i), Success
		}
	}
	return 0, ErrorInvalidValue
}

// CuDeviceCanAccessPeer: the simulated parts are NVLink-connected.
func (b *simBackend) CuDeviceCanAccessPeer(dev, peer int32) (int32, Result) {
	if _, r := b.dev(dev); r != Success {
		return 0, r
	}
	if _, r := b.dev(peer); r != Success {
		return 0, r
	}
	if dev == peer {
		return 0, Success
	}
	return 1, Success
}

func (b *simBackend) CuCtxGetCacheConfig() (uint32, Result) {
	if b.cur == nil {
		return 0, ErrorInvalidContext
	}
	return b.cur.cache, Success
}

func (b *simBackend) CuCtxSetCacheConfig(config uint32) Result {
	if b.cur == nil {
		return ErrorInvalidContext
	}
	if config > 3 {
		return ErrorInvalidValue
	}
	b.cur.cache = config
	return Success
}
