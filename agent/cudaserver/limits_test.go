package cudaserver

import (
	"log/slog"
	"os"
	"strings"
	"testing"

	"github.com/gpupool/gpupool/cuda/wire"
)

// newLimitedServer is a server whose sessions hold at most lim, logging
// to the returned buffer.
func newLimitedServer(t *testing.T, lim SessionLimits) (*Server, *syncBuffer) {
	t.Helper()
	var logs syncBuffer
	srv, err := New(Config{
		Devices: []Device{{Index: 0, MemoryBytes: testLimit}},
		NewBackend: func() (Backend, error) {
			return NewSimBackend([]SimDevice{DefaultSimDevice([16]byte{1})}, nil), nil
		},
		Logger: slog.New(slog.NewTextHandler(&logs, nil)),
		Limits: &lim,
	})
	if err != nil {
		t.Fatal(err)
	}
	return srv, &logs
}

func testPTX(t *testing.T) []byte {
	t.Helper()
	ptx, err := os.ReadFile("../../cuda/shimtest/testdata/kernels.ptx")
	if err != nil {
		t.Fatal(err)
	}
	return ptx
}

// created returns the handle a create call answered, or fails t.
func created(t *testing.T, what string, r Result, h uint64) uint64 {
	t.Helper()
	if r != Success {
		t.Fatalf("%s: got %v, want success", what, r)
	}
	return h
}

func TestCreatingOnePastEachSessionLimitFailsOutOfMemoryLogsOnceAndDestroyingFreesASlot(t *testing.T) {
	const max = 3
	type state struct {
		tc  *testClient
		ptx []byte
		mod []uint64 // modules to resolve functions in, the first in use
	}
	for _, tt := range []struct {
		name  string
		limit string // its name in the log
		set   func(l *SessionLimits)
		// held is how many the session holds before the first create:
		// session() made a context.
		held   int
		create func(t *testing.T, s *state) (uint64, Result)
		free   func(t *testing.T, s *state, h uint64)
	}{
		{"contexts", "contexts", func(l *SessionLimits) { l.Contexts = max }, 1,
			func(t *testing.T, s *state) (uint64, Result) {
				r, d := s.tc.call(opCuCtxCreateV2, uint32(0), int32(0))
				return d.U64(), r
			},
			func(t *testing.T, s *state, h uint64) {
				if r, _ := s.tc.call(opCuCtxDestroyV2, h); r != Success {
					t.Fatalf("cuCtxDestroy: got %v, want success", r)
				}
			}},
		{"streams", "streams", func(l *SessionLimits) { l.Streams = max }, 0,
			func(t *testing.T, s *state) (uint64, Result) {
				r, d := s.tc.call(opCuStreamCreate, uint32(0))
				return d.U64(), r
			},
			func(t *testing.T, s *state, h uint64) {
				if r, _ := s.tc.call(opCuStreamDestroyV2, h); r != Success {
					t.Fatalf("cuStreamDestroy: got %v, want success", r)
				}
			}},
		{"streams with a priority", "streams", func(l *SessionLimits) { l.Streams = max }, 0,
			func(t *testing.T, s *state) (uint64, Result) {
				r, d := s.tc.call(opCuStreamCreateWithPriority, uint32(0), int32(0))
				return d.U64(), r
			},
			func(t *testing.T, s *state, h uint64) {
				if r, _ := s.tc.call(opCuStreamDestroyV2, h); r != Success {
					t.Fatalf("cuStreamDestroy: got %v, want success", r)
				}
			}},
		{"events", "events", func(l *SessionLimits) { l.Events = max }, 0,
			func(t *testing.T, s *state) (uint64, Result) {
				r, d := s.tc.call(opCuEventCreate, uint32(0))
				return d.U64(), r
			},
			func(t *testing.T, s *state, h uint64) {
				if r, _ := s.tc.call(opCuEventDestroyV2, h); r != Success {
					t.Fatalf("cuEventDestroy: got %v, want success", r)
				}
			}},
		{"modules", "modules", func(l *SessionLimits) { l.Modules = max }, 0,
			func(t *testing.T, s *state) (uint64, Result) {
				r, d := s.tc.call(opCuModuleLoadData, s.ptx)
				return d.U64(), r
			},
			func(t *testing.T, s *state, h uint64) {
				if r, _ := s.tc.call(opCuModuleUnload, h); r != Success {
					t.Fatalf("cuModuleUnload: got %v, want success", r)
				}
			}},
		{"libraries, which count as modules", "modules", func(l *SessionLimits) { l.Modules = max }, 0,
			func(t *testing.T, s *state) (uint64, Result) {
				r, d := s.tc.call(opGpupoolLibraryLoadData, s.ptx)
				return d.U64(), r
			},
			func(t *testing.T, s *state, h uint64) {
				if r, _ := s.tc.call(opCuLibraryUnload, h); r != Success {
					t.Fatalf("cuLibraryUnload: got %v, want success", r)
				}
			}},
		{"functions, freed by unloading their module", "functions", func(l *SessionLimits) { l.Functions = max }, 0,
			func(t *testing.T, s *state) (uint64, Result) {
				if s.mod == nil {
					for range 2 {
						r, d := s.tc.call(opCuModuleLoadData, s.ptx)
						s.mod = append(s.mod, created(t, "cuModuleLoadData", r, d.U64()))
					}
				}
				r, d := s.tc.call(opCuModuleGetFunction, s.mod[0], "vecadd")
				return d.U64(), r
			},
			func(t *testing.T, s *state, _ uint64) {
				if r, _ := s.tc.call(opCuModuleUnload, s.mod[0]); r != Success {
					t.Fatalf("cuModuleUnload: got %v, want success", r)
				}
				s.mod = s.mod[1:]
			}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			lim := DefaultSessionLimits()
			tt.set(&lim)
			srv, logs := newLimitedServer(t, lim)
			s := &state{tc: dial(t, srv), ptx: testPTX(t)}
			s.tc.session()
			var last uint64
			for i := tt.held; i < max; i++ {
				h, r := tt.create(t, s)
				last = created(t, "one within the limit", r, h)
			}
			for i := range 3 {
				if _, r := tt.create(t, s); r != ErrorOutOfMemory {
					t.Fatalf("create %d past the limit of %d: got %v, want CUDA_ERROR_OUT_OF_MEMORY", i+1, max, r)
				}
			}
			if got := strings.Count(logs.String(), "limit="+tt.limit+" "); got != 1 {
				t.Errorf("log lines naming the limit after 3 refusals: got %d, want 1; logs:\n%s", got, logs.String())
			}
			if !strings.Contains(logs.String(), "session=1") || !strings.Contains(logs.String(), "max=3") {
				t.Errorf("the log line names neither the session nor the limit's value; logs:\n%s", logs.String())
			}
			tt.free(t, s, last)
			if h, r := tt.create(t, s); r != Success {
				t.Errorf("a create after destroying one: got %v (%#x), want success", r, h)
			}
		})
	}
}

func TestTheLimitsCountEachSessionOnItsOwn(t *testing.T) {
	lim := DefaultSessionLimits()
	lim.Streams = 1
	srv, _ := newLimitedServer(t, lim)
	for i := range 2 {
		tc := dial(t, srv)
		tc.session()
		if r, _ := tc.call(opCuStreamCreate, uint32(0)); r != Success {
			t.Errorf("session %d's one stream: got %v, want success", i+1, r)
		}
	}
}

func TestAPrimaryContextDoesNotCountAgainstTheContextLimit(t *testing.T) {
	lim := DefaultSessionLimits()
	lim.Contexts = 1
	srv, _ := newLimitedServer(t, lim)
	tc := dial(t, srv)
	if r, _ := tc.call(opCuInit, uint32(0)); r != Success {
		t.Fatalf("cuInit: got %v, want success", r)
	}
	if r, _ := tc.call(opCuDevicePrimaryCtxRetain, int32(0)); r != Success {
		t.Fatalf("cuDevicePrimaryCtxRetain: got %v, want success", r)
	}
	if r, _ := tc.call(opCuCtxCreateV2, uint32(0), int32(0)); r != Success {
		t.Errorf("one created context beside the primary one: got %v, want success", r)
	}
}

// Every call that creates an object is bounded: by its limit, or by the
// objects the session already holds (it returns one of theirs).
func TestEveryCallThatCreatesAnObjectIsBoundedByASessionLimit(t *testing.T) {
	boundedByWhatItHolds := map[uint16]string{
		opCuDevicePrimaryCtxRetain: "one primary context per device",
		opCuLibraryGetModule:       "one module per library",
		opCuStreamGetCtx:           "the context of a stream the session holds",
	}
	for op := range opCreates {
		_, limited := opLimits[op]
		_, held := boundedByWhatItHolds[op]
		if limited == held {
			t.Errorf("%s: in opLimits %v, bounded by what the session holds %v; want exactly one", opNames[op], limited, held)
		}
	}
	for op := range opLimits {
		if !opCreates[op] {
			t.Errorf("%s: limited but creates no handle", opNames[op])
		}
	}
}

func TestSessionLimitsOutOfRangeAreRefusedNamingTheFlagAndTheRange(t *testing.T) {
	for _, tt := range []struct {
		name string
		set  func(l *SessionLimits)
		flag string
	}{
		{"no contexts", func(l *SessionLimits) { l.Contexts = 0 }, FlagSessionContexts},
		{"negative streams", func(l *SessionLimits) { l.Streams = -1 }, FlagSessionStreams},
		{"more events than a session has handles", func(l *SessionLimits) { l.Events = MaxSessionLimit + 1 }, FlagSessionEvents},
		{"no modules", func(l *SessionLimits) { l.Modules = 0 }, FlagSessionModules},
		{"no functions", func(l *SessionLimits) { l.Functions = 0 }, FlagSessionFunctions},
	} {
		t.Run(tt.name, func(t *testing.T) {
			lim := DefaultSessionLimits()
			tt.set(&lim)
			err := lim.Validate()
			if err == nil {
				t.Fatal("got nil, want an error")
			}
			if msg := err.Error(); !strings.Contains(msg, "--"+tt.flag+" ") || !strings.Contains(msg, "between 1 and 65536") {
				t.Errorf("got %q, want it to name --%s and the range 1 to 65536", msg, tt.flag)
			}
			if _, err := New(Config{Devices: []Device{{}}, NewBackend: func() (Backend, error) { return nil, nil }, Limits: &lim}); err == nil {
				t.Error("New: got nil, want the same error")
			}
		})
	}
	if err := DefaultSessionLimits().Validate(); err != nil {
		t.Errorf("the defaults: got %v, want nil", err)
	}
}

// The probe that found the missing limits made 20,000 streams in one
// session: with the defaults, the 1025th fails.
func TestTheDefaultLimitsStopAProbeOfTwentyThousandStreamsAt1024(t *testing.T) {
	srv, _ := newLimitedServer(t, DefaultSessionLimits())
	tc := dial(t, srv)
	tc.session()
	made := 0
	for range 20000 {
		r, _ := tc.call(opCuStreamCreate, uint32(0))
		if r != Success {
			if r != ErrorOutOfMemory {
				t.Fatalf("stream %d: got %v, want CUDA_ERROR_OUT_OF_MEMORY", made+1, r)
			}
			break
		}
		made++
	}
	if made != DefaultSessionLimits().Streams {
		t.Errorf("streams made: got %d, want %d", made, DefaultSessionLimits().Streams)
	}
}

// The driver destroys a context's streams, events and modules with it
// (and a primary context's on reset): so do their slots.
func TestDestroyingAContextFreesTheSlotsOfWhatItHeld(t *testing.T) {
	for _, tt := range contextEnds {
		t.Run(tt.name, func(t *testing.T) {
			lim := SessionLimits{Contexts: 2, Streams: 1, Events: 1, Modules: 1, Functions: 1}
			srv, _ := newLimitedServer(t, lim)
			tc := dial(t, srv)
			ptx := testPTX(t)
			if r, _ := tc.call(opCuInit, uint32(0)); r != Success {
				t.Fatalf("cuInit: got %v, want success", r)
			}
			fill := func() []Result {
				var rs []Result
				for _, c := range []struct {
					op   uint16
					args []any
				}{
					{opCuStreamCreate, []any{uint32(0)}},
					{opCuEventCreate, []any{uint32(0)}},
					{opCuModuleLoadData, []any{ptx}},
				} {
					r, d := tc.call(c.op, c.args...)
					rs = append(rs, r)
					if c.op == opCuModuleLoadData && r == Success {
						r, _ = tc.call(opCuModuleGetFunction, d.U64(), "vecadd")
						rs = append(rs, r)
					}
				}
				return rs
			}
			ctx := tt.context(t, tc)
			tc.ctx = ctx
			for i, r := range fill() {
				if r != Success {
					t.Fatalf("object %d in the first context: got %v, want success", i+1, r)
				}
			}
			tt.end(t, tc, ctx)
			tc.ctx = tt.context(t, tc)
			for i, r := range fill() {
				if r != Success {
					t.Errorf("object %d in a fresh context: got %v, want success", i+1, r)
				}
			}
		})
	}
}

// A loop that creates and destroys objects holds nothing more in the
// session than one object does.
func TestCreatingAndDestroyingInALoopLeavesTheSessionHoldingNothingMore(t *testing.T) {
	srv, _ := newLimitedServer(t, DefaultSessionLimits())
	s := newSession(srv, NewSimBackend([]SimDevice{DefaultSimDevice([16]byte{1})}, nil), slog.New(slog.DiscardHandler))
	t.Cleanup(s.close)
	var ctx uint64
	call := func(op uint16, args ...uint64) uint64 {
		t.Helper()
		var in, out wire.Encoder
		for _, a := range args {
			in.U64(a)
		}
		if op == opCuInit || op == opCuStreamCreate || op == opCuEventCreate {
			in.U32(0)
		}
		if op == opCuCtxCreateV2 {
			in.U32(0)
			in.I32(0)
		}
		r, err := s.call(wire.Header{Op: op, Word: ctx}, in.B, &out)
		if err != nil || r != Success {
			t.Fatalf("%s: got %v, %v; want success", opNames[op], r, err)
		}
		if len(out.B) >= 8 {
			return wire.NewDecoder(out.B).U64()
		}
		return 0
	}
	call(opCuInit)
	ctx = call(opCuCtxCreateV2)
	handles, owners := len(s.handles), len(s.owner)
	for range 1000 {
		call(opCuStreamDestroyV2, call(opCuStreamCreate))
		call(opCuEventDestroyV2, call(opCuEventCreate))
	}
	if len(s.handles) != handles || len(s.owner) != owners || s.held != [numLimits]int{limitContexts: 1} {
		t.Errorf("after 1000 streams and events made and destroyed: %d handles, %d owners, held %v; want %d, %d and one context",
			len(s.handles), len(s.owner), s.held, handles, owners)
	}
}
