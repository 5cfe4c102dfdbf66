package broker

import (
	"errors"
	"fmt"
	"time"

	"github.com/gpupool/gpupool/broker/fsm"
	"github.com/gpupool/gpupool/broker/state"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// Ended leases (released, expired, revoked) stay readable for a while: a
// holder reads how its lease ended, and a retry of its request finds it
// instead of acquiring again. Then the leader collects them through Raft
// (CollectEndedLeases), so that churn does not grow the state, the
// snapshots or the restart time. A lease is kept for at most
// EndedLeaseRetention after it ended, and at most EndedLeasesMax ended
// leases are kept at once (the oldest go first). Audit entries are not
// affected.

// Defaults and bounds of the collection of ended leases.
const (
	DefaultEndedLeaseRetention = time.Hour
	DefaultEndedLeasesMax      = 10_000

	MinEndedLeaseRetention = time.Second
	MaxEndedLeaseRetention = 30 * 24 * time.Hour
	MaxEndedLeasesMax      = 10_000_000

	// collectEvery is the longest the leader waits between two passes
	// (or EndedLeaseRetention, when shorter); a pass also runs once a
	// quarter of EndedLeasesMax leases ended since the last one.
	collectEvery = 10 * time.Second
)

// validateCollection checks and defaults the collection settings; a zero
// value takes the default.
func (c *Config) validateCollection() error {
	switch {
	case c.EndedLeaseRetention == 0:
		c.EndedLeaseRetention = DefaultEndedLeaseRetention
	case c.EndedLeaseRetention < MinEndedLeaseRetention || c.EndedLeaseRetention > MaxEndedLeaseRetention:
		return fmt.Errorf("broker: --ended-lease-retention %s: must be between %s and %s", c.EndedLeaseRetention, MinEndedLeaseRetention, MaxEndedLeaseRetention)
	}
	switch {
	case c.EndedLeasesMax == 0:
		c.EndedLeasesMax = DefaultEndedLeasesMax
	case c.EndedLeasesMax < 1 || c.EndedLeasesMax > MaxEndedLeasesMax:
		return fmt.Errorf("broker: --ended-leases-max %d: must be between 1 and %d", c.EndedLeasesMax, MaxEndedLeasesMax)
	}
	return nil
}

// endedToCollect returns the ended leases of st to collect at nowMs, at
// most limit of them, oldest end first: those that ended more than
// retention ago, and the oldest beyond keep. A lease that cannot leave
// yet (an elastic parent with an extra still live) is passed over, and
// the next one is looked at instead, so that such leases never stall the
// collection. cutoffMs is when the newest of them ended (0 when there
// are none).
func endedToCollect(st *state.Reader, nowMs int64, retention time.Duration, keep, limit int) (ids []string, cutoffMs int64) {
	type ended struct {
		id   string
		atMs int64
	}
	var all []ended
	st.EndedLeases(func(l *gpupoolv1.Lease) bool {
		all = append(all, ended{l.Id, l.StateChangedAtMs})
		return true
	})

	excess := len(all) - keep
	oldest := nowMs - retention.Milliseconds()
	for _, e := range all {
		// Once excess leases are chosen, only those past the retention
		// are; a lease that cannot leave yet counts among those kept.
		if len(ids) == limit || (len(ids) >= excess && e.atMs > oldest) {
			break
		}
		if st.HoldingExtras(e.id) {
			continue
		}
		ids = append(ids, e.id)
		cutoffMs = e.atMs
	}
	return ids, cutoffMs
}

// noteEnded counts a lease that ended, and asks for a pass of the
// collection once a quarter of the ended leases the state keeps ended
// since the last pass.
func (ld *leadership) noteEnded(ls *leaderState) {
	if ls.endedSinceCollect.Add(1) >= int64(max(1, ld.cfg.EndedLeasesMax/4)) {
		select {
		case ls.collectKick <- struct{}{}:
		default:
		}
	}
}

// collectEnded runs passes of the collection while this server leads:
// every collectEvery, and when noteEnded asks.
func (ld *leadership) collectEnded(ls *leaderState) {
	for {
		ls.endedSinceCollect.Store(0)
		ld.collectEndedPass(ls)
		t := ld.cfg.Clock.AfterFunc(min(collectEvery, ld.cfg.EndedLeaseRetention), func() {
			select {
			case ls.collectKick <- struct{}{}:
			default:
			}
		})
		select {
		case <-ls.stopCh:
			t.Stop()
			return
		case <-ls.collectKick:
			t.Stop()
		}
	}
}

// collectEndedPass proposes CollectEndedLeases commands until nothing is
// left to collect now. A command the cluster cannot apply yet (a broker
// older than command-set version 3) is retried at the next pass.
func (ld *leadership) collectEndedPass(ls *leaderState) {
	for {
		select {
		case <-ls.stopCh:
			return
		default:
		}
		ids, cutoff := endedToCollect(ld.fsm.State(), ld.nowMs(), ld.cfg.EndedLeaseRetention, ld.cfg.EndedLeasesMax, fsm.MaxCollectedPerCommand)
		if len(ids) == 0 {
			return
		}
		res, err := ld.apply(&gpupoolv1.CollectEndedLeasesCommand{LeaseIds: ids, EndedAtOrBeforeMs: cutoff})
		if errors.Is(err, ErrPrecondition) {
			ld.log.Debug("collecting ended leases waits for every broker to be upgraded", "err", err)
			return
		}
		if err != nil {
			ld.log.Warn("collecting ended leases failed; retrying at the next pass", "err", err)
			return
		}
		ld.metrics.collectedLeases.Add(float64(res.Collected))
		if res.Collected == 0 {
			return // what is left cannot go yet (an extra still holds)
		}
	}
}
