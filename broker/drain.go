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
// same and not yet forced, so each deadline revokes once.

// reactDrain arms, moves or stops h's drain deadline timer to match its
// drain record.
func (s *Server) reactDrain(ls *leaderState, h *gpupoolv1.Host) {
	d := h.GetDrain()
	if d == nil || d.DeadlineMs == 0 || d.Force {
		ls.drain.Stop(h.Id)
		return
	}
	at := time.UnixMilli(d.DeadlineMs)
	if cur, ok := ls.drain.Deadline(h.Id); ok && cur.Equal(at) {
		return
	}
	ls.drain.Reset(h.Id, max(0, at.Sub(s.cfg.Clock.Now())))
}

// drainDeadlinePassed revokes every lease still on a host whose drain
// deadline passed.
func (s *Server) drainDeadlinePassed(hostID string) {
	h := s.fsm.State().Host(hostID)
	d := h.GetDrain()
	if d == nil || d.DeadlineMs == 0 || d.Force {
		return
	}
	_, err := s.apply(&gpupoolv1.DrainHostCommand{HostId: hostID, Force: true, IfDeadlineMs: d.DeadlineMs, NowMs: s.nowMs()})
	s.logTimerErr("revoke leases at the drain deadline", hostID, err)
	if err == nil {
		s.log.Info("drain deadline passed: leases on the host revoked", "host", hostID)
	}
}
