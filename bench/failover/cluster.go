package failover

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"time"

	"google.golang.org/grpc"

	"github.com/gpupool/gpupool/bench/report"
	"github.com/gpupool/gpupool/client"
	"github.com/gpupool/gpupool/internal/proc"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

const (
	brokers = 3
	agents  = 2
	// agentSpec is what each simulated agent reports.
	agentSpec = "8xA100-80GB"
	// poolSlices is how many 1 GiB slices the agents' GPUs hold together:
	// 16 GPUs of 80 GiB (compute, at 1 %, allows 100 per GPU).
	poolSlices = agents * 8 * 80
)

// cluster is three brokers, two simulated agents, a client spread over
// every broker and one client per broker that talks to it alone.
type cluster struct {
	brokers []*proc.Proc
	agents  []*proc.Proc
	addrs   []string
	c       *client.Client
	direct  []*client.Client
}

// startCluster starts the cluster in dir and waits until both agents'
// hosts are ready. On failure it stops what it started and returns an
// error with the tail of every log.
func startCluster(ctx context.Context, bin, dir string, p *report.Progress) (*cluster, error) {
	cl := &cluster{}
	var raftAddrs []string
	for i := range brokers {
		ip := fmt.Sprintf("127.0.0.%d", i+2)
		a, err := proc.FreeAddr(ip)
		if err != nil {
			return nil, fmt.Errorf("no free port on %s: %w", ip, err)
		}
		r, err := proc.FreeAddr(ip)
		if err != nil {
			return nil, fmt.Errorf("no free port on %s: %w", ip, err)
		}
		cl.addrs, raftAddrs = append(cl.addrs, a), append(raftAddrs, r)
	}
	for i := range brokers {
		var join []string
		for j, a := range cl.addrs {
			if j != i {
				join = append(join, a)
			}
		}
		name := brokerID(i)
		cl.brokers = append(cl.brokers, &proc.Proc{Name: name, Bin: bin, OwnGroup: true, Log: filepath.Join(dir, name+".log"), Args: []string{
			"broker", "--insecure", "--node-id", name, "--data-dir", filepath.Join(dir, name),
			"--bind", cl.addrs[i], "--raft-bind", raftAddrs[i], "--bootstrap-expect", "3", "--join", strings.Join(join, ","),
		}})
	}
	for i := range agents {
		name := fmt.Sprintf("host-%d", i+1)
		cl.agents = append(cl.agents, &proc.Proc{Name: name, Bin: bin, OwnGroup: true, Log: filepath.Join(dir, name+".log"), Args: []string{
			"agent", "--insecure", "--broker", strings.Join(cl.addrs, ","), "--simulate", agentSpec, "--host-id", name,
			"--data-dir", filepath.Join(dir, name), "--data-bind", "127.0.0.1:0", "--mps", "off",
		}})
	}
	for _, pr := range append(cl.brokers, cl.agents...) {
		if err := pr.Start(); err != nil {
			cl.stop()
			return nil, err
		}
	}
	fail := func(err error) (*cluster, error) {
		err = fmt.Errorf("the cluster did not start: %w%s", err, cl.logTails())
		cl.stop()
		return nil, err
	}
	var err error
	if cl.c, err = client.Dial(cl.addrs); err != nil {
		return fail(err)
	}
	for _, a := range cl.addrs {
		d, err := client.Dial([]string{a})
		if err != nil {
			return fail(err)
		}
		cl.direct = append(cl.direct, d)
	}
	p.Logf("started %d brokers (%s) and %d agents (%s); waiting for the hosts", brokers, strings.Join(cl.addrs, ", "), agents, agentSpec)
	if err := cl.waitHosts(ctx, 60*time.Second, append(cl.brokers, cl.agents...)); err != nil {
		return fail(err)
	}
	return cl, nil
}

// restartAgents kills and restarts every agent (on its data dir) and
// waits until their hosts are ready again.
func (cl *cluster) restartAgents(ctx context.Context, timeout time.Duration) error {
	for _, a := range cl.agents {
		a.Kill()
		if err := a.Start(); err != nil {
			return err
		}
	}
	return cl.waitHosts(ctx, timeout, cl.agents)
}

// waitHosts waits until both agents' hosts are ready, and gives up when
// one of procs exits.
func (cl *cluster) waitHosts(ctx context.Context, timeout time.Duration, procs []*proc.Proc) error {
	return proc.Poll(ctx, timeout, func(ctx context.Context) error {
		if err := exited(procs); err != nil {
			return proc.GiveUp{Err: err}
		}
		st, err := cl.c.Pool.Status(ctx, &gpupoolv1.StatusRequest{})
		if err != nil {
			return err
		}
		if st.HostsReady < agents {
			return fmt.Errorf("%d of %d hosts ready", st.HostsReady, agents)
		}
		return nil
	})
}

func brokerID(i int) string { return fmt.Sprintf("broker-%d", i+1) }

// exited returns an error naming the first of procs that has exited.
func exited(procs []*proc.Proc) error {
	for _, pr := range procs {
		if pr.Started() && !pr.Running() {
			return fmt.Errorf("%s exited: %s", pr.Name, pr.ProcessState())
		}
	}
	return nil
}

func (cl *cluster) logTails() string {
	var b strings.Builder
	for _, pr := range append(cl.brokers, cl.agents...) {
		fmt.Fprintf(&b, "\n---- %s (%s), last 2 KiB ----\n%s", pr.Name, pr.Log, pr.LogTail(2048))
	}
	return b.String()
}

// stop kills every process and closes the clients.
func (cl *cluster) stop() {
	for _, pr := range append(cl.agents, cl.brokers...) {
		pr.Kill()
	}
	for _, c := range append(cl.direct, cl.c) {
		if c != nil {
			c.Close()
		}
	}
}

// leader returns the index of the broker the running brokers agree leads.
func (cl *cluster) leader(ctx context.Context, timeout time.Duration) (int, error) {
	idx := -1
	err := proc.Poll(ctx, timeout, func(ctx context.Context) error {
		i, err := cl.agreedLeader(ctx)
		idx = i
		return err
	})
	return idx, err
}

// agreedLeader asks each running broker, locally, whom it follows.
func (cl *cluster) agreedLeader(ctx context.Context) (int, error) {
	leader := ""
	for i, pr := range cl.brokers {
		if !pr.Running() {
			continue
		}
		resp, err := cl.direct[i].Operator.RaftPeers(ctx, &gpupoolv1.RaftPeersRequest{}, grpc.WaitForReady(false))
		if err != nil {
			return -1, err
		}
		if resp.LeaderId == "" || (leader != "" && resp.LeaderId != leader) {
			return -1, fmt.Errorf("%s follows %q, others %q", pr.Name, resp.LeaderId, leader)
		}
		leader = resp.LeaderId
	}
	for i := range cl.brokers {
		if brokerID(i) == leader && cl.brokers[i].Running() {
			return i, nil
		}
	}
	return -1, fmt.Errorf("leader %q is not a running broker", leader)
}
