package cudaserver

import (
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gpupool/gpupool/cuda/wire"
)

// send writes a call without reading its answer, as the shim pipelines.
func (tc *testClient) send(op uint16, args ...any) {
	tc.t.Helper()
	var e wire.Encoder
	for _, a := range args {
		switch v := a.(type) {
		case uint32:
			e.U32(v)
		case uint64:
			e.U64(v)
		default:
			tc.t.Fatalf("arg %T", a)
		}
	}
	tc.seq++
	if _, err := tc.c.Write(wire.AppendFrame(nil, wire.Header{Op: op, Seq: tc.seq, Word: tc.ctx}, e.B)); err != nil {
		tc.t.Fatalf("write: %v", err)
	}
}

// recv reads the next answer.
func (tc *testClient) recv() (wire.Header, []byte) {
	tc.t.Helper()
	h, p, err := wire.ReadFrame(tc.c, nil)
	if err != nil {
		tc.t.Fatalf("read: %v", err)
	}
	return h, p
}

type wireCall struct {
	op   uint16
	args []any
}

func TestAFailedAsynchronousCallSticksAndTheCallsPipelinedAfterItDoNotRun(t *testing.T) {
	const n = 1024
	for _, tc := range []struct {
		name  string
		fail  func(p uint64) wireCall
		want  Result
		stick bool
	}{
		{"an event that is not the session's", func(uint64) wireCall {
			return wireCall{opCuEventRecord, []any{uint64(0xbad0), uint64(0)}}
		}, ErrorInvalidHandle, true},
		{"a memset past the allocation", func(p uint64) wireCall {
			return wireCall{opCuMemsetD32Async, []any{p, uint32(1), uint64(4 * n), uint64(0)}}
		}, ErrorInvalidValue, true},
		{"a launch of a function that is not the session's", func(uint64) wireCall {
			return wireCall{opGpupoolLaunchKernel, []any{uint64(0xf00), uint32(1), uint32(1), uint32(1), uint32(1), uint32(1), uint32(1), uint32(0), uint64(0), uint32(0), uint32(0)}}
		}, ErrorInvalidHandle, true},
		{"a synchronous copy past the allocation does not stick", func(p uint64) wireCall {
			return wireCall{opCuMemcpyDtoHV2, []any{p, uint64(8 * n)}}
		}, ErrorInvalidValue, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := dial(t, newTestServer(t, testLimit))
			c.session()
			p, r := c.alloc(4 * n)
			if r != Success {
				t.Fatalf("cuMemAlloc: %v", r)
			}
			fail := tc.fail(p)
			calls := []wireCall{
				{opCuMemsetD32Async, []any{p, uint32(7), uint64(n), uint64(0)}},
				fail,
				{opCuMemsetD32Async, []any{p, uint32(9), uint64(n), uint64(0)}},
				{opCuCtxSynchronize, nil},
				{opCuMemcpyDtoHV2, []any{p, uint64(4)}},
			}
			// All sent before any answer is read.
			sent := make(chan struct{})
			go func() {
				defer close(sent)
				for _, call := range calls {
					c.send(call.op, call.args...)
				}
			}()
			later := Success
			if tc.stick {
				later = tc.want
			}
			want := []Result{Success, tc.want, later, later, later}
			var last []byte
			for i := range calls {
				h, payload := c.recv()
				if got := Result(h.Word); got != want[i] {
					t.Errorf("answer %d (%s): got %v, want %v", i, opNames[calls[i].op], got, want[i])
				}
				last = payload
			}
			<-sent
			if !tc.stick {
				// The memset pipelined after the failure ran: 9 is in memory.
				d := wire.NewDecoder(last)
				if b := d.Bytes(); len(b) != 4 || b[0] != 9 {
					t.Errorf("got %v after the second memset, want 9", b)
				}
			}
		})
	}
}

// queueOf is the reply queue of the server's only session.
func queueOf(t *testing.T, srv *Server) *replyQueue {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		srv.mu.Lock()
		for _, q := range srv.queues {
			srv.mu.Unlock()
			return q
		}
		srv.mu.Unlock()
		runtime.Gosched()
	}
	t.Fatal("no session")
	return nil
}

func TestAClientThatStopsReadingMidCopyHoldsBoundedMemoryOnTheServer(t *testing.T) {
	const (
		chunk  = 1 << 20
		chunks = 256 // 256 MiB asked for, never read until the end
	)
	srv := newTestServer(t, testLimit)
	c := dial(t, srv)
	c.session()
	p, r := c.alloc(chunk)
	if r != Success {
		t.Fatalf("cuMemAlloc: %v", r)
	}
	c.send(opCuMemsetD8V2, p, uint32(0x5a), uint64(chunk))
	if h, _ := c.recv(); Result(h.Word) != Success {
		t.Fatalf("cuMemsetD8: %v", Result(h.Word))
	}
	runtime.GC()
	var before runtime.MemStats
	runtime.ReadMemStats(&before)

	var written atomic.Int32
	sent := make(chan struct{})
	go func() {
		defer close(sent)
		for range chunks {
			c.send(opCuMemcpyDtoHV2, p, uint64(chunk))
			written.Add(1)
		}
	}()
	q := queueOf(t, srv)
	deadline := time.Now().Add(time.Minute)
	for {
		if now, _ := q.queued(); now > maxQueuedReplyBytes-chunk-64 {
			break
		}
		if time.Now().After(deadline) {
			now, _ := q.queued()
			t.Fatalf("the server queued %d bytes of answers, never its most", now)
		}
		runtime.Gosched()
	}
	// The server stopped reading: the requests it took are those whose
	// answers it holds, and a few in hand.
	if n := written.Load(); n >= chunks {
		t.Errorf("the server took all %d requests of a client that reads nothing", n)
	}
	runtime.GC()
	var during runtime.MemStats
	runtime.ReadMemStats(&during)
	if grew := int64(during.HeapInuse) - int64(before.HeapInuse); grew > chunks*chunk/2 {
		t.Errorf("the heap grew by %d MiB for a client that reads nothing; want well under the %d MiB it asked for", grew>>20, chunks*chunk>>20)
	}
	// Reading resumes the session: every answer arrives, whole.
	for i := range chunks {
		h, payload := c.recv()
		if Result(h.Word) != Success || len(payload) != 4+chunk || payload[4] != 0x5a {
			t.Fatalf("answer %d: got %v with %d bytes, want success with %d", i, Result(h.Word), len(payload), 4+chunk)
		}
	}
	<-sent
	if _, high := q.queued(); high > maxQueuedReplyBytes {
		t.Errorf("the server queued up to %d bytes of answers, want at most %d", high, maxQueuedReplyBytes)
	}
}
