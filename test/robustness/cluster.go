package robustness

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/gpupool/gpupool/client"
	"github.com/gpupool/gpupool/internal/proc"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// Timing are the brokers' and agents' timers: short, so that a run sees
// many failovers, down hosts and lock-delays in a few minutes.
type Timing struct {
	HeartbeatInterval time.Duration // gpupool broker --heartbeat-interval
	HeartbeatTTL      time.Duration // gpupool broker --heartbeat-ttl
	LockDelay         time.Duration // gpupool broker --lock-delay
	ExpiryGrace       time.Duration // gpupool agent --expiry-grace
	KillAfter         time.Duration // gpupool agent --kill-after
}

// DefaultTiming keeps lock-delay + heartbeat-ttl above a lease TTL of
// LeaseTTL plus the agent's expiry grace and kill-after (see
// docs/robustness.md for the bound this gives).
var DefaultTiming = Timing{
	HeartbeatInterval: 300 * time.Millisecond,
	HeartbeatTTL:      2 * time.Second,
	LockDelay:         6 * time.Second,
	ExpiryGrace:       1 * time.Second,
	KillAfter:         500 * time.Millisecond,
}

// role is what a process of the cluster is.
type role int

const (
	roleBroker role = iota
	roleAgent
)

// procSpec is everything launchArgs needs to build one command line.
type procSpec struct {
	role    role
	node    string // node name: broker-N or host-N (also the id)
	dataDir string
	timing  Timing
	// broker
	bind, raftBind string
	join           []string
	expect         int
	// agent
	brokers  []string
	dataBind string
}

// launchArgs is the command line of every broker and agent this package
// starts, in one place so that flags every process needs (e.g. the
// security flags) are added once.
func launchArgs(s procSpec) []string {
	ms := func(d time.Duration) string { return d.String() }
	switch s.role {
	case roleBroker:
		return []string{"broker", "--node-id", s.node, "--data-dir", s.dataDir,
			"--bind", s.bind, "--raft-bind", s.raftBind,
			"--bootstrap-expect", strconv.Itoa(s.expect), "--join", strings.Join(s.join, ","),
			"--heartbeat-interval", ms(s.timing.HeartbeatInterval), "--heartbeat-ttl", ms(s.timing.HeartbeatTTL),
			"--lock-delay", ms(s.timing.LockDelay), "--log-level", "debug",
			"--limit-tenant-pending", strconv.Itoa(floodCap), "--disk-reserve", "16",
			// The history is checked against every lease's final state,
			// read at the end of the run: a lease revoked or expired
			// without its client seeing it is known to have ended only
			// from that list. So no ended lease may be collected before
			// then (the most the flags allow; collection itself is
			// tested in the broker's package and by bench churn).
			"--ended-leases-max", "10000000", "--ended-lease-retention", "720h",
			"--insecure"} // faults and history, not TLS or tokens, are under test
	default:
		return []string{"agent", "--broker", strings.Join(s.brokers, ","), "--simulate", "8xA100-80GB",
			"--host-id", s.node, "--data-dir", s.dataDir, "--data-bind", s.dataBind, "--mps", "off",
			"--watchdog-poll", "100ms", "--watchdog-grace", "500ms",
			"--kill-after", ms(s.timing.KillAfter), "--expiry-grace", ms(s.timing.ExpiryGrace), "--log-level", "debug",
			"--insecure"}
	}
}

// stopGrace is how long a process has to exit on SIGTERM before SIGKILL.
const stopGrace = 20 * time.Second

// Proc is one gpupool process on a node of the cluster's Network; its
// output is appended to a log file across restarts.
type Proc struct {
	*proc.Proc
	Node    string
	DataDir string
}

// ClusterOptions size a cluster.
type ClusterOptions struct {
	Bin     string // the gpupool binary
	Dir     string // data dirs and logs
	Net     Network
	Brokers int // 3 or 5
	Agents  int // simulated hosts of 8 A100-80GB each
	Timing  Timing
}

// Cluster is brokers and simulated agents of built gpupool binaries,
// each process on its own node of a Network.
type Cluster struct {
	opts    ClusterOptions
	Brokers []*Proc // node broker-N
	Agents  []*Proc // node host-N
	Addrs   []string
	Client  *client.Client // the observer's client: never cut off
	// mounts are the loop-mounted broker data dirs; diskErr says why
	// there are none (FaultFullDisk is then skipped).
	mounts  []string
	diskErr error
}

// BuildGpupool builds cmd/gpupool into dir, with the faultinject tag: a
// broker's data dir can slow its Raft log writes (FaultSlowDisk*).
func BuildGpupool(dir string) (string, error) {
	return proc.GoBuild(context.Background(), dir, "github.com/gpupool/gpupool/cmd/gpupool", "faultinject")
}

// StartCluster starts the brokers and agents and waits until every host
// is ready. The caller stops it with Stop, also when it fails.
func StartCluster(ctx context.Context, o ClusterOptions) (*Cluster, error) {
	cl := &Cluster{opts: o}
	var raft []string
	brokerIPs := make([]string, o.Brokers)
	for i := range o.Brokers {
		ip, err := o.Net.AddNode(brokerNode(i))
		if err != nil {
			return cl, err
		}
		brokerIPs[i] = ip
		g, r, err := ports(o.Net, ip)
		if err != nil {
			return cl, err
		}
		cl.Addrs = append(cl.Addrs, g)
		raft = append(raft, r)
	}
	for i := range o.Brokers {
		var join []string
		for j := range o.Brokers {
			if j != i {
				a, err := o.Net.BrokerAddr(brokerNode(i), brokerNode(j), cl.Addrs[j])
				if err != nil {
					return cl, err
				}
				join = append(join, a)
			}
		}
		cl.Brokers = append(cl.Brokers, cl.proc(procSpec{role: roleBroker, node: brokerNode(i), timing: o.Timing,
			bind: cl.Addrs[i], raftBind: raft[i], join: join, expect: o.Brokers}))
	}
	for range o.Agents {
		if _, err := cl.AddAgent(); err != nil {
			return cl, err
		}
	}
	if err := mountDataDirs(cl); err != nil {
		unmountDataDirs(cl)
		if !errors.Is(err, ErrUnsupported) {
			return cl, err
		}
		cl.diskErr = err
	}
	for _, p := range append(append([]*Proc(nil), cl.Brokers...), cl.Agents...) {
		if err := p.Start(); err != nil {
			return cl, err
		}
	}
	c, err := client.Dial(cl.Addrs)
	if err != nil {
		return cl, err
	}
	cl.Client = c
	return cl, cl.WaitHosts(ctx, o.Agents, 90*time.Second)
}

// AddAgent adds (unstarted) the next simulated host.
func (cl *Cluster) AddAgent() (*Proc, error) {
	node := fmt.Sprintf("host-%d", len(cl.Agents)+1)
	ip, err := cl.opts.Net.AddNode(node)
	if err != nil {
		return nil, err
	}
	var brokers []string
	for j, a := range cl.Addrs {
		b, err := cl.opts.Net.BrokerAddr(node, brokerNode(j), a)
		if err != nil {
			return nil, err
		}
		brokers = append(brokers, b)
	}
	p := cl.proc(procSpec{role: roleAgent, node: node, timing: cl.opts.Timing, brokers: brokers, dataBind: net.JoinHostPort(ip, "0")})
	cl.Agents = append(cl.Agents, p)
	return p, nil
}

func (cl *Cluster) proc(s procSpec) *Proc {
	s.dataDir = filepath.Join(cl.opts.Dir, s.node)
	return &Proc{Node: s.node, DataDir: s.dataDir, Proc: &proc.Proc{Name: s.node, Bin: cl.opts.Bin, Args: launchArgs(s),
		Log:  filepath.Join(cl.opts.Dir, s.node+".log"),
		Wrap: func(cmd *exec.Cmd) *exec.Cmd { return cl.opts.Net.Command(s.node, cmd) }}}
}

func brokerNode(i int) string { return fmt.Sprintf("broker-%d", i+1) }

// ports are the gRPC and Raft addresses of a broker on ip: fixed ports in
// a namespace of its own, ports from the kernel on a shared loopback.
func ports(n Network, ip string) (grpcAddr, raftAddr string, err error) {
	if n.Kind() == "netns" {
		return hostPort(ip, 7641), hostPort(ip, 7642), nil
	}
	var addrs [2]string
	for i := range addrs {
		l, err := net.Listen("tcp", net.JoinHostPort(ip, "0"))
		if err != nil {
			return "", "", err
		}
		addrs[i] = l.Addr().String()
		defer l.Close()
	}
	return addrs[0], addrs[1], nil
}

// Stop kills every process and closes the observer's client.
func (cl *Cluster) Stop() {
	if cl.Client != nil {
		cl.Client.Close()
	}
	for _, p := range append(append([]*Proc(nil), cl.Agents...), cl.Brokers...) {
		if p.Running() {
			p.Signal(syscall.SIGCONT) // a paused process dies too
			p.Kill()
		}
	}
	unmountDataDirs(cl)
}

// Leader is the index of the broker that leads, as the brokers say.
func (cl *Cluster) Leader(ctx context.Context) (int, error) {
	ctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	resp, err := cl.Client.Operator.RaftPeers(ctx, &gpupoolv1.RaftPeersRequest{})
	if err != nil {
		return -1, err
	}
	for i := range cl.Brokers {
		if resp.LeaderId == brokerNode(i) {
			return i, nil
		}
	}
	return -1, fmt.Errorf("no leader (leader id %q)", resp.LeaderId)
}

// WaitLeader polls until a running broker leads.
func (cl *Cluster) WaitLeader(ctx context.Context, timeout time.Duration) (int, error) {
	idx := -1
	err := proc.Poll(ctx, timeout, func(ctx context.Context) error {
		i, err := cl.Leader(ctx)
		if err != nil {
			return err
		}
		if !cl.Brokers[i].Running() {
			return fmt.Errorf("leader %s is not running", brokerNode(i))
		}
		idx = i
		return nil
	})
	return idx, err
}

// WaitHosts polls until at least n hosts are ready.
func (cl *Cluster) WaitHosts(ctx context.Context, n int, timeout time.Duration) error {
	return proc.Poll(ctx, timeout, func(ctx context.Context) error {
		st, err := cl.Client.Pool.Status(ctx, &gpupoolv1.StatusRequest{})
		if err != nil {
			return err
		}
		if int(st.HostsReady) < n {
			return fmt.Errorf("%d of %d hosts ready", st.HostsReady, n)
		}
		return nil
	})
}
