package sandbox

import (
	"fmt"
	"runtime"
	"unsafe"

	"golang.org/x/net/bpf"
	"golang.org/x/sys/unix"
)

// The lease's seccomp profile is a denylist, as narrow as container
// runtimes' default (moby's) is where it matters here and no narrower
// where CUDA needs more: a lease's processes may make every system call
// of the native ABI except those below, which return EPERM (so programs
// see an ordinary refusal and fall back, as they do in a container), and
// none of another ABI, which kill the process: a filter that let them
// through could be bypassed by the same call under another number.
//
// Denied, because they reach kernel code or host state that a lease has
// no business with, or make namespaces in which it would be root:
//   - namespaces and mounts: unshare, setns, clone with a CLONE_NEW* flag,
//     mount, umount2, pivot_root and the new mount API (fsopen, fsconfig,
//     fsmount, fspick, open_tree, move_mount, mount_setattr);
//   - kernel code and state: init_module, finit_module, delete_module,
//     kexec_load, kexec_file_load, bpf, reboot, swapon, swapoff, acct,
//     quotactl, quotactl_fd, syslog, lookup_dcookie, and the clocks
//     (settimeofday, clock_settime, clock_adjtime, adjtimex);
//   - the kernel keyring (keyctl, add_key, request_key), which is not
//     namespaced;
//   - userfaultfd and io_uring, the usual way in for kernel exploits;
//   - perf_event_open (CPU profilers such as perf and Nsight Systems'
//     sampling are refused; CUPTI and Nsight Compute use the driver);
//   - open_by_handle_at and name_to_handle_at, which open files by inode
//     past the mount namespace, and fanotify_init;
//   - personality, but for the harmless personas moby allows too (not
//     ADDR_NO_RANDOMIZE, for one);
//   - nfsservctl and vhangup, and the old and x86-only calls of
//     archDeniedSyscalls (iopl, ioperm, modify_ldt, uselib, ...).
//
// clone3 returns ENOSYS: its flags are behind a pointer a filter cannot
// read, and libc falls back to clone, whose flags it can.
//
// ptrace is allowed, as moby allows it on kernels since 4.8 (which check
// the filter again after a tracer changes a call): a lease's processes
// can trace only their own (one uid, its own PID namespace, no
// capabilities), and debuggers such as gdb, cuda-gdb and py-spy work.

// deniedSyscalls are the native ABI's calls that return EPERM whatever
// their arguments.
var deniedSyscalls = append([]uint32{
	unix.SYS_UNSHARE, unix.SYS_SETNS,
	unix.SYS_MOUNT, unix.SYS_UMOUNT2, unix.SYS_PIVOT_ROOT,
	unix.SYS_FSOPEN, unix.SYS_FSCONFIG, unix.SYS_FSMOUNT, unix.SYS_FSPICK,
	unix.SYS_OPEN_TREE, unix.SYS_MOVE_MOUNT, unix.SYS_MOUNT_SETATTR,
	unix.SYS_INIT_MODULE, unix.SYS_FINIT_MODULE, unix.SYS_DELETE_MODULE,
	unix.SYS_KEXEC_LOAD, unix.SYS_KEXEC_FILE_LOAD, unix.SYS_BPF,
	unix.SYS_REBOOT, unix.SYS_SWAPON, unix.SYS_SWAPOFF, unix.SYS_ACCT,
	unix.SYS_QUOTACTL, unix.SYS_QUOTACTL_FD, unix.SYS_SYSLOG, unix.SYS_LOOKUP_DCOOKIE,
	unix.SYS_SETTIMEOFDAY, unix.SYS_CLOCK_SETTIME, unix.SYS_CLOCK_ADJTIME, unix.SYS_ADJTIMEX,
	unix.SYS_KEYCTL, unix.SYS_ADD_KEY, unix.SYS_REQUEST_KEY,
	unix.SYS_USERFAULTFD,
	unix.SYS_IO_URING_SETUP, unix.SYS_IO_URING_ENTER, unix.SYS_IO_URING_REGISTER,
	unix.SYS_PERF_EVENT_OPEN,
	unix.SYS_OPEN_BY_HANDLE_AT, unix.SYS_NAME_TO_HANDLE_AT, unix.SYS_FANOTIFY_INIT,
	unix.SYS_NFSSERVCTL, unix.SYS_VHANGUP,
}, archDeniedSyscalls...)

// namespaceCloneFlags are the flags of clone that make a namespace.
// (CLONE_NEWTIME shares its bit with the exit signal in clone, and only
// clone3 and unshare take it.)
const namespaceCloneFlags = unix.CLONE_NEWNS | unix.CLONE_NEWCGROUP | unix.CLONE_NEWUTS |
	unix.CLONE_NEWIPC | unix.CLONE_NEWUSER | unix.CLONE_NEWPID | unix.CLONE_NEWNET

// allowedPersonalities are the personality(2) arguments a lease may
// pass, as moby's: Linux, Linux32, UNAME26 with either, and the query.
var allowedPersonalities = []uint32{0x0, 0x8, 0x20000, 0x20008, 0xffffffff}

// The offsets of struct seccomp_data's fields. The low half of args[0]
// is at +0 on the little-endian arches the profile is built for.
const (
	offNr    = 0
	offArch  = 4
	offArg0  = 16
	retAllow = unix.SECCOMP_RET_ALLOW
	retEPERM = unix.SECCOMP_RET_ERRNO | uint32(unix.EPERM)
	retNoSys = unix.SECCOMP_RET_ERRNO | uint32(unix.ENOSYS)
	retKill  = unix.SECCOMP_RET_KILL_PROCESS
)

// leaseFilter is the lease's seccomp profile as a classic BPF program
// over struct seccomp_data. Its instructions never jump further than
// a few, so none comes near the 255 a conditional jump can skip.
func leaseFilter() []bpf.Instruction {
	p := []bpf.Instruction{
		bpf.LoadAbsolute{Off: offArch, Size: 4},
		bpf.JumpIf{Cond: bpf.JumpEqual, Val: nativeArch, SkipTrue: 1},
		bpf.RetConstant{Val: retKill},
		bpf.LoadAbsolute{Off: offNr, Size: 4},
		// Number -1 is a tracer's way to skip a call (strace --inject,
		// rr, PRoot): ENOSYS, as the kernel answers it, before its x32
		// bit reads as another ABI's call.
		bpf.JumpIf{Cond: bpf.JumpEqual, Val: 0xffffffff, SkipFalse: 1},
		bpf.RetConstant{Val: retNoSys},
	}
	if archSyscallBit != 0 {
		// The same arch with another ABI's numbering (x32 on x86_64).
		p = append(p,
			bpf.JumpIf{Cond: bpf.JumpBitsSet, Val: archSyscallBit, SkipFalse: 1},
			bpf.RetConstant{Val: retKill})
	}
	// clone: EPERM if it would make a namespace.
	p = append(p,
		bpf.JumpIf{Cond: bpf.JumpNotEqual, Val: unix.SYS_CLONE, SkipTrue: 4},
		bpf.LoadAbsolute{Off: offArg0, Size: 4},
		bpf.JumpIf{Cond: bpf.JumpBitsSet, Val: namespaceCloneFlags, SkipTrue: 1},
		bpf.RetConstant{Val: retAllow},
		bpf.RetConstant{Val: retEPERM})
	// personality: EPERM but for allowedPersonalities.
	n := len(allowedPersonalities)
	p = append(p,
		bpf.JumpIf{Cond: bpf.JumpNotEqual, Val: unix.SYS_PERSONALITY, SkipTrue: uint8(n + 3)},
		bpf.LoadAbsolute{Off: offArg0, Size: 4})
	for i, v := range allowedPersonalities {
		p = append(p, bpf.JumpIf{Cond: bpf.JumpEqual, Val: v, SkipTrue: uint8(n - i)})
	}
	p = append(p, bpf.RetConstant{Val: retEPERM}, bpf.RetConstant{Val: retAllow})
	p = append(p,
		bpf.JumpIf{Cond: bpf.JumpNotEqual, Val: unix.SYS_CLONE3, SkipTrue: 1},
		bpf.RetConstant{Val: retNoSys})
	for _, nr := range deniedSyscalls {
		p = append(p,
			bpf.JumpIf{Cond: bpf.JumpNotEqual, Val: nr, SkipTrue: 1},
			bpf.RetConstant{Val: retEPERM})
	}
	return append(p, bpf.RetConstant{Val: retAllow})
}

// applySeccomp installs the lease's profile on the calling thread, which
// its forks inherit, and which no process can remove. The thread must
// have no_new_privs set (or CAP_SYS_ADMIN). The filter applies to the
// thread itself from then on: what it does after (fork, set the lease's
// user, exec) must not be denied.
func applySeccomp() error {
	if nativeArch == 0 {
		return fmt.Errorf("no seccomp profile for %s: the lease's processes would run without one", runtime.GOARCH)
	}
	raw, err := bpf.Assemble(leaseFilter())
	if err != nil {
		return fmt.Errorf("assembling the seccomp profile: %w", err)
	}
	filter := make([]unix.SockFilter, len(raw))
	for i, r := range raw {
		filter[i] = unix.SockFilter{Code: r.Op, Jt: r.Jt, Jf: r.Jf, K: r.K}
	}
	prog := unix.SockFprog{Len: uint16(len(filter)), Filter: &filter[0]}
	if err := unix.Prctl(unix.PR_SET_SECCOMP, unix.SECCOMP_MODE_FILTER, uintptr(unsafe.Pointer(&prog)), 0, 0); err != nil {
		return fmt.Errorf("applying the seccomp profile: %w", err)
	}
	runtime.KeepAlive(filter)
	return nil
}
