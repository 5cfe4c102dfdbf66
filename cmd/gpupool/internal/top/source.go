// Package top is the view model of 'gpupool top': it folds what the
// brokers report (hosts, the pool's status, lease changes, the pending
// queue, the audit log) into a State, derives the rows to show under a
// sort and filters (View), and lays them out for a terminal of a given
// size (Render). Only the Source does I/O; everything else is a pure
// function of the updates it sent, so the package is tested without a
// terminal or a cluster.
package top

import (
	"context"
	"time"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// Source feeds the view with updates from the brokers.
//
// Run sends updates on out until ctx is done, then returns; it never
// closes out. A failing call or stream is reported as an ErrorUpdate and
// retried: Run gives up only with its context. What a Source sends is
// what the caller's credentials may see: the brokers filter by the token.
//
// GRPCSource is the one implementation: it follows the lease watch and
// the audit log, and polls hosts, the status and the queue. A Source over
// host, device and queue watch streams replaces it without touching the
// rest of the package.
type Source interface {
	Run(ctx context.Context, out chan<- Update)
}

// Update is one fact a Source learned. Applying the updates in the order
// sent rebuilds what the brokers hold (State.Apply).
type Update interface{ isUpdate() }

// HostsUpdate replaces every host (with its devices and live readings).
type HostsUpdate struct{ Hosts []*gpupoolv1.Host }

// StatusUpdate replaces the pool's totals and leader.
type StatusUpdate struct{ Status *gpupoolv1.StatusResponse }

// QueueUpdate replaces the pending queue (leases with their why-pending).
type QueueUpdate struct{ Pending []*gpupoolv1.Lease }

// LeasesReset says a new lease watch starts: the snapshot that follows
// replaces every lease known so far.
type LeasesReset struct{}

// LeaseUpdate is one event of the lease watch.
type LeaseUpdate struct{ Event *gpupoolv1.LeaseEvent }

// AuditUpdate is one entry of the audit log.
type AuditUpdate struct{ Entry *gpupoolv1.AuditEntry }

// ErrorUpdate reports that what (e.g. "hosts", "lease watch") failed, or,
// with a nil Err, that it works again.
type ErrorUpdate struct {
	What string
	Err  error
}

// Tick carries no data; it moves the clock of ages and countdowns.
type Tick struct{ Now time.Time }

func (HostsUpdate) isUpdate()  {}
func (StatusUpdate) isUpdate() {}
func (QueueUpdate) isUpdate()  {}
func (LeasesReset) isUpdate()  {}
func (LeaseUpdate) isUpdate()  {}
func (AuditUpdate) isUpdate()  {}
func (ErrorUpdate) isUpdate()  {}
func (Tick) isUpdate()         {}
