package device

import (
	"path/filepath"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
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
	b := NewNVML()
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
