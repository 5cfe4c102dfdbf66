//go:build !amd64 && !arm64

package sandbox

// The profile is written for amd64 and arm64 only; elsewhere the init
// refuses to start a workload rather than start it without one.
const (
	nativeArch     = 0
	archSyscallBit = 0
)

var archDeniedSyscalls []uint32
