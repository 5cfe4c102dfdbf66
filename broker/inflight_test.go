package broker

import (
	"fmt"
	"sync"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

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
