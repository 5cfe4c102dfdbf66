package device

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"reflect"
	"sync"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"
)

// Without libnvidia-ml, Init fails and any further NVML call would kill the
// test binary: passing at all shows every call is gated on Init.
func TestNVMLWithoutTheLibraryOffersNoGPUs(t *testing.T) {
	path := filepath.Join(t.TempDir(), "libnvidia-ml.so.1")
	b := newNVML(nvml.New(nvml.WithLibraryPath(path)), path)
	devs, err := b.Devices()
	if err != nil || len(devs) != 0 {
		t.Fatalf("Devices = %d devices, %v; want none and no error", len(devs), err)
	}
	if s, err := b.Sample(); err != nil || len(s) != 0 {
		t.Fatalf("Sample = %d samples, %v; want none and no error", len(s), err)
	}
	if err := b.WatchHealth(context.Background(), func(HealthEvent) {}); err != nil {
		t.Fatalf("WatchHealth = %v, want nil at once", err)
	}
	if want := "NVML library " + path + " not found: this host offers no GPUs"; b.Note() != want {
		t.Errorf("Note = %q, want %q", b.Note(), want)
	}
	if b.Name() != "nvml" {
		t.Errorf("Name = %q, want nvml", b.Name())
	}
	if err := b.Close(); err != nil {
		t.Errorf("Close: %v", err)
	}
}

// NewNVML on whatever this machine has: GPUs, or none and a note.
func TestNewNVMLEitherFindsGPUsOrSaysWhyNot(t *testing.T) {
	b := NewNVML("")
	t.Cleanup(func() { _ = b.Close() })
	devs, err := b.Devices()
	if err != nil {
		t.Fatalf("Devices: %v", err)
	}
	if len(devs) == 0 && b.Note() == "" {
		t.Errorf("no devices and no note, want a note saying why")
	}
	t.Logf("%d devices, note %q", len(devs), b.Note())
}

// mustNotPanic runs f, failing the test if it panics, as a go-nvml mock
// does when called for a function the test did not set.
func mustNotPanic(t *testing.T, what string, f func()) {
	t.Helper()
	done := make(chan any, 1)
	go func() {
		defer func() { done <- recover() }()
		f()
	}()
	select {
	case p := <-done:
		if p != nil {
			t.Fatalf("%s made an NVML call it must not: %v", what, p)
		}
	case <-time.After(waitLimit):
		t.Fatalf("%s did not return within %v", what, waitLimit)
	}
}

// After a failed Init, real NVML kills the process on any other call. The
// mock sets only Init, so any other call panics.
func TestNVMLAfterFailedInitMakesNoOtherCall(t *testing.T) {
	lib := &mock.Interface{InitFunc: func() nvml.Return { return nvml.ERROR_DRIVER_NOT_LOADED }}
	b := newNVML(lib, "libnvidia-ml.so.1")
	if want := "NVML failed to initialise (ERROR_DRIVER_NOT_LOADED): this host offers no GPUs"; b.Note() != want {
		t.Errorf("Note = %q, want %q", b.Note(), want)
	}
	mustNotPanic(t, "Devices", func() {
		if devs, err := b.Devices(); len(devs) != 0 || err != nil {
			t.Errorf("Devices = %d devices, %v; want none and no error", len(devs), err)
		}
	})
	mustNotPanic(t, "Sample", func() {
		if s, err := b.Sample(); len(s) != 0 || err != nil {
			t.Errorf("Sample = %d samples, %v; want none and no error", len(s), err)
		}
	})
	mustNotPanic(t, "WatchHealth", func() {
		// A context that never ends: WatchHealth must return at once.
		if err := b.WatchHealth(context.Background(), func(e HealthEvent) { t.Errorf("event %+v", e) }); err != nil {
			t.Errorf("WatchHealth = %v, want nil", err)
		}
	})
	mustNotPanic(t, "Close", func() {
		if err := b.Close(); err != nil {
			t.Errorf("Close = %v", err)
		}
	})
	if n := len(lib.InitCalls()); n != 1 {
		t.Errorf("Init called %d times, want 1", n)
	}
}

// fakeHost is a host of n real GPUs as go-nvml's mock.Interface plays it:
// healthy, idle and able to report every watched event. Tests change the
// functions they need to; a call to a function nobody set panics.
type fakeHost struct {
	lib  *mock.Interface
	gpus []*mock.Device
}

func newFakeHost(n int) *fakeHost {
	h := &fakeHost{}
	for i := range n {
		h.gpus = append(h.gpus, &mock.Device{
			GetUUIDFunc: func() (string, nvml.Return) { return fmt.Sprintf("GPU-fake-%d", i), nvml.SUCCESS },
			GetMemoryInfoFunc: func() (nvml.Memory, nvml.Return) {
				return nvml.Memory{Total: 80 << 30, Used: uint64(i+1) << 30, Free: uint64(79-i) << 30}, nvml.SUCCESS
			},
			GetUtilizationRatesFunc: func() (nvml.Utilization, nvml.Return) {
				return nvml.Utilization{Gpu: uint32(10 * i)}, nvml.SUCCESS
			},
			GetComputeRunningProcessesFunc:    func() ([]nvml.ProcessInfo, nvml.Return) { return nil, nvml.SUCCESS },
			GetMPSComputeRunningProcessesFunc: func() ([]nvml.ProcessInfo, nvml.Return) { return nil, nvml.SUCCESS },
			GetSupportedEventTypesFunc:        func() (uint64, nvml.Return) { return watchedEvents, nvml.SUCCESS },
			RegisterEventsFunc:                func(uint64, nvml.EventSet) nvml.Return { return nvml.SUCCESS },
		})
	}
	h.lib = &mock.Interface{
		InitFunc:           func() nvml.Return { return nvml.SUCCESS },
		ShutdownFunc:       func() nvml.Return { return nvml.SUCCESS },
		DeviceGetCountFunc: func() (int, nvml.Return) { return len(h.gpus), nvml.SUCCESS },
		DeviceGetHandleByIndexFunc: func(i int) (nvml.Device, nvml.Return) {
			if i < 0 || i >= len(h.gpus) {
				return nil, nvml.ERROR_INVALID_ARGUMENT
			}
			return h.gpus[i], nvml.SUCCESS
		},
	}
	return h
}

// backend returns the NVML backend of the host, closed when the test ends.
func (h *fakeHost) backend(t *testing.T) *nvmlBackend {
	t.Helper()
	b := newNVML(h.lib, "libnvidia-ml.so.1")
	t.Cleanup(func() {
		if err := b.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return b
}

func idleSample(i int) Sample {
	return Sample{UUID: fmt.Sprintf("GPU-fake-%d", i), Index: i, MemoryUsedMiB: int64(i+1) << 10, UtilizationPercent: int32(10 * i), Processes: []Process{}}
}

func TestNVMLSample(t *testing.T) {
	lost := func() (nvml.Memory, nvml.Return) { return nvml.Memory{}, nvml.ERROR_GPU_IS_LOST }
	for _, tc := range []struct {
		name  string
		setup func(h *fakeHost)
		want  []Sample
	}{
		{"an idle host", func(*fakeHost) {}, []Sample{idleSample(0), idleSample(1)}},
		{"unsupported queries leave their fields unknown", func(h *fakeHost) {
			h.gpus[1].GetMemoryInfoFunc = func() (nvml.Memory, nvml.Return) { return nvml.Memory{}, nvml.ERROR_NOT_SUPPORTED }
			h.gpus[1].GetUtilizationRatesFunc = func() (nvml.Utilization, nvml.Return) { return nvml.Utilization{}, nvml.ERROR_NOT_SUPPORTED }
			h.gpus[1].GetComputeRunningProcessesFunc = func() ([]nvml.ProcessInfo, nvml.Return) { return nil, nvml.ERROR_NOT_SUPPORTED }
			h.gpus[1].GetMPSComputeRunningProcessesFunc = func() ([]nvml.ProcessInfo, nvml.Return) { return nil, nvml.ERROR_NOT_SUPPORTED }
		}, []Sample{idleSample(0), {UUID: "GPU-fake-1", Index: 1, MemoryUsedMiB: -1, UtilizationPercent: -1}}},
		{"an MPS client both lists name counts once", func(h *fakeHost) {
			h.gpus[0].GetComputeRunningProcessesFunc = func() ([]nvml.ProcessInfo, nvml.Return) {
				return []nvml.ProcessInfo{{Pid: 42, UsedGpuMemory: 512 << 20}, {Pid: 7, UsedGpuMemory: 64 << 20}}, nvml.SUCCESS
			}
			h.gpus[0].GetMPSComputeRunningProcessesFunc = func() ([]nvml.ProcessInfo, nvml.Return) {
				return []nvml.ProcessInfo{{Pid: 42, UsedGpuMemory: 512 << 20}}, nvml.SUCCESS
			}
		}, []Sample{{UUID: "GPU-fake-0", Index: 0, MemoryUsedMiB: 1024, Processes: []Process{{7, 64}, {42, 512}}}, idleSample(1)}},
		{"a GPU lost during the sample is marked lost", func(h *fakeHost) {
			h.gpus[1].GetMemoryInfoFunc = lost
		}, []Sample{idleSample(0), {UUID: "GPU-fake-1", Index: 1, MemoryUsedMiB: -1, UtilizationPercent: -1, Lost: true}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newFakeHost(2)
			tc.setup(h)
			if got := mustSample(t, h.backend(t)); !reflect.DeepEqual(got, tc.want) {
				t.Errorf("Sample =\n%+v\nwant\n%+v", got, tc.want)
			}
		})
	}
}

func TestNVMLSampleNamesAGPULostSinceTheLastSample(t *testing.T) {
	h := newFakeHost(2)
	b := h.backend(t)
	mustSample(t, b)
	h.lib.DeviceGetHandleByIndexFunc = func(i int) (nvml.Device, nvml.Return) {
		if i == 0 {
			return nil, nvml.ERROR_GPU_IS_LOST
		}
		return h.gpus[i], nvml.SUCCESS
	}
	want := []Sample{{UUID: "GPU-fake-0", Index: 0, MemoryUsedMiB: -1, UtilizationPercent: -1, Lost: true}, idleSample(1)}
	if got := mustSample(t, b); !reflect.DeepEqual(got, want) {
		t.Errorf("Sample =\n%+v\nwant\n%+v", got, want)
	}
}

func TestNVMLSampleFailsWhenItCannotCountOrIdentify(t *testing.T) {
	for _, tc := range []struct {
		name    string
		setup   func(h *fakeHost)
		wantErr string
	}{
		{"count fails", func(h *fakeHost) {
			h.lib.DeviceGetCountFunc = func() (int, nvml.Return) { return 0, nvml.ERROR_UNKNOWN }
		}, "device: count GPUs: ERROR_UNKNOWN"},
		{"a UUID cannot be read", func(h *fakeHost) {
			h.gpus[1].GetUUIDFunc = func() (string, nvml.Return) { return "", nvml.ERROR_UNKNOWN }
		}, "device: GPU 1: read UUID: ERROR_UNKNOWN"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newFakeHost(2)
			tc.setup(h)
			_, err := h.backend(t).Sample()
			if !errors.Is(err, nvml.ERROR_UNKNOWN) || err.Error() != tc.wantErr {
				t.Errorf("Sample error = %v, want %s", err, tc.wantErr)
			}
		})
	}
}

// scriptedEvents is an event set that delivers events, then answers
// last (ERROR_TIMEOUT or an error) to every later Wait, after waiting as
// long as asked.
func scriptedEvents(last nvml.Return, events ...nvml.EventData) *mock.EventSet {
	var mu sync.Mutex
	return &mock.EventSet{
		FreeFunc: func() nvml.Return { return nvml.SUCCESS },
		WaitFunc: func(ms uint32) (nvml.EventData, nvml.Return) {
			mu.Lock()
			if len(events) > 0 {
				e := events[0]
				events = events[1:]
				mu.Unlock()
				return e, nvml.SUCCESS
			}
			mu.Unlock()
			if last == nvml.ERROR_TIMEOUT {
				<-time.After(time.Duration(ms) * time.Millisecond)
			}
			return nvml.EventData{}, last
		},
	}
}

func TestNVMLWatchHealthSkipsGPUsWithoutEvents(t *testing.T) {
	h := newFakeHost(3)
	h.gpus[0].GetSupportedEventTypesFunc = func() (uint64, nvml.Return) { return 0, nvml.ERROR_NOT_SUPPORTED }
	h.gpus[1].GetSupportedEventTypesFunc = func() (uint64, nvml.Return) {
		return nvml.EventTypeXidCriticalError | nvml.EventTypePState, nvml.SUCCESS
	}
	h.gpus[2].GetSupportedEventTypesFunc = func() (uint64, nvml.Return) { return nvml.EventTypeClock, nvml.SUCCESS }
	set := scriptedEvents(nvml.ERROR_TIMEOUT, nvml.EventData{Device: h.gpus[1], EventType: nvml.EventTypeXidCriticalError, EventData: 62})
	h.lib.EventSetCreateFunc = func() (nvml.EventSet, nvml.Return) { return set, nvml.SUCCESS }
	w := watch(t, h.backend(t))
	if got, want := w.next(t), (HealthEvent{UUID: "GPU-fake-1", Kind: HealthXid, Xid: 62, Critical: true, Reason: "Xid 62"}); got != want {
		t.Errorf("got %+v, want %+v", got, want)
	}
	if err := w.stop(t); err != nil {
		t.Errorf("WatchHealth = %v, want nil", err)
	}
	for i, want := range []uint64{0, nvml.EventTypeXidCriticalError, 0} {
		var got uint64
		for _, c := range h.gpus[i].RegisterEventsCalls() {
			got |= c.V
		}
		if got != want {
			t.Errorf("GPU %d registered for events %#x, want %#x", i, got, want)
		}
	}
	if n := len(set.FreeCalls()); n != 1 {
		t.Errorf("event set freed %d times, want 1", n)
	}
}

func TestNVMLWatchHealthWithoutEventsWaitsForItsContext(t *testing.T) {
	h := newFakeHost(2)
	for _, g := range h.gpus {
		g.GetSupportedEventTypesFunc = func() (uint64, nvml.Return) { return 0, nvml.ERROR_NOT_SUPPORTED }
	}
	// EventSetCreateFunc is unset: creating a set would panic.
	w := watch(t, h.backend(t))
	waitFor(t, "both GPUs were asked for their events", func() bool {
		return len(h.gpus[0].GetSupportedEventTypesCalls()) == 1 && len(h.gpus[1].GetSupportedEventTypesCalls()) == 1
	})
	select {
	case err := <-w.done:
		t.Fatalf("WatchHealth returned %v before its context ended", err)
	default:
	}
	if err := w.stop(t); err != nil {
		t.Errorf("WatchHealth = %v, want nil", err)
	}
}

func TestNVMLWatchHealthReportsLostGPUs(t *testing.T) {
	h := newFakeHost(2)
	set := scriptedEvents(nvml.ERROR_GPU_IS_LOST, nvml.EventData{Device: h.gpus[0], EventType: nvml.EventTypeSingleBitEccError})
	h.lib.EventSetCreateFunc = func() (nvml.EventSet, nvml.Return) { return set, nvml.SUCCESS }
	w := watch(t, h.backend(t))
	for _, want := range []HealthEvent{
		{UUID: "GPU-fake-0", Kind: HealthECC, Reason: "single-bit ECC error"},
		{Kind: HealthLost, Critical: true, Reason: "GPU is lost"},
	} {
		if got := w.next(t); got != want {
			t.Errorf("got %+v, want %+v", got, want)
		}
	}
	if n := len(set.FreeCalls()); n != 1 {
		t.Errorf("event set freed %d times once the GPUs were lost, want 1", n)
	}
	if err := w.stop(t); err != nil {
		t.Errorf("WatchHealth = %v, want nil", err)
	}
	if n := len(set.WaitCalls()); n != 2 {
		t.Errorf("waited %d times for events, want 2: none after the loss", n)
	}
}

func TestNVMLWatchHealthWithoutGPUsReturnsAtOnce(t *testing.T) {
	b := newFakeHost(0).backend(t)
	mustNotPanic(t, "WatchHealth", func() {
		if err := b.WatchHealth(context.Background(), func(HealthEvent) {}); err != nil {
			t.Errorf("WatchHealth = %v, want nil", err)
		}
	})
}

func TestNVMLWatchHealthFailsOnAWaitError(t *testing.T) {
	h := newFakeHost(1)
	h.lib.EventSetCreateFunc = func() (nvml.EventSet, nvml.Return) { return scriptedEvents(nvml.ERROR_UNKNOWN), nvml.SUCCESS }
	w := watch(t, h.backend(t))
	if err := w.returned(t); !errors.Is(err, nvml.ERROR_UNKNOWN) || err.Error() != "device: wait for health events: ERROR_UNKNOWN" {
		t.Errorf("WatchHealth = %v, want device: wait for health events: ERROR_UNKNOWN", err)
	}
}

// Close shuts NVML down only once WatchHealth has freed its event set and
// returned: a call into the unloaded library would kill the process.
func TestNVMLCloseWaitsForWatchHealth(t *testing.T) {
	h := newFakeHost(1)
	set := scriptedEvents(nvml.ERROR_TIMEOUT)
	h.lib.EventSetCreateFunc = func() (nvml.EventSet, nvml.Return) { return set, nvml.SUCCESS }
	h.lib.ShutdownFunc = func() nvml.Return {
		if n := len(set.FreeCalls()); n != 1 {
			t.Errorf("NVML shut down with the event set freed %d times, want 1", n)
		}
		return nvml.SUCCESS
	}
	b := newNVML(h.lib, "libnvidia-ml.so.1")
	w := watch(t, b)
	waitFor(t, "WatchHealth waits for events", func() bool { return len(set.WaitCalls()) > 0 })
	if err := b.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if err := w.returned(t); err != ErrClosed {
		t.Errorf("WatchHealth = %v after Close, want %v", err, ErrClosed)
	}
	if n := len(h.lib.ShutdownCalls()); n != 1 {
		t.Errorf("Shutdown called %d times, want 1", n)
	}
}

// waitFor polls cond until it holds, failing the test after waitLimit.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(waitLimit)
	tick := time.NewTicker(time.Millisecond)
	defer tick.Stop()
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting until %s", waitLimit, what)
		}
		<-tick.C
	}
}

// A note or an error names NVML's return code by its constant, never by
// the library's own text: go-nvml asks the loaded libnvidia-ml for that
// text, whose wording differs between driver releases ("Driver Not
// Loaded"), so it would differ from host to host.
func TestNVMLErrorsNameTheReturnCodeTheSameOnEveryHost(t *testing.T) {
	for _, tc := range []struct {
		ret  nvml.Return
		want string
	}{
		{nvml.ERROR_DRIVER_NOT_LOADED, "ERROR_DRIVER_NOT_LOADED"},
		{nvml.ERROR_LIBRARY_NOT_FOUND, "ERROR_LIBRARY_NOT_FOUND"},
		{nvml.ERROR_GPU_IS_LOST, "ERROR_GPU_IS_LOST"},
		{nvml.ERROR_RESET_TYPE_NOT_SUPPORTED, "ERROR_RESET_TYPE_NOT_SUPPORTED"},
		{nvml.ERROR_UNKNOWN, "ERROR_UNKNOWN"},
		{nvml.Return(4242), "NVML_RETURN_4242"},
	} {
		t.Run(tc.want, func(t *testing.T) {
			err := fmt.Errorf("device: count GPUs: %w", code(tc.ret))
			if got, want := err.Error(), "device: count GPUs: "+tc.want; got != want {
				t.Errorf("got %q, want %q", got, want)
			}
			if !errors.Is(err, tc.ret) {
				t.Errorf("errors.Is(%v, %d) = false, want the return code in the chain", err, int32(tc.ret))
			}
		})
	}
}

// A host with NVIDIA's library but no kernel driver gets a note that
// names the return code, whichever library answered. The real library is
// opened first where this machine has one: from then on go-nvml's own
// Return.Error() reads the library's wording, which the note must not.
func TestNVMLNoteNamesTheInitCode(t *testing.T) {
	real := NewNVML("")
	t.Cleanup(func() { _ = real.Close() })
	t.Logf("this machine's NVML: %q", real.Note())
	for _, tc := range []struct {
		ret  nvml.Return
		want string
	}{
		{nvml.ERROR_DRIVER_NOT_LOADED, "ERROR_DRIVER_NOT_LOADED"},
		{nvml.ERROR_NO_PERMISSION, "ERROR_NO_PERMISSION"},
		{nvml.ERROR_LIB_RM_VERSION_MISMATCH, "ERROR_LIB_RM_VERSION_MISMATCH"},
	} {
		lib := &mock.Interface{InitFunc: func() nvml.Return { return tc.ret }}
		b := newNVML(lib, "libnvidia-ml.so.1")
		if want := "NVML failed to initialise (" + tc.want + "): this host offers no GPUs"; b.Note() != want {
			t.Errorf("Note = %q, want %q", b.Note(), want)
		}
	}
}
