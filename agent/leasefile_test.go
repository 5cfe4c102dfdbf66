package agent

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

func TestLeaseFilesRoundTripAndQuarantine(t *testing.T) {
	dir := t.TempDir()
	f, err := openLeaseFiles(dir)
	if err != nil {
		t.Fatal(err)
	}
	rec := leaseRecord{Assignment: assignmentsOf([]string{"l-1"})[0], Deadline: time.UnixMilli(1_800_000_000_000)}
	if err := f.put(rec); err != nil {
		t.Fatal(err)
	}
	bad := map[string]string{
		"l-2.json":    `{"version": 1, "assignment": {"leaseId": "l-2"`,
		"l-3.json":    `{"version": 2, "assignment": {}, "deadline_unix_ms": 1}`,
		"l-4.json":    `{"version": 1, "assignment": {"leaseId": "l-5", "slices": [{"device": "GPU-x"}]}, "deadline_unix_ms": 1}`,
		"l-6.json":    `{"version": 1, "assignment": {"leaseId": "l-6"}, "deadline_unix_ms": 1}`,
		"l-7.json":    `{"version": 1, "assignment": {"leaseId": "l-7", "slices": [{}]}, "deadline_unix_ms": 1, "extra": true}`,
		".tmp-123456": `half a write`,
	}
	for name, body := range bad {
		if err := os.WriteFile(filepath.Join(dir, "leases", name), []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	recs, quarantined, err := f.load()
	if err != nil {
		t.Fatal(err)
	}
	if len(recs) != 1 || !proto.Equal(recs[0].Assignment, rec.Assignment) || !recs[0].Deadline.Equal(rec.Deadline) {
		t.Fatalf("load: got %v, want only l-1 as written", recs)
	}
	if len(quarantined) != 5 {
		t.Fatalf("quarantined %d files, want 5: %v", len(quarantined), quarantined)
	}
	left, _ := os.ReadDir(filepath.Join(dir, "leases"))
	if len(left) != 1 || left[0].Name() != "l-1.json" {
		t.Fatalf("leases dir holds %v, want only l-1.json", left)
	}
	if err := f.put(leaseRecord{Assignment: &gpupoolv1.Assignment{LeaseId: "../escape"}}); err == nil {
		t.Fatal("put accepted a lease id that is a path")
	}
	if err := f.remove("l-1"); err != nil {
		t.Fatal(err)
	}
	if err := f.remove("l-1"); err != nil {
		t.Fatalf("removing a missing file: %v", err)
	}
}

func FuzzReadLeaseFile(f *testing.F) {
	f.Add([]byte(`{"version": 1, "assignment": {"leaseId": "l-1", "slices": [{"device": "GPU-x", "memoryMib": "1024"}]}, "deadline_unix_ms": 1}`))
	f.Add([]byte(`{"version": 1}`))
	f.Add([]byte(`{}`))
	f.Add([]byte(`not json`))
	dir := f.TempDir()
	f.Fuzz(func(t *testing.T, b []byte) {
		p := filepath.Join(dir, "l-1.json")
		if err := os.WriteFile(p, b, 0o600); err != nil {
			t.Fatal(err)
		}
		rec, err := readLeaseFile(p)
		if err != nil {
			return
		}
		if !validLeaseID.MatchString(rec.Assignment.LeaseId) || len(rec.Assignment.Slices) == 0 {
			t.Fatalf("accepted a record without a valid id or slices: %v", rec.Assignment)
		}
	})
}
