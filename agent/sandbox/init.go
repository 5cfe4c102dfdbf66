package sandbox

import (
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

// initArg0 is the argv[0] the agent's binary is re-executed with to run
// as a sandbox's init.
const initArg0 = "gpupool-sandbox-init"

// initSpec is what the agent tells the init, as its first argument.
type initSpec struct {
	Prog     string   `json:"prog"`
	Dir      string   `json:"dir"`
	LeaseDir string   `json:"lease_dir"`
	UID      int      `json:"uid"`
	GID      int      `json:"gid"`
	Cgroups  []string `json:"cgroups,omitempty"`
	Hide     []string `json:"hide,omitempty"`
	Expose   []string `json:"expose,omitempty"`
	// Hostname is set in the lease's UTS namespace.
	Hostname string `json:"hostname,omitempty"`
	// TmpfsSize is the size= of the private /tmp, /var/tmp and /dev/shm.
	TmpfsSize string `json:"tmpfs_size,omitempty"`
	// HostIPC keeps the host's /dev/shm (the init is then in the host's
	// IPC namespace too).
	HostIPC bool `json:"host_ipc,omitempty"`
}

// Init runs this process as a sandbox's init and exits, if the agent
// started it as one; otherwise it returns at once. Call it first thing in
// main, and in TestMain of tests that start sandboxes.
func Init() {
	if len(os.Args) < 3 || os.Args[0] != initArg0 || os.Args[2] != "--" {
		return
	}
	var s initSpec
	if err := json.Unmarshal([]byte(os.Args[1]), &s); err != nil {
		fmt.Fprintf(os.Stderr, "gpupool sandbox: bad spec: %v\n", err)
		os.Exit(127)
	}
	os.Exit(runInit(s, os.Args[3:]))
}

// runInit joins the cgroups, sets up the mounts, starts the workload as
// the lease's user and waits for it, reaping every orphan meanwhile (it
// is the PID namespace's init). It returns the workload's exit code, or
// 128+n if signal n killed it.
func runInit(s initSpec, argv []string) int {
	fail := func(format string, a ...any) int {
		fmt.Fprintf(os.Stderr, "gpupool sandbox: "+format+"\n", a...)
		return 127
	}
	for _, f := range s.Cgroups {
		if err := os.WriteFile(f, []byte("0"), 0); err != nil {
			return fail("joining the lease's cgroup: %v", err)
		}
	}
	if err := setupMounts(s); err != nil {
		return fail("%v", err)
	}
	if s.Hostname != "" {
		if err := unix.Sethostname([]byte(s.Hostname)); err != nil {
			return fail("setting the hostname: %v", err)
		}
		if err := unix.Setdomainname([]byte("(none)")); err != nil {
			return fail("setting the domain name: %v", err)
		}
	}
	// no_new_privs, like the capability sets, the securebits and the
	// seccomp filter, is a property of one thread, which its forks
	// inherit: the thread that sets it must be the one ForkExec forks
	// from. Go moves a goroutine between threads unless it is locked to
	// one, and then the workload was forked from a thread without it,
	// where a setuid program ran as root.
	runtime.LockOSThread()
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		return fail("no new privileges: %v", err)
	}
	if err := dropCapabilities(); err != nil {
		return fail("%v", err)
	}
	// Last, as the filter applies to this thread too: all it does from
	// here is catch signals, fork, become the lease's user, exec and wait.
	if err := applySeccomp(); err != nil {
		return fail("%v", err)
	}
	// Signals sent to the process group reach the workload directly; the
	// init only must not die of them (a caught signal's handler is reset
	// by exec, unlike an ignored one, so the workload keeps the default).
	sigs := make(chan os.Signal, 16)
	signal.Notify(sigs)
	go func() {
		for range sigs {
		}
	}()
	pid, err := syscall.ForkExec(s.Prog, argv, &syscall.ProcAttr{
		Dir:   s.Dir,
		Env:   os.Environ(),
		Files: []uintptr{0, 1, 2},
		Sys: &syscall.SysProcAttr{
			Credential: &syscall.Credential{Uid: uint32(s.UID), Gid: uint32(s.GID), Groups: []uint32{}},
		},
	})
	if err != nil {
		return fail("starting %s: %v", s.Prog, err)
	}
	for {
		var ws syscall.WaitStatus
		got, err := syscall.Wait4(-1, &ws, 0, nil)
		if errors.Is(err, syscall.EINTR) {
			continue
		}
		if err != nil {
			return fail("waiting for %s: %v", s.Prog, err)
		}
		if got != pid {
			continue // an orphan
		}
		if ws.Signaled() {
			return 128 + int(ws.Signal())
		}
		return ws.ExitStatus()
	}
}

// privateMount is a mount every sandbox gets a fresh one of, where the
// host has the directory: nothing in it is shared with the host or with
// another lease, and it ends with the mount namespace.
type privateMount struct {
	path, fstype, opts string
	flags              uintptr
}

// privateMounts are the sandbox's private mounts, in the order they are
// mounted, all nosuid and nodev: /tmp, /var/tmp and /dev/shm of
// s.TmpfsSize each, /run/lock of 1 MiB (lock files are empty), and a
// /dev/mqueue of the lease's IPC namespace. Leases with HostIPC keep the
// host's /dev/shm and /dev/mqueue.
func privateMounts(s initSpec) []privateMount {
	const flags = unix.MS_NOSUID | unix.MS_NODEV
	size := "size=" + cmp.Or(s.TmpfsSize, "50%")
	ms := []privateMount{
		{"/tmp", "tmpfs", "mode=1777," + size, flags},
		{"/var/tmp", "tmpfs", "mode=1777," + size, flags},
		{"/run/lock", "tmpfs", "mode=1777,size=1m", flags},
	}
	if !s.HostIPC {
		ms = append(ms,
			privateMount{"/dev/shm", "tmpfs", "mode=1777," + size, flags},
			privateMount{"/dev/mqueue", "mqueue", "", flags | unix.MS_NOEXEC})
	}
	return ms
}

// hostIPCMounts are the host's mounts that leases with HostIPC keep as
// the host has them, writable: MPS clients share memory with their
// server there.
var hostIPCMounts = []string{"/dev/shm", "/dev/mqueue"}

// setupMounts makes the mounts private, gives the sandbox its own empty
// /tmp, /var/tmp, /run/lock and (unless s.HostIPC) /dev/shm and
// /dev/mqueue, hides s.Hide behind empty tmpfs mounts, mounts the lease's
// directory back (writable) and s.Expose back (read-only), and mounts a
// /proc of its PID namespace.
func setupMounts(s initSpec) error {
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return fmt.Errorf("making the mounts private: %w", err)
	}
	type back struct {
		path string
		fd   int
		ro   bool
	}
	var backs []back
	defer func() {
		for _, b := range backs {
			unix.Close(b.fd)
		}
	}()
	mounts := privateMounts(s)
	var private []string
	for _, pm := range mounts {
		private = append(private, pm.path)
	}
	keep := func(path string, ro bool) error {
		fd, err := unix.Open(path, unix.O_PATH|unix.O_CLOEXEC, 0)
		if err != nil {
			if ro && errors.Is(err, unix.ENOENT) {
				return nil
			}
			return fmt.Errorf("opening %s: %w", path, err)
		}
		backs = append(backs, back{path, fd, ro})
		return nil
	}
	// The lease's directory always: it is the one writable path left
	// once the host's mounts are read-only.
	if err := keep(s.LeaseDir, false); err != nil {
		return err
	}
	for _, p := range s.Expose {
		if !under(p, s.Hide) && !under(p, private) {
			continue // in sight, and read-only with the host's mounts
		}
		if err := keep(p, true); err != nil {
			return err
		}
	}
	var hostWritable []string
	if s.HostIPC {
		hostWritable = hostIPCMounts
	}
	if err := readOnlyHost(hostWritable); err != nil {
		return err
	}
	// The private /tmp first: a hidden directory may be inside it, and is
	// then gone already.
	for _, pm := range mounts {
		if fi, err := os.Stat(pm.path); err != nil || !fi.IsDir() {
			continue
		}
		if err := unix.Mount(pm.fstype, pm.path, pm.fstype, pm.flags, pm.opts); err != nil {
			return fmt.Errorf("a private %s: %w", pm.path, err)
		}
	}
	var hidden []string
	for _, h := range s.Hide {
		if fi, err := os.Stat(h); err != nil || !fi.IsDir() {
			continue
		}
		if err := unix.Mount("tmpfs", h, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, "mode=0755,size=64k"); err != nil {
			return fmt.Errorf("hiding %s: %w", h, err)
		}
		hidden = append(hidden, h)
	}
	for _, b := range backs {
		if err := os.MkdirAll(b.path, 0o755); err != nil {
			return fmt.Errorf("mounting %s back: %w", b.path, err)
		}
		if err := unix.Mount(fmt.Sprintf("/proc/self/fd/%d", b.fd), b.path, "", unix.MS_BIND, ""); err != nil {
			return fmt.Errorf("mounting %s back: %w", b.path, err)
		}
		// A bind mount has the flags of the mount it came from, which is
		// read-only now: the lease's directory is made writable again,
		// keeping that mount's noexec and atime flags.
		kept, err := mountFlags(b.path)
		if err != nil {
			return fmt.Errorf("mounting %s back: %w", b.path, err)
		}
		flags := kept | unix.MS_BIND | unix.MS_REMOUNT | unix.MS_NOSUID | unix.MS_NODEV
		if b.ro {
			flags |= unix.MS_RDONLY
		}
		if err := unix.Mount("", b.path, "", flags, ""); err != nil {
			return fmt.Errorf("mounting %s back: %w", b.path, err)
		}
	}
	// Read-only once the directories to mount back are made in them.
	for _, h := range hidden {
		if err := unix.Mount("", h, "", unix.MS_BIND|unix.MS_REMOUNT|unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
			return fmt.Errorf("hiding %s: %w", h, err)
		}
	}
	if err := nameHost(s.Hostname); err != nil {
		return err
	}
	if err := unix.Mount("proc", "/proc", "proc", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
		return fmt.Errorf("mounting /proc of the PID namespace: %w", err)
	}
	return nil
}

// etcDir holds the lease's own /etc/hosts and /etc/hostname, root's files
// in the lease's private /run/lock, whose sticky bit keeps the lease from
// replacing them.
const etcDir = "/run/lock/gpupool-etc"

// nameHost makes the lease's hostname resolve, as a host's own does:
// programs that look up their own name (a framework's rendezvous, MPI)
// would fail on a name that is in no /etc/hosts. The lease sees the
// host's /etc/hosts with "127.0.1.1 NAME" added, and an /etc/hostname of
// NAME, both read-only bind mounts. Nothing when the lease keeps the
// host's name.
func nameHost(name string) error {
	if fi, err := os.Stat(filepath.Dir(etcDir)); name == "" || err != nil || !fi.IsDir() {
		return nil // no private /run/lock to hold the files
	}
	hosts, err := os.ReadFile("/etc/hosts")
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("the lease's /etc/hosts: %w", err)
	}
	if len(hosts) > 0 && hosts[len(hosts)-1] != '\n' {
		hosts = append(hosts, '\n')
	}
	hosts = append(hosts, "127.0.1.1\t"+name+"\n"...)
	if err := os.MkdirAll(etcDir, 0o755); err != nil {
		return fmt.Errorf("the lease's /etc/hosts: %w", err)
	}
	for file, content := range map[string][]byte{"hosts": hosts, "hostname": []byte(name + "\n")} {
		src, dst := filepath.Join(etcDir, file), filepath.Join("/etc", file)
		if err := os.WriteFile(src, content, 0o644); err != nil {
			return fmt.Errorf("the lease's %s: %w", dst, err)
		}
		if _, err := os.Stat(dst); err != nil {
			continue // nothing to mount over: the host has none
		}
		if err := unix.Mount(src, dst, "", unix.MS_BIND, ""); err != nil {
			return fmt.Errorf("the lease's %s: %w", dst, err)
		}
		if err := unix.Mount("", dst, "", unix.MS_BIND|unix.MS_REMOUNT|unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV, ""); err != nil {
			return fmt.Errorf("the lease's %s: %w", dst, err)
		}
	}
	return nil
}

// keptFlags are the per-mount flags readOnlyHost leaves as they were,
// as /proc/PID/mountinfo names them.
var keptFlags = map[string]uintptr{
	"nodev":      unix.MS_NODEV,
	"noexec":     unix.MS_NOEXEC,
	"noatime":    unix.MS_NOATIME,
	"nodiratime": unix.MS_NODIRATIME,
	"relatime":   unix.MS_RELATIME,
}

// readOnlyHost makes every mount of the (private) mount namespace
// read-only and nosuid, and nodev outside /dev, where device nodes such
// as /dev/null and the GPUs' must keep working (writing a device node
// needs no writable mount). It changes this namespace's mounts only,
// never the host's: a bind remount sets per-mount flags, not the
// filesystem's. Mounts made after it (the private tmpfs mounts, the
// lease's directory) have their own flags.
//
// Mounts at or under the paths of writable are left as they are.
func readOnlyHost(writable []string) error {
	mi, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return fmt.Errorf("listing the mounts: %w", err)
	}
	for line := range strings.SplitSeq(string(mi), "\n") {
		// id parent major:minor root mountpoint options ...; the flags
		// are read here, not with statfs, which would trigger an
		// automount point.
		f := strings.Fields(line)
		if len(f) < 6 {
			continue
		}
		mp := unescapeMountinfo(f[4])
		if under(mp, writable) {
			continue
		}
		flags := uintptr(unix.MS_BIND | unix.MS_REMOUNT | unix.MS_RDONLY | unix.MS_NOSUID)
		for opt := range strings.SplitSeq(f[5], ",") {
			flags |= keptFlags[opt]
		}
		if !under(mp, []string{"/dev"}) {
			flags |= unix.MS_NODEV
		}
		if err := unix.Mount("", mp, "", flags, ""); err != nil {
			// A mount that another covers is out of the lease's reach:
			// its path leads nowhere (ENOENT) or into a mount of which
			// it is not the root (EINVAL). Not so for /.
			if mp != "/" && (errors.Is(err, unix.ENOENT) || errors.Is(err, unix.EINVAL)) {
				continue
			}
			return fmt.Errorf("making %s read-only: %w", mp, err)
		}
	}
	return nil
}

// mountFlags returns the keptFlags of the mount path is on. It uses
// statfs, which follows symlinks in path as the bind mount did: the
// lease's directory is a mount of the sandbox's own, no automount point.
// Linux gives statfs's ST_ flags the values of the MS_ ones.
func mountFlags(path string) (uintptr, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		return 0, err
	}
	var flags uintptr
	for _, f := range keptFlags {
		flags |= uintptr(st.Flags) & f
	}
	return flags, nil
}

// unescapeMountinfo undoes the octal escapes (\040 for a space) of a path
// in /proc/PID/mountinfo.
func unescapeMountinfo(s string) string {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if n, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(n))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// under reports whether path is one of dirs or inside one.
func under(path string, dirs []string) bool {
	for _, d := range dirs {
		d = filepath.Clean(d)
		if p := filepath.Clean(path); p == d || strings.HasPrefix(p, d+"/") {
			return true
		}
	}
	return false
}
