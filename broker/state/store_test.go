package state

import (
	"testing"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

func TestStoreIndexesAndRestore(t *testing.T) {
	s := New()
	w := s.Write()
	w.PutHost(&gpupoolv1.Host{Id: "h1"})
	w.PutDevice(&gpupoolv1.Device{Uuid: "GPU-b", HostId: "h1", Index: 1})
	w.PutDevice(&gpupoolv1.Device{Uuid: "GPU-a", HostId: "h1", Index: 0})
	w.PutLease(&gpupoolv1.Lease{Id: "l-1", Tenant: "t", RequestId: "r-1", Slices: []*gpupoolv1.Slice{{Host: "h1"}, {Host: "h2"}, {Host: "h1"}}})
	w.PutLease(&gpupoolv1.Lease{Id: "l-2", Tenant: "t", Slices: []*gpupoolv1.Slice{{Host: "h2"}}})
	w.Commit(7)

	tests := []struct {
		name string
		got  any
		want any
	}{
		{"the applied index is kept", s.Read().Index(), uint64(7)},
		{"a lease is found by tenant and request id", s.Read().LeaseByRequest("t", "r-1").GetId(), "l-1"},
		{"an empty request id finds nothing", s.Read().LeaseByRequest("t", "") == nil, true},
		{"a lease is listed once per host it spans", len(s.Read().HostLeases("h1")), 1},
		{"h2 has both leases", len(s.Read().HostLeases("h2")), 2},
		{"a host's devices come in index order", s.Read().HostDevices("h1")[0].Uuid, "GPU-a"},
		{"hosts come with their devices", len(s.Read().HostsWithDevices()[0].Devices), 2},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if tt.got != tt.want {
				t.Fatalf("got %v, want %v", tt.got, tt.want)
			}
		})
	}

	b, err := s.Read().Encode()
	if err != nil {
		t.Fatal(err)
	}
	r := New()
	if err := r.Restore(b); err != nil {
		t.Fatal(err)
	}
	again, _ := r.Read().Encode()
	if string(again) != string(b) {
		t.Fatal("a restored store encodes differently")
	}
	if err := r.Restore([]byte{0xff, 0xff}); err == nil {
		t.Fatal("restoring garbage: got nil error")
	}
	if r.Read().Index() != 7 {
		t.Fatal("a failed restore changed the state")
	}
}
