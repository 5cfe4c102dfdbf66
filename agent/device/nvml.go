package device

import (
	"fmt"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// nvmlLibrary is the library NewNVML opens.
const nvmlLibrary = "libnvidia-ml.so.1"

// NewNVML returns the backend of the host's real GPUs, read through NVML:
// a dlopen of library, or of libnvidia-ml.so.1 from the loader's path when
// library is empty. It never fails: when NVML cannot be initialised, most
// often because the library is not installed, the backend offers no GPUs
// and Note says why, naming NVML's return code (ERROR_LIBRARY_NOT_FOUND,
// ERROR_DRIVER_NOT_LOADED...), which reads the same on every host.
func NewNVML(library string) Backend {
	if library == "" {
		return newNVML(nvml.New(), nvmlLibrary)
	}
	return newNVML(nvml.New(nvml.WithLibraryPath(library)), library)
}

// newNVML initialises lib, loaded from libName (for the note).
func newNVML(lib nvml.Interface, libName string) *nvmlBackend {
	// After a failed Init every other NVML call kills the process with a
	// symbol-lookup error that recover cannot catch: the session makes
	// none.
	ret := lib.Init()
	s := newSession(lib, "NVML", ret)
	switch ret {
	case nvml.SUCCESS:
	case nvml.ERROR_LIBRARY_NOT_FOUND:
		s.note = fmt.Sprintf("NVML library %s not found: this host offers no GPUs", libName)
	default:
		s.note = fmt.Sprintf("NVML failed to initialise (%s): this host offers no GPUs", codeName(ret))
	}
	return &nvmlBackend{s}
}

// nvmlBackend is the backend of the host's real GPUs; its session does
// all the work.
type nvmlBackend struct {
	*session
}

var _ Backend = (*nvmlBackend)(nil)

func (b *nvmlBackend) Name() string { return "nvml" }
