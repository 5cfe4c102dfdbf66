package mps

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

// fake is a stand-in for nvidia-cuda-mps-control. Each call appends one
// line to calls.log: its arguments, the three MPS variables and, without
// -d, its stdin. -d refuses to start twice on one pipe directory, as the
// real daemon does. FAKE_MODE=fail and FAKE_MODE=hang make it fail or hang.
const fake = `#!/bin/sh
log="$(dirname "$0")/calls.log"
env="CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES CUDA_MPS_PIPE_DIRECTORY=$CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY=$CUDA_MPS_LOG_DIRECTORY"
case "$FAKE_MODE" in
fail) echo "cannot open /dev/nvidiactl" >&2; exit 1 ;;
hang) exec sleep 600 ;;
esac
if [ "$1" = "-d" ]; then
  echo "-d $env" >> "$log"
  if [ -e "$CUDA_MPS_PIPE_DIRECTORY/control" ]; then
    echo "An instance of this daemon is already running" >&2
    exit 1
  fi
  touch "$CUDA_MPS_PIPE_DIRECTORY/control"
  exit 0
fi
stdin=$(cat)
echo "stdin=$stdin $env" >> "$log"
[ "$stdin" = "quit" ] && rm -f "$CUDA_MPS_PIPE_DIRECTORY/control"
exit 0
`

const gpu = "GPU-3c63abec-03c1-58d0-abe9-3c1015f46294"

func setup(t *testing.T) (c *Controller, calls func() []string, dir string) {
	t.Helper()
	bin := t.TempDir()
	path := filepath.Join(bin, Binary)
	if err := os.WriteFile(path, []byte(fake), 0o755); err != nil {
		t.Fatal(err)
	}
	dir = t.TempDir()
	calls = func() []string {
		b, err := os.ReadFile(filepath.Join(bin, "calls.log"))
		if os.IsNotExist(err) {
			return nil
		}
		if err != nil {
			t.Fatal(err)
		}
		return strings.Split(strings.TrimSpace(string(b)), "\n")
	}
	return New(path, dir, nil), calls, dir
}

func TestFindLooksOnPath(t *testing.T) {
	_, _, _ = setup(t)
	bin := t.TempDir()
	if err := os.WriteFile(filepath.Join(bin, Binary), []byte(fake), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Setenv("PATH", bin)
	if p, ok := Find(); !ok || p != filepath.Join(bin, Binary) {
		t.Fatalf("Find = %q %t, want the fake on PATH", p, ok)
	}
	t.Setenv("PATH", t.TempDir())
	if _, ok := Find(); ok {
		t.Fatal("Find found a binary on an empty PATH")
	}
}

func TestCommandStrings(t *testing.T) {
	c, calls, dir := setup(t)
	ctx := context.Background()
	env := "CUDA_VISIBLE_DEVICES=" + gpu + " CUDA_MPS_PIPE_DIRECTORY=" + filepath.Join(dir, gpu, "pipe") +
		" CUDA_MPS_LOG_DIRECTORY=" + filepath.Join(dir, gpu, "log")
	steps := []struct {
		name string
		do   func() error
		want []string // every call so far
	}{
		{"start runs -d with the GPU's environment", func() error { return c.Start(ctx, gpu) }, []string{"-d " + env}},
		{"a second start does nothing", func() error { return c.Start(ctx, gpu) }, []string{"-d " + env}},
		{"stop writes quit", func() error { return c.Stop(ctx, gpu) }, []string{"-d " + env, "stdin=quit " + env}},
		{"a second stop does nothing", func() error { return c.Stop(ctx, gpu) }, []string{"-d " + env, "stdin=quit " + env}},
	}
	for _, st := range steps {
		if err := st.do(); err != nil {
			t.Fatalf("%s: %v", st.name, err)
		}
		if got := calls(); !slices.Equal(got, st.want) {
			t.Fatalf("%s: calls\n got %q\nwant %q", st.name, got, st.want)
		}
	}
	if info, err := os.Stat(filepath.Join(dir, gpu, "pipe")); err != nil || info.Mode().Perm() != 0o700 {
		t.Fatalf("pipe dir: %v %v, want mode 0700", info, err)
	}
}

func TestStartAdoptsADaemonLeftRunningByAnEarlierAgent(t *testing.T) {
	c, calls, dir := setup(t)
	if err := c.Start(context.Background(), gpu); err != nil {
		t.Fatal(err)
	}
	restarted := New(c.binary, dir, nil) // same dirs, no memory of the daemon
	if err := restarted.Start(context.Background(), gpu); err != nil {
		t.Fatalf("start with a daemon already running: %v, want it adopted", err)
	}
	if got := restarted.Running(); !slices.Equal(got, []string{gpu}) {
		t.Fatalf("Running = %v, want [%s]", got, gpu)
	}
	if err := restarted.Stop(context.Background(), gpu); err != nil {
		t.Fatal(err)
	}
	if got := calls(); len(got) != 3 || !strings.HasPrefix(got[2], "stdin=quit") {
		t.Fatalf("calls %q: want -d, -d, quit", got)
	}
}

func TestFailuresAreClearErrors(t *testing.T) {
	tests := []struct {
		name, mode, uuid string
		ctxTimeout       time.Duration
		want             []string
	}{
		{"a failing binary", "fail", gpu, 0, []string{Binary + " -d for " + gpu, "exit status 1", "cannot open /dev/nvidiactl"}},
		{"a hung binary", "hang", gpu, 300 * time.Millisecond, []string{Binary + " -d for " + gpu}},
		{"a uuid that is not one", "", "../../etc", 0, []string{`GPU uuid "../../etc": want GPU-... or MIG-...`}},
		{"an empty uuid", "", "", 0, []string{`GPU uuid ""`}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, _, _ := setup(t)
			t.Setenv("FAKE_MODE", tt.mode)
			ctx := context.Background()
			if tt.ctxTimeout > 0 {
				var cancel context.CancelFunc
				ctx, cancel = context.WithTimeout(ctx, tt.ctxTimeout)
				defer cancel()
			}
			err := c.Start(ctx, tt.uuid)
			if err == nil {
				t.Fatal("Start succeeded")
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q lacks %q", err, w)
				}
			}
			if got := c.Running(); len(got) != 0 {
				t.Errorf("Running = %v after a failed start, want none", got)
			}
		})
	}
}

func TestClientEnv(t *testing.T) {
	c, _, dir := setup(t)
	got := c.ClientEnv(gpu, 8192, 25)
	want := []string{
		"CUDA_MPS_PIPE_DIRECTORY=" + filepath.Join(dir, gpu, "pipe"),
		"CUDA_MPS_LOG_DIRECTORY=" + filepath.Join(dir, gpu, "log"),
		"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=8192M",
		"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25",
	}
	if !slices.Equal(got, want) {
		t.Fatalf("ClientEnv\n got %q\nwant %q", got, want)
	}
}
