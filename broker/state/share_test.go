package state

import (
	"fmt"
	"testing"
	"unsafe"

	"google.golang.org/protobuf/proto"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// shareLease builds a lease as a decoded command gives it: every string
// and actor a copy of its own.
func shareLease(id string) *gpupoolv1.Lease {
	copyOf := func(s string) string { return string([]byte(s)) }
	return &gpupoolv1.Lease{
		Id: id, Tenant: copyOf("team-a"), Holder: copyOf("job"), RequestId: copyOf("r-" + id),
		State:     gpupoolv1.LeaseState_LEASE_STATE_GRANTED,
		Request:   &gpupoolv1.LeaseRequest{Tenant: copyOf("team-a"), Holder: copyOf("job"), RequestId: copyOf("r-" + id)},
		GrantedBy: &gpupoolv1.Actor{Name: copyOf("anonymous")},
		Slices:    []*gpupoolv1.Slice{{Host: copyOf("h1"), Device: copyOf("GPU-a"), Model: copyOf("A100")}},
	}
}

func sameString(a, b string) bool { return unsafe.StringData(a) == unsafe.StringData(b) }

func TestLeasesShareWhatTheyRepeat(t *testing.T) {
	s := New()
	w := s.Write()
	w.PutHost(&gpupoolv1.Host{Id: "h1"})
	w.PutDevice(&gpupoolv1.Device{Uuid: "GPU-a", HostId: "h1", Model: "A100"})
	for _, id := range []string{"l-1", "l-2"} {
		l := shareLease(id)
		w.ShareLease(l)
		w.PutLease(l)
	}
	w.Commit(1)
	restored := New()
	b, err := s.Read().Encode(1)
	if err != nil {
		t.Fatal(err)
	}
	if err := restored.Restore(b, func(uint32) error { return nil }); err != nil {
		t.Fatal(err)
	}
	for name, st := range map[string]*Store{"applied": s, "restored": restored} {
		r := st.Read()
		l1, l2, dev := r.Lease("l-1"), r.Lease("l-2"), r.Device("GPU-a")
		checks := []struct {
			what string
			ok   bool
		}{
			{"the request's tenant is the lease's", sameString(l1.Request.Tenant, l1.Tenant)},
			{"the request's holder is the lease's", sameString(l1.Request.Holder, l1.Holder)},
			{"the request's id is the lease's", sameString(l1.Request.RequestId, l1.RequestId)},
			{"equal actors are one", l1.GrantedBy == l2.GrantedBy},
			{"a slice's device is the device's uuid", sameString(l1.Slices[0].Device, dev.Uuid)},
			{"a slice's model is the device's", sameString(l1.Slices[0].Model, dev.Model)},
			{"a slice's host is the device's", sameString(l1.Slices[0].Host, dev.HostId)},
		}
		for _, c := range checks {
			if !c.ok {
				t.Errorf("%s: %s: not shared", name, c.what)
			}
		}
		if !proto.Equal(l1, shareLease("l-1")) {
			t.Errorf("%s: sharing changed the lease: %v", name, l1)
		}
	}
}

func TestUnequalValuesAreNotShared(t *testing.T) {
	s := New()
	w := s.Write()
	w.PutDevice(&gpupoolv1.Device{Uuid: "GPU-a", HostId: "h1", Model: "A100"})
	var got []*gpupoolv1.Lease
	for i, name := range []string{"alice", "bob"} {
		l := shareLease(fmt.Sprint("l-", i))
		l.GrantedBy.Name = name
		l.Request.Tenant = "other"
		l.Slices[0].Model = "H100"
		w.ShareLease(l)
		got = append(got, l)
	}
	if got[0].GrantedBy == got[1].GrantedBy || got[0].GrantedBy.Name != "alice" || got[1].GrantedBy.Name != "bob" {
		t.Fatalf("actors: %v, %v", got[0].GrantedBy, got[1].GrantedBy)
	}
	if got[0].Request.Tenant != "other" || got[0].Slices[0].Model != "H100" {
		t.Fatalf("unequal strings changed: %v", got[0])
	}
}
