package agent

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"time"

	"google.golang.org/protobuf/encoding/protojson"

	"github.com/gpupool/gpupool/internal/atomicfile"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// leaseFileVersion is the format of a lease state file. A file of another
// version is quarantined, like a corrupt one.
const leaseFileVersion = 1

// leaseFiles keeps one small state file per enforced lease under
// DATA_DIR/leases, so that a restarted agent goes on enforcing what it
// enforced before, even while the brokers are unreachable. Files are
// replaced atomically (write, fsync, rename, fsync the directory): after
// a crash a file is either the old or the new version, never a mix. A
// file that still cannot be read is moved to DATA_DIR/quarantine with a
// message, and the brokers' next assignment list restores the lease.
type leaseFiles struct {
	dir, quarantine string
}

// leaseRecord is what a lease file holds.
type leaseRecord struct {
	Assignment *gpupoolv1.Assignment
	// Deadline is when the lease expires as far as this agent knows: it
	// moves forward with every heartbeat response that lists the lease.
	Deadline time.Time
}

type leaseFileJSON struct {
	Version    int             `json:"version"`
	Assignment json.RawMessage `json:"assignment"`
	DeadlineMs int64           `json:"deadline_unix_ms"`
}

// quarantined is a lease file that could not be read.
type quarantined struct {
	File, MovedTo string
	Err           error
}

// validLeaseID is what a lease id may look like to become a file name.
var validLeaseID = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$`)

// openLeaseFiles creates the directories under dataDir (mode 0700).
func openLeaseFiles(dataDir string) (*leaseFiles, error) {
	f := &leaseFiles{dir: filepath.Join(dataDir, "leases"), quarantine: filepath.Join(dataDir, "quarantine")}
	for _, d := range []string{f.dir, f.quarantine} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return nil, fmt.Errorf("agent: data dir: %w", err)
		}
	}
	return f, nil
}

func (f *leaseFiles) path(id string) string { return filepath.Join(f.dir, id+".json") }

// put writes rec's file, replacing any earlier one atomically.
func (f *leaseFiles) put(rec leaseRecord) error {
	id := rec.Assignment.GetLeaseId()
	if !validLeaseID.MatchString(id) {
		return fmt.Errorf("agent: lease id %q: cannot name a state file", id)
	}
	a, err := protojson.Marshal(rec.Assignment)
	if err != nil {
		return fmt.Errorf("agent: encode lease %s: %w", id, err)
	}
	b, err := json.MarshalIndent(leaseFileJSON{Version: leaseFileVersion, Assignment: a, DeadlineMs: rec.Deadline.UnixMilli()}, "", "  ")
	if err != nil {
		return fmt.Errorf("agent: encode lease %s: %w", id, err)
	}
	return atomicfile.Write(f.path(id), append(b, '\n'))
}

// remove deletes a lease's file; a missing file is not an error.
func (f *leaseFiles) remove(id string) error {
	if !validLeaseID.MatchString(id) {
		return nil
	}
	if err := os.Remove(f.path(id)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("agent: remove state of lease %s: %w", id, err)
	}
	return nil
}

// load reads every lease file, sorted by lease id. Files it cannot read
// are moved to the quarantine directory and reported, never fatal.
// Leftover temporary files of an interrupted write are removed.
func (f *leaseFiles) load() ([]leaseRecord, []quarantined, error) {
	entries, err := os.ReadDir(f.dir)
	if err != nil {
		return nil, nil, fmt.Errorf("agent: read lease state: %w", err)
	}
	var (
		recs []leaseRecord
		bad  []quarantined
	)
	for _, e := range entries {
		name := e.Name()
		p := filepath.Join(f.dir, name)
		if strings.HasPrefix(name, ".tmp-") {
			os.Remove(p)
			continue
		}
		rec, err := readLeaseFile(p)
		if err == nil && rec.Assignment.LeaseId+".json" != name {
			err = fmt.Errorf("holds lease %q, not the one its name says", rec.Assignment.LeaseId)
		}
		if err != nil {
			q := quarantined{File: p, Err: err}
			// The wall clock, not the agent's: a unique name, not a time.
			q.MovedTo = filepath.Join(f.quarantine, fmt.Sprintf("%s.%d", name, time.Now().UnixNano()))
			if mvErr := os.Rename(p, q.MovedTo); mvErr != nil {
				return nil, nil, fmt.Errorf("agent: quarantine %s (%v): %w", p, err, mvErr)
			}
			bad = append(bad, q)
			continue
		}
		recs = append(recs, rec)
	}
	slices.SortFunc(recs, func(a, b leaseRecord) int { return strings.Compare(a.Assignment.LeaseId, b.Assignment.LeaseId) })
	return recs, bad, nil
}

func readLeaseFile(p string) (leaseRecord, error) {
	b, err := os.ReadFile(p)
	if err != nil {
		return leaseRecord{}, err
	}
	var j leaseFileJSON
	dec := json.NewDecoder(strings.NewReader(string(b)))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&j); err != nil {
		return leaseRecord{}, fmt.Errorf("not a lease state file: %w", err)
	}
	if j.Version != leaseFileVersion {
		return leaseRecord{}, fmt.Errorf("version %d: this agent reads version %d", j.Version, leaseFileVersion)
	}
	a := &gpupoolv1.Assignment{}
	if err := protojson.Unmarshal(j.Assignment, a); err != nil {
		return leaseRecord{}, fmt.Errorf("assignment: %w", err)
	}
	if !validLeaseID.MatchString(a.LeaseId) || len(a.Slices) == 0 {
		return leaseRecord{}, fmt.Errorf("assignment: lease id %q with %d slices: want an id and at least one slice", a.LeaseId, len(a.Slices))
	}
	return leaseRecord{Assignment: a, Deadline: time.UnixMilli(j.DeadlineMs)}, nil
}
