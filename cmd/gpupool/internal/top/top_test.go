package top

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/mattn/go-runewidth"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

var t0 = time.Date(2026, 11, 25, 18, 0, 0, 0, time.UTC)

func device(host string, i int, model string, allocMiB int64, allocPct int32, util int32) *gpupoolv1.Device {
	return &gpupoolv1.Device{Uuid: fmt.Sprintf("GPU-%s-%d", host, i), Index: int32(i), Model: model, MemoryMib: 81920, HostId: host,
		Health: gpupoolv1.DeviceHealth_DEVICE_HEALTH_HEALTHY, AllocatedMemoryMib: allocMiB, AllocatedComputePercent: allocPct,
		UsedMemoryMib: allocMiB / 2, UtilizationPercent: util}
}

func host(id string, devs ...*gpupoolv1.Device) *gpupoolv1.Host {
	return &gpupoolv1.Host{Id: id, Status: gpupoolv1.HostStatus_HOST_STATUS_READY, Eligible: true, Devices: devs, LastHeartbeatAgeMs: 400}
}

func lease(id, tenant, host, model string, mem int64, pct int32) *gpupoolv1.Lease {
	return &gpupoolv1.Lease{Id: id, Tenant: tenant, State: gpupoolv1.LeaseState_LEASE_STATE_GRANTED, StateChangedAtMs: t0.UnixMilli(),
		Slices: []*gpupoolv1.Slice{{Host: host, Device: "GPU-" + host + "-0", Model: model, MemoryMib: mem, ComputePercent: pct}}}
}

func event(typ gpupoolv1.LeaseEventType, l *gpupoolv1.Lease) Update {
	return LeaseUpdate{Event: &gpupoolv1.LeaseEvent{Type: typ, Lease: l}}
}

// pool is two A100 hosts and an H100 host, three leases of two tenants.
func pool() *State {
	s := &State{}
	for _, u := range []Update{
		HostsUpdate{Hosts: []*gpupoolv1.Host{
			host("a1", device("a1", 0, "A100", 40960, 50, 10), device("a1", 1, "A100", 0, 0, 0)),
			host("a2", device("a2", 0, "A100", 81920, 100, 90), device("a2", 1, "A100", 20480, 25, 30)),
			host("h1", device("h1", 0, "H100", 0, 0, 0)),
		}},
		StatusUpdate{Status: &gpupoolv1.StatusResponse{LeaderId: "broker-1", AppliedIndex: 42}},
		LeasesReset{},
		event(gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_SNAPSHOT, lease("l-1", "ml", "a1", "A100", 40960, 50)),
		event(gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_GRANTED, lease("l-2", "sim", "a2", "A100", 81920, 100)),
		event(gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_GRANTED, lease("l-3", "ml", "a2", "A100", 20480, 25)),
		QueueUpdate{Pending: []*gpupoolv1.Lease{
			{Id: "l-p1", Tenant: "sim", Priority: 0, CreateIndex: 10, State: gpupoolv1.LeaseState_LEASE_STATE_PENDING, PendingReason: "no room", CreatedAtMs: t0.Add(-time.Minute).UnixMilli(),
				Request: &gpupoolv1.LeaseRequest{Count: 2, Exclusive: true}},
			{Id: "l-p2", Tenant: "ml", Priority: 5, CreateIndex: 11, State: gpupoolv1.LeaseState_LEASE_STATE_PENDING, PendingReason: "quota",
				Request: &gpupoolv1.LeaseRequest{Count: 1, MemoryMib: 1024, ComputePercent: 10, Constraints: &gpupoolv1.Constraints{Model: "H1*"}}},
		}},
	} {
		s.Apply(u, t0)
	}
	return s
}

func ids[T any](rows []T, id func(T) string) []string {
	out := []string{}
	for _, r := range rows {
		out = append(out, id(r))
	}
	return out
}

func TestDeriveSortsAndFiltersHosts(t *testing.T) {
	for _, tc := range []struct {
		name string
		opts Options
		want []string
	}{
		{"the busiest host by utilisation comes first", Options{Sort: SortUtil}, []string{"a2", "a1", "h1"}},
		{"by name the hosts are in order", Options{Sort: SortName}, []string{"a1", "a2", "h1"}},
		{"by leases the host with most leases comes first", Options{Sort: SortLeases}, []string{"a2", "a1", "h1"}},
		{"a tenant filter keeps the hosts of its leases", Options{Tenant: "sim"}, []string{"a2"}},
		{"a model filter keeps the hosts of that model", Options{Model: "H100"}, []string{"h1"}},
		{"a tenant without leases shows no host", Options{Tenant: "nobody"}, []string{}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := ids(Derive(pool(), tc.opts).HostRows, func(h HostRow) string { return h.ID })
			if !slices.Equal(got, tc.want) {
				t.Errorf("hosts: got %v, want %v", got, tc.want)
			}
		})
	}
}

func TestDeriveSumsReservedAndMeasuredByModel(t *testing.T) {
	for _, tc := range []struct {
		name                 string
		opts                 Options
		model                string
		gpus, leases         int
		reservedPct, util    int64
		reservedMiB, usedMiB int64
	}{
		{"the pool's reservation is the devices' allocation", Options{}, "A100", 4, 3, 175, 32, 143360, 71680},
		{"a tenant filter counts that tenant's slices", Options{Tenant: "ml"}, "A100", 4, 2, 75, 32, 61440, 71680},
		{"a model without leases reserves nothing", Options{}, "H100", 1, 0, 0, 0, 0, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			v := Derive(pool(), tc.opts)
			i := slices.IndexFunc(v.Models, func(m ModelRow) bool { return m.Model == tc.model })
			if i < 0 {
				t.Fatalf("no row for %s in %v", tc.model, v.Models)
			}
			m := v.Models[i]
			got := []int64{int64(m.GPUs), int64(m.Leases), m.ReservedPct, int64(m.Util), m.ReservedMiB, m.UsedMiB}
			want := []int64{int64(tc.gpus), int64(tc.leases), tc.reservedPct, tc.util, tc.reservedMiB, tc.usedMiB}
			if !slices.Equal(got, want) {
				t.Errorf("gpus, leases, reserved %%, util, reserved MiB, used MiB: got %v, want %v", got, want)
			}
		})
	}
}

func TestDeriveOrdersAndFiltersTheQueue(t *testing.T) {
	for _, tc := range []struct {
		name string
		opts Options
		want []string
	}{
		{"higher priority is served first", Options{}, []string{"l-p2", "l-p1"}},
		{"a tenant filter keeps its requests", Options{Tenant: "sim"}, []string{"l-p1"}},
		{"a model filter keeps requests whose model glob matches", Options{Model: "H100"}, []string{"l-p2", "l-p1"}},
		{"a model filter drops requests for another model", Options{Model: "A100"}, []string{"l-p1"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := ids(Derive(pool(), tc.opts).Queue, func(q QueueRow) string { return q.ID })
			if !slices.Equal(got, tc.want) {
				t.Errorf("queue: got %v, want %v", got, tc.want)
			}
		})
	}
}

func TestApplyFollowsTheLeaseWatchAndTheAuditLog(t *testing.T) {
	s := pool()
	ended := lease("l-2", "sim", "a2", "A100", 81920, 100)
	ended.State = gpupoolv1.LeaseState_LEASE_STATE_RELEASED
	s.Apply(event(gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_ENDED, ended), t0)
	if _, ok := s.Leases["l-2"]; ok {
		t.Errorf("an ended lease is still among the leases")
	}
	audit := &gpupoolv1.AuditEntry{Index: 7, Kind: gpupoolv1.AuditKind_AUDIT_KIND_HOST_DRAIN_STARTED, Subject: "a1", Detail: "deadline 1h",
		Actor: &gpupoolv1.Actor{Name: "ops"}}
	s.Apply(AuditUpdate{Entry: audit}, t0)
	s.Apply(AuditUpdate{Entry: audit}, t0) // a reconnected follow sends it again
	// A grant the watch told already is not told again; one it did not
	// (before the watch started) is.
	s.Apply(AuditUpdate{Entry: &gpupoolv1.AuditEntry{Index: 8, Kind: gpupoolv1.AuditKind_AUDIT_KIND_LEASE_GRANTED, Subject: "l-3"}}, t0)
	s.Apply(AuditUpdate{Entry: &gpupoolv1.AuditEntry{Index: 9, Kind: gpupoolv1.AuditKind_AUDIT_KIND_LEASE_GRANTED, Subject: "l-9", Tenant: "ml"}}, t0)
	s.Apply(AuditUpdate{Entry: &gpupoolv1.AuditEntry{Index: 10, Kind: gpupoolv1.AuditKind_AUDIT_KIND_LEASE_RELEASED, Subject: "l-2"}}, t0)
	// The watch's grant of l-9 comes after the audit log's: it tells the
	// slices, so its text replaces the entry's.
	s.Apply(event(gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_GRANTED, lease("l-9", "ml", "h1", "H100", 1024, 5)), t0)
	got := ids(s.Events, func(e Event) string { return e.Kind + " " + e.Subject })
	want := []string{"granted l-2", "granted l-3", "released l-2", "host drain started a1", "granted l-9"}
	if e := s.Events[4]; e.Text != "H100 1 GiB 5% on h1" || !slices.Equal(e.Models, []string{"H100"}) {
		t.Errorf("l-9's grant: text %q, models %v; want the watch's", e.Text, e.Models)
	}
	if !slices.Equal(got, want) {
		t.Errorf("events: got %v, want %v", got, want)
	}
	if e := s.Events[3]; e.Text != "deadline 1h (by ops)" {
		t.Errorf("drain event text: got %q, want %q", e.Text, "deadline 1h (by ops)")
	}
	s.Apply(LeasesReset{}, t0)
	if len(s.Leases) != 0 {
		t.Errorf("after a watch reset: got %d leases, want 0", len(s.Leases))
	}
	s.Apply(ErrorUpdate{What: "hosts", Err: errors.New("rpc error: code = PermissionDenied desc = lacks pool read")}, t0)
	if got := Derive(s, Options{}).Errors; !slices.Equal(got, []string{"hosts: PermissionDenied: lacks pool read"}) {
		t.Errorf("errors: got %v", got)
	}
	s.Apply(ErrorUpdate{What: "hosts"}, t0)
	if got := Derive(s, Options{}).Errors; len(got) != 0 {
		t.Errorf("errors after recovery: got %v, want none", got)
	}
}

func TestEventsKeepTheNewestMaxEvents(t *testing.T) {
	s := &State{}
	for i := range MaxEvents + 10 {
		s.Apply(event(gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_GRANTED, lease(fmt.Sprintf("l-%d", i), "t", "h", "A100", 1, 1)), t0)
	}
	if len(s.Events) != MaxEvents || s.Events[0].Subject != "l-10" {
		t.Errorf("got %d events from %s, want %d from l-10", len(s.Events), s.Events[0].Subject, MaxEvents)
	}
}

func TestDeriveShowsDrainsInProgress(t *testing.T) {
	s := pool()
	h := host("a2", device("a2", 0, "A100", 0, 0, 0))
	h.Status = gpupoolv1.HostStatus_HOST_STATUS_DRAINING
	h.Drain = &gpupoolv1.HostDrain{DeadlineMs: t0.Add(90 * time.Second).UnixMilli(), Reason: "kernel", By: &gpupoolv1.Actor{Name: "ops"}}
	s.Apply(HostsUpdate{Hosts: []*gpupoolv1.Host{h, host("a1")}}, t0)
	v := Derive(s, Options{})
	want := DrainRow{Host: "a2", Leases: 2, Deadline: time.UnixMilli(t0.Add(90 * time.Second).UnixMilli()), Reason: "kernel", By: "ops"}
	if len(v.Drains) != 1 || v.Drains[0] != want {
		t.Fatalf("drains: got %+v, want [%+v]", v.Drains, want)
	}
	screen := strings.Join(Render(v, false, 100, 40), "\n")
	if !strings.Contains(screen, "in 1m30s") || !strings.Contains(screen, "kernel") {
		t.Errorf("the drain row lacks its countdown or reason:\n%s", screen)
	}
}

func TestRenderFitsEveryWidthAndHeight(t *testing.T) {
	s := pool()
	for i := range 30 {
		s.Apply(AuditUpdate{Entry: &gpupoolv1.AuditEntry{Index: uint64(100 + i), Kind: gpupoolv1.AuditKind_AUDIT_KIND_QUOTA_SET, Subject: "ml",
			Tenant: "ml", Detail: strings.Repeat("a long detail ", 10)}}, t0)
	}
	for _, tc := range []struct {
		width, height int
		want          []string
	}{
		{120, 50, []string{"-- POOL", "RESERVED(=) VS UTIL(#)", "-- HOSTS", "HEARTBEAT", "-- QUEUE 2 pending", "no room", "-- DRAINS", "-- EVENTS", "quota set"}},
		{80, 24, []string{"-- POOL", "A100", "-- HOSTS", "a2", "-- QUEUE", "-- EVENTS"}},
		{60, 24, []string{"-- POOL", "A100", "UTIL", "a2", "l-p2", "keys"}},
		{40, 20, []string{"-- POOL", "A100", "-- HOSTS", "a2", "s t m a p q"}},
		{30, 8, []string{"gpupool top", "-- POOL"}},
	} {
		t.Run(fmt.Sprintf("%dx%d", tc.width, tc.height), func(t *testing.T) {
			lines := Render(Derive(s, Options{}), false, tc.width, tc.height)
			if len(lines) > tc.height {
				t.Errorf("got %d lines, want at most %d", len(lines), tc.height)
			}
			for _, l := range lines {
				if w := runewidth.StringWidth(l); w > tc.width {
					t.Errorf("line %q is %d cells wide, want at most %d", l, w, tc.width)
				}
			}
			screen := strings.Join(lines, "\n")
			for _, w := range tc.want {
				if !strings.Contains(screen, w) {
					t.Errorf("the screen lacks %q:\n%s", w, screen)
				}
			}
		})
	}
}

func TestLayoutLeavesOutTheLeastUsefulColumnsFirst(t *testing.T) {
	cols := []column{{title: "ID", keep: 9}, {title: "LOW", keep: 1}, {title: "MID", keep: 5}, {title: "NOTE", keep: 3, flex: true}}
	rows := [][]string{{"host-1", "xxxxxxxxxx", "yyyyy", strings.Repeat("n", 40)}}
	for _, tc := range []struct {
		width      int
		wantHeader string
	}{
		{80, "ID      LOW         MID    NOTE"},
		{40, "ID      LOW         MID    NOTE"}, // the flex column is cut first
		{30, "ID      MID    NOTE"},
		{16, "ID      MID"},
	} {
		header, out := layout(cols, rows, tc.width)
		if header != tc.wantHeader {
			t.Errorf("at %d: header %q, want %q", tc.width, header, tc.wantHeader)
		}
		if w := runewidth.StringWidth(out[0]); w > tc.width {
			t.Errorf("at %d: row %q is %d wide", tc.width, out[0], w)
		}
	}
}

func TestKeysSortFilterAndPause(t *testing.T) {
	updates := make(chan Update)
	m := NewModel(updates, Options{}, func() time.Time { return t0 })
	for _, u := range []Update{HostsUpdate{Hosts: pool().Hosts}, event(gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_GRANTED, lease("l-1", "ml", "a1", "A100", 1, 1)),
		event(gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_GRANTED, lease("l-2", "sim", "a1", "A100", 1, 1))} {
		m.Update(updatesMsg{u})
	}
	for _, tc := range []struct {
		key  string
		want Options
	}{
		{"s", Options{Sort: SortReserved}},
		{"t", Options{Sort: SortReserved, Tenant: "ml"}},
		{"t", Options{Sort: SortReserved, Tenant: "sim"}},
		{"t", Options{Sort: SortReserved}},
		{"m", Options{Sort: SortReserved, Model: "A100"}},
		{"m", Options{Sort: SortReserved, Model: "H100"}},
		{"t", Options{Sort: SortReserved, Model: "H100", Tenant: "ml"}},
		{"a", Options{Sort: SortReserved}},
		{"s", Options{Sort: SortMemory}},
	} {
		m.Key(tc.key)
		if got := m.Options(); got != tc.want {
			t.Fatalf("after %q: got %+v, want %+v", tc.key, got, tc.want)
		}
	}
	m.Key("p")
	m.Update(updatesMsg{event(gpupoolv1.LeaseEventType_LEASE_EVENT_TYPE_GRANTED, lease("l-3", "ml", "a1", "A100", 1, 1))})
	if strings.Contains(m.View(), "l-3") || !strings.Contains(m.View(), "PAUSED") {
		t.Fatalf("paused: the screen shows a lease granted after the pause, or not PAUSED:\n%s", m.View())
	}
	for range 1000 { // a long pause: polls keep coming
		m.Update(updatesMsg{HostsUpdate{Hosts: pool().Hosts}, Tick{Now: t0}})
	}
	if len(m.held) != 3 {
		t.Errorf("held %d updates after 1000 polls, want 3 (the lease event, the latest hosts and tick)", len(m.held))
	}
	m.Key(" ")
	if !strings.Contains(m.View(), "l-3") || m.Paused() {
		t.Fatalf("resumed: the held lease is not shown:\n%s", m.View())
	}
	if m.Key("q") == nil {
		t.Errorf("q: got no quit command")
	}
}

func TestNextOfCyclesThroughAllAndBack(t *testing.T) {
	list := []string{"a", "b"}
	got := []string{}
	cur := ""
	for range 4 {
		cur = NextOf(list, cur)
		got = append(got, cur)
	}
	if want := []string{"a", "b", "", "a"}; !slices.Equal(got, want) {
		t.Errorf("got %q, want %q", got, want)
	}
	if got := NextOf(nil, "x"); got != "" {
		t.Errorf("empty list: got %q, want \"\"", got)
	}
}

func TestParseSortKeyNamesTheAllowedValues(t *testing.T) {
	for _, k := range []SortKey{SortUtil, SortReserved, SortMemory, SortLeases, SortName} {
		if got, err := ParseSortKey(k.String()); err != nil || got != k {
			t.Errorf("ParseSortKey(%q): got %v, %v", k, got, err)
		}
	}
	if _, err := ParseSortKey("cpu"); err == nil || !strings.Contains(err.Error(), "util, reserved, memory, leases, name") {
		t.Errorf("ParseSortKey(cpu): got %v, want an error naming the keys", err)
	}
}
