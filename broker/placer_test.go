package broker

import (
	"strings"
	"testing"

	"github.com/gpupool/gpupool/broker/placement"
	"github.com/gpupool/gpupool/broker/state"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// placerHosts are two ready hosts of one 80 GiB GPU: h1's has 35 % of its
// compute taken, h2's is idle.
func placerHosts() []*gpupoolv1.Host {
	gpu := func(host string, used int32) *gpupoolv1.Device {
		return &gpupoolv1.Device{Uuid: "GPU-" + host, HostId: host, Model: "A100-SXM4-80GB", MemoryMib: 81920,
			AllocatedComputePercent: used, LeaseCount: min(used, 1)}
	}
	host := func(id string, used int32) *gpupoolv1.Host {
		return &gpupoolv1.Host{Id: id, Status: gpupoolv1.HostStatus_HOST_STATUS_READY, Eligible: true,
			Devices: []*gpupoolv1.Device{gpu(id, used)}}
	}
	return []*gpupoolv1.Host{host("h1", 35), host("h2", 0)}
}

func TestPlacerFGDLearnsTheMixAndAvoidsFragments(t *testing.T) {
	third := &gpupoolv1.LeaseRequest{Count: 1, MemoryMib: 1024, ComputePercent: 30}
	small := &gpupoolv1.LeaseRequest{Count: 1, MemoryMib: 1024, ComputePercent: 10}
	tests := []struct {
		name     string
		policy   string
		observed []*gpupoolv1.LeaseRequest
		want     string
	}{
		// A 10 % slice on h1 would leave room for one 30 % task there
		// instead of two; on h2 three still fit: FGD with look-ahead opens
		// h2, binpack fills h1.
		{"fgd keeps room for the 30 % tasks it has seen", placement.FGD, []*gpupoolv1.LeaseRequest{third, third, third, small}, "h2"},
		{"binpack fills the fullest GPU", placement.Binpack, []*gpupoolv1.LeaseRequest{third, third, third, small}, "h1"},
		{"fgd with only small tasks seen leaves nothing unusable either way, and packs", placement.FGD, []*gpupoolv1.LeaseRequest{small}, "h1"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			hosts := placerHosts()
			p := newPlacer(tt.policy)
			for _, r := range tt.observed {
				p.observe(hosts, r)
			}
			ss, err := p.Place(hosts, small)
			if err != nil {
				t.Fatal(err)
			}
			if ss[0].Host != tt.want {
				t.Fatalf("placed on %s, want %s", ss[0].Host, tt.want)
			}
		})
	}
}

func TestPlacerRelearnsFromTheLiveLeases(t *testing.T) {
	third := &gpupoolv1.LeaseRequest{Count: 1, MemoryMib: 1024, ComputePercent: 30}
	s := state.New()
	w := s.Write()
	for _, h := range placerHosts() {
		devs := h.Devices
		h.Devices = nil
		w.PutHost(h)
		for _, d := range devs {
			w.PutDevice(d)
		}
	}
	for i, st := range []gpupoolv1.LeaseState{gpupoolv1.LeaseState_LEASE_STATE_GRANTED, gpupoolv1.LeaseState_LEASE_STATE_PENDING,
		gpupoolv1.LeaseState_LEASE_STATE_RELEASED} {
		w.PutLease(&gpupoolv1.Lease{Id: "l-" + string(rune('a'+i)), State: st, Request: third})
	}
	w.Commit(1)

	p := newPlacer(placement.FGD)
	p.observe(placerHosts(), &gpupoolv1.LeaseRequest{Count: 1, MemoryMib: 1024, ComputePercent: 10}) // forgotten
	p.relearn(s.Read())
	if got := p.options().Mix.Len(); got != 1 {
		t.Fatalf("the relearned mix has %d shapes, want 1 (the 30 %% shape of the granted and pending leases)", got)
	}
	ss, err := p.Place(s.Read().HostsWithDevices(), &gpupoolv1.LeaseRequest{Count: 1, MemoryMib: 1024, ComputePercent: 10})
	if err != nil {
		t.Fatal(err)
	}
	if ss[0].Host != "h2" {
		t.Fatalf("placed on %s, want h2", ss[0].Host)
	}
}

func TestPlacerPlacesThroughTheIndexAsOnTheWholePool(t *testing.T) {
	var hosts []*gpupoolv1.Host
	for i := range 5 {
		id := string(rune('a' + i))
		mem := int64(81920)
		if i == 4 {
			mem = 163840 // only host e has a GPU this large
		}
		hosts = append(hosts, &gpupoolv1.Host{Id: id, Status: gpupoolv1.HostStatus_HOST_STATUS_READY, Eligible: true,
			Devices: []*gpupoolv1.Device{{Uuid: "GPU-" + id, HostId: id, Model: "A100", MemoryMib: mem}}})
	}
	idx := placement.NewIndex(hosts, nil)
	for _, policy := range Policies {
		p := newPlacer(policy)
		for _, mem := range []int64{1024, 120000} {
			r := &gpupoolv1.LeaseRequest{Count: 1, MemoryMib: mem, ComputePercent: 10}
			p.observe(hosts, r)
			want, err := p.Place(hosts, r)
			if err != nil {
				t.Fatal(err)
			}
			got, err := p.placeIndexed(idx, nil, r)
			if err != nil || got[0].Host != want[0].Host || got[0].Device != want[0].Device {
				t.Errorf("%s, %d MiB: through the index got %v, %v; want %v as on the whole pool", policy, mem, got, err, want)
			}
		}
	}
	p := newPlacer(placement.Binpack)
	if _, err := p.placeIndexed(idx, nil, &gpupoolv1.LeaseRequest{Count: 1, MemoryMib: 200000, ComputePercent: 10}); err == nil ||
		!strings.Contains(err.Error(), "163840") {
		t.Fatalf("a request nothing fits: got %v, want the reason from the whole pool (largest GPU 163840 MiB)", err)
	}
}
