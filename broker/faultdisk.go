//go:build faultinject

package broker

import (
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"time"

	"github.com/hashicorp/raft"
)

// This file is built only with -tags faultinject (the robustness suite
// and the slow-disk benchmark build the binary so): the product has no
// way to slow its own disk.

// FaultFsyncDelayFile, in a broker's data dir, holds a duration (e.g.
// "100ms"; empty or missing: none) that every Raft log write sleeps
// before it is made, as a disk with slow fsyncs would.
const FaultFsyncDelayFile = "fault-fsync-delay"

// injectDiskFaults wraps the log store in one that sleeps what the data
// dir's FaultFsyncDelayFile says, read again every 100 ms until stop.
func injectDiskFaults(dir string, store raft.LogStore, stop <-chan struct{}, start func(func())) raft.LogStore {
	f := &slowLog{LogStore: store}
	path := filepath.Join(dir, FaultFsyncDelayFile)
	read := func() {
		b, err := os.ReadFile(path)
		d, perr := time.ParseDuration(strings.TrimSpace(string(b)))
		if err != nil || perr != nil {
			d = 0
		}
		f.delay.Store(int64(d))
	}
	read()
	start(func() {
		t := time.NewTicker(100 * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-stop:
				return
			case <-t.C:
				read()
			}
		}
	})
	return f
}

type slowLog struct {
	raft.LogStore
	delay atomic.Int64
}

func (s *slowLog) StoreLog(l *raft.Log) error { return s.StoreLogs([]*raft.Log{l}) }

func (s *slowLog) StoreLogs(logs []*raft.Log) error {
	if d := time.Duration(s.delay.Load()); d > 0 {
		time.Sleep(d)
	}
	return s.LogStore.StoreLogs(logs)
}
