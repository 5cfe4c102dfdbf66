package device

import (
	"fmt"
	"os/exec"
	"sync"
	"testing"
)

func TestNewSimulatedIsASimulator(t *testing.T) {
	b, err := NewSimulated("1xA100-80GB", "host-a")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = b.Close() })
	if _, ok := b.(Simulator); !ok {
		t.Fatalf("%T does not implement Simulator", b)
	}
}

// simulatorRefusals are bad calls of a Simulator of 8 A100-80GB, with the
// errors they must get.
var simulatorRefusals = []struct {
	name    string
	call    func(Simulator) error
	wantErr string
}{
	{"a device past the last", func(s Simulator) error { return s.SetProcess(8, 1, 1) }, "device 8: must be between 0 and 7"},
	{"a negative device", func(s Simulator) error { return s.SetUtilization(-1, 1) }, "device -1: must be between 0 and 7"},
	{"a bad device for an Xid", func(s Simulator) error { return s.InjectXid(9, 79) }, "device 9: must be between 0 and 7"},
	{"a bad device for an ECC error", func(s Simulator) error { return s.InjectECC(9, true) }, "device 9: must be between 0 and 7"},
	{"pid 0", func(s Simulator) error { return s.SetProcess(0, 0, 1) }, "pid 0: must be positive"},
	{"a negative pid", func(s Simulator) error { return s.SetProcess(0, -5, 1) }, "pid -5: must be positive"},
	{"a pid Linux cannot have", func(s Simulator) error { return s.SetProcess(0, 1<<22+1, 1) }, "pid 4194305: must be at most 4194304, Linux's largest"},
	{"negative memory", func(s Simulator) error { return s.SetProcess(0, 1, -1) }, "usedMiB -1: must be 0 or more"},
	{"more memory than the GPU has", func(s Simulator) error { return s.SetProcess(0, 1, 81921) },
		"usedMiB 81921: exceeds the device's 81920 MiB, of which other processes use 0 MiB"},
	{"more memory than other processes leave", func(s Simulator) error {
		if err := s.SetProcess(1, 1, 80000); err != nil {
			return err
		}
		return s.SetProcess(1, 2, 1921)
	}, "usedMiB 1921: exceeds the device's 81920 MiB, of which other processes use 80000 MiB"},
	{"utilisation above 100", func(s Simulator) error { return s.SetUtilization(0, 150) }, "percent 150: must be between 0 and 100"},
	{"negative utilisation", func(s Simulator) error { return s.SetUtilization(0, -1) }, "percent -1: must be between 0 and 100"},
	{"Xid 0", func(s Simulator) error { return s.InjectXid(0, 0) }, "xid 0: must be positive"},
}

func TestSimulatorRefusesBadInput(t *testing.T) {
	for _, tc := range simulatorRefusals {
		t.Run(tc.name, func(t *testing.T) {
			if err := tc.call(newSim(t, "8xA100-80GB")); err == nil || err.Error() != tc.wantErr {
				t.Errorf("error = %v, want %s", err, tc.wantErr)
			}
		})
	}
}

func TestSimulatorAcceptsTheLimits(t *testing.T) {
	b := newSim(t, "8xA100-80GB")
	for _, err := range []error{
		b.SetProcess(7, 1<<22, 81920),
		b.SetProcess(0, 1, 0), // removing a process that never ran
		b.SetUtilization(7, 0),
		b.SetUtilization(0, 100),
		b.InjectXid(0, 1),
		b.LoseGPUs(),
		b.LoseGPUs(),
	} {
		if err != nil {
			t.Error(err)
		}
	}
}

func TestSimulatorHoldsABoundedNumberOfEvents(t *testing.T) {
	b := newSim(t, "1xA100-80GB")
	for i := range maxSimEvents {
		if err := b.InjectECC(0, false); err != nil {
			t.Fatalf("event %d: %v", i, err)
		}
	}
	want := fmt.Sprintf("device 0: %d health events already wait for WatchHealth to start", maxSimEvents)
	if err := b.InjectXid(0, 79); err == nil || err.Error() != want {
		t.Errorf("error = %v, want %s", err, want)
	}
}

// Run with -race: the simulator and the backend reading it are used from
// many goroutines at once.
func TestSimulatorIsSafeForConcurrentUse(t *testing.T) {
	b := newSim(t, "4xA100-80GB")
	w := watch(t, b)
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Go(func() {
			for i := range 50 {
				if err := firstErr(
					b.SetProcess(g, 100+i%5, int64(i)),
					b.SetUtilization(g, i),
					b.InjectXid(g, 13),
				); err != nil {
					t.Error(err)
					return
				}
				if _, err := b.Sample(); err != nil {
					t.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
	for range 4 * 50 {
		if e := w.next(t); e.Xid != 13 {
			t.Fatalf("got %+v, want Xid 13", e)
		}
	}
}

func TestSimReapExitedFreesTheMemoryOfProcessesThatExited(t *testing.T) {
	b, err := NewSimulated("1xA100-80GB", "host-a", SimReapExited())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	cmd := exec.Command("sleep", "600")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	sim := b.(Simulator)
	if err := sim.SetProcess(0, cmd.Process.Pid, 1024); err != nil {
		t.Fatal(err)
	}
	used := func() int64 {
		s, err := b.Sample()
		if err != nil {
			t.Fatal(err)
		}
		return s[0].MemoryUsedMiB
	}
	if got := used(); got != 1024 {
		t.Fatalf("while the process runs: %d MiB used, want 1024", got)
	}
	cmd.Process.Kill()
	cmd.Wait()
	if got := used(); got != 0 {
		t.Fatalf("after the process exited: %d MiB used, want 0", got)
	}
}
