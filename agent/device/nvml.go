package device

import (
	"errors"
	"fmt"
	"sync"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// ErrClosed is returned by Devices after Close.
var ErrClosed = errors.New("device: backend closed")

// nvmlLibrary is the library NewNVML opens.
const nvmlLibrary = "libnvidia-ml.so.1"

// NewNVML returns the backend of the host's real GPUs, read through NVML
// (a dlopen of libnvidia-ml.so.1). It never fails: when NVML cannot be
// initialised, most often because the library is not installed, the
// backend offers no GPUs and Note says why.
func NewNVML() Backend {
	return newNVML(nvml.New(), nvmlLibrary)
}

// newNVML initialises lib, loaded from libName (for the note).
func newNVML(lib nvml.Interface, libName string) *nvmlBackend {
	b := &nvmlBackend{lib: lib}
	// After a failed Init every other NVML call kills the process with a
	// symbol-lookup error that recover cannot catch: b.ok gates them all.
	switch ret := lib.Init(); ret {
	case nvml.SUCCESS:
		b.ok = true
	case nvml.ERROR_LIBRARY_NOT_FOUND:
		b.note = fmt.Sprintf("NVML library %s not found: this host offers no GPUs", libName)
	default:
		b.note = fmt.Sprintf("NVML failed to initialise (%v): this host offers no GPUs", ret)
	}
	return b
}

type nvmlBackend struct {
	lib nvml.Interface
	ok  bool // Init succeeded; no other call is made unless it did

	mu     sync.Mutex
	note   string // guarded by mu
	closed bool   // guarded by mu
}

func (b *nvmlBackend) Name() string { return "nvml" }

func (b *nvmlBackend) Devices() ([]*gpupoolv1.Device, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return nil, ErrClosed
	}
	if !b.ok {
		return nil, nil
	}
	devs, err := enumerate(b.lib)
	if err != nil {
		return nil, err
	}
	b.note = ""
	if len(devs) == 0 {
		b.note = "NVML reports no GPUs on this host"
	}
	return devs, nil
}

func (b *nvmlBackend) Note() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.note
}

func (b *nvmlBackend) Close() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return nil
	}
	b.closed = true
	if !b.ok {
		return nil
	}
	if ret := b.lib.Shutdown(); ret != nvml.SUCCESS {
		return fmt.Errorf("device: NVML shutdown: %w", ret)
	}
	return nil
}
