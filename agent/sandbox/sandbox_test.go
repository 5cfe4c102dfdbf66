package sandbox

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func TestMain(m *testing.M) {
	Init()
	if filepath.Base(os.Args[0]) == probeArg0 {
		os.Exit(probeSyscalls())
	}
	os.Exit(m.Run())
}

// newManager returns a Manager whose hidden dir holds a secret, and
// removes the cgroups it made when the test ends. It skips unless the
// host gives a full sandbox (as root, as CI runs).
func newManager(t *testing.T) (*Manager, string) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("sandboxes need root; CI runs the tests as root")
	}
	hidden := t.TempDir()
	if err := os.Chmod(hidden, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(hidden, "agent.key"), []byte("secret"), 0o600); err != nil {
		t.Fatal(err)
	}
	parent := fmt.Sprintf("gpupool-test/%d-%s", os.Getpid(), strings.ReplaceAll(t.Name(), "/", "_"))
	m, err := New(Config{Hide: []string{hidden}, CgroupParent: parent})
	if err != nil {
		t.Fatal(err)
	}
	if !m.Report().Full() {
		t.Fatalf("this host gives %s, want a full sandbox as root", m.Report())
	}
	t.Cleanup(func() { m.Close() })
	return m, hidden
}

// prepare makes a lease's dir under hidden and its sandbox.
func prepare(t *testing.T, m *Manager, hidden, lease string, cpu, mem int64) (string, int) {
	t.Helper()
	dir := filepath.Join(hidden, "work", lease)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	uid, err := m.Prepare(Spec{Lease: lease, Dir: dir, CPUMillicores: cpu, MemoryMiB: mem})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := m.Remove(lease); err != nil {
			t.Errorf("Remove(%s): %v", lease, err)
		}
	})
	return dir, uid
}

// run runs a shell script in the lease's sandbox and returns its output.
func run(t *testing.T, m *Manager, lease, dir, script string) (string, int) {
	t.Helper()
	cmd := &exec.Cmd{Path: "/bin/sh", Args: []string{"sh", "-c", script}, Dir: dir, Env: []string{"PATH=/usr/bin:/bin", "GPUPOOL_LEASE_ID=" + lease}}
	if err := m.Command(lease, cmd); err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	if err != nil && cmd.ProcessState == nil {
		t.Fatal(err)
	}
	return out.String(), cmd.ProcessState.ExitCode()
}

func TestASandboxedProcessSeesOnlyItsOwnLease(t *testing.T) {
	m, hidden := newManager(t)
	dirA, uidA := prepare(t, m, hidden, "L-a", 500, 256)
	dirB, uidB := prepare(t, m, hidden, "L-b", 0, 0)
	if uidA == uidB || uidA < DefaultRange.First || uidB < DefaultRange.First {
		t.Fatalf("users %d and %d: want two distinct users of the range %s", uidA, uidB, DefaultRange)
	}
	if err := os.WriteFile(filepath.Join(dirA, "secret.txt"), []byte("A's data"), 0o600); err != nil {
		t.Fatal(err)
	}
	os.Chown(filepath.Join(dirA, "secret.txt"), uidA, uidA)
	hostTmp := filepath.Join(os.TempDir(), fmt.Sprintf("gpupool-sandbox-test-%d", os.Getpid()))
	if err := os.WriteFile(hostTmp, []byte("host"), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove(hostTmp) })
	// A setuid-root copy of id on the host, as a setuid helper of the
	// host's is: with no new privileges, exec does not honour the bit.
	suidDir, err := os.MkdirTemp("/opt", "gpupool-sandbox-test-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(suidDir) })
	if err := os.Chmod(suidDir, 0o755); err != nil {
		t.Fatal(err)
	}
	setuid := filepath.Join(suidDir, "id-setuid")
	if b, err := os.ReadFile("/usr/bin/id"); err != nil {
		t.Fatal(err)
	} else if err := os.WriteFile(setuid, b, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(setuid, 0o755|os.ModeSetuid); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name, script, want string
		code               int
	}{
		{"it runs as the lease's own user", "id -u; id -G", fmt.Sprintf("%d\n%d\n", uidB, uidB), 0},
		{"it can write its own directory", "echo hi > mine.txt && cat mine.txt", "hi\n", 0},
		{"it cannot read another lease's directory", "cat " + filepath.Join(dirA, "secret.txt") + " 2>&1 >/dev/null | grep -c 'No such file'", "1\n", 0},
		{"it cannot read the agent's key", "cat " + filepath.Join(hidden, "agent.key") + " 2>/dev/null || echo refused", "refused\n", 0},
		{"the hidden directory shows only its own lease", "ls " + filepath.Join(hidden, "work"), "L-b\n", 0},
		// The init, sh, a subshell, ls and grep at most: none of the host's.
		{"its /proc shows only its own processes", "tr '\\0' ' ' </proc/1/cmdline | cut -d' ' -f1; [ $(ls /proc | grep -c '^[0-9]') -le 5 ] && echo few", initArg0 + "\nfew\n", 0},
		{"it cannot write outside its directory", "touch /etc/gpupool-sandbox-test 2>/dev/null || echo refused", "refused\n", 0},
		{"it cannot leave its cgroup", "(echo $$ > /sys/fs/cgroup/pids/cgroup.procs) 2>/dev/null || echo refused", "refused\n", 0},
		{"its /tmp is its own", "cat " + hostTmp + " 2>/dev/null || echo hidden", "hidden\n", 0},
		{"it can gain no privileges", "grep NoNewPrivs /proc/self/status", "NoNewPrivs:\t1\n", 0},
		{"a setuid-root program runs as the lease's user", setuid + " -u", fmt.Sprintf("%d\n", uidB), 0},
		{"it holds no capability and can gain none", "grep ^Cap /proc/self/status", "CapInh:\t0000000000000000\nCapPrm:\t0000000000000000\nCapEff:\t0000000000000000\nCapBnd:\t0000000000000000\nCapAmb:\t0000000000000000\n", 0},
		{"root's securebits are locked on", "setpriv --dump | grep -o 'noroot,noroot_locked,no_setuid_fixup_locked,keep_caps_locked'", "noroot,noroot_locked,no_setuid_fixup_locked,keep_caps_locked\n", 0},
		{"its exit code is the workload's", "exit 7", "", 7},
		{"a signal that kills it is its exit code", "kill -TERM $$", "", 128 + int(syscall.SIGTERM)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			// Several times: which thread the init forks from varied
			// from run to run when no_new_privs was set on another.
			for range 4 {
				got, code := run(t, m, "L-b", dirB, tt.script)
				if got != tt.want || code != tt.code {
					t.Fatalf("got %q exit %d, want %q exit %d", got, code, tt.want, tt.code)
				}
			}
		})
	}
	// Lease A's caps are in its cgroup.
	if m.Report().Cgroup == "v1" {
		for file, want := range map[string]string{
			filepath.Join("/sys/fs/cgroup/memory", m.cfg.CgroupParent, "L-a", "memory.limit_in_bytes"): strconv.Itoa(256 << 20),
			filepath.Join("/sys/fs/cgroup/cpu", m.cfg.CgroupParent, "L-a", "cpu.cfs_quota_us"):         "50000",
		} {
			b, err := os.ReadFile(file)
			if got := strings.TrimSpace(string(b)); err != nil || got != want {
				t.Errorf("%s: got %q (%v), want %q", file, got, err, want)
			}
		}
	}
}

func TestTheCgroupFindsEveryProcessAndRemoveKillsThem(t *testing.T) {
	m, hidden := newManager(t)
	dir, _ := prepare(t, m, hidden, "L-c", 0, 0)
	// The workload starts a detached child without GPUPOOL_LEASE_ID, then
	// waits: both must be found by their cgroup and killed by Remove.
	cmd := &exec.Cmd{Path: "/bin/sh", Args: []string{"sh", "-c", "env -u GPUPOOL_LEASE_ID setsid sleep 600 & echo started; exec sleep 601"},
		Dir: dir, Env: []string{"PATH=/usr/bin:/bin", "GPUPOOL_LEASE_ID=L-c"}, SysProcAttr: &syscall.SysProcAttr{Setpgid: true}}
	if err := m.Command("L-c", cmd); err != nil {
		t.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	buf := make([]byte, 8)
	if n, err := out.Read(buf); err != nil || string(buf[:n]) != "started\n" {
		t.Fatalf("read %q, %v; want started", buf[:n], err)
	}
	var pids []int
	deadline := time.Now().Add(20 * time.Second)
	for len(pids) < 3 { // the init, sleep 601 and the detached sleep 600
		if time.Now().After(deadline) {
			t.Fatalf("the cgroup holds %v, want 3 processes", pids)
		}
		if pids, err = m.Procs("L-c"); err != nil {
			t.Fatal(err)
		}
	}
	for _, pid := range pids {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
		if err != nil {
			t.Fatal(err)
		}
		if got := m.LeaseOf(b); got != "L-c" {
			t.Errorf("LeaseOf(pid %d) = %q, want L-c", pid, got)
		}
	}
	if err := m.Remove("L-c"); err != nil {
		t.Fatal(err)
	}
	<-done
	for _, pid := range pids {
		if err := syscall.Kill(pid, 0); err == nil {
			if b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid)); !bytes.Contains(b, []byte(") Z")) {
				t.Errorf("pid %d still runs after Remove", pid)
			}
		}
	}
}

func TestBadConfigAndSpecsAreRefused(t *testing.T) {
	tests := []struct {
		name    string
		cfg     Config
		wantErr string
	}{
		{"a range of system users", Config{Users: Range{First: 0, Count: 10}, CgroupParent: "x"}, "want ids of 1000 or more"},
		{"no cgroup parent", Config{}, "Config.CgroupParent \"\""},
		{"a cgroup parent that climbs", Config{CgroupParent: "../x"}, "want a relative path"},
		{"a relative hidden dir", Config{CgroupParent: "x", Hide: []string{"data"}}, "must be an absolute path"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := New(tt.cfg)
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("New: got %v, want an error containing %q", err, tt.wantErr)
			}
		})
	}
	for _, tt := range []struct{ in, wantErr string }{
		{"1-2", "ids below 1000 belong to the system"},
		{"5000", "want FIRST-LAST"},
		{"6000-5000", "want 1000 <= FIRST <= LAST"},
	} {
		if _, err := ParseRange(tt.in); err == nil || !strings.Contains(err.Error(), tt.wantErr) {
			t.Errorf("ParseRange(%q): got %v, want an error containing %q", tt.in, err, tt.wantErr)
		}
	}
	if r, err := ParseRange("200000-265535"); err != nil || r != DefaultRange {
		t.Errorf("ParseRange(200000-265535) = %v, %v; want %v", r, err, DefaultRange)
	}
	m, err := New(Config{CgroupParent: "gpupool-test/bad"})
	if err != nil {
		t.Fatal(err)
	}
	for _, spec := range []Spec{{Lease: "../x", Dir: "/tmp"}, {Lease: "L", Dir: "rel"}, {Lease: "L", Dir: "/tmp", MemoryMiB: -1}} {
		if _, err := m.Prepare(spec); err == nil {
			t.Errorf("Prepare(%+v) succeeded, want an error", spec)
		}
	}
}

// start starts a shell script in the lease's sandbox and returns the
// first line it prints, leaving it running until the test ends.
func start(t *testing.T, m *Manager, lease, dir, script string) string {
	t.Helper()
	cmd := &exec.Cmd{Path: "/bin/sh", Args: []string{"sh", "-c", script}, Dir: dir, Env: []string{"PATH=/usr/bin:/bin", "GPUPOOL_LEASE_ID=" + lease}}
	if err := m.Command(lease, cmd); err != nil {
		t.Fatal(err)
	}
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
	})
	// The read ends at the first line, or at EOF when the script fails.
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil {
		cmd.Wait()
		t.Fatalf("lease %s printed %q (%v), stderr %q", lease, line, err, stderr.String())
	}
	return line
}

// haveIPCTools says why SysV IPC rows cannot run, or "".
func haveIPCTools() string {
	for _, tool := range []string{"ipcmk", "ipcs"} {
		if _, err := exec.LookPath(tool); err != nil {
			return "util-linux's " + tool + " is not installed: SysV IPC rows need it to make and list objects"
		}
	}
	return ""
}

// ipcCounts is a script that prints how many SysV shared memory
// segments, message queues and semaphore sets its IPC namespace holds.
const ipcCounts = `echo $(ipcs -m | grep -c '^0x') $(ipcs -q | grep -c '^0x') $(ipcs -s | grep -c '^0x')`

func TestTwoLiveLeasesShareNoTmpfsIPCOrHostname(t *testing.T) {
	m, hidden := newManager(t)
	dirA, _ := prepare(t, m, hidden, "L-a", 0, 256)
	dirB, _ := prepare(t, m, hidden, "L-b", 0, 256)
	name := fmt.Sprintf("gpupool-sandbox-test-%d", os.Getpid())
	shared := []string{"/tmp", "/var/tmp", "/dev/shm", "/run/lock"}
	// Lease A leaves a file in each shared place and one SysV object of
	// each kind, then stays alive while lease B looks for them.
	var script strings.Builder
	for _, p := range shared {
		if _, err := os.Stat(p); err == nil {
			fmt.Fprintf(&script, "echo A > %s/%s && chmod 644 %s/%s && ", p, name, p, name)
		}
	}
	noIPC := haveIPCTools()
	if noIPC == "" {
		script.WriteString("ipcmk -M 4096 >/dev/null && ipcmk -Q >/dev/null && ipcmk -S 1 >/dev/null && " + ipcCounts + " && ")
	} else {
		script.WriteString("echo - && ")
	}
	script.WriteString("exec sleep 600")
	got := start(t, m, "L-a", dirA, script.String())
	if noIPC == "" && got != "1 1 1\n" {
		t.Fatalf("lease A's IPC namespace holds %q objects, want its own 1 1 1", got)
	}
	host, err := os.Hostname()
	if err != nil {
		t.Fatal(err)
	}
	type row struct {
		name, script, want, skip string
		// after, when set, checks the host once the row ran.
		after func(t *testing.T)
	}
	var tests []row
	for _, p := range shared {
		skip := ""
		if _, err := os.Stat(p); err != nil {
			skip = "this host has no " + p
		}
		mine := filepath.Join(p, name+"-b")
		tests = append(tests,
			row{name: "it cannot see lease A's file in " + p, script: "cat " + filepath.Join(p, name) + " 2>/dev/null || echo hidden", want: "hidden\n", skip: skip},
			row{name: "what it writes to " + p + " stays out of the host's", script: "echo B > " + mine + " && echo wrote", want: "wrote\n", skip: skip,
				after: func(t *testing.T) {
					if _, err := os.Stat(mine); err == nil {
						os.Remove(mine)
						t.Errorf("%s is on the host, want it in the lease's private %s only", mine, p)
					}
				}},
		)
	}
	tests = append(tests,
		row{name: "it cannot see lease A's or the host's SysV shared memory, message queues or semaphores", script: ipcCounts, want: "0 0 0\n", skip: noIPC},
		row{name: "its /dev/shm, /tmp and /var/tmp are bounded by its memory cap", script: "df -m /dev/shm /tmp /var/tmp | awk 'NR>1{print $2}' | uniq", want: "256\n"},
		row{name: "its hostname names the lease, not the host", script: "hostname", want: leaseHostname("L-b") + "\n",
			after: func(t *testing.T) {
				if leaseHostname("L-b") == host {
					t.Errorf("the lease's hostname %q is the host's", host)
				}
			}},
		row{name: "its hostname resolves, as a host's own does", script: "getent hosts $(hostname) | cut -f1 -d' '; cat /etc/hostname",
			want: "127.0.1.1\n" + leaseHostname("L-b") + "\n"},
		row{name: "it cannot rename itself in /etc/hosts", script: "(echo '10.0.0.1 x' >> /etc/hosts) 2>/dev/null || echo refused; rm -f /run/lock/gpupool-etc/hosts 2>/dev/null || echo kept",
			want: "refused\nkept\n"},
	)
	if noIPC == "" {
		// One of the host's own, which B must not see either.
		out, err := exec.Command("ipcmk", "-M", "4096").Output()
		id := strings.TrimSpace(strings.TrimPrefix(string(out), "Shared memory id:"))
		if err != nil {
			t.Fatalf("ipcmk -M on the host: %v", err)
		}
		t.Cleanup(func() { exec.Command("ipcrm", "-m", id).Run() })
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if tt.skip != "" {
				t.Skip(tt.skip)
			}
			got, code := run(t, m, "L-b", dirB, tt.script)
			if got != tt.want || code != 0 {
				t.Fatalf("got %q exit %d, want %q exit 0", got, code, tt.want)
			}
			if tt.after != nil {
				tt.after(t)
			}
		})
	}
	for _, p := range shared {
		if _, err := os.Stat(filepath.Join(p, name)); err == nil {
			t.Errorf("lease A's %s is on the host, want it in A's private %s only", filepath.Join(p, name), p)
		}
	}
}

func TestALeaseHostnameFitsAndNamesNoHost(t *testing.T) {
	host, _ := os.Hostname()
	for _, lease := range []string{"L-1", strings.Repeat("x", 128)} {
		got := leaseHostname(lease)
		if len(got) > 64 || !strings.HasPrefix(got, lease[:min(len(lease), 55)]+"-") || len(host) >= 8 && strings.Contains(got, host) {
			t.Errorf("leaseHostname(%q) = %q, want at most 64 bytes: the lease id, a dash and a hash, without %q", lease, got, host)
		}
	}
}

func TestALeaseCanWriteNothingOfTheHostButItsDirectory(t *testing.T) {
	m, hidden := newManager(t)
	dir, _ := prepare(t, m, hidden, "L-w", 0, 0)
	// World-writable on the host: only a read-only mount keeps B out.
	open, err := os.MkdirTemp("/opt", "gpupool-sandbox-test-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(open) })
	if err := os.Chmod(open, 0o777|os.ModeSticky); err != nil {
		t.Fatal(err)
	}
	openFile := filepath.Join(open, "shared.txt")
	if err := os.WriteFile(openFile, []byte("host\n"), 0o666); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(openFile, 0o666); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name, script, want string
		// onHost, when set, is a path the row must not have made.
		onHost string
	}{
		{"it cannot make a file in a world-writable directory of the host", "touch " + open + "/b 2>&1 | grep -c 'Read-only file system'", "1\n", open + "/b"},
		{"it cannot change a world-writable file of the host", "(echo B >> " + openFile + ") 2>/dev/null || echo refused; cat " + openFile, "refused\nhost\n", ""},
		{"it cannot write the host's /etc as root could", "touch /etc/gpupool-sandbox-test 2>&1 | grep -c 'Read-only file system'", "1\n", "/etc/gpupool-sandbox-test"},
		{"its device nodes still work", "head -c 4 /dev/zero | wc -c; echo x > /dev/null && echo ok", "4\nok\n", ""},
		{"it can write its own directory", "echo hi > mine.txt && cat mine.txt", "hi\n", ""},
		// The options of the mount each path is on, the last listed
		// being the one in sight.
		{"the host's mounts are read-only and nosuid, and nodev outside /dev",
			`for p in / /dev /sys; do awk -v p=$p '$5==p{o=$6} END{n=split(o,f,","); r=""; for(i=1;i<=n;i++) if(f[i]=="ro"||f[i]=="nosuid"||f[i]=="nodev") r=r f[i] " "; print p ": " r}' /proc/self/mountinfo; done`,
			"/: ro nosuid nodev \n/dev: ro nosuid \n/sys: ro nosuid nodev \n", ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, code := run(t, m, "L-w", dir, tt.script)
			if got != tt.want || code != 0 {
				t.Fatalf("got %q exit %d, want %q exit 0", got, code, tt.want)
			}
			if tt.onHost != "" {
				if _, err := os.Stat(tt.onHost); err == nil {
					os.Remove(tt.onHost)
					t.Errorf("%s is on the host, want no file made", tt.onHost)
				}
			}
		})
	}
	// The host's own mounts are as they were.
	if err := os.WriteFile(filepath.Join(open, "after"), nil, 0o644); err != nil {
		t.Errorf("the host cannot write %s after the lease ran: %v", open, err)
	}
}

func TestTheNextLeaseOfAReleasedUserFindsNothingOfThePrevious(t *testing.T) {
	m, hidden := newManager(t)
	dirA, uidA := prepare(t, m, hidden, "L-prev", 0, 0)
	// What the probe's first tenant left for the next holder of its user:
	// a chmod 600 file in /dev/shm and the other shared places, and SysV
	// objects.
	script := "for d in /tmp /var/tmp /dev/shm /run/lock; do [ -d $d ] && echo A > $d/secret && chmod 600 $d/secret; done; "
	noIPC := haveIPCTools()
	if noIPC == "" {
		script += "ipcmk -M 4096 >/dev/null && ipcmk -Q >/dev/null && ipcmk -S 1 >/dev/null; "
	}
	start(t, m, "L-prev", dirA, script+"echo ready; exec sleep 600")
	// The agent's teardown: Remove, then the lease's directory.
	if err := m.Remove("L-prev"); err != nil {
		t.Fatal(err)
	}
	if err := os.RemoveAll(dirA); err != nil {
		t.Fatal(err)
	}
	dirN, uidN := prepare(t, m, hidden, "L-next", 0, 0)
	if uidN != uidA {
		t.Fatalf("the next lease got user %d, want the released %d (nothing of it is left)", uidN, uidA)
	}
	tests := []struct{ name, script, want, skip string }{
		{"no file of the previous holder is in /tmp, /var/tmp, /dev/shm or /run/lock", "ls -A /tmp /var/tmp /dev/shm /run/lock 2>/dev/null | grep -c secret", "0\n", ""},
		{"no SysV object of the previous holder is left", ipcCounts, "0 0 0\n", noIPC},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if tt.skip != "" {
				t.Skip(tt.skip)
			}
			// grep -c exits 1 when it counts none.
			got, _ := run(t, m, "L-next", dirN, tt.script)
			if got != tt.want {
				t.Fatalf("got %q, want %q", got, tt.want)
			}
		})
	}
}

func TestAQuarantinedUserReturnsOnlyWhenNothingOfItIsLeft(t *testing.T) {
	m, hidden := newManager(t)
	tests := []struct {
		name string
		// leave leaves something of the released user behind, and
		// returns how to remove it.
		leave func(t *testing.T, uid int, dir string) (undo func())
	}{
		{"a process of it still runs", func(t *testing.T, uid int, dir string) func() {
			cmd := exec.Command("sleep", "600")
			cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uint32(uid), Gid: uint32(uid)}}
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
			if err := os.RemoveAll(dir); err != nil {
				t.Fatal(err)
			}
			return func() { cmd.Process.Kill(); cmd.Wait() }
		}},
		{"its lease's directory still holds its files", func(t *testing.T, uid int, dir string) func() {
			f := filepath.Join(dir, "left.txt")
			if err := os.WriteFile(f, []byte("A"), 0o600); err != nil {
				t.Fatal(err)
			}
			if err := os.Chown(f, uid, uid); err != nil {
				t.Fatal(err)
			}
			return func() { os.RemoveAll(dir) }
		}},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			lease := func(what string) string { return fmt.Sprintf("L-q%d-%s", i, what) }
			dir, uid := prepare(t, m, hidden, lease("released"), 0, 0)
			undo := tt.leave(t, uid, dir)
			if err := m.Remove(lease("released")); err != nil {
				t.Fatal(err)
			}
			if _, got := prepare(t, m, hidden, lease("while"), 0, 0); got == uid {
				t.Fatalf("a new lease got the quarantined user %d while %s", uid, tt.name)
			}
			undo()
			if _, got := prepare(t, m, hidden, lease("after"), 0, 0); got != uid {
				t.Fatalf("a new lease got user %d once nothing was left, want the released %d back", got, uid)
			}
		})
	}
}

func TestMountinfoPathsAreUnescaped(t *testing.T) {
	for _, tt := range []struct{ in, want string }{
		{"/", "/"},
		{`/mnt/a\040b`, "/mnt/a b"},
		{`/mnt/tab\011and\134backslash`, "/mnt/tab\tand\\backslash"},
		{`/mnt/short\04`, `/mnt/short\04`},
	} {
		if got := unescapeMountinfo(tt.in); got != tt.want {
			t.Errorf("unescapeMountinfo(%q) = %q, want %q", tt.in, got, tt.want)
		}
	}
}

func TestOnlyLeasesOfTheSharedMPSUserKeepTheHostsIPC(t *testing.T) {
	m, hidden := newManager(t)
	hostIPC, err := os.Readlink("/proc/self/ns/ipc")
	if err != nil {
		t.Fatal(err)
	}
	var shm syscall.Stat_t
	if err := syscall.Stat("/dev/shm", &shm); err != nil {
		t.Skipf("this host has no /dev/shm: %v", err)
	}
	for _, tt := range []struct {
		name, lease string
		user        int
		wantHost    bool
	}{
		{"a lease of its own user gets its own IPC namespace and /dev/shm", "L-own", 0, false},
		// An MPS server and its clients share memory through them.
		{"a lease of the shared MPS user keeps the host's", "L-mps", m.SharedUser(), true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			dir := filepath.Join(hidden, "work", tt.lease)
			if err := os.MkdirAll(dir, 0o700); err != nil {
				t.Fatal(err)
			}
			if _, err := m.Prepare(Spec{Lease: tt.lease, Dir: dir, User: tt.user}); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { m.Remove(tt.lease) })
			// Writable either way: MPS clients need the host's.
			name := fmt.Sprintf("/dev/shm/gpupool-sandbox-test-%d-%s", os.Getpid(), tt.lease)
			t.Cleanup(func() { os.Remove(name) })
			got, _ := run(t, m, tt.lease, dir, "readlink /proc/self/ns/ipc; stat -c %d /dev/shm; touch "+name+" && echo writable")
			f := strings.Split(strings.TrimSpace(got), "\n")
			if len(f) != 3 || (f[0] == hostIPC) != tt.wantHost || (f[1] == strconv.FormatUint(shm.Dev, 10)) != tt.wantHost || f[2] != "writable" {
				t.Fatalf("got %q (IPC namespace, /dev/shm device, writable); the host's are %s and %d: want the host's %v", got, hostIPC, shm.Dev, tt.wantHost)
			}
		})
	}
}

func TestALeaseDirectoryKeepsTheNoexecAndAtimeFlagsOfItsMount(t *testing.T) {
	m, hidden := newManager(t)
	work := filepath.Join(hidden, "work")
	if err := os.MkdirAll(work, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("tmpfs", work, "tmpfs", unix.MS_NOEXEC|unix.MS_NOATIME|unix.MS_NOSUID|unix.MS_NODEV, "size=1m"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(work, unix.MNT_DETACH) })
	dir, _ := prepare(t, m, hidden, "L-noexec", 0, 0)
	out, code := run(t, m, "L-noexec", dir, `awk -v d="$PWD" '$5 == d { print $6 }' /proc/self/mountinfo | tail -n 1`)
	if code != 0 {
		t.Fatalf("reading the lease's mounts: exit %d: %s", code, out)
	}
	opts := strings.Split(strings.TrimSpace(out), ",")
	for _, want := range []string{"rw", "noexec", "noatime"} {
		if !slices.Contains(opts, want) {
			t.Errorf("the lease directory's mount options: got %q, want %s among them", opts, want)
		}
	}
}
