package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"github.com/gpupool/gpupool/agent/sandbox"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/gpupool/gpupool/broker"
	"github.com/gpupool/gpupool/client"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

type devOpts struct {
	brokers  int
	hosts    int
	simulate string
	basePort int
	dataDir  string
	keep     bool
	demo     bool
	exit     bool
	ip       string
	grace    time.Duration
}

func newDevCmd() *cobra.Command {
	o := devOpts{}
	cmd := &cobra.Command{
		Use:   "dev",
		Short: "Run a local pool: 3 brokers and 4 simulated GPU hosts, in the foreground",
		Long: `Run a whole gpupool on this machine, each part its own child process:
3 broker servers forming a Raft cluster, and 4 pool hosts whose agents
simulate 8 A100 GPUs each (go-nvml's mock servers; no GPU needed).

Every other command finds this cluster by default. Kill a broker to watch
the cluster fail over; Ctrl-C stops everything and deletes the data dirs
(unless --keep). Not for production: no TLS and no authentication.`,
		Example: `  gpupool dev                 # run until Ctrl-C
  gpupool dev --demo          # also acquire, list and release a lease
  gpupool dev --hosts 2 --simulate 4xA100-40GB`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error { return runDev(cmd, o) },
	}
	f := cmd.Flags()
	f.IntVar(&o.brokers, "brokers", 3, "broker servers to run (1, 3 or 5)")
	f.IntVar(&o.hosts, "hosts", 4, "simulated pool hosts to run (0-64)")
	f.StringVar(&o.simulate, "simulate", "8xA100-80GB", "GPUs of each simulated host, as for 'gpupool agent --simulate'")
	f.IntVar(&o.basePort, "base-port", 7641, "first broker's gRPC port; broker i uses base+2i (gRPC), base+2i+1 (Raft) and base+50+i (metrics), base+60+i (web console), agent i base+100+i (data plane) and base+150+i (metrics)")
	f.StringVar(&o.dataDir, "data-dir", "", "where the brokers keep their data (default: a new temporary directory)")
	f.BoolVar(&o.keep, "keep", false, "keep the data dir on exit")
	f.BoolVar(&o.demo, "demo", false, "once the pool is up, acquire a lease, show it in 'gpupool status', and release it")
	f.BoolVar(&o.exit, "exit-after-demo", false, "stop everything after --demo (for scripts and tests)")
	f.StringVar(&o.ip, "ip", "127.0.0.1", "loopback address to listen on")
	f.DurationVar(&o.grace, "preempt-grace", broker.DefaultPreemptGrace, "how long preempted leases and elastic extras taken back keep running after their notice")
	cmd.AddCommand(newDevRestartCmd())
	return cmd
}

func newDevRestartCmd() *cobra.Command {
	basePort := 7641
	cmd := &cobra.Command{
		Use:   "restart NAME",
		Short: "Restart a process of a running 'gpupool dev' that exited (broker-2, host-1, ...)",
		Long: `Restart asks the running 'gpupool dev' (over its control socket) to start the
named process again, on its old data dir and ports, and to supervise it as
before: Ctrl-C of dev stops it with the rest. It fails when the process
still runs.`,
		Example: `  gpupool dev restart broker-2
  gpupool dev restart host-1 --base-port 17641`,
		Args: exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			sock := devSocket(basePort)
			conn, err := net.DialTimeout("unix", sock, 5*time.Second)
			if err != nil {
				return fmt.Errorf("no 'gpupool dev' runs on --base-port %d (%s): %v", basePort, sock, err)
			}
			defer conn.Close()
			conn.SetDeadline(time.Now().Add(30 * time.Second))
			fmt.Fprintf(conn, "restart %s\n", args[0])
			line, err := bufio.NewReader(conn).ReadString('\n')
			if err != nil {
				return fmt.Errorf("gpupool dev did not answer: %v", err)
			}
			line = strings.TrimSpace(line)
			if msg, ok := strings.CutPrefix(line, "ok: "); ok {
				fmt.Fprintln(cmd.OutOrStdout(), msg)
				return nil
			}
			return errors.New(strings.TrimPrefix(line, "error: "))
		},
	}
	cmd.Flags().IntVar(&basePort, "base-port", basePort, "the --base-port of the 'gpupool dev' to ask")
	return cmd
}

func (o devOpts) validate() error {
	switch o.brokers {
	case 1, 3, 5:
	default:
		return usagef("--brokers %d: must be 1, 3 or 5 (Raft needs an odd number)", o.brokers)
	}
	if o.hosts < 0 || o.hosts > 64 {
		return usagef("--hosts %d: must be between 0 and 64", o.hosts)
	}
	if o.basePort < 1024 || o.basePort+220 > 65535 {
		return usagef("--base-port %d: must be between 1024 and 65315", o.basePort)
	}
	if o.exit && !o.demo {
		return usagef("--exit-after-demo needs --demo")
	}
	if o.grace <= 0 {
		return usagef("--preempt-grace %s: must be positive, e.g. 30s or 5s", o.grace)
	}
	if ip := net.ParseIP(o.ip); ip == nil || !ip.IsLoopback() {
		return usagef("--ip %q: must be a loopback address such as 127.0.0.1 (dev has no TLS or auth)", o.ip)
	}
	return nil
}

// devChild is one process of the dev pool.
type devChild struct {
	name string
	args []string
	cmd  *exec.Cmd
	done chan struct{}
	err  error
}

func runDev(cmd *cobra.Command, o devOpts) error {
	if err := o.validate(); err != nil {
		return err
	}
	out := cmd.OutOrStdout()
	self, err := os.Executable()
	if err != nil {
		return fmt.Errorf("dev: find own binary: %w", err)
	}
	dir := o.dataDir
	if dir == "" {
		if dir, err = os.MkdirTemp("", "gpupool-dev-"); err != nil {
			return err
		}
	}
	if !o.keep && o.dataDir == "" {
		defer os.RemoveAll(dir)
	}
	// The pool runs without TLS: certificates from the environment would
	// contradict its --insecure children and its own demo's plaintext calls.
	for _, f := range []string{"tls-ca", "tls-cert", "tls-key"} {
		if cmd.Flags().Changed(f) {
			return usagef("--%s: gpupool dev runs without TLS; start brokers with 'gpupool broker' for a cluster with TLS", f)
		}
	}
	for _, env := range []string{envTLSCA, envTLSCert, envTLSKey} {
		os.Unsetenv(env)
	}
	global.tls = tlsOpts{}

	var addrs []string
	for i := range o.brokers {
		addrs = append(addrs, net.JoinHostPort(o.ip, strconv.Itoa(o.basePort+2*i)))
	}
	for _, a := range addrs {
		if err := checkFree(a); err != nil {
			return fmt.Errorf("dev: %s is in use (another 'gpupool dev' running?): stop it or pick --base-port: %w", a, err)
		}
	}
	var children []*devChild
	for i, a := range addrs {
		var join []string
		for j, b := range addrs {
			if j != i {
				join = append(join, b)
			}
		}
		args := []string{"broker", "--node-id", fmt.Sprintf("broker-%d", i+1), "--data-dir", filepath.Join(dir, fmt.Sprintf("broker-%d", i+1)),
			"--bind", a, "--bootstrap-expect", strconv.Itoa(o.brokers), "--heartbeat-interval", "1s", "--heartbeat-ttl", "5s", "--lock-delay", "10s",
			"--preempt-grace", o.grace.String(), "--insecure",
			"--metrics-bind", net.JoinHostPort(o.ip, strconv.Itoa(o.basePort+50+i)),
			"--ui-bind", net.JoinHostPort(o.ip, strconv.Itoa(o.basePort+60+i))}
		if len(join) > 0 {
			args = append(args, "--join", strings.Join(join, ","))
		}
		children = append(children, &devChild{name: fmt.Sprintf("broker-%d", i+1), args: args})
	}
	for i := range o.hosts {
		children = append(children, &devChild{name: fmt.Sprintf("host-%d", i+1), args: []string{
			"agent", "--insecure", "--broker", strings.Join(addrs, ","), "--simulate", o.simulate, "--host-id", fmt.Sprintf("host-%d", i+1),
			"--data-bind", net.JoinHostPort(o.ip, strconv.Itoa(o.basePort+100+i)),
			"--data-dir", filepath.Join(dir, fmt.Sprintf("host-%d", i+1)),
			"--metrics-bind", net.JoinHostPort(o.ip, strconv.Itoa(o.basePort+150+i)),
			// dev may run without root: then leases run with reduced
			// isolation, which dev allows (and the agents say so).
			"--allow-reduced-isolation",
			"--sandbox-users", fmt.Sprintf("%d-%d", sandbox.DefaultRange.First+i*10000, sandbox.DefaultRange.First+i*10000+9999),
			"--cgroup-parent", devCgroupParent(i),
		}})
	}

	pool := &devPool{self: self, out: out, brokers: o.brokers, children: children, exited: make(chan *devChild, len(children)), adopted: map[string]int{}}
	for _, c := range children {
		if err := pool.start(c); err != nil {
			pool.stopAll()
			return err
		}
	}
	// Deferred first, so it runs after the agents stopped: their leases'
	// cgroups, and whatever still runs in them, go with the dev pool.
	defer func() {
		for i := range o.hosts {
			if m, err := sandbox.New(sandbox.Config{CgroupParent: devCgroupParent(i)}); err == nil {
				m.Purge()
			}
		}
	}()
	defer pool.stopAll()
	sock := devSocket(o.basePort)
	stopCtl, err := pool.serveControl(sock)
	if err != nil {
		return err
	}
	defer stopCtl()

	fmt.Fprint(out, devBanner)
	for i, c := range children[:o.brokers] {
		fmt.Fprintf(out, "  %-9s pid %-7d gRPC %s  raft %s:%d  metrics http://%s:%d/metrics  console http://%s:%d/  data %s\n",
			c.name, c.cmd.Process.Pid, addrs[i], o.ip, o.basePort+2*i+1, o.ip, o.basePort+50+i, o.ip, o.basePort+60+i, filepath.Join(dir, c.name))
	}
	for i, c := range children[o.brokers:] {
		fmt.Fprintf(out, "  %-9s pid %-7d agent, %s simulated  metrics http://%s:%d/metrics  sim-control %s\n", c.name, c.cmd.Process.Pid,
			o.simulate, o.ip, o.basePort+150+i, filepath.Join(dir, c.name, "simulate.sock"))
	}

	if os.Geteuid() != 0 {
		fmt.Fprintf(out, "  (not root: the agents cannot sandbox leases, so their processes run as you, with reduced isolation, which dev allows with --allow-reduced-isolation)\n")
	} else {
		fmt.Fprintf(out, "  (root: each lease's processes run in a sandbox of their own; dev still passes --allow-reduced-isolation)\n")
	}

	ctx := cmd.Context()
	if err := waitForPool(ctx, addrs, o.hosts); err != nil {
		return err
	}
	fmt.Fprintf(out, "\nThe pool is up. Console (open: no ACL in dev): %s\n", devConsoleURL(o))
	fmt.Fprintf(out, "In another terminal (GPUPOOL_ADDR defaults to this cluster):\n")
	fmt.Fprintf(out, "  gpupool status\n  gpupool host ls\n  gpupool lease acquire --memory 20GiB --compute 25 --ttl 10m\n  gpupool lease ls\n  gpupool operator members\n")
	fmt.Fprintf(out, "Watch failover: kill -9 the leader's pid (see 'gpupool operator members'); leases survive.\n")
	fmt.Fprintf(out, "Restart a process that exited: %s NAME (e.g. broker-2); dev supervises it again.\nCtrl-C stops everything.\n\n", restartCommand(o.basePort))

	if o.demo {
		if err := runDemo(ctx, out, cmd.ErrOrStderr(), strings.Join(addrs, ",")); err != nil {
			return err
		}
		if o.exit {
			return nil
		}
	}
	pool.watch(ctx, o.basePort)
	fmt.Fprintln(out, "\ngpupool dev: stopping")
	return nil
}

// devPool supervises the processes of one 'gpupool dev': its children,
// and brokers a user restarted by hand on a child's data dir (adopted).
// Stopping the pool stops both.
type devPool struct {
	self    string
	out     io.Writer
	brokers int
	exited  chan *devChild // a child's process ended

	logMu sync.Mutex // serialises the children's output lines

	mu       sync.Mutex
	children []*devChild    // guarded by mu; a restart replaces its entry
	adopted  map[string]int // child name -> pid of its hand-started stand-in; guarded by mu
}

// devSocket is the control socket of the dev pool on basePort.
func devSocket(basePort int) string {
	return filepath.Join(os.TempDir(), fmt.Sprintf("gpupool-dev-%d.sock", basePort))
}

// restartCommand is how a user restarts a child of the dev pool.
func restartCommand(basePort int) string {
	if basePort == 7641 {
		return "gpupool dev restart"
	}
	return fmt.Sprintf("gpupool dev restart --base-port %d", basePort)
}

func (p *devPool) start(c *devChild) error {
	if err := c.start(p.self, p.out, &p.logMu); err != nil {
		return err
	}
	go func() {
		<-c.done
		p.exited <- c
	}()
	return nil
}

// restart starts the named child again, on its old arguments, when its
// process has ended and no adopted stand-in runs.
func (p *devPool) restart(name string) (string, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	var names []string
	for i, c := range p.children {
		names = append(names, c.name)
		if c.name != name {
			continue
		}
		if !c.exitedYet() {
			return "", fmt.Errorf("%s is running (pid %d)", name, c.cmd.Process.Pid)
		}
		if pid, ok := p.adopted[name]; ok && pidAlive(pid) {
			return "", fmt.Errorf("%s runs as pid %d, started by hand; dev stops it on Ctrl-C", name, pid)
		}
		delete(p.adopted, name)
		n := &devChild{name: c.name, args: c.args}
		if err := p.start(n); err != nil {
			return "", err
		}
		p.children[i] = n
		return fmt.Sprintf("%s restarted, pid %d", name, n.cmd.Process.Pid), nil
	}
	return "", fmt.Errorf("no process %q in this dev pool; choose one of: %s", name, strings.Join(names, ", "))
}

// serveControl serves restart requests on a unix socket at path: one line
// "restart NAME" in, one line "ok: ..." or "error: ..." out.
func (p *devPool) serveControl(path string) (stop func(), err error) {
	os.Remove(path) // a dead dev's; the ports check rules out a live one
	lis, err := net.Listen("unix", path)
	if err != nil {
		return nil, fmt.Errorf("dev: control socket: %w", err)
	}
	go func() {
		for {
			conn, err := lis.Accept()
			if err != nil {
				return
			}
			go func() {
				defer conn.Close()
				conn.SetDeadline(time.Now().Add(30 * time.Second))
				line, _ := bufio.NewReader(conn).ReadString('\n')
				verb, name, _ := strings.Cut(strings.TrimSpace(line), " ")
				if verb != "restart" {
					fmt.Fprintf(conn, "error: unknown request %q\n", verb)
					return
				}
				msg, err := p.restart(name)
				if err != nil {
					fmt.Fprintf(conn, "error: %v\n", err)
					return
				}
				p.logMu.Lock()
				fmt.Fprintf(p.out, "\n*** %s\n\n", msg)
				p.logMu.Unlock()
				fmt.Fprintf(conn, "ok: %s\n", msg)
			}()
		}
	}()
	return func() { lis.Close(); os.Remove(path) }, nil
}

// stopAll stops every process of the pool, adopted ones included, and
// waits until they are gone (SIGKILL after 10 s).
func (p *devPool) stopAll() {
	p.mu.Lock()
	children := slices.Clone(p.children)
	var adopted []int
	for _, pid := range p.adopted {
		adopted = append(adopted, pid)
	}
	p.mu.Unlock()
	for _, c := range children {
		if c.cmd != nil && c.cmd.Process != nil && !c.exitedYet() {
			c.cmd.Process.Signal(syscall.SIGTERM)
		}
	}
	for _, pid := range adopted {
		syscall.Kill(pid, syscall.SIGTERM)
	}
	deadline := time.Now().Add(10 * time.Second)
	for _, c := range children {
		if c.done == nil {
			continue
		}
		select {
		case <-c.done:
		case <-time.After(time.Until(deadline)):
			c.cmd.Process.Kill()
			<-c.done
		}
	}
	for _, pid := range adopted {
		for pidAlive(pid) && time.Now().Before(deadline) {
			time.Sleep(50 * time.Millisecond)
		}
		if pidAlive(pid) {
			syscall.Kill(pid, syscall.SIGKILL)
			for pidAlive(pid) {
				time.Sleep(50 * time.Millisecond)
			}
		}
	}
}

// pidAlive reports whether a process with pid exists (and is not a zombie
// of ours: those are reaped by their Wait).
func pidAlive(pid int) bool {
	if syscall.Kill(pid, 0) != nil {
		return false
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	// The state follows the command name in parentheses: "Z" is a zombie.
	if i := strings.LastIndexByte(string(b), ')'); i >= 0 && i+2 < len(b) {
		return b[i+2] != 'Z'
	}
	return true
}

// watch reports children that exit, counting the brokers left, and adopts
// brokers restarted by hand on a child's data dir, until ctx ends.
func (p *devPool) watch(ctx context.Context, basePort int) {
	tick := time.NewTicker(500 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case c := <-p.exited:
			p.mu.Lock()
			current := slices.Contains(p.children, c)
			p.mu.Unlock()
			if !current {
				continue
			}
			fmt.Fprintf(p.out, "\n*** %s (pid %d) exited: %v\n", c.name, c.cmd.Process.Pid, c.err)
			if strings.HasPrefix(c.name, "broker") {
				fmt.Fprintf(p.out, "*** %s\n", p.quorumLine())
			}
			fmt.Fprintf(p.out, "*** restart it with:  %s %s\n", restartCommand(basePort), c.name)
			if strings.HasPrefix(c.name, "broker") {
				fmt.Fprintf(p.out, "***   or by hand (dev adopts it, and stops it on Ctrl-C):\n***   gpupool %s\n", strings.Join(c.args, " "))
			}
			fmt.Fprintln(p.out)
		case <-tick.C:
			p.adopt()
		}
	}
}

// quorumLine counts the brokers up against the majority the cluster needs.
func (p *devPool) quorumLine() string {
	p.mu.Lock()
	up := 0
	for _, c := range p.children[:p.brokers] {
		if !c.exitedYet() {
			up++
		} else if pid, ok := p.adopted[c.name]; ok && pidAlive(pid) {
			up++
		}
	}
	p.mu.Unlock()
	majority := p.brokers/2 + 1
	if up >= majority {
		return fmt.Sprintf("%d of %d brokers up; the cluster keeps serving while a majority (%d) is up", up, p.brokers, majority)
	}
	return fmt.Sprintf("%d of %d brokers up: the cluster has lost its quorum and serves nothing until a majority (%d) is up again", up, p.brokers, majority)
}

// adopt takes in brokers a user started by hand on the data dir of a
// broker child that exited: the broker writes its pid there.
func (p *devPool) adopt() {
	p.mu.Lock()
	var found []string
	for _, c := range p.children[:p.brokers] {
		if !c.exitedYet() {
			continue
		}
		if pid, ok := p.adopted[c.name]; ok && pidAlive(pid) {
			continue
		}
		pid := readPIDFile(filepath.Join(flagValue(c.args, "--data-dir"), brokerPIDFile))
		if pid > 0 && pidAlive(pid) {
			p.adopted[c.name] = pid
			found = append(found, fmt.Sprintf("adopted %s (pid %d), started by hand; Ctrl-C stops it too", c.name, pid))
		}
	}
	p.mu.Unlock()
	for _, f := range found {
		fmt.Fprintf(p.out, "\n*** %s\n*** %s\n\n", f, p.quorumLine())
	}
}

func readPIDFile(path string) int {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0
	}
	pid, _ := strconv.Atoi(strings.TrimSpace(string(b)))
	return pid
}

// flagValue is the value after flag in args, "" if absent.
func flagValue(args []string, flag string) string {
	for i, a := range args {
		if a == flag && i+1 < len(args) {
			return args[i+1]
		}
	}
	return ""
}

// devBanner says loudly what dev leaves out.
const devBanner = `
****************************************************************************
*  gpupool dev: a local pool for trying things out. NOT FOR PRODUCTION.    *
*  It runs WITHOUT TLS and WITHOUT ACL tokens: every process on this       *
*  machine can lease, release, drain and join the cluster. For a real      *
*  cluster see docs/security.md and the README's Production sections.      *
****************************************************************************

`

func checkFree(addr string) error {
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	return l.Close()
}

func (c *devChild) start(self string, out io.Writer, mu *sync.Mutex) error {
	c.cmd = exec.Command(self, c.args...)
	c.cmd.Env = append(os.Environ(), devChildEnv+"=1")
	// Children die with dev, even if dev is killed.
	c.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	pr, pw := io.Pipe()
	c.cmd.Stdout, c.cmd.Stderr = pw, pw
	if err := c.cmd.Start(); err != nil {
		return fmt.Errorf("dev: start %s: %w", c.name, err)
	}
	c.done = make(chan struct{})
	go func() {
		sc := bufio.NewScanner(pr)
		for sc.Scan() {
			mu.Lock()
			fmt.Fprintf(out, "%-9s | %s\n", c.name, sc.Text())
			mu.Unlock()
		}
	}()
	go func() {
		c.err = c.cmd.Wait()
		pw.Close()
		close(c.done)
	}()
	return nil
}

// exitedYet reports whether the child's process has ended.
func (c *devChild) exitedYet() bool {
	select {
	case <-c.done:
		return true
	default:
		return false
	}
}

// waitForPool waits until the brokers have a leader and every host has
// registered, printing progress.
func waitForPool(ctx context.Context, addrs []string, hosts int) error {
	cl, err := client.Dial(addrs)
	if err != nil {
		return err
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	for {
		st, err := cl.Pool.Status(ctx, &gpupoolv1.StatusRequest{})
		if err == nil && int(st.HostsReady) >= hosts {
			return nil
		}
		select {
		case <-ctx.Done():
			if err != nil {
				return fmt.Errorf("dev: the pool did not come up within 60s: %v", errorMessage(err))
			}
			return fmt.Errorf("dev: only %d of %d hosts registered within 60s", st.HostsReady, hosts)
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// runDemo shows a newcomer a lease's life with the same commands they
// would type.
func runDemo(ctx context.Context, out, errOut io.Writer, addr string) error {
	step := func(args ...string) (string, error) {
		fmt.Fprintf(out, "$ gpupool %s\n", strings.Join(args, " "))
		var buf strings.Builder
		code := run(append(args, "--addr", addr), io.MultiWriter(out, &buf), errOut)
		fmt.Fprintln(out)
		if code != 0 {
			return "", fmt.Errorf("dev demo: 'gpupool %s' exited with %d", strings.Join(args, " "), code)
		}
		return buf.String(), nil
	}
	fmt.Fprintln(out, "== demo: acquire a fractional slice, see it in the pool, release it ==")
	if _, err := step("status"); err != nil {
		return err
	}
	table, err := step("lease", "acquire", "--memory", "20GiB", "--compute", "25", "--ttl", "10m", "--holder", "dev-demo")
	if err != nil {
		return err
	}
	id := leaseIDRE.FindString(table)
	if id == "" {
		return errors.New("dev demo: acquire printed no lease id")
	}
	for _, args := range [][]string{{"lease", "ls"}, {"status"}, {"lease", "release", id}} {
		if _, err := step(args...); err != nil {
			return err
		}
	}
	fmt.Fprintln(out, "== demo done: the lease was granted, counted in status, and released ==")
	return ctx.Err()
}

// leaseIDRE finds a lease id in a command's output.
var leaseIDRE = regexp.MustCompile(`\bl-[0-9a-f]{16}\b`)

// devConsoleURL is the first broker's web console.
func devConsoleURL(o devOpts) string {
	return "http://" + net.JoinHostPort(o.ip, strconv.Itoa(o.basePort+60)) + "/"
}

// devCgroupParent is where dev's host i keeps its leases' cgroups: under
// this dev process, which removes them when it stops.
func devCgroupParent(i int) string {
	return fmt.Sprintf("gpupool-dev/%d/host-%d", os.Getpid(), i+1)
}
