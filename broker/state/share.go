package state

import (
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// A lease repeats what many other leases hold: its tenant and holder, the
// actor that granted or ended it, each slice's host, device and model.
// Decoded from a command or a snapshot, each is a copy of its own; the
// state keeps one of each instead (about 150 bytes a lease). Only equal
// values are shared, so a lease's content does not change, and records
// read from the store are never modified in place (see the package doc),
// so a shared actor is never changed under another lease.

// maxSharedActors bounds the actors kept to share: actors are ACL
// identities, few in a cluster; past the bound new ones are kept as they
// are.
const maxSharedActors = 4096

// sharer holds the one copy of each shared value. It is the writer's: only
// the FSM, from Apply and Restore, uses it.
type sharer struct {
	actors map[[2]string]*gpupoolv1.Actor
}

func (s *sharer) actor(a *gpupoolv1.Actor) *gpupoolv1.Actor {
	if a == nil || len(a.ProtoReflect().GetUnknown()) > 0 {
		return a
	}
	key := [2]string{a.AccessorId, a.Name}
	if x, ok := s.actors[key]; ok {
		return x
	}
	if s.actors == nil {
		s.actors = map[[2]string]*gpupoolv1.Actor{}
	}
	if len(s.actors) < maxSharedActors {
		s.actors[key] = a
	}
	return a
}

// ShareLease points what a lease about to be written repeats at the
// copies the state already holds: its request's tenant, holder and
// request id at the lease's own, its actors at equal actors of other
// leases, and its slices' host, device and model at the devices'.
func (w *Writer) ShareLease(l *gpupoolv1.Lease) {
	w.shareLease(l, func(uuid string) *gpupoolv1.Device { return w.Device(uuid) })
}

func (w *Writer) shareLease(l *gpupoolv1.Lease, device func(uuid string) *gpupoolv1.Device) {
	share := func(dst *string, src string) {
		if *dst == src {
			*dst = src
		}
	}
	if r := l.Request; r != nil {
		share(&r.Tenant, l.Tenant)
		share(&r.Holder, l.Holder)
		share(&r.RequestId, l.RequestId)
	}
	if w.share != nil {
		l.GrantedBy = w.share.actor(l.GrantedBy)
		l.EndedBy = w.share.actor(l.EndedBy)
	}
	for _, s := range l.Slices {
		if d := device(s.Device); d != nil {
			share(&s.Device, d.Uuid)
			share(&s.Model, d.Model)
			share(&s.Host, d.HostId)
		}
	}
}
