package fsm

import (
	"cmp"
	"errors"
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

func TestDrainCommandsKeepTheDrainRecordConsistent(t *testing.T) {
	const deadline, later = 100_000, 200_000
	drain := func(c *gpupoolv1.DrainHostCommand) *gpupoolv1.DrainHostCommand {
		c.HostId, c.NowMs = "h1", 5000
		return c
	}
	disable := &gpupoolv1.SetHostEligibilityCommand{HostId: "h1", NowMs: 5000}
	enable := &gpupoolv1.SetHostEligibilityCommand{HostId: "h1", Eligible: true, NowMs: 6000}
	down := &gpupoolv1.SetHostStatusCommand{HostId: "h1", Status: gpupoolv1.HostStatus_HOST_STATUS_DOWN, Reason: "no heartbeat", NowMs: 5500}
	// A host the state has never seen, whose agent sends a drain.
	newWithDrain := func() *gpupoolv1.RegisterHostCommand {
		c := host("h2", 0)
		c.Host.Drain = &gpupoolv1.HostDrain{DeadlineMs: deadline, Reason: "sent by the agent"}
		c.Host.Status = gpupoolv1.HostStatus_HOST_STATUS_DRAINING
		return c
	}
	for _, tc := range []struct {
		name     string
		log      []proto.Message // after host h1 registers with lease l-1 on it
		err      string          // of the last command
		id       string          // the host checked; h1 if empty
		status   gpupoolv1.HostStatus
		drain    *gpupoolv1.HostDrain
		eligible bool
	}{
		{"keep_deadline keeps the deadline of a drain under way and takes the new reason",
			[]proto.Message{drain(&gpupoolv1.DrainHostCommand{DeadlineMs: deadline, Reason: "kernel"}), drain(&gpupoolv1.DrainHostCommand{DeadlineMs: later, KeepDeadline: true, Reason: "firmware"})},
			"", "", gpupoolv1.HostStatus_HOST_STATUS_DRAINING, &gpupoolv1.HostDrain{StartedAtMs: 5000, DeadlineMs: deadline, Reason: "firmware"}, false},
		{"keep_deadline keeps no deadline too",
			[]proto.Message{drain(&gpupoolv1.DrainHostCommand{Reason: "kernel"}), drain(&gpupoolv1.DrainHostCommand{DeadlineMs: later, KeepDeadline: true})},
			"", "", gpupoolv1.HostStatus_HOST_STATUS_DRAINING, &gpupoolv1.HostDrain{StartedAtMs: 5000, Reason: "kernel"}, false},
		{"keep_deadline on a host not draining starts a drain with the deadline given",
			[]proto.Message{drain(&gpupoolv1.DrainHostCommand{DeadlineMs: later, KeepDeadline: true, Reason: "firmware"})},
			"", "", gpupoolv1.HostStatus_HOST_STATUS_DRAINING, &gpupoolv1.HostDrain{StartedAtMs: 5000, DeadlineMs: later, Reason: "firmware"}, false},
		{"without keep_deadline a new deadline replaces the old",
			[]proto.Message{drain(&gpupoolv1.DrainHostCommand{DeadlineMs: deadline}), drain(&gpupoolv1.DrainHostCommand{DeadlineMs: later})},
			"", "", gpupoolv1.HostStatus_HOST_STATUS_DRAINING, &gpupoolv1.HostDrain{StartedAtMs: 5000, DeadlineMs: later, Reason: "drain requested"}, false},
		{"keep_deadline with force is invalid",
			[]proto.Message{drain(&gpupoolv1.DrainHostCommand{Force: true, KeepDeadline: true})},
			"invalid command", "", gpupoolv1.HostStatus_HOST_STATUS_READY, nil, true},
		{"cancel of a disabled host that is not draining leaves it disabled",
			[]proto.Message{disable, drain(&gpupoolv1.DrainHostCommand{Cancel: true})},
			"host h1 is not draining", "", gpupoolv1.HostStatus_HOST_STATUS_READY, nil, false},
		{"cancel of a draining host makes it ready and eligible",
			[]proto.Message{drain(&gpupoolv1.DrainHostCommand{}), drain(&gpupoolv1.DrainHostCommand{Cancel: true})},
			"", "", gpupoolv1.HostStatus_HOST_STATUS_READY, nil, true},
		{"enabling a draining host is refused",
			[]proto.Message{drain(&gpupoolv1.DrainHostCommand{DeadlineMs: deadline}), enable},
			"host h1 is draining and not drained yet: cancel the drain with 'gpupool host drain h1 --cancel'", "", gpupoolv1.HostStatus_HOST_STATUS_DRAINING,
			&gpupoolv1.HostDrain{StartedAtMs: 5000, DeadlineMs: deadline, Reason: "drain requested"}, false},
		{"enabling a host that went down while draining is refused and keeps the drain",
			[]proto.Message{drain(&gpupoolv1.DrainHostCommand{DeadlineMs: deadline}), down, enable},
			"host h1 is down and not drained yet", "", gpupoolv1.HostStatus_HOST_STATUS_DOWN,
			&gpupoolv1.HostDrain{StartedAtMs: 5000, DeadlineMs: deadline, Reason: "drain requested"}, false},
		{"a first registration drops a drain the agent sent",
			[]proto.Message{newWithDrain()},
			"", "h2", gpupoolv1.HostStatus_HOST_STATUS_READY, nil, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := New(nil)
			res := applyAll(t, f, append([]proto.Message{host("h1", 1), grant("l-1", "h1", 0, 1024, 10)}, tc.log...))
			for i, r := range res[:len(res)-1] {
				if r.Err != nil {
					t.Fatalf("setup command %d: %v", i, r.Err)
				}
			}
			err := res[len(res)-1].Err
			if (tc.err == "") != (err == nil) || (err != nil && !strings.Contains(err.Error(), tc.err)) {
				t.Fatalf("last command: got %v, want %q", err, tc.err)
			}
			var pe *PreconditionError
			if strings.Contains(tc.err, "not draining") || strings.Contains(tc.err, "not drained") {
				if !errors.As(err, &pe) {
					t.Fatalf("error %v is a %T, want a *PreconditionError (FailedPrecondition)", err, err)
				}
			}
			h := f.State().Host(cmp.Or(tc.id, "h1"))
			if h.Status != tc.status || h.Eligible != tc.eligible || !proto.Equal(h.Drain, tc.drain) {
				t.Fatalf("host: got %v eligible=%t drain=%v, want %v eligible=%t drain=%v", h.Status, h.Eligible, h.Drain, tc.status, tc.eligible, tc.drain)
			}
		})
	}
}
