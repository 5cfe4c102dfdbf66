package k8s

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/gpupool/gpupool/client"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

var (
	binaryOnce sync.Once
	binaryPath string
	binaryErr  error
)

// gpupoolBinary returns the path of the gpupool command, built once per
// test binary from the root module (../..).
func gpupoolBinary(t testing.TB) string {
	t.Helper()
	binaryOnce.Do(func() {
		start := time.Now()
		binaryPath = filepath.Join(suiteDir, "gpupool")
		cmd := exec.Command("go", "build", "-o", binaryPath, "github.com/gpupool/gpupool/cmd/gpupool")
		cmd.Dir = filepath.Join("..", "..")
		if out, err := cmd.CombinedOutput(); err != nil {
			binaryErr = fmt.Errorf("%v\n%s", err, out)
		}
		t.Logf("built gpupool in %s", time.Since(start).Round(time.Millisecond))
	})
	if binaryErr != nil {
		t.Fatalf("build gpupool: %v", binaryErr)
	}
	return binaryPath
}

// proc is one gpupool child process. Its output goes to a log file whose
// tail the test prints when it fails.
type proc struct {
	Name string
	Args []string
	Log  string // path of its output
	cmd  *exec.Cmd
	done chan struct{}
}

// startGpupool starts `gpupool args...` as name, killed when t ends. The
// process also dies with the test binary.
func startGpupool(t testing.TB, name string, args ...string) *proc {
	t.Helper()
	return startCommand(t, name, gpupoolBinary(t), args...)
}

// startCommand starts `path args...` as name, killed when t ends, its
// output in the suite's log directory. The process also dies with the test
// binary.
func startCommand(t testing.TB, name, path string, args ...string) *proc {
	t.Helper()
	p := &proc{Name: name, Args: args, Log: filepath.Join(suiteDir, fmt.Sprintf("%s-%s.log", logPrefix(t), name))}
	f, err := os.OpenFile(p.Log, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	p.cmd = exec.Command(path, args...)
	p.cmd.Stdout, p.cmd.Stderr = f, f
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := p.cmd.Start(); err != nil {
		f.Close()
		t.Fatalf("start %s: %v", name, err)
	}
	p.done = make(chan struct{})
	go func() {
		p.cmd.Wait()
		f.Close()
		close(p.done)
	}()
	t.Cleanup(func() {
		p.stop()
		if t.Failed() {
			b, _ := os.ReadFile(p.Log)
			t.Logf("---- %s (%s), last 4 KiB ----\n%s", name, p.Log, b[max(0, len(b)-4096):])
		}
	})
	return p
}

// stop kills the process and waits for it to exit.
func (p *proc) stop() {
	if p.running() {
		p.cmd.Process.Kill()
	}
	<-p.done
}

// running reports whether the process has not exited.
func (p *proc) running() bool {
	select {
	case <-p.done:
		return false
	default:
		return true
	}
}

// logPrefix is t's name as a file name.
func logPrefix(t testing.TB) string {
	return strings.NewReplacer("/", "_", " ", "_").Replace(t.Name())
}

// brokers is a dev broker cluster: three brokers and simulated agents.
type brokers struct {
	// Addrs are the brokers' gRPC addresses, comma-separated, as for
	// --broker and --brokers flags.
	Addrs string
	// Client is connected to all three brokers.
	Client *client.Client
	// HostIDs are the agents' host ids, which name their ResourceSlice
	// pools: "s<N>-host-<i>", N counting the clusters of this test binary,
	// so that no two tests' pools share a name.
	HostIDs []string
	Brokers []*proc
	Agents  []*proc
}

// brokerSeq numbers the broker clusters of the test binary.
var brokerSeq atomic.Int32

// agentGPUs is what each simulated agent has.
const agentGPUs = "2xA100-80GB"

// startBrokers starts three brokers and hosts simulated agents (2 A100
// 80GB each), and waits until every host is registered and ready. All of
// it is killed when t ends.
func startBrokers(t testing.TB, hosts int) *brokers {
	t.Helper()
	specs := make([]string, hosts)
	for i := range specs {
		specs[i] = agentGPUs
	}
	return startBrokersWith(t, specs...)
}

// startBrokersWith is startBrokers with one simulated agent per spec, whose
// --simulate it is (e.g. "2xA100-80GB:pcie=1").
func startBrokersWith(t testing.TB, specs ...string) *brokers {
	t.Helper()
	hosts := len(specs)
	seq := brokerSeq.Add(1)
	dir := shortTempDir(t) // the agents' simulation sockets live in their data dirs
	b := &brokers{}
	var addrs, raft []string
	for range 3 {
		addrs = append(addrs, mustFreePort(t))
		raft = append(raft, mustFreePort(t))
	}
	b.Addrs = strings.Join(addrs, ",")
	for i := range addrs {
		var join []string
		for j, a := range addrs {
			if j != i {
				join = append(join, a)
			}
		}
		id := fmt.Sprintf("broker-%d", i+1)
		b.Brokers = append(b.Brokers, startGpupool(t, fmt.Sprintf("s%d-%s", seq, id), "broker", "--insecure",
			"--node-id", id, "--data-dir", filepath.Join(dir, id), "--bind", addrs[i], "--raft-bind", raft[i],
			"--bootstrap-expect", "3", "--join", strings.Join(join, ","),
			"--heartbeat-interval", "500ms", "--heartbeat-ttl", "5s", "--log-level", "debug", "--insecure"))
	}
	for i := range hosts {
		id := fmt.Sprintf("s%d-host-%d", seq, i+1)
		b.HostIDs = append(b.HostIDs, id)
		b.Agents = append(b.Agents, startGpupool(t, id, "agent", "--insecure",
			"--broker", b.Addrs, "--simulate", specs[i], "--host-id", id, "--mps", "off",
			"--data-dir", filepath.Join(dir, id), "--data-bind", "127.0.0.1:0", "--log-level", "debug", "--insecure"))
	}
	c, err := client.Dial(addrs)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	b.Client = c
	eventually(t, fmt.Sprintf("%d ready hosts", hosts), time.Minute, func(ctx context.Context) error {
		ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		resp, err := c.Pool.ListHosts(ctx, &gpupoolv1.ListHostsRequest{})
		if err != nil {
			return err
		}
		ready := 0
		for _, h := range resp.Hosts {
			if h.Status == gpupoolv1.HostStatus_HOST_STATUS_READY {
				ready++
			}
		}
		if ready < hosts {
			return fmt.Errorf("%d of %d hosts ready", ready, len(resp.Hosts))
		}
		return nil
	})
	return b
}

func mustFreePort(t testing.TB) string {
	t.Helper()
	addr, err := freePort()
	if err != nil {
		t.Fatal(err)
	}
	return addr
}
