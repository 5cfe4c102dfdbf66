package broker

import (
	"time"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// The drainer runs on the leader. Everything it needs is in the state
// (Host.drain): the leader arms one timer per drain deadline from it, and a
// new leader re-arms them the same way, so a deadline survives failover.
// When a deadline passes the leader submits a forced drain guarded by that
// deadline (if_deadline_ms); Apply ignores it unless the drain is still the
// same and not yet forced, so each deadline revokes once. If that command
// fails to commit (leadership transfer, enqueue timeout), the leader re-arms
// the timer with backoff for as long as it leads: nothing else would.

// Backoff of the retries of a deadline's revocation, as retryWhileLeading.
const (
	drainRetryMin = 50 * time.Millisecond
	drainRetryMax = 2 * time.Second
)

// drainRetry is a pending retry of the revocation at a drain's deadline.
type drainRetry struct {
	deadlineMs int64         // the drain deadline it is for
	backoff    time.Duration // the wait before it
}

// retryingDrain reports whether host's drain timer is a retry for the
// drain deadline deadlineMs.
func (ls *leaderState) retryingDrain(host string, deadlineMs int64) bool {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	r, ok := ls.drainRetry[host]
	return ok && r.deadlineMs == deadlineMs
}

// nextDrainRetry returns the wait before the next retry for host's drain
// deadline deadlineMs, doubling from drainRetryMin up to drainRetryMax.
func (ls *leaderState) nextDrainRetry(host string, deadlineMs int64) time.Duration {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	r, ok := ls.drainRetry[host]
	if !ok || r.deadlineMs != deadlineMs {
		r = drainRetry{deadlineMs: deadlineMs, backoff: drainRetryMin}
	} else {
		r.backoff = min(2*r.backoff, drainRetryMax)
	}
	ls.drainRetry[host] = r
	return r.backoff
}

func (ls *leaderState) forgetDrainRetry(host string) {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	delete(ls.drainRetry, host)
}

// reactDrain arms, moves or stops h's drain deadline timer to match its
// drain record. A retry already armed for the same deadline is left alone.
func (ld *leadership) reactDrain(ls *leaderState, h *gpupoolv1.Host) {
	d := h.GetDrain()
	if d == nil || d.DeadlineMs == 0 || d.Force {
		ls.drain.Stop(h.Id)
		ls.forgetDrainRetry(h.Id)
		return
	}
	at := time.UnixMilli(d.DeadlineMs)
	if cur, ok := ls.drain.Deadline(h.Id); ok && (cur.Equal(at) || ls.retryingDrain(h.Id, d.DeadlineMs)) {
		return
	}
	ls.forgetDrainRetry(h.Id)
	ls.drain.Reset(h.Id, max(0, at.Sub(ld.cfg.Clock.Now())))
}

// drainDeadlinePassed revokes every lease still on a host whose drain
// deadline passed. When the command does not commit it tries again, with
// backoff, while ls leads.
func (ld *leadership) drainDeadlinePassed(ls *leaderState, hostID string) {
	h := ld.fsm.State().Host(hostID)
	d := h.GetDrain()
	if d == nil || d.DeadlineMs == 0 || d.Force {
		ls.forgetDrainRetry(hostID)
		return
	}
	now := ld.cfg.Clock.Now()
	if at := time.UnixMilli(d.DeadlineMs); now.Before(at) {
		// A retry that outlived a change of the deadline: wait for the new one.
		ls.forgetDrainRetry(hostID)
		ls.drain.Reset(hostID, at.Sub(now))
		return
	}
	res, err := ld.apply(&gpupoolv1.DrainHostCommand{HostId: hostID, Force: true, IfDeadlineMs: d.DeadlineMs, NowMs: now.UnixMilli()})
	switch {
	case err == nil:
		ls.forgetDrainRetry(hostID)
		ld.log.Info("drain deadline passed: leases on the host revoked", "host", hostID)
		return
	case res != nil:
		// Apply refused it: the same command would be refused again.
		ls.forgetDrainRetry(hostID)
		ld.log.Warn("revoking the leases at the drain deadline failed", "host", hostID, "err", err)
		return
	}
	select {
	case <-ls.stopCh:
		// Leadership ended; the next leader re-arms the deadline.
		ld.logTimerErr("revoke leases at the drain deadline", hostID, err)
		return
	default:
	}
	backoff := ls.nextDrainRetry(hostID, d.DeadlineMs)
	ld.log.Warn("revoking the leases at the drain deadline failed; retrying", "host", hostID, "err", err, "retry_in", backoff)
	ls.drain.Reset(hostID, backoff)
}
