package leasebench

import (
	"fmt"
	"os"
	"path/filepath"
	"time"
)

// fsyncBlock is the size of one write of the fsync probe: about what one
// Raft entry of a grant adds to the log.
const fsyncBlock = 4 << 10

// fsyncFigures are the disk's limit, measured on the data dirs' disk: a
// loop of 4 KiB writes, each followed by an fsync.
type fsyncFigures struct {
	PerSec float64 `json:"per_sec"`
	P50    float64 `json:"p50_ms"`
	P99    float64 `json:"p99_ms"`
}

// measureFsync appends 4 KiB and fsyncs, in a loop, for d in a file in
// dir, and removes the file. No lease can commit faster than one such
// fsync on the leader and one on a follower (in parallel), so one client's
// cycle (two commits) takes at least two of them.
func measureFsync(dir string, d time.Duration) (fsyncFigures, error) {
	f, err := os.CreateTemp(dir, "fsync-probe-")
	if err != nil {
		return fsyncFigures{}, err
	}
	defer os.Remove(f.Name())
	defer f.Close()
	block := make([]byte, fsyncBlock)
	var lat []time.Duration
	start := time.Now()
	for time.Since(start) < d {
		t0 := time.Now()
		if _, err := f.Write(block); err != nil {
			return fsyncFigures{}, fmt.Errorf("fsync probe in %s: %w", filepath.Dir(f.Name()), err)
		}
		if err := f.Sync(); err != nil {
			return fsyncFigures{}, fmt.Errorf("fsync probe in %s: %w", filepath.Dir(f.Name()), err)
		}
		lat = append(lat, time.Since(t0))
	}
	l := summarize(lat)
	return fsyncFigures{PerSec: float64(len(lat)) / time.Since(start).Seconds(), P50: l.P50, P99: l.P99}, nil
}
