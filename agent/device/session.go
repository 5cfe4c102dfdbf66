package device

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// ErrClosed is returned by Devices, Sample and WatchHealth after Close.
var ErrClosed = errors.New("device: backend closed")

// session is the NVML library of one backend, shared by all its calls. It
// implements every Backend method but Name, the same way for every
// backend.
//
// No call reaches lib unless Init succeeded (ok), and none once Close has
// begun: Close shuts lib down only after running Devices and Sample calls
// have released mu and running WatchHealth calls have returned. That
// matters because go-nvml unloads libnvidia-ml on Shutdown, and a call
// into an unloaded or uninitialised library kills the process.
type session struct {
	lib   nvml.Interface
	ok    bool   // Init succeeded; no other call is made unless it did
	label string // names lib in errors: "NVML" or "mock NVML"

	closing     context.Context    // done once Close begins; ends every WatchHealth
	markClosing context.CancelFunc // makes closing done
	watchers    sync.WaitGroup     // running WatchHealth calls

	mu     sync.Mutex
	closed bool     // guarded by mu
	note   string   // guarded by mu
	uuids  []string // guarded by mu; the UUID of each device index, as last read
}

// newSession returns the session of lib, whose Init returned initRet.
func newSession(lib nvml.Interface, label string, initRet nvml.Return) *session {
	s := &session{lib: lib, ok: initRet == nvml.SUCCESS, label: label}
	s.closing, s.markClosing = context.WithCancel(context.Background())
	return s
}

// usableLocked reports whether a call may reach lib: not once Close has
// begun (ErrClosed), nor when Init failed (false with a nil error: the
// call does nothing and succeeds). s.mu must be held.
func (s *session) usableLocked() (bool, error) {
	if s.closed {
		return false, ErrClosed
	}
	return s.ok, nil
}

func (s *session) Devices() ([]*gpupoolv1.Device, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if ok, err := s.usableLocked(); !ok {
		return nil, err
	}
	devs, err := enumerate(s.lib)
	if err != nil {
		return nil, err
	}
	s.note = ""
	if len(devs) == 0 {
		s.note = "NVML reports no GPUs on this host"
	}
	s.uuids = s.uuids[:0]
	for _, d := range devs {
		s.uuids = append(s.uuids, d.GetUuid())
	}
	return devs, nil
}

func (s *session) Note() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.note
}

// Sample names a lost device by the UUID Devices or Sample last read at
// its index, since a lost GPU no longer says its UUID; "" if none was.
func (s *session) Sample() ([]Sample, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if ok, err := s.usableLocked(); !ok {
		return nil, err
	}
	out, err := sample(s.lib, s.uuids)
	if err != nil {
		return nil, err
	}
	s.uuids = s.uuids[:0]
	for _, smp := range out {
		s.uuids = append(s.uuids, smp.UUID)
	}
	return out, nil
}

func (s *session) WatchHealth(ctx context.Context, fn func(HealthEvent)) error {
	s.mu.Lock()
	if ok, err := s.usableLocked(); !ok {
		s.mu.Unlock()
		return err
	}
	s.watchers.Add(1)
	s.mu.Unlock()
	defer s.watchers.Done()

	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	stop := context.AfterFunc(s.closing, func() { cancel(ErrClosed) })
	defer stop()
	if err := watchHealth(ctx, s.lib, fn); err != nil {
		return err
	}
	if errors.Is(context.Cause(ctx), ErrClosed) {
		return ErrClosed
	}
	return nil
}

func (s *session) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	s.markClosing()
	s.mu.Unlock()

	s.watchers.Wait()
	if !s.ok {
		return nil
	}
	if ret := s.lib.Shutdown(); ret != nvml.SUCCESS {
		return fmt.Errorf("device: %s shutdown: %w", s.label, code(ret))
	}
	return nil
}
