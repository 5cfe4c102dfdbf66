package sandbox

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"unsafe"

	"golang.org/x/net/bpf"
	"golang.org/x/sys/unix"
)

// seccompData is a struct seccomp_data for bpf.VM, which loads words
// big-endian where the kernel loads them native-endian: each field is
// written the way the VM reads back the value the kernel would.
func seccompData(arch, nr, arg0 uint32) []byte {
	b := make([]byte, 64)
	binary.BigEndian.PutUint32(b[offNr:], nr)
	binary.BigEndian.PutUint32(b[offArch:], arch)
	binary.BigEndian.PutUint32(b[offArg0:], arg0)
	return b
}

func TestTheLeaseFilterDeniesWhatItShouldAndNothingElse(t *testing.T) {
	skipWithoutProfile(t)
	vm, err := bpf.NewVM(leaseFilter())
	if err != nil {
		t.Fatal(err)
	}
	foreign := uint32(unix.AUDIT_ARCH_I386)
	if nativeArch != unix.AUDIT_ARCH_X86_64 {
		foreign = unix.AUDIT_ARCH_ARM
	}
	const thread = unix.CLONE_VM | unix.CLONE_FS | unix.CLONE_FILES | unix.CLONE_SIGHAND | unix.CLONE_THREAD |
		unix.CLONE_SYSVSEM | unix.CLONE_SETTLS | unix.CLONE_PARENT_SETTID | unix.CLONE_CHILD_CLEARTID
	type call struct {
		name           string
		arch, nr, arg0 uint32
		want           uint32
	}
	calls := []call{
		{"read is allowed", nativeArch, unix.SYS_READ, 0, retAllow},
		{"openat is allowed", nativeArch, unix.SYS_OPENAT, 0, retAllow},
		{"mmap is allowed", nativeArch, unix.SYS_MMAP, 0, retAllow},
		{"ioctl (the GPUs' driver) is allowed", nativeArch, unix.SYS_IOCTL, 0, retAllow},
		{"futex is allowed", nativeArch, unix.SYS_FUTEX, 0, retAllow},
		{"epoll_pwait is allowed", nativeArch, unix.SYS_EPOLL_PWAIT, 0, retAllow},
		{"socket is allowed", nativeArch, unix.SYS_SOCKET, 0, retAllow},
		{"execve is allowed", nativeArch, unix.SYS_EXECVE, 0, retAllow},
		{"setuid (the init's fork) is allowed", nativeArch, unix.SYS_SETUID, 0, retAllow},
		{"ptrace is allowed", nativeArch, unix.SYS_PTRACE, 0, retAllow},
		{"a thread's clone is allowed", nativeArch, unix.SYS_CLONE, thread, retAllow},
		{"a fork's clone is allowed", nativeArch, unix.SYS_CLONE, uint32(unix.SIGCHLD) | unix.CLONE_CHILD_SETTID | unix.CLONE_CHILD_CLEARTID, retAllow},
		{"a vfork's clone is allowed", nativeArch, unix.SYS_CLONE, uint32(unix.SIGCHLD) | unix.CLONE_VM | unix.CLONE_VFORK, retAllow},
		{"clone3 is not there, so libc uses clone", nativeArch, unix.SYS_CLONE3, 0, retNoSys},
		{"personality's query is allowed", nativeArch, unix.SYS_PERSONALITY, 0xffffffff, retAllow},
		{"the Linux personality is allowed", nativeArch, unix.SYS_PERSONALITY, 0, retAllow},
		{"ADDR_NO_RANDOMIZE is denied", nativeArch, unix.SYS_PERSONALITY, 0x0040000, retEPERM},
		{"number -1 (a tracer skipping a call) is ENOSYS", nativeArch, 0xffffffff, 0, retNoSys},
		{"a call of another arch kills", foreign, unix.SYS_READ, 0, retKill},
	}
	for _, f := range []uint32{unix.CLONE_NEWNS, unix.CLONE_NEWCGROUP, unix.CLONE_NEWUTS, unix.CLONE_NEWIPC, unix.CLONE_NEWUSER, unix.CLONE_NEWPID, unix.CLONE_NEWNET} {
		calls = append(calls, call{fmt.Sprintf("clone with %#x is denied", f), nativeArch, unix.SYS_CLONE, uint32(unix.SIGCHLD) | f, retEPERM})
	}
	for _, nr := range deniedSyscalls {
		calls = append(calls, call{fmt.Sprintf("call %d is denied", nr), nativeArch, nr, 0, retEPERM})
	}
	if archSyscallBit != 0 {
		calls = append(calls, call{"a call of the arch's other ABI kills", nativeArch, archSyscallBit | unix.SYS_READ, 0, retKill})
	}
	for _, c := range calls {
		got, err := vm.Run(seccompData(c.arch, c.nr, c.arg0))
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		if uint32(got) != c.want {
			t.Errorf("%s: got %#x, want %#x", c.name, uint32(got), c.want)
		}
	}
}

// probeArg0 is the argv[0] that makes the test binary probeSyscalls.
const probeArg0 = "gpupool-syscall-probe"

// probeSyscalls makes, in a lease, each call the profile should deny,
// with arguments that an unfiltered kernel would answer otherwise than
// EPERM (success, EFAULT or EINVAL), and a few that it must allow, and
// prints one line per call: its name and the errno name, or "ok".
func probeSyscalls() int {
	raw := func(nr uintptr, a ...uintptr) error {
		a = append(a, 0, 0, 0, 0, 0, 0)
		if _, _, e := unix.Syscall6(nr, a[0], a[1], a[2], a[3], a[4], a[5]); e != 0 {
			return e
		}
		return nil
	}
	bad := uintptr(unsafe.Pointer(nil))
	cwd := unix.AT_FDCWD
	for _, p := range []struct {
		name string
		call func() error
	}{
		{"keyctl", func() error {
			_, err := unix.KeyctlInt(unix.KEYCTL_GET_KEYRING_ID, unix.KEY_SPEC_USER_KEYRING, 0, 0, 0)
			return err
		}},
		{"add_key", func() error {
			_, err := unix.AddKey("user", "gpupool-probe", []byte("x"), unix.KEY_SPEC_PROCESS_KEYRING)
			return err
		}},
		{"unshare", func() error { return unix.Unshare(unix.CLONE_NEWUSER) }},
		{"clone", func() error {
			_, err := syscall.ForkExec("/bin/true", []string{"true"}, &syscall.ProcAttr{Sys: &syscall.SysProcAttr{Cloneflags: unix.CLONE_NEWUSER}})
			return err
		}},
		{"clone3", func() error { return raw(unix.SYS_CLONE3, bad, 0) }},
		{"setns", func() error { return raw(unix.SYS_SETNS, ^uintptr(0), 0) }},
		{"perf_event_open", func() error { return raw(unix.SYS_PERF_EVENT_OPEN, bad, 0, ^uintptr(0), ^uintptr(0), 0) }},
		{"userfaultfd", func() error { return raw(unix.SYS_USERFAULTFD, 0xffff) }},
		{"io_uring_setup", func() error { return raw(unix.SYS_IO_URING_SETUP, 0, bad) }},
		{"name_to_handle_at", func() error { return raw(unix.SYS_NAME_TO_HANDLE_AT, uintptr(cwd), bad, bad, bad, 0) }},
		{"personality", func() error { return raw(unix.SYS_PERSONALITY, 0x0040000) }},
		{"personality query", func() error { return raw(unix.SYS_PERSONALITY, 0xffffffff) }},
		{"loopback socket", func() error {
			l, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				return err
			}
			defer l.Close()
			go func() {
				if c, err := l.Accept(); err == nil {
					c.Write([]byte("x"))
					c.Close()
				}
			}()
			c, err := net.Dial("tcp", l.Addr().String())
			if err != nil {
				return err
			}
			defer c.Close()
			_, err = io.ReadAll(c)
			return err
		}},
		{"exec", func() error { return exec.Command("/bin/true").Run() }},
	} {
		err := p.call()
		var errno unix.Errno
		switch {
		case err == nil:
			fmt.Printf("%s: ok\n", p.name)
		case errors.As(err, &errno):
			fmt.Printf("%s: %s\n", p.name, unix.ErrnoName(errno))
		default:
			fmt.Printf("%s: %v\n", p.name, err)
		}
	}
	return 0
}

func TestALeaseMakesNoNamespaceAndNoDangerousCall(t *testing.T) {
	skipWithoutProfile(t)
	m, hidden := newManager(t)
	dir, uid := prepare(t, m, hidden, "L-a", 0, 256)
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(self)
	if err != nil {
		t.Fatal(err)
	}
	probe := filepath.Join(dir, probeArg0)
	if err := os.WriteFile(probe, b, 0o755); err != nil {
		t.Fatal(err)
	}
	os.Chown(probe, uid, uid)
	const probeWant = `keyctl: EPERM
add_key: EPERM
unshare: EPERM
clone: EPERM
clone3: ENOSYS
setns: EPERM
perf_event_open: EPERM
userfaultfd: EPERM
io_uring_setup: EPERM
name_to_handle_at: EPERM
personality: EPERM
personality query: ok
loopback socket: ok
exec: ok
`
	tests := []struct {
		name, script, want string
		skip               func() string
	}{
		{"it runs under the lease's filter", "grep -E '^Seccomp(_filters)?:' /proc/self/status", "Seccomp:\t2\nSeccomp_filters:\t1\n", nil},
		{"it cannot make a user namespace", "unshare --user true 2>&1 | grep -c 'Operation not permitted'", "1\n", needTool("unshare")},
		{"it cannot mount", "mount -t tmpfs none " + dir + " 2>/dev/null || echo refused", "refused\n", needTool("mount")},
		{"the dangerous calls return EPERM and the ordinary ones work", "./" + probeArg0, probeWant, nil},
		{"the shell's tools work", "ls -d / && echo hi | wc -c", "/\n3\n", nil},
		// glibc's threads use clone3 first, and clone on its ENOSYS.
		{"python3's threads, sockets and children work", `python3 -c "import threading, socket, subprocess
t = threading.Thread(target=print, args=('thread',)); t.start(); t.join()
s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()
print(subprocess.run(['true']).returncode)"`, "thread\n0\n", needTool("python3")},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if tt.skip != nil {
				if why := tt.skip(); why != "" {
					t.Skip(why)
				}
			}
			// Several times, as the no_new_privs row: the filter is the
			// forking thread's.
			for range 4 {
				got, code := run(t, m, "L-a", dir, tt.script)
				if got != tt.want || code != 0 {
					t.Fatalf("got %q exit %d, want %q exit 0", got, code, tt.want)
				}
			}
		})
	}
}

// needTool says why a row that runs tool cannot run, or "".
func needTool(tool string) func() string {
	return func() string {
		for _, d := range strings.Split("/usr/bin:/bin", ":") {
			if _, err := os.Stat(filepath.Join(d, tool)); err == nil {
				return ""
			}
		}
		return tool + " is not installed in /usr/bin or /bin"
	}
}

// skipWithoutProfile skips on the architectures the profile is not
// written for, where the init refuses to start a lease's process.
func skipWithoutProfile(t *testing.T) {
	t.Helper()
	if nativeArch == 0 {
		t.Skipf("no seccomp profile for %s", runtime.GOARCH)
	}
}
