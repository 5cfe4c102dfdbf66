// Package k8s is gpupool's Kubernetes integration suite. It runs a real
// kube-apiserver, kube-scheduler and kube-controller-manager, built from the
// k8s.io/kubernetes module, inside the test binary on an embedded etcd;
// starts the dev broker cluster and simulated agents as child processes;
// and runs our controller and node plugin against them.
//
// Nodes come two ways. Most tests add fake Ready nodes that no kubelet
// backs, and stand in for the kubelet on the DRA gRPC API of node plugins
// (kubelet_test.go): fast, and in control of every call. TestRealKubelet
// runs the real kubelet instead (realkubelet_test.go), built from the same
// module as a child process (root only), on a container runtime that runs
// nothing and records what it is asked (Kubernetes' fake CRI, plus the CDI
// devices of each created container): plugin registration, prepare and
// unprepare with their retries, a kubelet restart and the CDI ids it passes
// to the runtime are the kubelet's own. TestControllerFailover runs two
// controller replicas under leader election and kills the leader.
//
// One control plane serves the whole test binary: its servers set
// process-wide feature gates, metrics and configz entries, so a second one
// cannot start. Tests therefore share it and must not run in parallel with
// each other. Each test works in its own namespace (newNamespace) and deletes
// the cluster-scoped objects it creates (nodes, ResourceSlices); the
// DeviceClass gpu.gpupool.dev is shared (ensureDeviceClass).
//
// The suite keeps its logs (control plane, etcd, every child process) in a
// directory that it removes when every test passed and prints otherwise.
package k8s

import (
	"context"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/klog/v2"
)

// suiteDir holds the suite's logs, kubeconfigs and the gpupool binary.
var suiteDir string

func TestMain(m *testing.M) {
	flag.Parse()
	dir, err := os.MkdirTemp("", "gpupool-k8s-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	suiteDir = dir
	closeLog, err := logKlogTo(filepath.Join(dir, "control-plane.log"))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	code := m.Run()
	suite.teardown()
	closeLog()
	if code == 0 {
		os.RemoveAll(dir)
	} else {
		fmt.Fprintf(os.Stderr, "test/k8s: logs kept in %s\n", dir)
	}
	os.Exit(code)
}

// logKlogTo sends klog's global output (which the control plane's servers
// use besides their contextual loggers) to path instead of stderr.
func logKlogTo(path string) (func(), error) {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	fs := flag.NewFlagSet("klog", flag.ContinueOnError)
	klog.InitFlags(fs)
	for name, value := range map[string]string{"logtostderr": "false", "alsologtostderr": "false", "stderrthreshold": "FATAL", "v": "2"} {
		if err := fs.Set(name, value); err != nil {
			return nil, fmt.Errorf("klog flag %s: %w", name, err)
		}
	}
	klog.SetOutput(f)
	return func() { klog.Flush(); f.Close() }, nil
}

// suite is the test binary's long-lived state: what outlives any one test.
var suite = &suiteTB{name: "test/k8s suite"}

// suiteTB is the testing.TB-like value that the control plane's servers are
// started with (they want one to log to and to register their teardown
// with). Unlike a *testing.T it lives as long as the test binary: its
// cleanups run in TestMain after the last test. Log output goes to the
// control-plane log; a Fatal panics, which startControlPlane recovers into
// an error.
type suiteTB struct {
	name string

	mu       sync.Mutex
	cleanups []func() // guarded by mu
	failed   bool     // guarded by mu
}

// suiteFatal is what a suiteTB's Fatal and Skip panic with.
type suiteFatal struct{ msg string }

func (s *suiteTB) Attr(key, value string)   {}
func (s *suiteTB) Chdir(dir string)         { panic(suiteFatal{"suite: Chdir is not supported"}) }
func (s *suiteTB) Helper()                  {}
func (s *suiteTB) Name() string             { return s.name }
func (s *suiteTB) Setenv(key, value string) { os.Setenv(key, value) }
func (s *suiteTB) Skipped() bool            { return false }

func (s *suiteTB) Cleanup(f func()) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.cleanups = append(s.cleanups, f)
}

// teardown runs the cleanups, last registered first.
func (s *suiteTB) teardown() {
	for {
		s.mu.Lock()
		if len(s.cleanups) == 0 {
			s.mu.Unlock()
			return
		}
		f := s.cleanups[len(s.cleanups)-1]
		s.cleanups = s.cleanups[:len(s.cleanups)-1]
		s.mu.Unlock()
		f()
	}
}

func (s *suiteTB) Log(args ...any)                 { klog.InfoDepth(1, fmt.Sprint(args...)) }
func (s *suiteTB) Logf(format string, args ...any) { klog.InfoDepth(1, fmt.Sprintf(format, args...)) }
func (s *suiteTB) Error(args ...any)               { s.Fail(); klog.ErrorDepth(1, fmt.Sprint(args...)) }
func (s *suiteTB) Errorf(format string, args ...any) {
	s.Fail()
	klog.ErrorDepth(1, fmt.Sprintf(format, args...))
}

func (s *suiteTB) Fail() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.failed = true
}

func (s *suiteTB) Failed() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.failed
}

func (s *suiteTB) FailNow()          { s.Fail(); panic(suiteFatal{"suite: FailNow"}) }
func (s *suiteTB) Fatal(args ...any) { s.Fail(); panic(suiteFatal{fmt.Sprint(args...)}) }
func (s *suiteTB) Fatalf(format string, args ...any) {
	s.Fail()
	panic(suiteFatal{fmt.Sprintf(format, args...)})
}
func (s *suiteTB) Skip(args ...any) { panic(suiteFatal{"suite: skipped: " + fmt.Sprint(args...)}) }
func (s *suiteTB) Skipf(format string, args ...any) {
	panic(suiteFatal{"suite: skipped: " + fmt.Sprintf(format, args...)})
}
func (s *suiteTB) SkipNow() { panic(suiteFatal{"suite: skipped"}) }

// TempDir returns a new directory under the suite's, removed with it.
func (s *suiteTB) TempDir() string {
	dir, err := os.MkdirTemp(suiteDir, "tmp-")
	if err != nil {
		s.Fatalf("suite: TempDir: %v", err)
	}
	return dir
}

// eventually polls cond every 100ms until it returns nil, and fails t with
// what and cond's last error if that does not happen within timeout.
func eventually(t testing.TB, what string, timeout time.Duration, cond func(ctx context.Context) error) {
	t.Helper()
	var last error
	err := wait.PollUntilContextTimeout(context.Background(), 100*time.Millisecond, timeout, true, func(ctx context.Context) (bool, error) {
		last = cond(ctx)
		return last == nil, nil
	})
	if err != nil {
		t.Fatalf("%s: not within %s: %v", what, timeout, last)
	}
}
