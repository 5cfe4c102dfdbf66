package sandbox

import "golang.org/x/sys/unix"

const (
	nativeArch = unix.AUDIT_ARCH_X86_64
	// archSyscallBit marks x32's calls, which share x86_64's arch.
	archSyscallBit = 0x40000000
)

// archDeniedSyscalls are the calls that only x86_64 has of those the
// profile denies: port I/O, the LDT, and calls of old kernels. vm86 is
// i386's, whose ABI the profile kills.
var archDeniedSyscalls = []uint32{
	unix.SYS_IOPL, unix.SYS_IOPERM, unix.SYS_MODIFY_LDT,
	unix.SYS_CREATE_MODULE, unix.SYS_QUERY_MODULE, unix.SYS_GET_KERNEL_SYMS,
	unix.SYS_USELIB, unix.SYS__SYSCTL, unix.SYS_USTAT, unix.SYS_SYSFS,
}
