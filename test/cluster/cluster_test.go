// Package cluster_test runs real clusters of built gpupool binaries: three
// broker processes on 127.0.0.x ports and simulated agents, then kills,
// restarts and checks them.
package cluster_test

import (
	"bytes"
	"context"
	"fmt"
	"github.com/gpupool/gpupool/agent/sandbox"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/gpupool/gpupool/client"
	"github.com/gpupool/gpupool/internal/pki"
	"github.com/gpupool/gpupool/internal/pki/pkitest"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

var binary string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "gpupool-cluster-test-")
	if err != nil {
		panic(err)
	}
	// bin/gpupool, so that 'gpupool attach' finds the CUDA shim in ../lib
	// as it does in a build tree (cuda_test.go builds it there).
	binary = filepath.Join(dir, "bin", "gpupool")
	out, err := exec.Command("go", "build", "-o", binary, "github.com/gpupool/gpupool/cmd/gpupool").CombinedOutput()
	if err != nil {
		fmt.Fprintf(os.Stderr, "build gpupool: %v\n%s", err, out)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// freePort returns an address on ip that nothing listens on, for a child
// process to bind. The port is below the kernel's ephemeral range: a port
// the kernel handed out for :0 was free only until the next process
// (another test on a busy machine) asked for one, and a broker that lost
// its port that way failed with "address already in use". The kernel never
// hands out these ports; only an explicit bind can take one.
func freePort(t *testing.T, ip string) string {
	t.Helper()
	const from = 10000
	if lo := ephemeralStart(); lo > from+1000 {
		for range 200 {
			if l, err := net.Listen("tcp", net.JoinHostPort(ip, strconv.Itoa(from+rand.IntN(lo-from)))); err == nil {
				defer l.Close()
				return l.Addr().String()
			}
		}
	}
	l, err := net.Listen("tcp", net.JoinHostPort(ip, "0")) // the kernel's, as a last resort
	if err != nil {
		t.Fatalf("no free port on %s: %v", ip, err)
	}
	defer l.Close()
	return l.Addr().String()
}

// ephemeralStart is the first port the kernel hands out for :0.
func ephemeralStart() int {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if f := strings.Fields(string(b)); err == nil && len(f) == 2 {
		if n, err := strconv.Atoi(f[0]); err == nil {
			return n
		}
	}
	return 32768 // Linux's default
}

// proc is one gpupool child process.
type proc struct {
	name string
	args []string
	env  []string // added to the test's environment
	log  *os.File
	cmd  *exec.Cmd
	done chan struct{}
}

func (p *proc) start(t *testing.T) {
	t.Helper()
	p.cmd = exec.Command(binary, p.args...)
	p.cmd.Env = append(os.Environ(), p.env...)
	p.cmd.Stdout, p.cmd.Stderr = p.log, p.log
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := p.cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", p.name, err)
	}
	p.done = make(chan struct{})
	go func(cmd *exec.Cmd, done chan struct{}) {
		cmd.Wait()
		close(done)
	}(p.cmd, p.done)
}

func (p *proc) signal(t *testing.T, sig syscall.Signal) {
	t.Helper()
	p.cmd.Process.Signal(sig)
	select {
	case <-p.done:
	case <-time.After(20 * time.Second):
		p.cmd.Process.Kill()
		<-p.done
		t.Errorf("%s did not stop on %v within 20s", p.name, sig)
	}
}

func (p *proc) running() bool {
	select {
	case <-p.done:
		return false
	default:
		return p.done != nil
	}
}

// cluster is three brokers and some agents.
type cluster struct {
	t   *testing.T
	dir string
	// ports are the agents' data-plane addresses by index.
	ports struct {
		mu sync.Mutex
		m  map[int]string
	}
	brokers []*proc
	agents  []*proc
	addrs   []string
	c       *client.Client
	// ca, when set, issued every broker, agent and client certificate of
	// the cluster; nil runs everything with --insecure.
	ca      *pkitest.CA
	clientF pki.Files // the clients' certificate; issued on first use
	// acl runs the brokers with ACL on (it needs ca): agents and clients
	// need tokens. Without it a TLS cluster runs with --acl=false.
	acl bool
}

// clusterOption changes a cluster before it starts.
type clusterOption func(*cluster)

// withTLS runs the cluster with mutual TLS: a CA in the test's temporary
// directory, a certificate per broker (for its 127.0.0.x address and
// brokerIPs), per agent (bound to its host id) and one for the clients.
func withTLS(cl *cluster) { cl.ca = pkitest.NewCA(cl.t) }

// withACL runs the cluster with mutual TLS and ACL on, as in production.
func withACL(cl *cluster) { withTLS(cl); cl.acl = true }

// newSecureCluster starts three brokers with TLS and ACL on, and no
// agents; cl.c carries a client certificate and no token.
func newSecureCluster(t *testing.T) *cluster {
	t.Helper()
	return newCluster(t, 0, withACL)
}

func newCluster(t *testing.T, agents int, opts ...clusterOption) *cluster {
	t.Helper()
	cl := &cluster{t: t, dir: t.TempDir()}
	for _, o := range opts {
		o(cl)
	}
	var raftAddrs []string
	for i := range 3 {
		ip := fmt.Sprintf("127.0.0.%d", i+2)
		cl.addrs = append(cl.addrs, freePort(t, ip))
		raftAddrs = append(raftAddrs, freePort(t, ip))
	}
	for i := range 3 {
		var join []string
		for j, a := range cl.addrs {
			if j != i {
				join = append(join, a)
			}
		}
		name := fmt.Sprintf("broker-%d", i+1)
		args := []string{"broker", "--node-id", name, "--data-dir", filepath.Join(cl.dir, name),
			"--bind", cl.addrs[i], "--raft-bind", raftAddrs[i], "--bootstrap-expect", "3", "--join", strings.Join(join, ","),
			"--heartbeat-interval", "500ms", "--heartbeat-ttl", "5s", "--preempt-grace", "3s", "--log-level", "debug"}
		cl.brokers = append(cl.brokers, cl.newProc(name, append(args, cl.security(name, pki.RoleBroker)...)...))
	}
	for i := range agents {
		cl.agents = append(cl.agents, cl.newAgent(i))
	}
	for _, p := range append(cl.brokers, cl.agents...) {
		p.start(t)
	}
	t.Cleanup(func() {
		for _, p := range append(cl.agents, cl.brokers...) {
			if p.running() {
				p.cmd.Process.Kill()
				<-p.done
			}
		}
		if t.Failed() {
			for _, p := range append(cl.brokers, cl.agents...) {
				b, _ := os.ReadFile(p.log.Name())
				t.Logf("---- %s log (last 4 KiB) ----\n%s", p.name, tail(b, 4096))
			}
		}
	})
	cl.c = cl.dial(cl.addrs...)
	if !cl.acl {
		cl.waitForHosts(agents)
	}
	return cl
}

// brokerIPs are the addresses a broker may move to (readdress_test.go),
// besides its own: its certificate names them all.
func brokerIPs(i int) []string {
	return []string{fmt.Sprintf("127.0.0.%d", i+2), fmt.Sprintf("127.0.0.%d", i+12)}
}

// security are the flags that give the process name its certificate, or
// --insecure in a cluster without TLS. Brokers are named broker-N,
// agents by their host id.
func (cl *cluster) security(name string, role pki.Role) []string {
	if cl.ca == nil {
		return []string{"--insecure"}
	}
	req := pki.Request{Name: name, Role: role, NotBefore: time.Now().Add(-time.Minute), NotAfter: time.Now().Add(time.Hour)}
	switch role {
	case pki.RoleBroker:
		var i int
		fmt.Sscanf(name, "broker-%d", &i)
		req.Hosts = brokerIPs(i - 1)
	case pki.RoleAgent:
		req.HostID = name
	}
	flags := tlsFlags(cl.ca.IssueRequest(cl.t, req))
	if role == pki.RoleBroker && !cl.acl {
		flags = append(flags, "--acl=false")
	}
	return flags
}

func tlsFlags(f pki.Files) []string {
	return []string{"--tls-ca", f.CA, "--tls-cert", f.Cert, "--tls-key", f.Key}
}

// clientFlags are the flags a CLI command needs to reach the cluster.
func (cl *cluster) clientFlags() []string {
	if cl.ca == nil {
		return nil
	}
	return tlsFlags(cl.clientFiles())
}

func (cl *cluster) clientFiles() pki.Files {
	if cl.clientF.Cert == "" {
		cl.clientF = cl.ca.Issue(cl.t, "test-client", pki.RoleClient)
	}
	return cl.clientF
}

// dial connects a client to addrs, with a client certificate when the
// cluster runs TLS.
func (cl *cluster) dial(addrs ...string) *client.Client {
	cl.t.Helper()
	return cl.dialWithToken("", addrs...)
}

// dialWithToken is dial with an ACL token's secret on every call.
func (cl *cluster) dialWithToken(secret string, addrs ...string) *client.Client {
	cl.t.Helper()
	o := client.Options{Token: secret}
	if cl.ca != nil {
		o.TLS = pkitest.Source(cl.t, cl.clientFiles()).ClientConfig()
	}
	c, err := client.DialWith(addrs, o)
	if err != nil {
		cl.t.Fatal(err)
	}
	cl.t.Cleanup(func() { c.Close() })
	return c
}

// olderAgents leaves out of the agents' command lines the flags that
// older builds do not know (the upgrade test starts them on one).
var olderAgents bool

// agentWatchdog are the agents' enforcement flags: short, so that tests
// end quickly. Tests never assert how fast the agent is.
var agentWatchdog = []string{"--watchdog-poll", "100ms", "--watchdog-grace", "500ms", "--kill-after", "1s", "--expiry-grace", "2s"}

// newAgent returns (unstarted) the simulated agent of host-(i+1); its data
// dir and simulation socket are under the cluster's dir.
func (cl *cluster) newAgent(i int, extra ...string) *proc {
	name := fmt.Sprintf("host-%d", i+1)
	args := append([]string{"agent", "--broker", strings.Join(cl.addrs, ","), "--simulate", "8xA100-80GB", "--host-id", name,
		"--data-dir", cl.agentDir(i), "--data-bind", cl.dataBind(i), "--log-level", "debug"}, agentWatchdog...)
	if !olderAgents {
		// Agents on one machine each take their own users.
		args = append(args, "--sandbox-users", fmt.Sprintf("%d-%d", 300000+i*1000, 300000+i*1000+999),
			"--cgroup-parent", cl.cgroupParent(name))
	}
	args = append(args, cl.security(name, pki.RoleAgent)...)
	return cl.newProc(name, append(args, extra...)...)
}

// dataBind is host-(i+1)'s data-plane address, the same across its
// restarts: a host that comes back on another address while it holds
// leases is refused until an operator resets its identity.
func (cl *cluster) dataBind(i int) string {
	cl.ports.mu.Lock()
	defer cl.ports.mu.Unlock()
	if cl.ports.m == nil {
		cl.ports.m = map[int]string{}
	}
	if a, ok := cl.ports.m[i]; ok {
		return a
	}
	c, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		cl.t.Fatal(err)
	}
	a := c.LocalAddr().String()
	c.Close()
	cl.ports.m[i] = a
	return a
}

// cgroupParent is where host's agent keeps its leases' cgroups: under
// this test process, so that no other agent on the machine shares them.
// The leases left when the test ends are purged with their processes.
func (cl *cluster) cgroupParent(host string) string {
	p := fmt.Sprintf("gpupool-test/cluster-%d/%s", os.Getpid(), host)
	cl.t.Cleanup(func() {
		if m, err := sandbox.New(sandbox.Config{CgroupParent: p}); err == nil {
			m.Purge()
		}
	})
	return p
}

// agentDir is host-(i+1)'s data dir.
func (cl *cluster) agentDir(i int) string { return filepath.Join(cl.dir, fmt.Sprintf("host-%d", i+1)) }

func tail(b []byte, n int) []byte {
	if len(b) > n {
		return b[len(b)-n:]
	}
	return b
}

func (cl *cluster) newProc(name string, args ...string) *proc {
	f, err := os.OpenFile(filepath.Join(cl.dir, name+".log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		cl.t.Fatal(err)
	}
	cl.t.Cleanup(func() { f.Close() })
	return &proc{name: name, args: args, log: f}
}

func ctxFor(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// eventually polls f until it returns nil or the deadline passes.
func eventually(t *testing.T, what string, d time.Duration, f func() error) {
	t.Helper()
	deadline := time.Now().Add(d)
	for {
		err := f()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s: %v", d, what, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func (cl *cluster) waitForHosts(n int) {
	cl.t.Helper()
	eventually(cl.t, fmt.Sprintf("%d ready hosts", n), 60*time.Second, func() error {
		st, err := cl.c.Pool.Status(ctxFor(cl.t, 5*time.Second), &gpupoolv1.StatusRequest{})
		if err != nil {
			return err
		}
		if int(st.HostsReady) < n {
			return fmt.Errorf("%d ready", st.HostsReady)
		}
		return nil
	})
}

// leader returns the index of the leading broker.
func (cl *cluster) leader() int {
	cl.t.Helper()
	var idx int
	eventually(cl.t, "a leader", 30*time.Second, func() error {
		resp, err := cl.c.Operator.RaftPeers(ctxFor(cl.t, 5*time.Second), &gpupoolv1.RaftPeersRequest{})
		if err != nil {
			return err
		}
		for i := range cl.brokers {
			if resp.LeaderId == fmt.Sprintf("broker-%d", i+1) && cl.brokers[i].running() {
				idx = i
				return nil
			}
		}
		return fmt.Errorf("leader %q is not a running broker", resp.LeaderId)
	})
	return idx
}

func fractional(mem int64, compute int32, reqID string) *gpupoolv1.AcquireRequest {
	return &gpupoolv1.AcquireRequest{Request: &gpupoolv1.LeaseRequest{
		Count: 1, MemoryMib: mem, ComputePercent: compute, TtlMs: 10 * 60 * 1000, RequestId: reqID, Holder: "cluster-test",
	}}
}

// checkNoOvercommit sums every holding lease's slices per device and
// compares them with each device's capacity and recorded allocation.
func checkNoOvercommit(t *testing.T, leases []*gpupoolv1.Lease, devices []*gpupoolv1.Device) {
	t.Helper()
	mem := map[string]int64{}
	compute := map[string]int32{}
	for _, l := range leases {
		if l.State != gpupoolv1.LeaseState_LEASE_STATE_GRANTED && l.State != gpupoolv1.LeaseState_LEASE_STATE_RELEASING {
			continue
		}
		for _, s := range l.Slices {
			mem[s.Device] += s.MemoryMib
			compute[s.Device] += s.ComputePercent
		}
	}
	for _, d := range devices {
		if mem[d.Uuid] > d.MemoryMib || compute[d.Uuid] > 100 {
			t.Errorf("device %s over-committed: %d/%d MiB, %d%% compute", d.Uuid, mem[d.Uuid], d.MemoryMib, compute[d.Uuid])
		}
		if mem[d.Uuid] != d.AllocatedMemoryMib || compute[d.Uuid] != d.AllocatedComputePercent {
			t.Errorf("device %s: leases hold %d MiB/%d%%, device records %d MiB/%d%%", d.Uuid, mem[d.Uuid], compute[d.Uuid], d.AllocatedMemoryMib, d.AllocatedComputePercent)
		}
	}
}

func (cl *cluster) listAll(stale bool, c *client.Client) []*gpupoolv1.Lease {
	cl.t.Helper()
	if c == nil {
		c = cl.c
	}
	resp, err := c.Lease.List(ctxFor(cl.t, 20*time.Second), &gpupoolv1.ListLeasesRequest{IncludeEnded: true, Stale: stale})
	if err != nil {
		cl.t.Fatal(err)
	}
	return resp.Leases
}

func (cl *cluster) devices() []*gpupoolv1.Device {
	cl.t.Helper()
	resp, err := cl.c.Pool.ListDevices(ctxFor(cl.t, 20*time.Second), &gpupoolv1.ListDevicesRequest{})
	if err != nil {
		cl.t.Fatal(err)
	}
	return resp.Devices
}

func TestClusterKeepsEveryAcknowledgedLeaseThroughLeaderKillRestartAndFullRestart(t *testing.T) {
	if testing.Short() {
		t.Skip("starts real processes")
	}
	// With real certificates: every connection of the run, Raft included,
	// is mutual TLS.
	cl := newCluster(t, 2, withTLS) // 16 GPUs of 80 GiB

	// 200 leases of 4 GiB and 5 %: 20 fit per GPU, 320 in the pool.
	acked := map[string]*gpupoolv1.Lease{}
	started := time.Now()
	var mu sync.Mutex
	var wg sync.WaitGroup
	errs := make(chan error, 200)
	for w := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := w; i < 200; i += 8 {
				resp, err := cl.c.Lease.Acquire(ctxFor(t, 30*time.Second), fractional(4096, 5, fmt.Sprintf("req-%d", i)))
				if err != nil {
					errs <- fmt.Errorf("acquire %d: %w", i, err)
					continue
				}
				mu.Lock()
				acked[resp.Lease.Id] = resp.Lease
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if len(acked) != 200 {
		t.Fatalf("got %d distinct leases, want 200", len(acked))
	}
	t.Logf("200 acquires by 8 clients took %s", time.Since(started).Round(time.Millisecond))
	checkNoOvercommit(t, cl.listAll(false, nil), cl.devices())

	// kill -9 the leader.
	old := cl.leader()
	killedAt := time.Now()
	cl.brokers[old].cmd.Process.Kill()
	<-cl.brokers[old].done
	var firstAcquire time.Duration
	eventually(t, "an acquire after the leader kill", 30*time.Second, func() error {
		_, err := cl.c.Lease.Acquire(ctxFor(t, 5*time.Second), fractional(1024, 1, "after-kill"))
		if err == nil {
			firstAcquire = time.Since(killedAt)
		}
		return err
	})
	newLeader := cl.leader()
	t.Logf("leader broker-%d killed; broker-%d leads; first acquire succeeded %s after the kill", old+1, newLeader+1, firstAcquire.Round(time.Millisecond))
	if newLeader == old {
		t.Fatalf("the killed broker-%d still leads", old+1)
	}

	after := cl.listAll(false, nil)
	byID := map[string]*gpupoolv1.Lease{}
	for _, l := range after {
		byID[l.Id] = l
	}
	for id, want := range acked {
		got := byID[id]
		if got == nil {
			t.Fatalf("acknowledged lease %s is gone after the leader kill", id)
		}
		if got.State != gpupoolv1.LeaseState_LEASE_STATE_GRANTED || got.FencingToken != want.FencingToken {
			t.Fatalf("lease %s: got %v fencing %d, want GRANTED fencing %d", id, got.State, got.FencingToken, want.FencingToken)
		}
	}
	checkNoOvercommit(t, after, cl.devices())

	// A lease acquired before the kill can still be renewed.
	var some string
	for id := range acked {
		some = id
		break
	}
	ka, err := cl.c.Lease.KeepAlive(ctxFor(t, 20*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	if err := ka.Send(&gpupoolv1.KeepAliveRequest{LeaseId: some}); err != nil {
		t.Fatal(err)
	}
	if r, err := ka.Recv(); err != nil || r.Error != "" || r.TtlMs == 0 {
		t.Fatalf("renew %s after failover: got %v (err %v)", some, r, err)
	}
	ka.CloseSend()

	// The killed server restarts from its data dir and catches up.
	cl.brokers[old].start(t)
	direct := cl.dial(cl.addrs[old])
	eventually(t, "the restarted server to catch up", 30*time.Second, func() error {
		resp, err := direct.Lease.List(ctxFor(t, 5*time.Second), &gpupoolv1.ListLeasesRequest{IncludeEnded: true, Stale: true})
		if err != nil {
			return err
		}
		if len(resp.Leases) != len(after) {
			return fmt.Errorf("has %d leases, want %d", len(resp.Leases), len(after))
		}
		return nil
	})

	// Stop all three and start them again: the state is intact.
	before := cl.listAll(false, nil)
	for _, b := range cl.brokers {
		b.signal(t, syscall.SIGTERM)
	}
	for _, b := range cl.brokers {
		b.start(t)
	}
	cl.leader()
	again := cl.listAll(false, nil)
	if len(again) != len(before) {
		t.Fatalf("after a full restart: %d leases, want %d", len(again), len(before))
	}
	for i := range before {
		if before[i].Id != again[i].Id || before[i].State != again[i].State || before[i].FencingToken != again[i].FencingToken {
			t.Fatalf("after a full restart, lease %d differs: %v vs %v", i, again[i], before[i])
		}
	}
	checkNoOvercommit(t, again, cl.devices())
}

func TestBrokerRefusesACorruptDataDir(t *testing.T) {
	dir := t.TempDir()
	if err := os.MkdirAll(filepath.Join(dir, "raft"), 0o700); err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(dir, "node-id"), []byte("broker-x\n"), 0o600)
	os.WriteFile(filepath.Join(dir, "raft", "raft.db"), bytes.Repeat([]byte("garbage!"), 1024), 0o600)
	tests := []struct {
		name  string
		setup func()
		want  string
	}{
		{"a raft.db that is not a bolt file", func() {}, "damaged or not a gpupool Raft log"},
		{"a data dir whose raft.db went missing", func() { os.Remove(filepath.Join(dir, "raft", "raft.db")) }, "refusing to start empty"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tt.setup()
			out, err := exec.Command(binary, "broker", "--insecure", "--data-dir", dir, "--bind", freePort(t, "127.0.0.1"), "--bootstrap-expect", "1").CombinedOutput()
			if err == nil || !strings.Contains(string(out), tt.want) {
				t.Fatalf("got err %v, output %q; want a failure mentioning %q", err, out, tt.want)
			}
		})
	}
}
