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
	f.IntVar(&o.basePort, "base-port", 7641, "first broker's gRPC port; broker i uses base+2i (gRPC), base+2i+1 (Raft) and base+50+i (metrics), agent i base+100+i (data plane) and base+150+i (metrics)")
	f.StringVar(&o.dataDir, "data-dir", "", "where the brokers keep their data (default: a new temporary directory)")
	f.BoolVar(&o.keep, "keep", false, "keep the data dir on exit")
	f.BoolVar(&o.demo, "demo", false, "once the pool is up, acquire a lease, show it in 'gpupool status', and release it")
	f.BoolVar(&o.exit, "exit-after-demo", false, "stop everything after --demo (for scripts and tests)")
	f.StringVar(&o.ip, "ip", "127.0.0.1", "loopback address to listen on")
	f.DurationVar(&o.grace, "preempt-grace", broker.DefaultPreemptGrace, "how long preempted leases and elastic extras taken back keep running after their notice")
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
			"--metrics-bind", net.JoinHostPort(o.ip, strconv.Itoa(o.basePort+50+i))}
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

	var logMu sync.Mutex
	for _, c := range children {
		if err := c.start(self, out, &logMu); err != nil {
			stopAll(children)
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
	defer stopAll(children)

	fmt.Fprint(out, devBanner)
	for i, c := range children[:o.brokers] {
		fmt.Fprintf(out, "  %-9s pid %-7d gRPC %s  raft %s:%d  metrics http://%s:%d/metrics  data %s\n",
			c.name, c.cmd.Process.Pid, addrs[i], o.ip, o.basePort+2*i+1, o.ip, o.basePort+50+i, filepath.Join(dir, c.name))
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
	fmt.Fprintf(out, "\nThe pool is up. In another terminal (GPUPOOL_ADDR defaults to this cluster):\n")
	fmt.Fprintf(out, "  gpupool status\n  gpupool host ls\n  gpupool lease acquire --memory 20GiB --compute 25 --ttl 10m\n  gpupool lease ls\n  gpupool operator raft peers\n")
	fmt.Fprintf(out, "Watch failover: kill -9 the leader's pid (see 'gpupool operator raft peers'); leases survive.\nCtrl-C stops everything.\n\n")

	if o.demo {
		if err := runDemo(ctx, out, cmd.ErrOrStderr(), strings.Join(addrs, ",")); err != nil {
			return err
		}
		if o.exit {
			return nil
		}
	}
	watchChildren(ctx, out, children, o.brokers)
	fmt.Fprintln(out, "\ngpupool dev: stopping")
	return nil
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

func stopAll(children []*devChild) {
	for _, c := range children {
		if c.cmd != nil && c.cmd.Process != nil {
			c.cmd.Process.Signal(syscall.SIGTERM)
		}
	}
	deadline := time.After(10 * time.Second)
	for _, c := range children {
		if c.done == nil {
			continue
		}
		select {
		case <-c.done:
		case <-deadline:
			c.cmd.Process.Kill()
		}
	}
}

// watchChildren reports children that exit until ctx ends.
func watchChildren(ctx context.Context, out io.Writer, children []*devChild, brokers int) {
	pending := map[*devChild]bool{}
	for _, c := range children {
		pending[c] = true
	}
	for len(pending) > 0 {
		cases := make(chan *devChild, len(children))
		for c := range pending {
			go func(c *devChild) {
				select {
				case <-c.done:
					cases <- c
				case <-ctx.Done():
				}
			}(c)
		}
		select {
		case <-ctx.Done():
			return
		case c := <-cases:
			delete(pending, c)
			alive := 0
			for _, b := range children[:brokers] {
				if pending[b] {
					alive++
				}
			}
			fmt.Fprintf(out, "\n*** %s (pid %d) exited: %v\n", c.name, c.cmd.Process.Pid, c.err)
			if strings.HasPrefix(c.name, "broker") {
				fmt.Fprintf(out, "*** %d of %d brokers left; the cluster keeps serving while a majority (%d) is up. Restart it with:\n    gpupool %s\n\n",
					alive, brokers, brokers/2+1, strings.Join(c.args, " "))
			}
		}
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

// devCgroupParent is where dev's host i keeps its leases' cgroups: under
// this dev process, which removes them when it stops.
func devCgroupParent(i int) string {
	return fmt.Sprintf("gpupool-dev/%d/host-%d", os.Getpid(), i+1)
}
