package broker

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/gpupool/gpupool/broker/placement"
	"github.com/gpupool/gpupool/broker/state"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// Concurrent acquires place while earlier grants still commit: every slice
// that fits is granted, the rest are refused as exhausted (not as a grant
// Apply rejected), and no GPU holds more than it has.
func TestConcurrentAcquiresFillThePoolExactly(t *testing.T) {
	ts := startServer(t)
	ts.registerHost(t, "h1", 2, 81920)
	ts.registerHost(t, "h2", 2, 81920)
	const clients = 48 // 4 GPUs × 8 slices of 10 GiB = 32 fit
	codesSeen := make(chan codes.Code, clients)
	var wg sync.WaitGroup
	for i := range clients {
		wg.Go(func() {
			r := slice(10240, 10)
			r.RequestId = fmt.Sprintf("c%d", i)
			_, err := ts.c.Lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: r})
			codesSeen <- status.Code(err)
		})
	}
	wg.Wait()
	close(codesSeen)
	got := map[codes.Code]int{}
	for c := range codesSeen {
		got[c]++
	}
	if got[codes.OK] != 32 || got[codes.ResourceExhausted] != clients-32 {
		t.Fatalf("outcomes %v: want 32 OK and %d ResourceExhausted", got, clients-32)
	}
	for _, d := range ts.s.fsm.State().Devices() {
		if d.AllocatedMemoryMib > d.MemoryMib || d.AllocatedComputePercent > 100 {
			t.Errorf("%s over-committed: %d MiB, %d%%", d.Uuid, d.AllocatedMemoryMib, d.AllocatedComputePercent)
		}
	}
}

func TestInflightOverlayCountsOnlyWhatTheStateLacks(t *testing.T) {
	s := state.New()
	w := s.Write()
	for _, id := range []string{"h1", "h2"} {
		w.PutHost(&gpupoolv1.Host{Id: id})
		w.PutDevice(&gpupoolv1.Device{Uuid: "GPU-" + id, HostId: id, MemoryMib: 81920})
	}
	applied := &gpupoolv1.Lease{Id: "l-applied", Slices: []*gpupoolv1.Slice{{Host: "h2", Device: "GPU-h2", MemoryMib: 1024, ComputePercent: 5}}}
	w.PutLease(applied)
	w.Commit(1)
	st := s.Read()
	hosts := st.HostsWithDevices()

	f := newInflight()
	f.add(&gpupoolv1.Lease{Id: "l-new", Slices: []*gpupoolv1.Slice{{Host: "h1", Device: "GPU-h1", MemoryMib: 4096, ComputePercent: 20}}})
	f.add(applied) // applied already: the state counts it
	out := overlay(st, hosts, f.snapshot())

	tests := []struct {
		name string
		got  any
		want any
	}{
		{"the in-flight grant is counted", out[0].Devices[0].AllocatedMemoryMib, int64(4096)},
		{"its compute too", out[0].Devices[0].AllocatedComputePercent, int32(20)},
		{"a grant the state shows is not counted twice", out[1] == hosts[1], true},
		{"the state's own host is left alone", hosts[0].Devices[0].AllocatedMemoryMib, int64(0)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if tt.got != tt.want {
				t.Fatalf("got %v, want %v", tt.got, tt.want)
			}
		})
	}

	drained := make(chan struct{})
	go func() { f.drain(); close(drained) }()
	f.done("l-new")
	select {
	case <-drained:
		t.Fatal("drain returned while a grant was still in flight")
	default:
	}
	f.done("l-applied")
	<-drained
	f.done("l-unknown") // harmless
	f.drain()
}

// A pending lease's reservation is made on the pool with the grants in
// flight: otherwise it would reserve what a grant in flight took, and
// leave free what it needs once its victims are gone.
func TestReservationsSeeTheGrantsInFlight(t *testing.T) {
	s := state.New()
	w := s.Write()
	w.PutHost(&gpupoolv1.Host{Id: "h1", Status: gpupoolv1.HostStatus_HOST_STATUS_READY, Eligible: true})
	devs := map[string]*gpupoolv1.Device{}
	for i, id := range []string{"GPU-a", "GPU-b", "GPU-c"} {
		devs[id] = &gpupoolv1.Device{Uuid: id, HostId: "h1", Index: int32(i), Model: "A100", MemoryMib: 81920}
	}
	whole := func(dev string) []*gpupoolv1.Slice {
		return []*gpupoolv1.Slice{{Host: "h1", Device: dev, MemoryMib: 81920, ComputePercent: 100, Exclusive: true}}
	}
	victim := &gpupoolv1.Lease{Id: "l-victim", State: gpupoolv1.LeaseState_LEASE_STATE_GRANTED, Class: gpupoolv1.LeaseClass_LEASE_CLASS_PREEMPTIBLE,
		Slices: whole("GPU-b"), PreemptedFor: "l-pending"}
	placement.Allocate(devs["GPU-b"], victim.Slices[0])
	for _, d := range devs {
		w.PutDevice(d)
	}
	w.PutLease(victim)
	w.PutLease(&gpupoolv1.Lease{Id: "l-pending", State: gpupoolv1.LeaseState_LEASE_STATE_PENDING,
		Request: &gpupoolv1.LeaseRequest{Count: 2, Exclusive: true}})
	w.Commit(1)

	srv := &capacity{placer: newPlacer(placement.Binpack)}
	inflight := []*gpupoolv1.Lease{{Id: "l-inflight", Slices: whole("GPU-a")}}
	hosts := srv.reservedPool(s.Read(), inflight)
	if ss, err := srv.placer.Place(hosts, &gpupoolv1.LeaseRequest{Count: 1, Exclusive: true}); err == nil {
		t.Fatalf("a whole GPU was placed on %s: GPU-a is in flight, GPU-b and GPU-c are reserved for the pending lease", ss[0].Device)
	}
}

// A retry of an Acquire whose first grant is still committing waits for it
// and returns the same lease, instead of being refused for the capacity
// that grant took (which nobody would then release).
func TestRetryWhileTheGrantIsInFlightReturnsTheSameLease(t *testing.T) {
	ts := startServer(t)
	ts.registerHost(t, "h1", 1, 81920)
	r := slice(81920, 100)
	r.RequestId = "r1"
	r.Tenant = "default"
	r.Class = gpupoolv1.LeaseClass_LEASE_CLASS_GUARANTEED
	first := &gpupoolv1.Lease{
		Id: "l-first", Tenant: r.Tenant, Request: r, Class: r.Class, TtlMs: r.TtlMs, RequestId: r.RequestId,
		Slices: []*gpupoolv1.Slice{{Host: "h1", Device: "GPU-h1-0", MemoryMib: 81920, ComputePercent: 100,
			Isolation: gpupoolv1.Isolation_ISOLATION_WATCHDOG}},
	}
	ts.s.capacity.grants.add(first) // placed, not committed yet

	// While it is in flight, a retry waits for it (here until its own
	// deadline) instead of being told the pool is full.
	short, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	_, err := ts.c.Lease.Acquire(short, &gpupoolv1.AcquireRequest{Request: r})
	if status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("retry while the grant is in flight: got %v, want it to wait (DeadlineExceeded)", err)
	}
	if _, err := ts.s.apply(&gpupoolv1.GrantLeaseCommand{Lease: first}); err != nil {
		t.Fatal(err)
	}
	ts.s.capacity.grants.done(first.Id)
	resp, err := ts.c.Lease.Acquire(ctx(t), &gpupoolv1.AcquireRequest{Request: r})
	if err != nil || resp.Lease.Id != first.Id || !resp.Existing {
		t.Fatalf("retry: got %v existing=%t err %v, want the first grant %s", resp.GetLease().GetId(), resp.GetExisting(), err, first.Id)
	}
}

// The overlay an acquire reuses from the one before equals the overlay
// built afresh from the state and every grant in flight, at every step:
// grants added while the state stays put, a grant landing, one leaving the
// set without landing, and one on a host no grant in flight touched yet.
func TestReusedOverlayEqualsOneBuiltAfresh(t *testing.T) {
	s := state.New()
	w := s.Write()
	for _, id := range []string{"h1", "h2", "h3"} {
		w.PutHost(&gpupoolv1.Host{Id: id, CpuMillicores: 64000})
		for _, d := range []string{"a", "b"} {
			w.PutDevice(&gpupoolv1.Device{Uuid: "GPU-" + id + d, HostId: id, MemoryMib: 81920})
		}
	}
	w.Commit(1)
	lease := func(id, host, dev string, mib int64) *gpupoolv1.Lease {
		return &gpupoolv1.Lease{Id: id, State: gpupoolv1.LeaseState_LEASE_STATE_GRANTED, HostCpuMillicores: 100,
			Slices: []*gpupoolv1.Slice{{Host: host, Device: "GPU-" + host + dev, MemoryMib: mib, ComputePercent: 1}}}
	}
	srv := &capacity{}
	f := newInflight()
	index := uint64(1)
	steps := []struct {
		name string
		do   func()
	}{
		{"nothing in flight", func() {}},
		{"one grant", func() { f.add(lease("l1", "h1", "a", 1024)) }},
		{"two more on the same host", func() {
			f.add(lease("l2", "h1", "a", 2048))
			f.add(lease("l3", "h1", "b", 4096))
		}},
		{"one on another host", func() { f.add(lease("l4", "h2", "a", 1024)) }},
		{"the first lands", func() {
			index++
			w := s.Write()
			w.PutLease(lease("l1", "h1", "a", 1024))
			w.Commit(index)
			f.done("l1")
		}},
		{"one more after it landed", func() { f.add(lease("l5", "h2", "b", 512)) }},
		{"one leaves without landing", func() { f.done("l3") }},
		{"one more while the state stays put", func() { f.add(lease("l6", "h1", "b", 256)) }},
		{"on a third host", func() { f.add(lease("l7", "h3", "a", 128)) }},
		{"all of them leave", func() {
			for _, id := range []string{"l2", "l4", "l5", "l6", "l7"} {
				f.done(id)
			}
		}},
	}
	for _, step := range steps {
		t.Run(step.name, func(t *testing.T) {
			step.do()
			st := s.Read()
			snap := f.snapshot()
			got := srv.inflightOverlay(st, snap)
			var touched []*gpupoolv1.Host
			seen := map[string]bool{}
			for _, l := range inFlight(st, snap) {
				for _, id := range state.LeaseHosts(l) {
					if !seen[id] {
						seen[id] = true
						touched = append(touched, st.HostWithDevices(id))
					}
				}
			}
			want := overlay(st, touched, snap) // every host of touched, with the grants: the overlay built afresh
			byID := func(hs []*gpupoolv1.Host) map[string]*gpupoolv1.Host {
				m := map[string]*gpupoolv1.Host{}
				for _, h := range hs {
					m[h.Id] = h
				}
				return m
			}
			g, wt := byID(got), byID(want)
			if len(g) != len(wt) {
				t.Fatalf("overlay holds %d hosts, want %d", len(g), len(wt))
			}
			for id, h := range wt {
				if !proto.Equal(g[id], h) {
					t.Fatalf("host %s: got %v, want %v", id, g[id], h)
				}
			}
			if orig := st.HostWithDevices("h1"); orig.Devices[0].AllocatedMemoryMib > 1024 {
				t.Fatalf("the state's own host was written: %v", orig)
			}
		})
	}
}
