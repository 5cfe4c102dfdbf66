package agent

import (
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"

	"github.com/gpupool/gpupool/internal/atomicfile"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// jobMap keeps DCGM's HPC job mapping for this host's GPUs: in dir, one
// file per GPU, named after the GPU's index ("0", "1", ...), listing the
// ids of the leases that hold a slice of it, one per line, sorted. A GPU
// without leases has no file. dcgm-exporter, started with
// --hpc-job-mapping-dir on the same directory, then labels each GPU's
// metrics with its leases (label hpc_job), so that per-GPU metrics carry
// the lease even when several leases share the GPU.
//
// The agent owns the files named after its GPUs' indexes in dir and no
// others. Files are replaced atomically, so the exporter never reads half
// of one. A directory that is missing or not writable is reported once
// (and once more when it works again); enforcement never waits for it.
type jobMap struct {
	dir string
	log *slog.Logger

	mu sync.Mutex
	// failing is the last error reported, "" while the map works.
	// Guarded by mu.
	failing string
}

func newJobMap(dir string, log *slog.Logger) *jobMap {
	if dir == "" {
		return nil
	}
	return &jobMap{dir: dir, log: log}
}

// JobMapContent is the content of a GPU's mapping file for these lease
// ids: one per line, sorted; empty for none.
func jobMapContent(ids []string) []byte {
	if len(ids) == 0 {
		return nil
	}
	ids = slices.Clone(ids)
	slices.Sort(ids)
	ids = slices.Compact(ids)
	return []byte(strings.Join(ids, "\n") + "\n")
}

// sync makes the files say which of gpus each lease of enforced() holds.
// enforced is read under the map's lock, so that of two syncs racing the
// later one's view of the leases is what stays on disk. A nil jobMap does
// nothing.
func (j *jobMap) sync(gpus []*gpupoolv1.Device, enforced func() []*gpupoolv1.Assignment) {
	if j == nil {
		return
	}
	j.mu.Lock()
	defer j.mu.Unlock()
	holders := map[string][]string{} // uuid -> lease ids
	for _, as := range enforced() {
		for _, s := range as.GetSlices() {
			holders[s.Device] = append(holders[s.Device], as.LeaseId)
		}
	}
	var errs []error
	if st, err := os.Stat(j.dir); err != nil {
		errs = append(errs, err)
	} else if !st.IsDir() {
		errs = append(errs, fmt.Errorf("%s: not a directory", j.dir))
	} else {
		for _, d := range gpus {
			if err := j.writeLocked(strconv.Itoa(int(d.Index)), jobMapContent(holders[d.Uuid])); err != nil {
				errs = append(errs, err)
			}
		}
	}
	j.reportLocked(errors.Join(errs...))
}

// writeLocked puts content in the file name, or removes the file when
// content is empty. Unchanged files are not written again.
func (j *jobMap) writeLocked(name string, content []byte) error {
	path := filepath.Join(j.dir, name)
	old, err := os.ReadFile(path)
	switch {
	case len(content) == 0:
		if errors.Is(err, fs.ErrNotExist) {
			return nil
		}
		if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return err
		}
		return nil
	case err == nil && string(old) == string(content):
		return nil
	}
	return atomicfile.WriteMode(path, content, 0o644)
}

func (j *jobMap) reportLocked(err error) {
	switch {
	case err == nil && j.failing != "":
		j.log.Info("DCGM job mapping works again", "dir", j.dir)
		j.failing = ""
	case err != nil && j.failing == "":
		j.failing = err.Error()
		j.log.Error("cannot write the DCGM job mapping; leases are enforced all the same, and this is not reported again until it works",
			"dir", j.dir, "err", err)
	}
}
