package workload

import (
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
)

// fakeProc is one process of a fake proc tree.
type fakeProc struct {
	pid   int
	comm  string // "sleep" if empty
	state byte   // 'S' if zero
	start uint64
	// stat replaces the generated stat line when not empty.
	stat string
	// environ is the process's environment; an unreadable environ file
	// when nil.
	environ []string
}

func (f fakeProc) proc() Proc { return Proc{PID: f.pid, Start: f.start} }

// statLine is a /proc/PID/stat line with the fields the package reads set.
func (f fakeProc) statLine() string {
	if f.stat != "" {
		return f.stat
	}
	comm, state := cmpOr(f.comm, "sleep"), cmpOr(f.state, 'S')
	// Fields 3 to 52; field 22 (index 19 here) is the start time.
	fields := make([]string, 50)
	for i := range fields {
		fields[i] = "0"
	}
	fields[0] = string(state)
	fields[19] = strconv.FormatUint(f.start, 10)
	return fmt.Sprintf("%d (%s) %s\n", f.pid, comm, strings.Join(fields, " "))
}

func cmpOr[T comparable](v, fallback T) T {
	var zero T
	if v == zero {
		return fallback
	}
	return v
}

// writeFakeProc writes f under root, replacing what was there.
func writeFakeProc(t *testing.T, root string, f fakeProc) {
	t.Helper()
	dir := filepath.Join(root, strconv.Itoa(f.pid))
	if err := os.RemoveAll(dir); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "stat"), []byte(f.statLine()), 0o644); err != nil {
		t.Fatal(err)
	}
	environ := filepath.Join(dir, "environ")
	if f.environ == nil {
		// A directory cannot be read as a file, even by root, for whom
		// file modes would not get in the way.
		if err := os.Mkdir(environ, 0o755); err != nil {
			t.Fatal(err)
		}
		return
	}
	var b []byte
	for _, kv := range f.environ {
		b = append(append(b, kv...), 0)
	}
	if err := os.WriteFile(environ, b, 0o400); err != nil {
		t.Fatal(err)
	}
}

func fakeTree(t *testing.T, procs ...fakeProc) string {
	t.Helper()
	root := t.TempDir()
	for _, f := range procs {
		writeFakeProc(t, root, f)
	}
	return root
}

type tracking struct {
	lease string
	proc  Proc
}

func TestScanFakeTree(t *testing.T) {
	withLease := func(env ...string) []string { return append([]string{"PATH=/bin"}, env...) }
	tests := []struct {
		name  string
		procs []fakeProc
		track []tracking
		want  map[string][]Proc
	}{{
		name:  "the variable names the lease",
		procs: []fakeProc{{pid: 10, start: 100, environ: withLease("GPUPOOL_LEASE_ID=lease-1")}},
		want:  map[string][]Proc{"lease-1": {{10, 100}}},
	}, {
		name: "processes of one lease are sorted by pid",
		procs: []fakeProc{
			{pid: 300, start: 1, environ: withLease("GPUPOOL_LEASE_ID=lease-1")},
			{pid: 20, start: 2, environ: withLease("GPUPOOL_LEASE_ID=lease-1")},
			{pid: 4, start: 3, environ: withLease("GPUPOOL_LEASE_ID=lease-2")},
		},
		want: map[string][]Proc{"lease-1": {{20, 2}, {300, 1}}, "lease-2": {{4, 3}}},
	}, {
		name:  "a process without the variable belongs to no lease",
		procs: []fakeProc{{pid: 10, start: 100, environ: withLease()}},
		want:  map[string][]Proc{},
	}, {
		name:  "a process with an empty environment belongs to no lease",
		procs: []fakeProc{{pid: 10, start: 100, environ: []string{}}},
		want:  map[string][]Proc{},
	}, {
		name:  "a longer variable that starts with the name is not the variable",
		procs: []fakeProc{{pid: 10, start: 100, environ: withLease("GPUPOOL_LEASE_ID_X=lease-1")}},
		want:  map[string][]Proc{},
	}, {
		name:  "the variable inside another variable's value is not the variable",
		procs: []fakeProc{{pid: 10, start: 100, environ: withLease("FOO=GPUPOOL_LEASE_ID=lease-1")}},
		want:  map[string][]Proc{},
	}, {
		name:  "an empty lease id names no lease",
		procs: []fakeProc{{pid: 10, start: 100, environ: withLease("GPUPOOL_LEASE_ID=")}},
		want:  map[string][]Proc{},
	}, {
		name:  "the first of two entries wins, as with getenv",
		procs: []fakeProc{{pid: 10, start: 100, environ: withLease("GPUPOOL_LEASE_ID=lease-1", "GPUPOOL_LEASE_ID=lease-2")}},
		want:  map[string][]Proc{"lease-1": {{10, 100}}},
	}, {
		name: "a process whose environment cannot be read is skipped",
		procs: []fakeProc{
			{pid: 10, start: 100, environ: nil},
			{pid: 11, start: 101, environ: withLease("GPUPOOL_LEASE_ID=lease-1")},
		},
		want: map[string][]Proc{"lease-1": {{11, 101}}},
	}, {
		name: "a process with a malformed stat is skipped",
		procs: []fakeProc{
			{pid: 10, stat: "10 sleep S 1 2 3\n", environ: withLease("GPUPOOL_LEASE_ID=lease-1")},
			{pid: 11, stat: "11 (sleep) S 1 2 3\n", environ: withLease("GPUPOOL_LEASE_ID=lease-1")},
			{pid: 12, stat: "12 (sleep) S 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 soon\n", environ: withLease("GPUPOOL_LEASE_ID=lease-1")},
			{pid: 13, start: 103, environ: withLease("GPUPOOL_LEASE_ID=lease-1")},
		},
		want: map[string][]Proc{"lease-1": {{13, 103}}},
	}, {
		name:  "a zombie is not live",
		procs: []fakeProc{{pid: 10, start: 100, state: 'Z', environ: withLease("GPUPOOL_LEASE_ID=lease-1")}},
		want:  map[string][]Proc{},
	}, {
		name:  "a command name with spaces and parentheses is skipped over",
		procs: []fakeProc{{pid: 10, start: 100, comm: "a) (b c", environ: withLease("GPUPOOL_LEASE_ID=lease-1")}},
		want:  map[string][]Proc{"lease-1": {{10, 100}}},
	}, {
		name:  "a tracked process belongs to its lease without the variable",
		procs: []fakeProc{{pid: 10, start: 100, environ: withLease()}},
		track: []tracking{{"lease-1", Proc{10, 100}}},
		want:  map[string][]Proc{"lease-1": {{10, 100}}},
	}, {
		name:  "a tracked process belongs to its lease even if it cannot be read",
		procs: []fakeProc{{pid: 10, start: 100, environ: nil}},
		track: []tracking{{"lease-1", Proc{10, 100}}},
		want:  map[string][]Proc{"lease-1": {{10, 100}}},
	}, {
		name:  "tracking wins over the environment",
		procs: []fakeProc{{pid: 10, start: 100, environ: withLease("GPUPOOL_LEASE_ID=lease-1")}},
		track: []tracking{{"lease-2", Proc{10, 100}}},
		want:  map[string][]Proc{"lease-2": {{10, 100}}},
	}, {
		name:  "tracking an earlier process with the same pid does not apply",
		procs: []fakeProc{{pid: 10, start: 100, environ: withLease("GPUPOOL_LEASE_ID=lease-1")}},
		track: []tracking{{"lease-2", Proc{10, 99}}},
		want:  map[string][]Proc{"lease-1": {{10, 100}}},
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			table := NewTable(fakeTree(t, tt.procs...))
			for _, tr := range tt.track {
				table.Track(tr.lease, tr.proc)
			}
			got, err := table.Scan()
			if err != nil {
				t.Fatalf("Scan: %v", err)
			}
			if !maps.EqualFunc(got, tt.want, slices.Equal) {
				t.Errorf("Scan = %v, want %v", got, tt.want)
			}
			for _, f := range tt.procs {
				want := ""
				for lease, procs := range tt.want {
					if slices.Contains(procs, f.proc()) {
						want = lease
					}
				}
				if got := table.LeaseOf(f.pid); got != want {
					t.Errorf("LeaseOf(%d) = %q, want %q", f.pid, got, want)
				}
			}
		})
	}
}

func TestScanIgnoresEntriesThatAreNotProcesses(t *testing.T) {
	root := fakeTree(t, fakeProc{pid: 10, start: 100, environ: []string{"GPUPOOL_LEASE_ID=lease-1"}})
	for _, dir := range []string{"self", "net", "sys", "0", "-1"} {
		if err := os.Mkdir(filepath.Join(root, dir), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(root, "uptime"), []byte("1.0 1.0\n"), 0o444); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(root, "42"), []byte("not a directory"), 0o444); err != nil {
		t.Fatal(err)
	}
	got, err := NewTable(root).Scan()
	if err != nil {
		t.Fatalf("Scan: %v", err)
	}
	want := map[string][]Proc{"lease-1": {{10, 100}}}
	if !maps.EqualFunc(got, want, slices.Equal) {
		t.Errorf("Scan = %v, want %v", got, want)
	}
}

func TestScanFailsWithoutProcRoot(t *testing.T) {
	_, err := NewTable(filepath.Join(t.TempDir(), "missing")).Scan()
	if err == nil {
		t.Fatal("Scan of a missing proc root succeeded, want an error")
	}
}

func TestLeaseOfReadsEnvironOncePerProcess(t *testing.T) {
	root := fakeTree(t, fakeProc{pid: 10, start: 100, environ: []string{"GPUPOOL_LEASE_ID=lease-1"}})
	table := NewTable(root)
	if got := table.LeaseOf(10); got != "lease-1" {
		t.Fatalf("LeaseOf(10) = %q, want %q", got, "lease-1")
	}

	writeFakeProc(t, root, fakeProc{pid: 10, start: 100, environ: []string{"GPUPOOL_LEASE_ID=lease-2"}})
	if got := table.LeaseOf(10); got != "lease-1" {
		t.Errorf("LeaseOf(10) after the environment changed = %q, want the cached %q", got, "lease-1")
	}

	// The pid now names another process, whose environment is read.
	writeFakeProc(t, root, fakeProc{pid: 10, start: 200, environ: []string{"GPUPOOL_LEASE_ID=lease-2"}})
	if got := table.LeaseOf(10); got != "lease-2" {
		t.Errorf("LeaseOf(10) after pid reuse = %q, want %q", got, "lease-2")
	}
}

func TestLeaseOfReadsTheEnvironmentAgainAfterExec(t *testing.T) {
	// Seen between fork and exec: the parent's command and environment.
	root := fakeTree(t, fakeProc{pid: 10, start: 100, comm: "kubelet", environ: []string{"PATH=/bin"}})
	table := NewTable(root)
	if got := table.LeaseOf(10); got != "" {
		t.Fatalf("LeaseOf(10) before exec = %q, want none", got)
	}
	writeFakeProc(t, root, fakeProc{pid: 10, start: 100, comm: "python3", environ: []string{"GPUPOOL_LEASE_ID=lease-1"}})
	if got := table.LeaseOf(10); got != "lease-1" {
		t.Fatalf("LeaseOf(10) after exec = %q, want lease-1", got)
	}
}

func TestLeaseOfMissingProcess(t *testing.T) {
	table := NewTable(fakeTree(t))
	if got := table.LeaseOf(10); got != "" {
		t.Errorf("LeaseOf(10) = %q, want \"\"", got)
	}
}

func TestScanForgetsExitedProcesses(t *testing.T) {
	root := fakeTree(t,
		fakeProc{pid: 10, start: 100, environ: []string{"GPUPOOL_LEASE_ID=lease-1"}},
		fakeProc{pid: 11, start: 101, environ: []string{}},
		fakeProc{pid: 12, start: 102, environ: []string{}},
	)
	table := NewTable(root)
	table.Track("lease-2", Proc{11, 101})
	table.Track("lease-2", Proc{12, 102})
	if _, err := table.Scan(); err != nil {
		t.Fatalf("Scan: %v", err)
	}
	for _, pid := range []string{"10", "11"} {
		if err := os.RemoveAll(filepath.Join(root, pid)); err != nil {
			t.Fatal(err)
		}
	}
	got, err := table.Scan()
	if err != nil {
		t.Fatalf("Scan: %v", err)
	}
	want := map[string][]Proc{"lease-2": {{12, 102}}}
	if !maps.EqualFunc(got, want, slices.Equal) {
		t.Errorf("Scan = %v, want %v", got, want)
	}
	table.mu.Lock()
	defer table.mu.Unlock()
	if want := map[Proc]string{{12, 102}: "lease-2"}; !maps.Equal(table.tracked, want) {
		t.Errorf("tracked = %v, want %v", table.tracked, want)
	}
	if _, ok := table.environ[Proc{10, 100}]; ok {
		t.Errorf("environ still caches exited process 10: %v", table.environ)
	}
}

func TestUntrack(t *testing.T) {
	root := fakeTree(t,
		fakeProc{pid: 10, start: 100, environ: []string{}},
		fakeProc{pid: 11, start: 101, environ: []string{"GPUPOOL_LEASE_ID=lease-1"}},
		fakeProc{pid: 12, start: 102, environ: []string{}},
	)
	table := NewTable(root)
	table.Track("lease-1", Proc{10, 100})
	table.Track("lease-2", Proc{12, 102})
	table.Untrack("lease-1")
	got, err := table.Scan()
	if err != nil {
		t.Fatalf("Scan: %v", err)
	}
	want := map[string][]Proc{"lease-1": {{11, 101}}, "lease-2": {{12, 102}}}
	if !maps.EqualFunc(got, want, slices.Equal) {
		t.Errorf("Scan = %v, want %v", got, want)
	}
}

func TestLookup(t *testing.T) {
	table := NewTable(fakeTree(t,
		fakeProc{pid: 10, start: 100, environ: []string{}},
		fakeProc{pid: 11, start: 101, state: 'Z', environ: []string{}},
		fakeProc{pid: 12, stat: "12 (sleep) S\n", environ: []string{}},
	))
	tests := []struct {
		name    string
		pid     int
		want    Proc
		wantErr error
	}{
		{name: "a live process is found", pid: 10, want: Proc{10, 100}},
		{name: "a zombie is no process", pid: 11, wantErr: ErrNoProcess},
		{name: "a missing pid is no process", pid: 13, wantErr: ErrNoProcess},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := table.Lookup(tt.pid)
			if got != tt.want || !errors.Is(err, tt.wantErr) {
				t.Errorf("Lookup(%d) = %v, %v; want %v, %v", tt.pid, got, err, tt.want, tt.wantErr)
			}
		})
	}
	t.Run("a malformed stat is an error", func(t *testing.T) {
		if _, err := table.Lookup(12); err == nil || errors.Is(err, ErrNoProcess) {
			t.Errorf("Lookup(12) error = %v, want a malformed stat error", err)
		}
	})
}

func TestScanRealProcesses(t *testing.T) {
	leaseA := "lease-a-" + strconv.Itoa(os.Getpid())
	leaseB := "lease-b-" + strconv.Itoa(os.Getpid())
	a1 := startChild(t, leaseA, "sleep", "60")
	a2 := startChild(t, leaseA, "sleep", "60")
	b := startChild(t, leaseB, "sleep", "60")
	none := startChild(t, "", "sleep", "60")
	zombie := startChild(t, leaseB, "sleep", "60")
	zombie.killToZombie(t)

	table := NewTable("/proc")
	got, err := table.Scan()
	if err != nil {
		t.Fatalf("Scan: %v", err)
	}
	wantA := []Proc{a1.proc, a2.proc}
	slices.SortFunc(wantA, func(x, y Proc) int { return x.PID - y.PID })
	if !slices.Equal(got[leaseA], wantA) {
		t.Errorf("Scan()[%s] = %v, want %v", leaseA, got[leaseA], wantA)
	}
	if want := []Proc{b.proc}; !slices.Equal(got[leaseB], want) {
		t.Errorf("Scan()[%s] = %v, want %v (the zombie %v left out)", leaseB, got[leaseB], want, zombie.proc)
	}
	for lease, procs := range got {
		if slices.Contains(procs, none.proc) {
			t.Errorf("process without %s listed under lease %q", EnvLeaseID, lease)
		}
	}

	for _, tt := range []struct {
		name string
		c    *child
		want string
	}{
		{"a process of lease A", a1, leaseA},
		{"a process of lease B", b, leaseB},
		{"a process without the variable", none, ""},
		{"a zombie", zombie, ""},
	} {
		if got := table.LeaseOf(tt.c.proc.PID); got != tt.want {
			t.Errorf("%s: LeaseOf(%d) = %q, want %q", tt.name, tt.c.proc.PID, got, tt.want)
		}
	}
}

func TestTableConcurrentUse(t *testing.T) {
	root := fakeTree(t,
		fakeProc{pid: 10, start: 100, environ: []string{"GPUPOOL_LEASE_ID=lease-1"}},
		fakeProc{pid: 11, start: 101, environ: []string{}},
	)
	table := NewTable(root)
	var wg sync.WaitGroup
	for i := range 8 {
		wg.Go(func() {
			for range 50 {
				table.Track("lease-2", Proc{11, 101})
				if _, err := table.Scan(); err != nil {
					t.Errorf("Scan: %v", err)
				}
				if got := table.LeaseOf(10); got != "lease-1" {
					t.Errorf("LeaseOf(10) = %q, want %q", got, "lease-1")
				}
				if i%2 == 0 {
					table.Untrack("lease-2")
				}
			}
		})
	}
	wg.Wait()
}
