package agent

import (
	"bytes"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// syncBuf is a log sink safe for the tests' reads.
type syncBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuf) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuf) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func jobMapGPUs() []*gpupoolv1.Device {
	return []*gpupoolv1.Device{{Uuid: "GPU-a", Index: 0}, {Uuid: "GPU-b", Index: 1}, {Uuid: "GPU-c", Index: 2}}
}

func assignment(id string, uuids ...string) *gpupoolv1.Assignment {
	as := &gpupoolv1.Assignment{LeaseId: id}
	for _, u := range uuids {
		as.Slices = append(as.Slices, &gpupoolv1.Slice{Device: u})
	}
	return as
}

// readJobMap returns the mapping files of dir as name -> content.
func readJobMap(t *testing.T, dir string) map[string]string {
	t.Helper()
	out := map[string]string{}
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		b, err := os.ReadFile(filepath.Join(dir, e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		out[e.Name()] = string(b)
	}
	return out
}

func TestJobMapListsEachGPUsLeasesOnePerLine(t *testing.T) {
	dir := t.TempDir()
	os.WriteFile(filepath.Join(dir, "2"), []byte("l-left-by-a-crash\n"), 0o644)
	os.WriteFile(filepath.Join(dir, "9"), []byte("not ours\n"), 0o644)
	j := newJobMap(dir, slog.New(slog.DiscardHandler))
	for _, tc := range []struct {
		name   string
		leases []*gpupoolv1.Assignment
		want   map[string]string
	}{
		{"no lease leaves only files that are not of this host's GPUs", nil, map[string]string{"9": "not ours\n"}},
		{"a lease on two GPUs is in both files",
			[]*gpupoolv1.Assignment{assignment("l-2", "GPU-a", "GPU-b")},
			map[string]string{"0": "l-2\n", "1": "l-2\n", "9": "not ours\n"}},
		{"two leases sharing a GPU are listed sorted, one per line",
			[]*gpupoolv1.Assignment{assignment("l-2", "GPU-a", "GPU-b"), assignment("l-1", "GPU-a")},
			map[string]string{"0": "l-1\nl-2\n", "1": "l-2\n", "9": "not ours\n"}},
		{"a lease torn down leaves the files of its GPUs",
			[]*gpupoolv1.Assignment{assignment("l-1", "GPU-a")},
			map[string]string{"0": "l-1\n", "9": "not ours\n"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			j.sync(jobMapGPUs(), func() []*gpupoolv1.Assignment { return tc.leases })
			if got := readJobMap(t, dir); !mapsEqual(got, tc.want) {
				t.Errorf("files: got %q, want %q", got, tc.want)
			}
		})
	}
}

func mapsEqual(a, b map[string]string) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if w, ok := b[k]; !ok || w != v {
			return false
		}
	}
	return true
}

func TestJobMapReportsAMissingDirectoryOnceAndRecovers(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "dcgm")
	var log syncBuf
	j := newJobMap(dir, slog.New(slog.NewTextHandler(&log, nil)))
	leases := func() []*gpupoolv1.Assignment { return []*gpupoolv1.Assignment{assignment("l-1", "GPU-b")} }
	for range 3 {
		j.sync(jobMapGPUs(), leases)
	}
	if n := strings.Count(log.String(), "cannot write the DCGM job mapping"); n != 1 {
		t.Fatalf("a missing directory was reported %d times, want once:\n%s", n, log.String())
	}
	if !strings.Contains(log.String(), dir) {
		t.Errorf("the report does not name the directory %s:\n%s", dir, log.String())
	}
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	j.sync(jobMapGPUs(), leases)
	if got := readJobMap(t, dir); !mapsEqual(got, map[string]string{"1": "l-1\n"}) {
		t.Errorf("after the directory appeared: got %q", got)
	}
	if !strings.Contains(log.String(), "DCGM job mapping works again") {
		t.Errorf("the recovery is not logged:\n%s", log.String())
	}
}

func TestJobMapOffWritesNothing(t *testing.T) {
	var j *jobMap = newJobMap("", nil)
	j.sync(jobMapGPUs(), func() []*gpupoolv1.Assignment { t.Fatal("read the leases"); return nil })
}

func TestJobMapContentIsSortedAndDeduplicated(t *testing.T) {
	for _, tc := range []struct {
		ids  []string
		want string
	}{
		{nil, ""},
		{[]string{"l-b", "l-a", "l-b"}, "l-a\nl-b\n"},
	} {
		if got := string(jobMapContent(tc.ids)); got != tc.want {
			t.Errorf("jobMapContent(%q): got %q, want %q", tc.ids, got, tc.want)
		}
	}
}
