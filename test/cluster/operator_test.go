package cluster_test

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

func TestAnUnreachableClusterFailsWithinTheConnectBudgetNamingEachBroker(t *testing.T) {
	if testing.Short() {
		t.Skip("runs the built binary")
	}
	// Free ports: nothing listens there.
	addrs := []string{freePort(t, "127.0.0.2"), freePort(t, "127.0.0.3"), freePort(t, "127.0.0.4")}
	_, stderr, code := gpupool(t, "status", "--addr", strings.Join(addrs, ","), "--timeout", "10m", "--connect-timeout", "2s")
	if code != 1 {
		t.Fatalf("exit code: got %d, want 1\n%s", code, stderr)
	}
	for _, a := range addrs {
		if !strings.Contains(stderr, a+": refused") {
			t.Errorf("stderr does not name %s as refused:\n%s", a, stderr)
		}
	}
	for _, bad := range []string{"timed out", "rpc error", "code ="} {
		if strings.Contains(stderr, bad) {
			t.Errorf("stderr says %q; the connect budget, not --timeout, should end the call:\n%s", bad, stderr)
		}
	}
}

func TestLostQuorumIsNamedAsSuch(t *testing.T) {
	if testing.Short() {
		t.Skip("starts real processes")
	}
	cl := newCluster(t, 0)
	cl.leader()
	addr := "--addr=" + strings.Join(cl.addrs, ",")
	for _, i := range []int{1, 2} {
		cl.brokers[i].signal(t, syscall.SIGKILL)
	}
	_, stderr, code := gpupool(t, "status", addr, "--timeout", "10m", "--connect-timeout", "3s")
	if code != 1 {
		t.Fatalf("status: exit code got %d, want 1\n%s", code, stderr)
	}
	want := "lost quorum: 1 of 3 brokers reachable (broker-1); a majority (2) is needed"
	if !strings.Contains(stderr, want) {
		t.Errorf("status: stderr lacks %q:\n%s", want, stderr)
	}
	for _, name := range []string{"broker-2", "broker-3"} {
		if !regexp.MustCompile(name + ` \([0-9.:]+\): refused`).MatchString(stderr) {
			t.Errorf("status: stderr does not name %s as refused:\n%s", name, stderr)
		}
	}

	out, stderr, code := gpupool(t, "operator", "members", addr, "-o", "json")
	if code != 1 {
		t.Errorf("members: exit code got %d, want 1 (no quorum)\n%s", code, stderr)
	}
	var got struct {
		Members []struct {
			ID        string `json:"id"`
			Reachable bool   `json:"reachable"`
			Status    string `json:"status"`
			Voter     bool   `json:"voter"`
		} `json:"members"`
	}
	if err := json.Unmarshal([]byte(out), &got); err != nil {
		t.Fatalf("members -o json: %v\n%s", err, out)
	}
	var rows []string
	for _, m := range got.Members {
		rows = append(rows, fmt.Sprintf("%s %v %s", m.ID, m.Reachable, m.Status))
	}
	wantRows := []string{"broker-1 true up, no leader", "broker-2 false refused", "broker-3 false refused"}
	if strings.Join(rows, "; ") != strings.Join(wantRows, "; ") {
		t.Errorf("members: got %q, want %q", rows, wantRows)
	}
}

// devRun is a running 'gpupool dev' whose output the test reads.
type devRun struct {
	cmd  *exec.Cmd
	done chan struct{}
	mu   sync.Mutex
	out  strings.Builder // guarded by mu
}

func (d *devRun) output() string {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.out.String()
}

// waitFor waits until dev's output matches re, returning the submatches.
func (d *devRun) waitFor(t *testing.T, re string) []string {
	t.Helper()
	rx := regexp.MustCompile(re)
	var m []string
	eventually(t, "dev to print "+re, 90*time.Second, func() error {
		if m = rx.FindStringSubmatch(d.output()); m == nil {
			return fmt.Errorf("not yet")
		}
		return nil
	})
	return m
}

func alive(pid int) bool {
	if syscall.Kill(pid, 0) != nil {
		return false
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	return i < 0 || i+2 >= len(s) || s[i+2] != 'Z'
}

func TestDevSupervisesRestartsAndAdoptsBrokersAndCtrlCLeavesNothing(t *testing.T) {
	if testing.Short() {
		t.Skip("starts real processes")
	}
	ip := "127.0.0.6"
	base := 0
	for range 20 {
		_, p, _ := net.SplitHostPort(freePort(t, ip))
		n, _ := strconv.Atoi(p)
		if n+220 < 65535 && n > 1024 {
			base = n
			break
		}
	}
	d := &devRun{done: make(chan struct{})}
	d.cmd = exec.Command(binary, "dev", "--hosts", "1", "--ip", ip, "--base-port", strconv.Itoa(base))
	pr, pw := io.Pipe()
	d.cmd.Stdout, d.cmd.Stderr = pw, pw
	if err := d.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		sc := bufio.NewScanner(pr)
		for sc.Scan() {
			d.mu.Lock()
			d.out.WriteString(sc.Text() + "\n")
			d.mu.Unlock()
		}
	}()
	go func() { d.cmd.Wait(); pw.Close(); close(d.done) }()
	var byHand *exec.Cmd
	t.Cleanup(func() {
		d.cmd.Process.Kill()
		if byHand != nil && byHand.Process != nil {
			byHand.Process.Kill()
		}
		if t.Failed() {
			t.Logf("dev output:\n%s", d.output())
		}
	})

	d.waitFor(t, "The pool is up")
	var pids []int
	for _, m := range regexp.MustCompile(`(?m)^  (broker-\d|host-\d)\s+pid (\d+)`).FindAllStringSubmatch(d.output(), -1) {
		pid, _ := strconv.Atoi(m[2])
		pids = append(pids, pid)
	}
	if len(pids) != 4 {
		t.Fatalf("dev printed %d pids, want 4 (3 brokers, 1 host)", len(pids))
	}

	// broker-2 killed, then restarted by hand with the command dev prints:
	// dev adopts it.
	syscall.Kill(pids[1], syscall.SIGKILL)
	m := d.waitFor(t, `\*\*\*   gpupool (broker --node-id broker-2 [^\n]*)`)
	if !strings.Contains(d.output(), "2 of 3 brokers up; the cluster keeps serving") {
		t.Errorf("after one kill dev does not count 2 of 3 brokers up")
	}
	byHand = exec.Command(binary, strings.Fields(m[1])...)
	if err := byHand.Start(); err != nil {
		t.Fatal(err)
	}
	handDone := make(chan struct{})
	go func() { byHand.Wait(); close(handDone) }()
	d.waitFor(t, `adopted broker-2 \(pid \d+\)`)

	// broker-3 killed, then restarted through dev's control socket.
	syscall.Kill(pids[2], syscall.SIGKILL)
	d.waitFor(t, `broker-3 \(pid \d+\) exited`)
	out, stderr, code := gpupool(t, "dev", "restart", "broker-3", "--base-port", strconv.Itoa(base))
	if code != 0 {
		t.Fatalf("dev restart: exit %d: %s", code, stderr)
	}
	rm := regexp.MustCompile(`broker-3 restarted, pid (\d+)`).FindStringSubmatch(out)
	if rm == nil {
		t.Fatalf("dev restart printed %q, want the new pid", out)
	}
	restarted, _ := strconv.Atoi(rm[1])
	_, stderr, code = gpupool(t, "dev", "restart", "broker-3", "--base-port", strconv.Itoa(base))
	if code != 1 || !strings.Contains(stderr, "broker-3 is running") {
		t.Errorf("a second restart of a running broker: got exit %d %q, want 1 and 'is running'", code, stderr)
	}

	d.cmd.Process.Signal(syscall.SIGINT)
	select {
	case <-d.done:
	case <-time.After(60 * time.Second):
		t.Fatal("dev did not exit within 60s of SIGINT")
	}
	select {
	case <-handDone:
	case <-time.After(30 * time.Second):
		t.Fatal("the adopted broker still runs after dev's Ctrl-C")
	}
	for _, pid := range append(pids, restarted) {
		if alive(pid) {
			t.Errorf("pid %d still runs after dev's Ctrl-C", pid)
		}
	}
	ports := []int{base, base + 1, base + 2, base + 3, base + 4, base + 5, base + 50, base + 51, base + 52, base + 100, base + 150}
	for _, p := range ports {
		addr := net.JoinHostPort(ip, strconv.Itoa(p))
		l, err := net.Listen("tcp", addr)
		if err != nil {
			t.Errorf("port %s still bound after dev's Ctrl-C: %v", addr, err)
			continue
		}
		l.Close()
	}
}

func TestEveryListPrintsIdsWithDashOName(t *testing.T) {
	if testing.Short() {
		t.Skip("starts real processes")
	}
	cl := newCluster(t, 1)
	addr := "--addr=" + strings.Join(cl.addrs, ",")
	var ids []string
	for range 3 {
		out, stderr, code := gpupool(t, "lease", "acquire", "--memory", "1GiB", "--compute", "5", "-o", "name", addr)
		if code != 0 {
			t.Fatalf("acquire -o name: exit %d: %s", code, stderr)
		}
		ids = append(ids, strings.TrimSpace(out))
	}
	lines := func(s string) string { return strings.Join(strings.Fields(s), " ") }
	cases := []struct {
		args []string
		want string
	}{
		{[]string{"lease", "ls", "-o", "name"}, strings.Join(ids, " ")},
		{[]string{"lease", "ls", "-q"}, strings.Join(ids, " ")},
		{[]string{"host", "ls", "-o", "name"}, "host-1"},
		{[]string{"host", "ls", "-q"}, "host-1"},
		{[]string{"operator", "raft", "peers", "-o", "name"}, "broker-1 broker-2 broker-3"},
		{[]string{"operator", "members", "-q"}, "broker-1 broker-2 broker-3"},
		{[]string{"operator", "quota", "ls", "-o", "name"}, ""},
		{[]string{"lease", "ls", "--tenant", "nobody"}, "no leases"},
		{[]string{"lease", "ls", "--tenant", "nobody", "-q"}, ""},
	}
	for _, c := range cases {
		out, stderr, code := gpupool(t, append(c.args, addr)...)
		if code != 0 {
			t.Errorf("gpupool %s: exit %d: %s", strings.Join(c.args, " "), code, stderr)
			continue
		}
		if got := lines(out); got != c.want {
			t.Errorf("gpupool %s: got %q, want %q (the ids, oldest lease first)", strings.Join(c.args, " "), got, c.want)
		}
	}
	keys, _, code := gpupool(t, "operator", "keys", "ls", "-q", addr)
	if code != 0 || !regexp.MustCompile(`^\S+\n$`).MatchString(keys) {
		t.Errorf("keys ls -q: exit %d, got %q, want one key id", code, keys)
	}

	out, stderr, code := gpupool(t, append([]string{"lease", "release", addr}, ids...)...)
	if code != 0 || strings.Count(out, "released l-") != 3 {
		t.Errorf("release of 3 ids: exit %d, stdout %q, stderr %q; want 3 released", code, out, stderr)
	}
	_, stderr, code = gpupool(t, "lease", "release", addr, "l-0000000000000000", ids[0])
	if code != 1 || !strings.Contains(stderr, "l-0000000000000000") {
		t.Errorf("release of an unknown id among others: exit %d, stderr %q; want 1 naming it", code, stderr)
	}
}

func TestCtrlCOfARunWhoseCommandIgnoresSIGINTExits130(t *testing.T) {
	if testing.Short() {
		t.Skip("starts real processes")
	}
	cl := newCluster(t, 1)
	cmd := exec.Command(binary, "run", "--addr="+strings.Join(cl.addrs, ","), "--memory", "1GiB", "--compute", "10", "--",
		"sh", "-c", `trap "" INT; echo started; sleep 600`)
	var out, errOut syncBuffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { cmd.Wait(); close(done) }()
	t.Cleanup(func() { cmd.Process.Kill(); <-done })
	eventually(t, "the remote command to start", 30*time.Second, func() error {
		if !strings.Contains(out.String(), "started") {
			return fmt.Errorf("not yet; stderr %q", errOut.String())
		}
		return nil
	})
	cmd.Process.Signal(syscall.SIGINT)
	select {
	case <-done:
	case <-time.After(60 * time.Second):
		t.Fatal("run did not end within 60s of Ctrl-C")
	}
	if code := cmd.ProcessState.ExitCode(); code != 130 {
		t.Errorf("exit code: got %d, want 130\nstderr: %s", code, errOut.String())
	}
	if strings.Contains(errOut.String(), "context canceled") {
		t.Errorf("stderr shows a raw context error:\n%s", errOut.String())
	}
}
