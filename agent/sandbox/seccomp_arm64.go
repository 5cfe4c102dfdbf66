package sandbox

import "golang.org/x/sys/unix"

const (
	nativeArch     = unix.AUDIT_ARCH_AARCH64
	archSyscallBit = 0
)

// archDeniedSyscalls: arm64 has none of x86_64's old calls.
var archDeniedSyscalls []uint32
