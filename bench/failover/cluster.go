package failover

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"google.golang.org/grpc"

	"github.com/gpupool/gpupool/client"
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

// proc is one gpupool child process; its output goes to a log file.
type proc struct {
	name string
	bin  string
	args []string
	log  string // path of the log file, appended to across restarts

	cmd  *exec.Cmd
	done chan struct{} // closed once cmd has exited
}

// start starts the process. It dies with the benchmark (SIGKILL on the
// parent's death) so that an interrupted run leaves nothing behind.
func (p *proc) start() error {
	f, err := os.OpenFile(p.log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	cmd := exec.Command(p.bin, p.args...)
	cmd.Stdout, cmd.Stderr = f, f
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL, Setpgid: true}
	if err := cmd.Start(); err != nil {
		f.Close()
		return fmt.Errorf("start %s: %w", p.name, err)
	}
	p.cmd, p.done = cmd, make(chan struct{})
	go func(done chan struct{}) {
		cmd.Wait()
		f.Close()
		close(done)
	}(p.done)
	return nil
}

// kill sends SIGKILL and waits for the process to be gone.
func (p *proc) kill() {
	if !p.running() {
		return
	}
	p.cmd.Process.Signal(syscall.SIGKILL)
	<-p.done
}

func (p *proc) running() bool {
	if p.done == nil {
		return false
	}
	select {
	case <-p.done:
		return false
	default:
		return true
	}
}

// logTail returns the last n bytes of the process's log.
func (p *proc) logTail(n int) string {
	b, err := os.ReadFile(p.log)
	if err != nil {
		return fmt.Sprintf("(no log: %v)", err)
	}
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return string(b)
}

// buildGpupool builds cmd/gpupool into dir. It must run inside the module.
func buildGpupool(ctx context.Context, dir string) (string, error) {
	bin := filepath.Join(dir, "gpupool")
	out, err := exec.CommandContext(ctx, "go", "build", "-o", bin, "github.com/gpupool/gpupool/cmd/gpupool").CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("go build ./cmd/gpupool (run from the repository, or pass --gpupool PATH): %v\n%s", err, out)
	}
	return bin, nil
}

// freeAddr asks the kernel for a free TCP port on ip. Another process may
// take it before the broker binds it; the broker then fails to start and
// says so in its log.
func freeAddr(ip string) (string, error) {
	l, err := net.Listen("tcp", net.JoinHostPort(ip, "0"))
	if err != nil {
		return "", err
	}
	defer l.Close()
	return l.Addr().String(), nil
}

// cluster is three brokers, two simulated agents, a client spread over
// every broker and one client per broker that talks to it alone.
type cluster struct {
	brokers []*proc
	agents  []*proc
	addrs   []string
	c       *client.Client
	direct  []*client.Client
}

// startCluster starts the cluster in dir and waits until both agents'
// hosts are ready. On failure it stops what it started and returns an
// error with the tail of every log.
func startCluster(ctx context.Context, bin, dir string, p *progress) (*cluster, error) {
	cl := &cluster{}
	var raftAddrs []string
	for i := range brokers {
		ip := fmt.Sprintf("127.0.0.%d", i+2)
		a, err := freeAddr(ip)
		if err != nil {
			return nil, fmt.Errorf("no free port on %s: %w", ip, err)
		}
		r, err := freeAddr(ip)
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
		cl.brokers = append(cl.brokers, &proc{name: name, bin: bin, log: filepath.Join(dir, name+".log"), args: []string{
			"broker", "--node-id", name, "--data-dir", filepath.Join(dir, name),
			"--bind", cl.addrs[i], "--raft-bind", raftAddrs[i], "--bootstrap-expect", "3", "--join", strings.Join(join, ","),
		}})
	}
	for i := range agents {
		name := fmt.Sprintf("host-%d", i+1)
		cl.agents = append(cl.agents, &proc{name: name, bin: bin, log: filepath.Join(dir, name+".log"), args: []string{
			"agent", "--broker", strings.Join(cl.addrs, ","), "--simulate", agentSpec, "--host-id", name,
			"--data-dir", filepath.Join(dir, name), "--data-bind", "127.0.0.1:0", "--mps", "off",
		}})
	}
	for _, pr := range append(cl.brokers, cl.agents...) {
		if err := pr.start(); err != nil {
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
	p.logf("started %d brokers (%s) and %d agents (%s); waiting for the hosts", brokers, strings.Join(cl.addrs, ", "), agents, agentSpec)
	if err := cl.waitHosts(ctx, 60*time.Second, append(cl.brokers, cl.agents...)); err != nil {
		return fail(err)
	}
	return cl, nil
}

// restartAgents kills and restarts every agent (on its data dir) and
// waits until their hosts are ready again.
func (cl *cluster) restartAgents(ctx context.Context, timeout time.Duration) error {
	for _, a := range cl.agents {
		a.kill()
		if err := a.start(); err != nil {
			return err
		}
	}
	return cl.waitHosts(ctx, timeout, cl.agents)
}

// waitHosts waits until both agents' hosts are ready, and gives up when
// one of procs exits.
func (cl *cluster) waitHosts(ctx context.Context, timeout time.Duration, procs []*proc) error {
	return poll(ctx, timeout, func(ctx context.Context) error {
		if err := exited(procs); err != nil {
			return backoffStop{err}
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
func exited(procs []*proc) error {
	for _, pr := range procs {
		if pr.done != nil && !pr.running() {
			return fmt.Errorf("%s exited: %s", pr.name, pr.cmd.ProcessState)
		}
	}
	return nil
}

func (cl *cluster) logTails() string {
	var b strings.Builder
	for _, pr := range append(cl.brokers, cl.agents...) {
		fmt.Fprintf(&b, "\n---- %s (%s), last 2 KiB ----\n%s", pr.name, pr.log, pr.logTail(2048))
	}
	return b.String()
}

// stop kills every process and closes the clients.
func (cl *cluster) stop() {
	for _, pr := range append(cl.agents, cl.brokers...) {
		pr.kill()
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
	err := poll(ctx, timeout, func(ctx context.Context) error {
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
		if !pr.running() {
			continue
		}
		resp, err := cl.direct[i].Operator.RaftPeers(ctx, &gpupoolv1.RaftPeersRequest{}, grpc.WaitForReady(false))
		if err != nil {
			return -1, err
		}
		if resp.LeaderId == "" || (leader != "" && resp.LeaderId != leader) {
			return -1, fmt.Errorf("%s follows %q, others %q", pr.name, resp.LeaderId, leader)
		}
		leader = resp.LeaderId
	}
	for i := range cl.brokers {
		if brokerID(i) == leader && cl.brokers[i].running() {
			return i, nil
		}
	}
	return -1, fmt.Errorf("leader %q is not a running broker", leader)
}

// backoffStop makes poll give up at once.
type backoffStop struct{ err error }

func (b backoffStop) Error() string { return b.err.Error() }

// poll calls f, each call bounded by 5s, every 20ms until it returns nil,
// returns backoffStop, or timeout passes; it returns f's last error.
func poll(ctx context.Context, timeout time.Duration, f func(context.Context) error) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	var last error
	for {
		cctx, ccancel := context.WithTimeout(ctx, 5*time.Second)
		err := f(cctx)
		ccancel()
		if err == nil {
			return nil
		}
		if stop, ok := errors.AsType[backoffStop](err); ok {
			return stop.err
		}
		if ctx.Err() == nil || last == nil {
			last = err
		}
		select {
		case <-ctx.Done():
			if errors.Is(ctx.Err(), context.DeadlineExceeded) {
				return fmt.Errorf("after %s: %w", timeout, last)
			}
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
}
