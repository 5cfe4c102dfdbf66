package broker

import (
	"errors"
	"fmt"
	"slices"
	"sync"
	"syscall"
	"time"

	"github.com/hashicorp/raft"
)

// ErrDiskFull means the data dir's file system has too little space left
// for the Raft log: writes are refused until space returns, and the
// server resumes by itself then.
var ErrDiskFull = errors.New("data dir disk full")

// DiskFullError says how full the data dir is.
type DiskFullError struct {
	Dir        string
	FreeMiB    uint64
	ReserveMiB uint64
	WriteErr   error // the write's own error (ENOSPC), when it got that far
}

func (e *DiskFullError) Error() string {
	if e.WriteErr != nil {
		return fmt.Sprintf("broker data dir %s: disk full: writing the Raft log: %v; free space there and the broker resumes by itself", e.Dir, e.WriteErr)
	}
	return fmt.Sprintf("broker data dir %s: disk full: %d MiB free, below the reserve of %d MiB (--disk-reserve); free space there and the broker resumes by itself", e.Dir, e.FreeMiB, e.ReserveMiB)
}

func (e *DiskFullError) Unwrap() error { return ErrDiskFull }

// Defaults of the disk checks.
const (
	// DefaultDiskReserveMiB is the free space below which the Raft log
	// refuses writes, so that the small writes Raft cannot survive failing
	// (its term and vote) still find room.
	DefaultDiskReserveMiB = 64
	// DefaultSlowDiskThreshold is the median Raft log write time above
	// which a leader hands leadership to a follower.
	DefaultSlowDiskThreshold = 200 * time.Millisecond
	// slowDiskWindow is how far back the median looks, and
	// slowDiskMinWrites how many writes it needs there.
	slowDiskWindow    = 5 * time.Second
	slowDiskMinWrites = 3
	// slowDiskCooldown is how long a server that handed leadership over
	// for its slow disk waits before it would do it again.
	slowDiskCooldown = 30 * time.Second
)

// diskLog is the Raft log store with the data dir's disk checks, and it
// times every write for the slow-disk check. It keeps two thresholds:
//
//   - checkSpace, which the proposer asks before a command enters Raft,
//     refuses new commands while less than the reserve is free;
//   - StoreLogs refuses a write only below half the reserve (a
//     *DiskFullError, before bbolt runs out of room mid-write).
//
// A write the log refuses makes a Raft leader step down, and a lone
// broker then has no leader until space returns: every client waits out
// its deadline instead of hearing "disk full". The half of the reserve
// between the two is room for what was admitted and is still on its way
// to the log (a batch of small entries), and for Raft's own entries
// (no-op, barrier, configuration), which no proposer checks. So an
// admitted command is never refused by the log, and a full disk is
// answered at once with Unavailable, however the writes interleave.
type diskLog struct {
	raft.LogStore
	dir        string
	reserveMiB uint64
	observe    func(time.Duration) // the write-time histogram
	// freeMiB reads the space free to unprivileged writers in dir;
	// statfs, but for tests.
	freeMiB func(dir string) (uint64, error)

	mu     sync.Mutex
	writes []timedWrite // guarded by mu; the last slowDiskWindow's
}

type timedWrite struct {
	at   time.Time
	took time.Duration
}

func (d *diskLog) StoreLog(l *raft.Log) error { return d.StoreLogs([]*raft.Log{l}) }

func (d *diskLog) StoreLogs(logs []*raft.Log) error {
	if err := d.below(d.reserveMiB / 2); err != nil {
		return err
	}
	start := time.Now()
	err := d.LogStore.StoreLogs(logs)
	took := time.Since(start)
	d.record(start, took)
	if errors.Is(err, syscall.ENOSPC) {
		return &DiskFullError{Dir: d.dir, WriteErr: err}
	}
	return err
}

// checkSpace returns a *DiskFullError while the file system holding the
// data dir has less than the reserve free: the proposer asks it before
// every command. It looks at the disk each time (one statfs, about a
// microsecond, small beside a commit); a cached answer would admit
// commands for a while after the disk filled.
func (d *diskLog) checkSpace() error { return d.below(d.reserveMiB) }

// below returns a *DiskFullError, naming the reserve, while less than
// floorMiB is free; nil when the reserve is off or statfs fails (the write
// itself then says what is wrong).
func (d *diskLog) below(floorMiB uint64) error {
	if d.reserveMiB == 0 {
		return nil
	}
	free, err := d.free()
	if err != nil {
		return nil
	}
	if free < floorMiB {
		return &DiskFullError{Dir: d.dir, FreeMiB: free, ReserveMiB: d.reserveMiB}
	}
	return nil
}

func (d *diskLog) free() (uint64, error) {
	if d.freeMiB != nil {
		return d.freeMiB(d.dir)
	}
	return statfsFreeMiB(d.dir)
}

// statfsFreeMiB is the space in MiB free to unprivileged writers on the
// file system holding dir.
func statfsFreeMiB(dir string) (uint64, error) {
	var st syscall.Statfs_t
	if err := syscall.Statfs(dir, &st); err != nil {
		return 0, err
	}
	return st.Bavail * uint64(st.Bsize) >> 20, nil
}

func (d *diskLog) record(at time.Time, took time.Duration) {
	if d.observe != nil {
		d.observe(took)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	d.writes = append(d.writes, timedWrite{at, took})
	cut := 0
	for cut < len(d.writes) && at.Sub(d.writes[cut].at) > slowDiskWindow {
		cut++
	}
	d.writes = d.writes[cut:]
}

// medianWrite is the median time of the writes of the last
// slowDiskWindow made since since, and false when there were too few to
// tell.
func (d *diskLog) medianWrite(now, since time.Time) (time.Duration, bool) {
	d.mu.Lock()
	var took []time.Duration
	for _, w := range d.writes {
		if now.Sub(w.at) <= slowDiskWindow && !w.at.Before(since) {
			took = append(took, w.took)
		}
	}
	d.mu.Unlock()
	if len(took) < slowDiskMinWrites {
		return 0, false
	}
	slices.Sort(took)
	return took[len(took)/2], true
}

// watchDisk hands leadership to a follower while this server leads with a
// disk that cannot keep up:
//
//   - a full data dir (below Config.DiskReserveMiB free): the leader
//     refuses every write, whereas a follower with room could take them,
//     so it hands leadership over at once, again every fullDiskRetry while
//     the disk stays full and it leads (the new leader may be just as
//     full). The server keeps its data and catches up by itself once
//     space returns;
//   - Raft log writes slower than Config.SlowDiskThreshold (the median of
//     the last few seconds): every grant waits for the leader's own write,
//     so a slow leader slows the whole cluster, whereas a slow follower is
//     outvoted by the others. It waits slowDiskCooldown before doing it
//     again, so that a cluster whose disks are all slow does not hand
//     leadership round in circles.
func (s *Server) watchDisk() {
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	var last, lastFull, led time.Time
	for {
		select {
		case <-s.ctx.Done():
			return
		case <-tick.C:
		}
		now := time.Now()
		if !s.IsLeader() {
			led = time.Time{}
			continue
		}
		if led.IsZero() {
			led = now // count only the writes made while leading
		}
		if err := s.disk.checkSpace(); err != nil && now.Sub(lastFull) >= fullDiskRetry {
			if s.handOver(func() {
				s.log.Warn("this broker's data dir is full: handing leadership to a follower", "err", err)
				s.metrics.fullDiskTransfers.Inc()
			}) {
				lastFull = now
			}
			continue
		}
		if s.cfg.SlowDiskThreshold <= 0 || now.Sub(last) < slowDiskCooldown || now.Sub(led) < slowDiskWindow {
			// A new leader judges its disk over a whole window of its
			// own writes, so that leadership moves at most once a
			// window even when every disk of the cluster is slow.
			continue
		}
		median, ok := s.disk.medianWrite(now, led)
		if !ok || median < s.cfg.SlowDiskThreshold {
			continue
		}
		if s.handOver(func() {
			s.log.Warn("this broker's disk is slow: handing leadership to a follower",
				"median_log_write", median, "threshold", s.cfg.SlowDiskThreshold, "data_dir", s.cfg.DataDir)
			s.metrics.slowDiskTransfers.Inc()
		}) {
			last = now
		}
	}
}

// fullDiskRetry is how long a leader on a full disk waits before it hands
// leadership over again.
const fullDiskRetry = 10 * time.Second

// handOver transfers leadership to a follower, after say, and reports
// whether it tried: not when there is nobody to hand it to.
func (s *Server) handOver(say func()) bool {
	if len(s.raft.GetConfiguration().Configuration().Servers) < 2 {
		return false
	}
	say()
	if err := s.raft.LeadershipTransfer().Error(); err != nil {
		s.log.Warn("handing leadership over failed", "err", err)
	}
	return true
}
