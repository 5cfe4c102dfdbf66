package cudaserver

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gpupool/gpupool/cuda/wire"
)

const testLimit = 1 << 30

func newTestServer(t testing.TB, limit uint64) *Server {
	t.Helper()
	srv, err := New(Config{
		Devices: []Device{{Index: 0, MemoryBytes: limit}},
		NewBackend: func() (Backend, error) {
			return NewSimBackend([]SimDevice{DefaultSimDevice([16]byte{1})}, nil), nil
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	return srv
}

// testClient speaks the wire protocol to a session over a pipe.
type testClient struct {
	t    testing.TB
	c    net.Conn
	seq  uint32
	ctx  uint64
	done chan error
}

func dial(t testing.TB, srv *Server) *testClient {
	t.Helper()
	a, b := net.Pipe()
	tc := &testClient{t: t, c: a, done: make(chan error, 1)}
	go func() { tc.done <- srv.ServeConn(b) }()
	t.Cleanup(func() { a.Close() })
	var e wire.Encoder
	e.U32(wire.Magic)
	e.U32(Protocol)
	e.U32(APIHash)
	if r, _ := tc.raw(wire.OpHello, e.B); r != Success {
		t.Fatalf("handshake: got %v, want success", r)
	}
	return tc
}

func (tc *testClient) raw(op uint16, payload []byte) (Result, []byte) {
	tc.t.Helper()
	tc.seq++
	if _, err := tc.c.Write(wire.AppendFrame(nil, wire.Header{Op: op, Seq: tc.seq, Word: tc.ctx}, payload)); err != nil {
		tc.t.Fatalf("write: %v", err)
	}
	h, p, err := wire.ReadFrame(tc.c, nil)
	if err != nil {
		tc.t.Fatalf("read: %v", err)
	}
	if h.Seq != tc.seq || h.Op != op || h.Flags != wire.FlagReply {
		tc.t.Fatalf("got reply %+v, want op %d seq %d", h, op, tc.seq)
	}
	return Result(h.Word), p
}

// call encodes args (uint32, int32, uint64, string, []byte) in order.
func (tc *testClient) call(op uint16, args ...any) (Result, *wire.Decoder) {
	tc.t.Helper()
	var e wire.Encoder
	for _, a := range args {
		switch v := a.(type) {
		case uint32:
			e.U32(v)
		case int32:
			e.I32(v)
		case uint64:
			e.U64(v)
		case string:
			e.String(v)
		case []byte:
			e.Bytes(v)
		default:
			tc.t.Fatalf("arg %T", a)
		}
	}
	r, p := tc.raw(op, e.B)
	return r, wire.NewDecoder(p)
}

// session makes a context current and returns it.
func (tc *testClient) session() uint64 {
	tc.t.Helper()
	if r, _ := tc.call(opCuInit, uint32(0)); r != Success {
		tc.t.Fatalf("cuDriverGetVersion: %v", r)
	}
	r, d := tc.call(opCuCtxCreateV2, uint32(0), int32(0))
	if r != Success {
		tc.t.Fatalf("cuCtxCreate: %v", r)
	}
	tc.ctx = d.U64()
	return tc.ctx
}

func (tc *testClient) alloc(n uint64) (uint64, Result) {
	r, d := tc.call(opCuMemAllocV2, n)
	return d.U64(), r
}

// socketPair is a connected pair of loopback TCP connections: unlike
// net.Pipe, closing one end is an EOF at the other.
func socketPair(t testing.TB) (net.Conn, net.Conn) {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	a, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	b, err := l.Accept()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Close(); b.Close() })
	return a, b
}

func TestNewRefusesBadConfigs(t *testing.T) {
	sim := func() (Backend, error) { return NewSimBackend(nil, nil), nil }
	for _, tc := range []struct {
		name string
		cfg  Config
		want string
	}{
		{"no devices", Config{NewBackend: sim}, "Devices: at least one"},
		{"a negative device", Config{Devices: []Device{{Index: -1}}, NewBackend: sim}, "Devices[0].Index -1"},
		{"a device twice", Config{Devices: []Device{{Index: 0}, {Index: 0}}, NewBackend: sim}, "Devices[1].Index 0: want distinct"},
		{"no backend", Config{Devices: []Device{{Index: 0}}}, "NewBackend: required"},
		{"a negative close wait", Config{Devices: []Device{{Index: 0}}, NewBackend: sim, CloseWait: -time.Second}, "CloseWait -1s: must not be negative"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := New(tc.cfg); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("got %v, want an error containing %q", err, tc.want)
			}
		})
	}
}

func TestCallsBeforeInitFailNotInitialized(t *testing.T) {
	tc := dial(t, newTestServer(t, testLimit))
	if r, _ := tc.call(opCuDeviceGetCount); r != ErrorNotInitialized {
		t.Errorf("got %v, want CUDA_ERROR_NOT_INITIALIZED", r)
	}
	if r, d := tc.call(opCuDriverGetVersion); r != Success || d.I32() != SimDriverVersion {
		t.Errorf("cuDriverGetVersion before cuInit: got %v, want success", r)
	}
}

func TestTheSessionRefusesWhatItDoesNotOwn(t *testing.T) {
	tc := dial(t, newTestServer(t, testLimit))
	tc.session()
	p, r := tc.alloc(4096)
	if r != Success {
		t.Fatal(r)
	}
	for _, c := range []struct {
		name string
		op   uint16
		args []any
		want Result
	}{
		{"a copy past the allocation's end", opCuMemcpyHtoDV2, []any{p + 4000, make([]byte, 200), uint64(200)}, ErrorInvalidValue},
		{"a copy out of memory it never allocated", opCuMemcpyDtoHV2, []any{uint64(0x1000), uint64(16)}, ErrorInvalidValue},
		{"a copy larger than a frame may carry", opCuMemcpyDtoHV2, []any{p, uint64(wire.Chunk + 1)}, ErrorInvalidValue},
		{"a memset past the end", opCuMemsetD32V2, []any{p, uint32(0), uint64(1025)}, ErrorInvalidValue},
		{"a memset of an overflowing size", opCuMemsetD32V2, []any{p, uint32(0), ^uint64(0) / 2}, ErrorInvalidValue},
		{"freeing the inside of an allocation", opCuMemFreeV2, []any{p + 8}, ErrorInvalidValue},
		{"a stream of another session", opCuStreamSynchronize, []any{uint64(0xabc0)}, ErrorInvalidHandle},
		{"a module handle used as an event", opCuEventQuery, []any{tc.ctx}, ErrorInvalidHandle},
		{"a device beyond the lease", opCuDeviceGetAttribute, []any{uint32(16), int32(1)}, ErrorInvalidDevice},
		{"a negative name length", opCuDeviceGetName, []any{int32(-1), int32(0)}, ErrorInvalidValue},
	} {
		t.Run(c.name, func(t *testing.T) {
			if r, _ := tc.call(c.op, c.args...); r != c.want {
				t.Errorf("got %v, want %v", r, c.want)
			}
		})
	}
	tc.ctx = 0xdead0
	if r, _ := tc.call(opCuCtxSynchronize); r != ErrorInvalidContext {
		t.Errorf("a call bound to a context of another session: got %v, want CUDA_ERROR_INVALID_CONTEXT", r)
	}
}

func TestTheLeasesMemoryIsSharedByItsSessions(t *testing.T) {
	srv := newTestServer(t, 1<<20)
	a, b := dial(t, srv), dial(t, srv)
	a.session()
	b.session()
	if _, r := a.alloc(768 << 10); r != Success {
		t.Fatalf("first session: got %v, want success", r)
	}
	if _, r := b.alloc(512 << 10); r != ErrorOutOfMemory {
		t.Errorf("second session past the lease's memory: got %v, want CUDA_ERROR_OUT_OF_MEMORY", r)
	}
	r, d := b.call(opCuMemGetInfoV2)
	if free, total := d.U64(), d.U64(); r != Success || total != 1<<20 || free != 256<<10 {
		t.Errorf("cuMemGetInfo: got free %d total %d (%v), want 262144 of 1048576", free, total, r)
	}
	a.c.Close() // the first process exits: its memory returns to the lease
	if err := <-a.done; err != nil {
		t.Fatalf("session end: %v", err)
	}
	if _, r := b.alloc(512 << 10); r != Success {
		t.Errorf("after the first session ended: got %v, want success", r)
	}
}

func TestMalformedFramesEndTheSessionWithAnError(t *testing.T) {
	hello := func() []byte {
		var e wire.Encoder
		e.U32(wire.Magic)
		e.U32(Protocol)
		e.U32(APIHash)
		return wire.AppendFrame(nil, wire.Header{Op: wire.OpHello, Seq: 1}, e.B)
	}
	frame := func(op uint16, payload []byte) []byte {
		return wire.AppendFrame(nil, wire.Header{Op: op, Seq: 2}, payload)
	}
	huge := binary.LittleEndian.AppendUint32(nil, 1<<31)
	for _, c := range []struct {
		name  string
		bytes []byte
		want  error
	}{
		{"no handshake first", frame(opCuInit, []byte{0, 0, 0, 0}), errMalformed},
		{"a handshake without the magic", wire.AppendFrame(nil, wire.Header{}, []byte{1, 2, 3, 4, 1, 0, 0, 0}), errMalformed},
		{"a frame larger than the maximum", append(hello(), huge...), wire.ErrFrameTooLarge},
		{"a truncated frame", append(hello(), frame(opCuInit, []byte{0, 0, 0, 0})[:10]...), wire.ErrTruncated},
		{"arguments cut short", append(hello(), frame(opCuInit, []byte{0, 0})...), wire.ErrTruncated},
		{"trailing bytes", append(hello(), frame(opCuInit, []byte{0, 0, 0, 0, 9})...), wire.ErrTrailing},
		{"a buffer longer than its size argument", append(append(hello(), frame(opCuInit, []byte{0, 0, 0, 0})...), frame(opCuMemcpyHtoDV2, func() []byte {
			var e wire.Encoder
			e.U64(0)
			e.Bytes(make([]byte, 8))
			e.U64(4)
			return e.B
		}())...), errMalformed},
		{"a second handshake", append(hello(), hello()...), errMalformed},
	} {
		t.Run(c.name, func(t *testing.T) {
			srv := newTestServer(t, testLimit)
			a, b := socketPair(t)
			done := make(chan error, 1)
			go func() { done <- srv.ServeConn(b) }()
			go func() { // read and drop replies so the server never blocks
				buf := make([]byte, 4096)
				for {
					if _, err := a.Read(buf); err != nil {
						return
					}
				}
			}()
			go func() {
				_, _ = a.Write(c.bytes)
				if c.name == "a truncated frame" {
					// A half-close: a full close with the reply to the
					// handshake unread would be a reset, not an EOF.
					a.(*net.TCPConn).CloseWrite()
				}
			}()
			var err error
			select {
			case err = <-done:
			case <-time.After(time.Minute):
				t.Fatal("the session did not end")
			}
			a.Close()
			if !errors.Is(err, c.want) {
				t.Errorf("got %v, want %v", err, c.want)
			}
		})
	}
}

func TestAShimOfAnotherVersionIsToldBothVersions(t *testing.T) {
	srv := newTestServer(t, testLimit)
	a, b := net.Pipe()
	done := make(chan error, 1)
	go func() { done <- srv.ServeConn(b) }()
	defer a.Close()
	var e wire.Encoder
	e.U32(wire.Magic)
	e.U32(Protocol + 1)
	e.U32(APIHash)
	go a.Write(wire.AppendFrame(nil, wire.Header{Op: wire.OpHello, Seq: 1}, e.B))
	h, p, err := wire.ReadFrame(a, nil)
	if err != nil {
		t.Fatal(err)
	}
	d := wire.NewDecoder(p)
	server, hash, msg := d.U32(), d.U32(), d.String()
	if want := fmt.Sprintf("protocol %d (API %08x), this server %d (API %08x)", Protocol+1, APIHash, Protocol, APIHash); Result(h.Word) != ErrorSystemDriverMismatch ||
		server != Protocol || hash != APIHash || !strings.Contains(msg, want) {
		t.Errorf("got %v, server %d, %q; want CUDA_ERROR_SYSTEM_DRIVER_MISMATCH naming both versions", Result(h.Word), server, msg)
	}
	if err := <-done; err == nil {
		t.Error("the session went on after a version mismatch")
	}
}

// FuzzSession feeds arbitrary frames to a session after a good handshake:
// it may refuse them or end, but never panic or hang.
func FuzzSession(f *testing.F) {
	var e wire.Encoder
	e.U32(0)
	f.Add(wire.AppendFrame(nil, wire.Header{Op: opCuInit, Seq: 2}, e.B))
	e = wire.Encoder{}
	e.U64(1 << 20)
	f.Add(append(wire.AppendFrame(nil, wire.Header{Op: opCuInit, Seq: 2}, []byte{0, 0, 0, 0}),
		wire.AppendFrame(nil, wire.Header{Op: opCuMemAllocV2, Seq: 3}, e.B)...))
	e = wire.Encoder{}
	e.Bytes([]byte(".version 7.0\n.entry vecadd(.param .u64 a, .param .u64 b, .param .u64 c, .param .u32 n)\n"))
	f.Add(wire.AppendFrame(nil, wire.Header{Op: opCuModuleLoadData, Seq: 2}, e.B))
	f.Fuzz(func(t *testing.T, frames []byte) {
		srv := newTestServer(t, 1<<20)
		a, b := net.Pipe()
		done := make(chan error, 1)
		go func() { done <- srv.ServeConn(b) }()
		go func() {
			buf := make([]byte, 4096)
			for {
				if _, err := a.Read(buf); err != nil {
					return
				}
			}
		}()
		var e wire.Encoder
		e.U32(wire.Magic)
		e.U32(Protocol)
		e.U32(APIHash)
		_, _ = a.Write(wire.AppendFrame(nil, wire.Header{Op: wire.OpHello, Seq: 1}, e.B))
		_, _ = a.Write(bytes.Clone(frames))
		a.Close()
		<-done
	})
}

func TestTheClientSeesTheLeasesDevicesFromZeroInLeaseOrderWithTheirMemory(t *testing.T) {
	devs := []SimDevice{DefaultSimDevice([16]byte{0xa}), DefaultSimDevice([16]byte{0xb}), DefaultSimDevice([16]byte{0xc})}
	srv, err := New(Config{Devices: []Device{{Index: 2}, {Index: 0, MemoryBytes: 1 << 30}}, NewBackend: func() (Backend, error) { return NewSimBackend(devs, nil), nil }})
	if err != nil {
		t.Fatal(err)
	}
	tc := dial(t, srv)
	tc.call(opCuInit, uint32(0))
	if r, d := tc.call(opCuDeviceGetCount); r != Success || d.I32() != 2 {
		t.Errorf("cuDeviceGetCount: got %v, want 2 devices", r)
	}
	for ordinal, want := range []byte{0xc, 0xa} {
		r, d := tc.call(opCuDeviceGet, int32(ordinal))
		dev := d.I32()
		if r != Success || dev != int32(ordinal) {
			t.Errorf("cuDeviceGet(%d): got %d (%v), want %d", ordinal, dev, r, ordinal)
		}
		r, d = tc.call(opCuDeviceGetUuid, dev)
		if u := d.UUID(); r != Success || u[0] != want {
			t.Errorf("device %d's UUID: got %x (%v), want the pool host's device %x", ordinal, u[0], r, want)
		}
	}
	for ordinal, want := range []uint64{40 << 30, 1 << 30} {
		if r, d := tc.call(opCuDeviceTotalMemV2, int32(ordinal)); r != Success || d.U64() != want {
			t.Errorf("device %d's total memory: got %v, want %d", ordinal, r, want)
		}
	}
	if r, _ := tc.call(opCuDeviceGet, int32(2)); r != ErrorInvalidDevice {
		t.Errorf("cuDeviceGet(2): got %v, want CUDA_ERROR_INVALID_DEVICE", r)
	}
	// A context on lease device 1 reports device 1, not the host's 0.
	r, d := tc.call(opCuCtxCreateV2, uint32(0), int32(1))
	if r != Success {
		t.Fatal(r)
	}
	tc.ctx = d.U64()
	if r, d := tc.call(opCuCtxGetDevice); r != Success || d.I32() != 1 {
		t.Errorf("cuCtxGetDevice: got %v, want lease device 1", r)
	}
}

func TestEventTimesComeFromTheInjectedClock(t *testing.T) {
	now := time.Unix(1000, 0)
	srv, err := New(Config{Devices: []Device{{Index: 0}}, NewBackend: func() (Backend, error) {
		return NewSimBackend([]SimDevice{DefaultSimDevice([16]byte{})}, func() time.Time { return now }), nil
	}})
	if err != nil {
		t.Fatal(err)
	}
	tc := dial(t, srv)
	tc.session()
	_, d := tc.call(opCuEventCreate, uint32(0))
	start := d.U64()
	_, d = tc.call(opCuEventCreate, uint32(0))
	end := d.U64()
	tc.call(opCuEventRecord, start, uint64(0))
	now = now.Add(1500 * time.Microsecond)
	tc.call(opCuEventRecord, end, uint64(0))
	r, d := tc.call(opCuEventElapsedTime, start, end)
	if ms := d.F32(); r != Success || ms != 1.5 {
		t.Errorf("got %v ms (%v), want 1.5", ms, r)
	}
}

func TestSpansDropWhatANewRangeOverlaps(t *testing.T) {
	var m spans[int]
	m.add(100, 50, 1)
	m.add(200, 50, 2)
	m.add(300, 50, 3)
	gone := m.dropOverlapping(140, 70) // [140, 210) meets the first two
	if len(gone) != 2 || len(m.s) != 1 || m.s[0].v != 3 {
		t.Errorf("got %d dropped and %v left, want 2 dropped and the third left", len(gone), m.s)
	}
	if !m.contains(300, 50) || m.contains(300, 51) || m.contains(299, 1) {
		t.Error("contains: want exactly [300, 350)")
	}
}

func TestListenAndServeMakesAPrivateSocketAndRemovesIt(t *testing.T) {
	dir, err := os.MkdirTemp("", "cuda")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	path := filepath.Join(dir, "s")
	srv := newTestServer(t, testLimit)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.ListenAndServe(ctx, path) }()
	var c net.Conn
	deadline := time.Now().Add(time.Minute)
	for c == nil {
		if c, err = net.Dial("unix", path); err != nil {
			if time.Now().After(deadline) {
				t.Fatalf("the socket never accepted: %v", err)
			}
			c = nil
			time.Sleep(10 * time.Millisecond)
		}
	}
	if fi, err := os.Stat(path); err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("socket mode: got %v (%v), want 0600", fi.Mode().Perm(), err)
	}
	tc := &testClient{t: t, c: c}
	var e wire.Encoder
	e.U32(wire.Magic)
	e.U32(Protocol)
	e.U32(APIHash)
	if r, _ := tc.raw(wire.OpHello, e.B); r != Success {
		t.Fatalf("handshake: %v", r)
	}
	cancel()
	if err := <-done; err != nil {
		t.Errorf("got %v, want nil once ctx ended", err)
	}
	if _, _, err := wire.ReadFrame(c, nil); err == nil {
		t.Error("the session survived the server's end")
	}
	if _, err := os.Stat(path); !os.IsNotExist(err) {
		t.Errorf("the socket is still there: %v", err)
	}
	if err := srv.ListenAndServe(context.Background(), filepath.Join(dir, "no", "s")); err == nil {
		t.Error("a socket in a missing directory: got nil, want an error")
	}
}

func TestASessionHoldsABoundedNumberOfObjects(t *testing.T) {
	defer func(h, a int) { maxHandles, maxAllocations = h, a }(maxHandles, maxAllocations)
	maxHandles, maxAllocations = 4, 3
	tc := dial(t, newTestServer(t, testLimit))
	tc.session() // one handle: the context
	for i := range 3 {
		if r, _ := tc.call(opCuStreamCreate, uint32(0)); r != Success {
			t.Fatalf("stream %d: got %v, want success", i, r)
		}
	}
	if r, _ := tc.call(opCuEventCreate, uint32(0)); r != ErrorOutOfMemory {
		t.Errorf("a fifth handle: got %v, want CUDA_ERROR_OUT_OF_MEMORY", r)
	}
	for i := range 3 {
		if _, r := tc.alloc(16); r != Success {
			t.Fatalf("allocation %d: got %v, want success", i, r)
		}
	}
	if _, r := tc.alloc(16); r != ErrorOutOfMemory {
		t.Errorf("a fourth allocation: got %v, want CUDA_ERROR_OUT_OF_MEMORY", r)
	}
}

// A session on a unix socket waits for its requests on its own thread,
// in the kernel (threadConn): whichever end closes, the session ends.
func TestASessionWaitingOnAUnixSocketEndsWhenEitherEndCloses(t *testing.T) {
	for _, tt := range []struct {
		name  string
		close func(srv *Server, client net.Conn)
	}{
		{"the client closes", func(_ *Server, c net.Conn) { c.Close() }},
		{"the server closes", func(srv *Server, _ net.Conn) { srv.Close() }},
	} {
		t.Run(tt.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "s")
			l, err := net.Listen("unix", path)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { l.Close() })
			srv := newTestServer(t, testLimit)
			done := make(chan error, 1)
			go func() {
				c, err := l.Accept()
				if err != nil {
					done <- err
					return
				}
				done <- srv.ServeConn(c)
			}()
			c, err := net.Dial("unix", path)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { c.Close() })
			tc := &testClient{t: t, c: c}
			var e wire.Encoder
			e.U32(wire.Magic)
			e.U32(Protocol)
			e.U32(APIHash)
			if r, _ := tc.raw(wire.OpHello, e.B); r != Success {
				t.Fatalf("handshake: %v", r)
			}
			if r, _ := tc.call(opCuDriverGetVersion); r != Success {
				t.Fatalf("cuDriverGetVersion: %v", r)
			}
			tt.close(srv, c)
			select {
			case err := <-done:
				if err != nil {
					t.Errorf("the session ended with %v, want nil", err)
				}
			case <-time.After(time.Minute):
				t.Fatal("the session still waits for a request")
			}
		})
	}
}

func TestOnSessionsHearsHowManySessionsAreOpenInOrder(t *testing.T) {
	heard := make(chan int, 16)
	srv, err := New(Config{
		Devices: []Device{{Index: 0, MemoryBytes: testLimit}},
		NewBackend: func() (Backend, error) {
			return NewSimBackend([]SimDevice{DefaultSimDevice([16]byte{1})}, nil), nil
		},
		OnSessions: func(open int) { heard <- open },
	})
	if err != nil {
		t.Fatal(err)
	}
	next := func() int {
		t.Helper()
		select {
		case n := <-heard:
			return n
		case <-time.After(time.Minute):
			t.Fatal("OnSessions was not called")
			return -1
		}
	}
	a := dial(t, srv)
	if n := next(); n != 1 {
		t.Fatalf("the first session: heard %d, want 1", n)
	}
	b := dial(t, srv)
	if n := next(); n != 2 {
		t.Fatalf("the second session: heard %d, want 2", n)
	}
	a.c.Close()
	if n := next(); n != 1 {
		t.Fatalf("the first session's end: heard %d, want 1", n)
	}
	srv.Close()
	if n := next(); n != 0 {
		t.Fatalf("Close: heard %d, want 0", n)
	}
	<-a.done // both sessions have ended
	<-b.done
	select {
	case n := <-heard:
		t.Errorf("after Close: heard %d, want nothing more", n)
	default:
	}
}

// closeGate is a backend whose Close waits for the test to open the gate.
type closeGate struct {
	Backend
	closing chan struct{} // closed when Close starts
	open    chan struct{} // closed by the test to let Close return
}

func (g *closeGate) Close() error {
	close(g.closing)
	<-g.open
	return g.Backend.Close()
}

// serveUnix runs srv.Serve on a fresh unix socket and returns its path.
func serveUnix(t *testing.T, srv *Server) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "s")
	l, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go srv.Serve(l)
	return path
}

// handshake dials path and says hello.
func handshake(t *testing.T, path string) *testClient {
	t.Helper()
	c, err := net.Dial("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	tc := &testClient{t: t, c: c}
	var e wire.Encoder
	e.U32(wire.Magic)
	e.U32(Protocol)
	e.U32(APIHash)
	if r, _ := tc.raw(wire.OpHello, e.B); r != Success {
		t.Fatalf("handshake: got %v, want success", r)
	}
	return tc
}

func TestCloseReturnsOnlyOnceTheSessionsServeStartedFreedTheirBackends(t *testing.T) {
	gate := &closeGate{closing: make(chan struct{}), open: make(chan struct{})}
	srv, err := New(Config{
		Devices: []Device{{Index: 0, MemoryBytes: testLimit}},
		NewBackend: func() (Backend, error) {
			gate.Backend = NewSimBackend([]SimDevice{DefaultSimDevice([16]byte{1})}, nil)
			return gate, nil
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	tc := handshake(t, serveUnix(t, srv))
	if r, _ := tc.call(opCuDriverGetVersion); r != Success {
		t.Fatalf("cuDriverGetVersion: got %v, want success", r)
	}
	closed := make(chan struct{})
	go func() {
		srv.Close()
		close(closed)
	}()
	select {
	case <-gate.closing:
	case <-time.After(time.Minute):
		t.Fatal("Close did not end the session")
	}
	select {
	case <-closed:
		t.Fatal("Close returned while a session was still freeing its backend")
	default:
	}
	close(gate.open)
	select {
	case <-closed:
	case <-time.After(time.Minute):
		t.Fatal("Close did not return once the session ended")
	}
}

func TestServeLogsASessionsErrorButNotAClientHangingUp(t *testing.T) {
	for _, tt := range []struct {
		name     string
		client   func(t *testing.T, path string)
		wantWarn bool
	}{
		{"a client that hangs up after its calls", func(t *testing.T, path string) {
			tc := handshake(t, path)
			if r, _ := tc.call(opCuDriverGetVersion); r != Success {
				t.Fatalf("cuDriverGetVersion: got %v, want success", r)
			}
			tc.c.Close()
		}, false},
		{"a client that calls before its handshake", func(t *testing.T, path string) {
			c, err := net.Dial("unix", path)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { c.Close() })
			if _, err := c.Write(wire.AppendFrame(nil, wire.Header{Op: opCuDriverGetVersion, Seq: 1}, nil)); err != nil {
				t.Fatal(err)
			}
		}, true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var logs syncBuffer
			srv, err := New(Config{
				Devices: []Device{{Index: 0, MemoryBytes: testLimit}},
				NewBackend: func() (Backend, error) {
					return NewSimBackend([]SimDevice{DefaultSimDevice([16]byte{1})}, nil), nil
				},
				Logger: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug})),
			})
			if err != nil {
				t.Fatal(err)
			}
			path := serveUnix(t, srv)
			tt.client(t, path)
			// The session may still run; Close waits for its end, and
			// with it its log line.
			waitLogged(t, &logs, "cuda session ended")
			srv.Close()
			got := strings.Contains(logs.String(), "level=WARN")
			if got != tt.wantWarn {
				t.Errorf("warned: got %v, want %v; logs:\n%s", got, tt.wantWarn, logs.String())
			}
		})
	}
}

// syncBuffer is a bytes.Buffer safe for a logger and a test together.
type syncBuffer struct {
	mu    sync.Mutex
	b     bytes.Buffer  // guarded by mu
	wrote chan struct{} // guarded by mu; closed on every write
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.wrote != nil {
		close(s.wrote)
		s.wrote = nil
	}
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// waitLogged waits until logs hold msg.
func waitLogged(t *testing.T, logs *syncBuffer, msg string) {
	t.Helper()
	deadline := time.After(time.Minute)
	for {
		logs.mu.Lock()
		if strings.Contains(logs.b.String(), msg) {
			logs.mu.Unlock()
			return
		}
		if logs.wrote == nil {
			logs.wrote = make(chan struct{})
		}
		wrote := logs.wrote
		logs.mu.Unlock()
		select {
		case <-wrote:
		case <-deadline:
			t.Fatalf("nothing logged %q; logs:\n%s", msg, logs.String())
		}
	}
}

// stuckBackend is a backend whose cuCtxSynchronize never returns while
// the test runs, as a driver call on a hung GPU.
type stuckBackend struct {
	Backend
	entered chan struct{} // closed when the call starts
	release chan struct{} // closed when the test ends
}

func (b *stuckBackend) CuCtxSynchronize() Result {
	close(b.entered)
	<-b.release
	return ErrorDeviceUnavailable
}

func TestCloseReturnsAfterCloseWaitNamingTheSessionsStuckInABackendCall(t *testing.T) {
	stuck := &stuckBackend{entered: make(chan struct{}), release: make(chan struct{})}
	t.Cleanup(func() { close(stuck.release) })
	var logs syncBuffer
	srv, err := New(Config{
		Devices: []Device{{Index: 0, MemoryBytes: testLimit}},
		NewBackend: func() (Backend, error) {
			stuck.Backend = NewSimBackend([]SimDevice{DefaultSimDevice([16]byte{1})}, nil)
			return stuck, nil
		},
		Logger:    slog.New(slog.NewTextHandler(&logs, nil)),
		CloseWait: time.Millisecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	tc := handshake(t, serveUnix(t, srv))
	ctx := tc.session()
	// The call never answers, so the client does not wait for its reply.
	frame := wire.AppendFrame(nil, wire.Header{Op: opCuCtxSynchronize, Seq: tc.seq + 1, Word: ctx}, nil)
	if _, err := tc.c.Write(frame); err != nil {
		t.Fatal(err)
	}
	<-stuck.entered

	closed := make(chan struct{})
	go func() {
		srv.Close()
		close(closed)
	}()
	select {
	case <-closed:
	case <-time.After(time.Minute):
		t.Fatal("Close did not return while a session was stuck in a backend call")
	}
	if got := logs.String(); !strings.Contains(got, "cuda server closed with sessions still running") || !strings.Contains(got, "sessions=[1]") {
		t.Errorf("Close logged:\n%s\nwant a warning naming session 1", got)
	}
}
