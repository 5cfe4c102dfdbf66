package robustness

import (
	"bytes"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// namePrefix starts the name of every namespace and link this package
// creates; the creating process's PID (base 36), "x" and a counter
// follow, so that a later run can tell a stale namespace (its PID is
// gone) from one in use. Link names stay within Linux's 15 bytes.
const namePrefix = "gprb"

var networks atomic.Int64 // networks this process created

// netnsNetwork puts each node in a network namespace with one veth pair
// to a bridge in the root namespace; the test process reaches every node
// through the bridge. Block is an iptables DROP on the receiver's INPUT
// chain (a blackhole route on the sender where iptables is missing);
// Degrade is tc netem, or tc tbf where the kernel has no netem.
type netnsNetwork struct {
	prefix string // namePrefix + PID
	bridge string
	subnet string // "10.211.N", the /24 of this run

	mu    sync.Mutex
	nodes map[string]int // node → index; guarded by mu
	order []string       // guarded by mu
}

// newNetnsNetwork removes namespaces left by dead runs, then creates the
// bridge of this run, or returns why it cannot.
func newNetnsNetwork() (*netnsNetwork, error) {
	for _, tool := range []string{"ip", "tc"} {
		if _, err := exec.LookPath(tool); err != nil {
			return nil, fmt.Errorf("%s is not installed (Debian package iproute2)", tool)
		}
	}
	removeStaleNamespaces()
	n := &netnsNetwork{prefix: namePrefix + strconv.FormatInt(int64(os.Getpid()), 36) + "x" + strconv.FormatInt(networks.Add(1), 36), nodes: map[string]int{}}
	n.bridge = n.prefix + "b"
	subnet, err := freeSubnet()
	if err != nil {
		return nil, err
	}
	n.subnet = subnet
	if err := run("ip", "link", "add", n.bridge, "type", "bridge"); err != nil {
		return nil, err
	}
	if err := firstErr(
		run("ip", "addr", "add", n.subnet+".1/24", "dev", n.bridge),
		run("ip", "link", "set", n.bridge, "up"),
	); err != nil {
		n.Close()
		return nil, err
	}
	return n, nil
}

// freeSubnet picks a 10.211.N.0/24 that no route of this machine covers.
func freeSubnet() (string, error) {
	out, err := exec.Command("ip", "-4", "route", "show", "table", "all").CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("ip route: %v: %s", err, out)
	}
	for i := 1 + os.Getpid()%200; i < 1+os.Getpid()%200+250; i++ {
		s := fmt.Sprintf("10.211.%d", i%250+1)
		if !bytes.Contains(out, []byte(s+".")) {
			return s, nil
		}
	}
	return "", fmt.Errorf("no free 10.211.N.0/24 subnet")
}

// removeStaleNamespaces deletes the namespaces and bridges of runs whose
// process is gone. It is idempotent and ignores what it cannot remove.
func removeStaleNamespaces() {
	stale := func(name string) bool {
		rest, ok := strings.CutPrefix(name, namePrefix)
		if !ok {
			return false
		}
		pid36, _, ok := strings.Cut(rest, "x")
		pid, err := strconv.ParseInt(pid36, 36, 64)
		if !ok || err != nil {
			return false
		}
		_, err = os.Stat("/proc/" + strconv.FormatInt(pid, 10))
		return os.IsNotExist(err)
	}
	if out, err := exec.Command("ip", "netns", "list").Output(); err == nil {
		for _, line := range strings.Split(string(out), "\n") {
			if f := strings.Fields(line); len(f) > 0 && stale(f[0]) {
				exec.Command("ip", "netns", "del", f[0]).Run()
			}
		}
	}
	if out, err := exec.Command("ip", "-o", "link", "show").Output(); err == nil {
		for _, line := range strings.Split(string(out), "\n") {
			f := strings.Fields(line)
			if len(f) < 2 {
				continue
			}
			name, _, _ := strings.Cut(strings.TrimSuffix(f[1], ":"), "@")
			if stale(name) {
				exec.Command("ip", "link", "del", name).Run()
			}
		}
	}
}

func (n *netnsNetwork) Kind() string { return "netns" }

func (n *netnsNetwork) Describe() string {
	block := "iptables DROP"
	if !hasIptables() {
		block = "blackhole routes (iptables is not installed)"
	}
	degrade := "tc netem"
	if !hasNetem() {
		degrade = "tc tbf (this kernel has no sch_netem: a slow link with tail drop instead of netem delay and loss)"
	}
	return fmt.Sprintf("network namespaces %s-* on bridge %s (%s.0/24); partitions by %s; slow links by %s", n.prefix, n.bridge, n.subnet, block, degrade)
}

func (n *netnsNetwork) ns(node string) string { return n.prefix + "-" + node }

func (n *netnsNetwork) ip(node string) string {
	n.mu.Lock()
	defer n.mu.Unlock()
	return fmt.Sprintf("%s.%d", n.subnet, n.nodes[node]+10)
}

func (n *netnsNetwork) AddNode(name string) (string, error) {
	n.mu.Lock()
	i := len(n.order)
	n.nodes[name] = i
	n.order = append(n.order, name)
	n.mu.Unlock()
	ns, host, peer := n.ns(name), n.hostLink(i), fmt.Sprintf("%sp%s", n.prefix, strconv.FormatInt(int64(i), 36))
	ip := n.ip(name)
	err := firstErr(
		run("ip", "netns", "add", ns),
		run("ip", "link", "add", host, "type", "veth", "peer", "name", peer),
		run("ip", "link", "set", peer, "netns", ns),
		run("ip", "link", "set", host, "master", n.bridge),
		run("ip", "link", "set", host, "up"),
		run("ip", "-n", ns, "link", "set", peer, "name", "eth0"),
		run("ip", "-n", ns, "addr", "add", ip+"/24", "dev", "eth0"),
		run("ip", "-n", ns, "link", "set", "eth0", "up"),
		run("ip", "-n", ns, "link", "set", "lo", "up"),
	)
	if err != nil {
		return "", fmt.Errorf("node %s: %w", name, err)
	}
	return ip, nil
}

// hostLink is the root namespace's end of node i's veth pair.
func (n *netnsNetwork) hostLink(i int) string {
	return fmt.Sprintf("%sv%s", n.prefix, strconv.FormatInt(int64(i), 36))
}

func (n *netnsNetwork) Command(node string, cmd *exec.Cmd) *exec.Cmd {
	c := exec.Command("ip", append([]string{"netns", "exec", n.ns(node), cmd.Path}, cmd.Args[1:]...)...)
	c.Env, c.Dir, c.Stdin, c.Stdout, c.Stderr, c.SysProcAttr = cmd.Env, cmd.Dir, cmd.Stdin, cmd.Stdout, cmd.Stderr, cmd.SysProcAttr
	return c
}

func (n *netnsNetwork) BrokerAddr(_, _, addr string) (string, error) { return addr, nil }

func (n *netnsNetwork) Block(from, to string) error {
	if hasIptables() {
		return run("ip", "netns", "exec", n.ns(to), "iptables", "-w", "-A", "INPUT", "-s", n.ip(from), "-j", "DROP")
	}
	return run("ip", "-n", n.ns(from), "route", "add", "blackhole", n.ip(to)+"/32")
}

func (n *netnsNetwork) Degrade(node string, delay time.Duration, lossPct float64) (string, error) {
	ns := n.ns(node)
	if hasNetem() {
		err := run("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", "eth0", "root", "netem",
			"delay", fmt.Sprintf("%dms", delay.Milliseconds()), fmt.Sprintf("%dms", delay.Milliseconds()/4), "loss", fmt.Sprintf("%.1f%%", lossPct))
		return fmt.Sprintf("netem delay %s±25%% loss %.1f%%", delay, lossPct), err
	}
	// A slow link: 256 kbit/s; a packet that would wait longer than delay
	// in the queue is dropped.
	err := run("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", "eth0", "root", "tbf",
		"rate", "256kbit", "burst", "4kb", "latency", fmt.Sprintf("%dms", delay.Milliseconds()))
	return fmt.Sprintf("tbf 256kbit, queue ≤ %s, tail drop", delay), err
}

func (n *netnsNetwork) Heal() error {
	n.mu.Lock()
	nodes := append([]string(nil), n.order...)
	n.mu.Unlock()
	var errs []error
	for _, node := range nodes {
		ns := n.ns(node)
		if hasIptables() {
			errs = append(errs, run("ip", "netns", "exec", ns, "iptables", "-w", "-F", "INPUT"))
		}
		exec.Command("ip", "-n", ns, "route", "flush", "type", "blackhole").Run()
		exec.Command("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", "eth0", "root").Run() // none is fine
	}
	return firstErr(errs...)
}

func (n *netnsNetwork) Close() error {
	n.mu.Lock()
	nodes := append([]string(nil), n.order...)
	n.mu.Unlock()
	for i, node := range nodes {
		exec.Command("ip", "link", "del", n.hostLink(i)).Run() // at once, not when the kernel reaps the namespace
		exec.Command("ip", "netns", "del", n.ns(node)).Run()
	}
	exec.Command("ip", "link", "del", n.bridge).Run()
	return nil
}

var (
	probeOnce           sync.Once
	iptablesOK, netemOK bool
)

func probeTools() {
	probeOnce.Do(func() {
		_, err := exec.LookPath("iptables")
		iptablesOK = err == nil && exec.Command("iptables", "-w", "-S", "INPUT").Run() == nil
		netemOK = probeNetem()
	})
}

func hasIptables() bool { probeTools(); return iptablesOK }
func hasNetem() bool    { probeTools(); return netemOK }

// probeNetem adds a netem qdisc to a throwaway dummy link in a throwaway
// namespace: the kernel module may be missing (sch_netem).
func probeNetem() bool {
	ns := namePrefix + strconv.FormatInt(int64(os.Getpid()), 36) + "x0-probe"
	if exec.Command("ip", "netns", "add", ns).Run() != nil {
		return false
	}
	defer exec.Command("ip", "netns", "del", ns).Run()
	return exec.Command("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms").Run() == nil
}

// run runs a command and returns its output in the error.
func run(name string, args ...string) error {
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s %s: %v: %s", name, strings.Join(args, " "), err, bytes.TrimSpace(out))
	}
	return nil
}

func firstErr(errs ...error) error {
	for _, e := range errs {
		if e != nil {
			return e
		}
	}
	return nil
}

// hostPort joins ip and port.
func hostPort(ip string, port int) string { return net.JoinHostPort(ip, strconv.Itoa(port)) }
