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
	w.PutLease(&gpupoolv1.Lease{Id: "l-1", Tenant: "t", RequestId: "r-1", State: gpupoolv1.LeaseState_LEASE_STATE_GRANTED,
		Slices: []*gpupoolv1.Slice{{Host: "h1"}, {Host: "h2"}, {Host: "h1"}}})
	w.PutLease(&gpupoolv1.Lease{Id: "l-2", Tenant: "t", State: gpupoolv1.LeaseState_LEASE_STATE_RELEASING, Slices: []*gpupoolv1.Slice{{Host: "h2"}}})
	w.PutLease(&gpupoolv1.Lease{Id: "l-3", Tenant: "t", State: gpupoolv1.LeaseState_LEASE_STATE_RELEASED, Slices: []*gpupoolv1.Slice{{Host: "h2"}}})
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
		{"h2 has both leases that hold capacity", len(s.Read().HostLeases("h2")), 2},
		{"an ended lease is not listed by host", len(s.Read().HostLeases("h2")) == 2 && s.Read().Lease("l-3") != nil, true},
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

	b, err := s.Read().Encode(1)
	if err != nil {
		t.Fatal(err)
	}
	r := New()
	if err := r.Restore(b, anyVersion); err != nil {
		t.Fatal(err)
	}
	again, _ := r.Read().Encode(1)
	if string(again) != string(b) {
		t.Fatal("a restored store encodes differently")
	}
	if err := r.Restore([]byte{0xff, 0xff}, anyVersion); err == nil {
		t.Fatal("restoring garbage: got nil error")
	}
	if r.Read().Index() != 7 {
		t.Fatal("a failed restore changed the state")
	}
}

func TestPoolViewFollowsEveryWrite(t *testing.T) {
	s := New()
	w := s.Write()
	w.PutHost(&gpupoolv1.Host{Id: "h1"})
	w.PutHost(&gpupoolv1.Host{Id: "h2"})
	w.PutDevice(&gpupoolv1.Device{Uuid: "GPU-a", HostId: "h1", Index: 0})
	w.PutDevice(&gpupoolv1.Device{Uuid: "GPU-b", HostId: "h1", Index: 1})
	w.Commit(1)
	before := s.Read()

	w = s.Write()
	w.PutDevice(&gpupoolv1.Device{Uuid: "GPU-a", HostId: "h1", Index: 0, AllocatedMemoryMib: 512})
	w.DeleteDevice(&gpupoolv1.Device{Uuid: "GPU-b", HostId: "h1", Index: 1})
	w.PutHost(&gpupoolv1.Host{Id: "h2", Eligible: true})
	w.Commit(2)

	view := func(r *Reader) map[string]*gpupoolv1.Host {
		out := map[string]*gpupoolv1.Host{}
		for _, h := range r.HostsWithDevices() {
			out[h.Id] = h
		}
		return out
	}
	old, now := view(before), view(s.Read())
	restored := New()
	b, err := s.Read().Encode(1)
	if err != nil {
		t.Fatal(err)
	}
	if err := restored.Restore(b, anyVersion); err != nil {
		t.Fatal(err)
	}
	again := view(restored.Read())
	tests := []struct {
		name string
		got  any
		want any
	}{
		{"an older read still sees both devices", len(old["h1"].Devices), 2},
		{"an older read sees the old allocation", old["h1"].Devices[0].AllocatedMemoryMib, int64(0)},
		{"a deleted device leaves the view", len(now["h1"].Devices), 1},
		{"a changed device shows in the view", now["h1"].Devices[0].AllocatedMemoryMib, int64(512)},
		{"a changed host shows in the view", now["h2"].Eligible, true},
		{"a host without devices has none", len(now["h2"].Devices), 0},
		{"the stored host keeps no devices", len(s.Read().Host("h1").Devices), 0},
		{"a restore rebuilds the view", again["h1"].Devices[0].AllocatedMemoryMib, int64(512)},
		{"a restore keeps every host", len(again), 2},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if tt.got != tt.want {
				t.Fatalf("got %v, want %v", tt.got, tt.want)
			}
		})
	}
}

// anyVersion accepts a snapshot of any version.
func anyVersion(uint32) error { return nil }

func TestSparseLeaseIndexesAfterWritesDeletesAndARestore(t *testing.T) {
	s := New()
	w := s.Write()
	put := func(id string, st gpupoolv1.LeaseState, class gpupoolv1.LeaseClass, elastic int32, endedAt int64) *gpupoolv1.Lease {
		l := &gpupoolv1.Lease{Id: id, Tenant: "t", State: st, Class: class, StateChangedAtMs: endedAt,
			Request: &gpupoolv1.LeaseRequest{ElasticMax: elastic}}
		w.PutLease(l)
		return l
	}
	put("p-1", gpupoolv1.LeaseState_LEASE_STATE_PENDING, gpupoolv1.LeaseClass_LEASE_CLASS_GUARANTEED, 0, 1)
	put("g-1", gpupoolv1.LeaseState_LEASE_STATE_GRANTED, gpupoolv1.LeaseClass_LEASE_CLASS_PREEMPTIBLE, 0, 1)
	put("e-1", gpupoolv1.LeaseState_LEASE_STATE_GRANTED, gpupoolv1.LeaseClass_LEASE_CLASS_GUARANTEED, 3, 1)
	put("x-2", gpupoolv1.LeaseState_LEASE_STATE_EXPIRED, gpupoolv1.LeaseClass_LEASE_CLASS_GUARANTEED, 0, 20)
	gone := put("x-1", gpupoolv1.LeaseState_LEASE_STATE_RELEASED, gpupoolv1.LeaseClass_LEASE_CLASS_GUARANTEED, 0, 10)
	put("x-0", gpupoolv1.LeaseState_LEASE_STATE_REVOKED, gpupoolv1.LeaseClass_LEASE_CLASS_PREEMPTIBLE, 0, 10)
	w.Commit(1)
	w = s.Write()
	w.DeleteLease(gone)
	w.Commit(2)

	b, err := s.Read().Encode(1)
	if err != nil {
		t.Fatal(err)
	}
	restored := New()
	if err := restored.Restore(b, anyVersion); err != nil {
		t.Fatal(err)
	}
	ids := func(ls []*gpupoolv1.Lease) string {
		var out string
		for _, l := range ls {
			out += l.Id + " "
		}
		return out
	}
	ended := func(r *Reader) []*gpupoolv1.Lease {
		var ls []*gpupoolv1.Lease
		r.EndedLeases(func(l *gpupoolv1.Lease) bool { ls = append(ls, l); return true })
		return ls
	}
	for name, st := range map[string]*Store{"written": s, "restored": restored} {
		r := st.Read()
		tests := []struct {
			name      string
			got, want string
		}{
			{"the queue holds the pending lease only", ids(r.PendingLeases()), "p-1 "},
			{"the elastic index holds the granted elastic lease only", ids(r.ElasticLeases()), "e-1 "},
			{"the preemptible index holds the granted preemptible lease only", ids(r.Preemptible()), "g-1 "},
			{"ended leases come oldest first, without the deleted one", ids(ended(r)), "x-0 x-2 "},
			{"a deleted lease is gone from the table", ids(r.Leases()), "e-1 g-1 p-1 x-0 x-2 "},
		}
		for _, tt := range tests {
			t.Run(name+": "+tt.name, func(t *testing.T) {
				if tt.got != tt.want {
					t.Fatalf("got %q, want %q", tt.got, tt.want)
				}
			})
		}
	}
}

func TestTokensVersionChangesWithATokenOrARestore(t *testing.T) {
	s := New()
	b, err := s.Read().Encode(1)
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name    string
		change  func()
		changed bool
	}{
		{"a token put", func() {
			w := s.Write()
			w.PutACLToken(&gpupoolv1.AclToken{AccessorId: "a-1", SecretSha256: []byte{1}})
			w.Commit(1)
		}, true},
		{"a write of no token", func() {
			w := s.Write()
			w.PutHost(&gpupoolv1.Host{Id: "h1"})
			w.Commit(2)
		}, false},
		{"a token put, aborted", func() {
			w := s.Write()
			w.PutACLToken(&gpupoolv1.AclToken{AccessorId: "a-2", SecretSha256: []byte{2}})
			w.Abort()
		}, false},
		{"a restore", func() {
			if err := s.Restore(b, anyVersion); err != nil {
				t.Fatal(err)
			}
		}, true},
	}
	for _, tt := range tests {
		before := s.TokensVersion()
		tt.change()
		if changed := s.TokensVersion() != before; changed != tt.changed {
			t.Errorf("%s: TokensVersion changed %v, want %v", tt.name, changed, tt.changed)
		}
	}
}
