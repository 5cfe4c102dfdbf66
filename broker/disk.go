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

// diskLog is the Raft log store with the data dir's disk checks: it
// refuses writes while the file system has less than the reserve free
// (a *DiskFullError, before bbolt runs out of room mid-write), and it
// times every write for the slow-disk check.
type diskLog struct {
	raft.LogStore
	dir        string
	reserveMiB uint64
	observe    func(time.Duration) // the write-time histogram

	mu     sync.Mutex
	writes []timedWrite // guarded by mu; the last slowDiskWindow's
}

type timedWrite struct {
	at   time.Time
	took time.Duration
}

func (d *diskLog) StoreLog(l *raft.Log) error { return d.StoreLogs([]*raft.Log{l}) }

func (d *diskLog) StoreLogs(logs []*raft.Log) error {
	if err := d.checkSpace(); err != nil {
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
// data dir has less than the reserve free. The proposer asks it before
// every command, and it looks at the disk each time (one statfs, about a
// microsecond, small beside a commit): a cached answer let a proposal
// made just after the disk filled reach Raft, whose leader steps down
// when its own log write fails.
func (d *diskLog) checkSpace() error {
	if d.reserveMiB == 0 {
		return nil
	}
	var st syscall.Statfs_t
	if err := syscall.Statfs(d.dir, &st); err != nil {
		return nil // the write itself will say what is wrong
	}
	free := st.Bavail * uint64(st.Bsize) >> 20
	if free < d.reserveMiB {
		return &DiskFullError{Dir: d.dir, FreeMiB: free, ReserveMiB: d.reserveMiB}
	}
	return nil
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
