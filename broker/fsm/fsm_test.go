package fsm

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"testing"

	"github.com/hashicorp/raft"
	"google.golang.org/protobuf/proto"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

func host(id string, gpus int) *gpupoolv1.RegisterHostCommand {
	c := &gpupoolv1.RegisterHostCommand{
		Host:  &gpupoolv1.Host{Id: id, Labels: map[string]string{"zone": "a", "rack": "r1"}, CpuMillicores: 64000, MemoryMib: 512 << 10},
		NowMs: 1000,
	}
	for i := range gpus {
		c.Devices = append(c.Devices, &gpupoolv1.Device{
			Uuid: fmt.Sprintf("GPU-%s-%d", id, i), Index: int32(i), Model: "A100-SXM4-80GB", MemoryMib: 81920,
		})
	}
	return c
}

func grant(id, host string, dev int, mem int64, compute int32) *gpupoolv1.GrantLeaseCommand {
	return &gpupoolv1.GrantLeaseCommand{Lease: &gpupoolv1.Lease{
		Id: id, Tenant: "default", TtlMs: 60000, CreatedAtMs: 2000,
		Slices: []*gpupoolv1.Slice{{Host: host, Device: fmt.Sprintf("GPU-%s-%d", host, dev), MemoryMib: mem, ComputePercent: compute}},
	}}
}

// testLog is a log that exercises every command type, including grants
// that Apply must refuse.
func testLog() []proto.Message {
	return []proto.Message{
		&gpupoolv1.UpsertServerCommand{Id: "b1", RpcAddress: "127.0.0.1:1", RaftAddress: "127.0.0.1:2"},
		host("h1", 2),
		host("h2", 2),
		grant("l-1", "h1", 0, 40960, 50),
		grant("l-2", "h1", 0, 40960, 50),
		grant("l-3", "h1", 0, 1, 1), // device full: refused
		grant("l-4", "h2", 1, 81920, 100),
		&gpupoolv1.EndLeaseCommand{LeaseId: "l-1", EndState: gpupoolv1.LeaseState_LEASE_STATE_RELEASED, Reason: "done", NowMs: 3000},
		&gpupoolv1.FreeLeaseCommand{LeaseId: "l-1", Reason: "agent confirmed teardown", NowMs: 3100},
		grant("l-5", "h1", 0, 20480, 25),
		&gpupoolv1.SetHostStatusCommand{HostId: "h2", Status: gpupoolv1.HostStatus_HOST_STATUS_DOWN, Reason: "no heartbeat", NowMs: 4000},
		grant("l-6", "h2", 0, 1024, 10), // host down: refused
		host("h1", 1),                   // device 1 disappears (free), device 0 stays
		pendingLease("p-1", "r1"),
		preemptible("v-1", "h1", 0),
		&gpupoolv1.PreemptLeasesCommand{LeaseIds: []string{"v-1"}, ForLease: "p-1", DeadlineMs: 9000, Reason: "room"},
		bootstrapToken("t-boot", 1),
		createToken(clientTok("t-a", 2, "a")),
		&gpupoolv1.RevokeAclTokenCommand{AccessorId: "t-a", NowMs: 9500, Actor: &gpupoolv1.Actor{AccessorId: "t-boot", Name: "bootstrap"}},
		&gpupoolv1.CollectEndedLeasesCommand{LeaseIds: []string{"l-1", "l-2"}, EndedAtOrBeforeMs: 3100}, // l-2 holds: kept
	}
}

func applyAll(t *testing.T, f *FSM, log []proto.Message) []*Result {
	t.Helper()
	var out []*Result
	for i, m := range log {
		b, err := Encode(m)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, f.Apply(&raft.Log{Index: uint64(i + 1), Type: raft.LogCommand, Data: b}).(*Result))
	}
	return out
}

type memSink struct {
	bytes.Buffer
}

func (s *memSink) ID() string    { return "mem" }
func (s *memSink) Cancel() error { return nil }
func (s *memSink) Close() error  { return nil }

func snapshotBytes(t *testing.T, f *FSM) []byte {
	t.Helper()
	snap, err := f.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	var sink memSink
	if err := snap.Persist(&sink); err != nil {
		t.Fatal(err)
	}
	return sink.Bytes()
}

func TestSameLogGivesIdenticalStateOnThreeFSMs(t *testing.T) {
	var snaps [][]byte
	for range 3 {
		f := New(nil)
		applyAll(t, f, testLog())
		snaps = append(snaps, snapshotBytes(t, f))
	}
	for i := 1; i < len(snaps); i++ {
		if !bytes.Equal(snaps[0], snaps[i]) {
			t.Fatalf("snapshot of FSM %d differs from FSM 0 (%d vs %d bytes)", i, len(snaps[i]), len(snaps[0]))
		}
	}
	// A fourth FSM restored from the snapshot, then fed the same tail,
	// agrees with one that applied the whole log.
	restored := New(nil)
	if err := restored.Restore(io.NopCloser(bytes.NewReader(snaps[0]))); err != nil {
		t.Fatal(err)
	}
	if got := snapshotBytes(t, restored); !bytes.Equal(got, snaps[0]) {
		t.Fatal("snapshot of a restored FSM differs from the snapshot it was restored from")
	}
}

func TestApplyRefusesGrantsThatNoLongerFit(t *testing.T) {
	f := New(nil)
	res := applyAll(t, f, testLog())
	tests := []struct {
		name    string
		entry   int // index into testLog
		wantErr bool
	}{
		{"first half of a GPU is granted", 3, false},
		{"second half of the same GPU is granted", 4, false},
		{"a third slice on the full GPU is refused", 5, true},
		{"a whole GPU on another host is granted", 6, false},
		{"a grant on a down host is refused", 11, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := res[tt.entry].Err
			var ce *ConflictError
			if tt.wantErr != errors.As(err, &ce) {
				t.Fatalf("got err %v, want conflict=%t", err, tt.wantErr)
			}
		})
	}
	st := f.State()
	d := st.Device("GPU-h1-0")
	if got, want := d.AllocatedMemoryMib, int64(40960+20480+1024); got != want { // l-2, l-5, v-1
		t.Errorf("GPU-h1-0 allocated memory: got %d, want %d", got, want)
	}
	if got, want := d.AllocatedComputePercent, int32(85); got != want {
		t.Errorf("GPU-h1-0 allocated compute: got %d, want %d", got, want)
	}
	if st.Device("GPU-h1-1") != nil {
		t.Error("GPU-h1-1 was dropped by re-registration and held nothing, but is still there")
	}
	if l := st.Lease("l-4"); l.State != gpupoolv1.LeaseState_LEASE_STATE_RELEASING || !l.Lost {
		t.Errorf("lease on the down host: got state %v lost=%t, want RELEASING lost=true", l.State, l.Lost)
	}
	if got := st.Lease("l-2").FencingToken; got != 5 {
		t.Errorf("fencing token of l-2: got %d, want its log index 5", got)
	}
}

func TestGrantWithSameRequestIDReturnsTheFirstLease(t *testing.T) {
	f := New(nil)
	a := grant("l-a", "h1", 0, 1024, 10)
	a.Lease.RequestId = "req-1"
	b := grant("l-b", "h1", 1, 1024, 10)
	b.Lease.RequestId = "req-1"
	res := applyAll(t, f, []proto.Message{host("h1", 2), a, b})
	if !res[2].Existing || res[2].Lease.Id != "l-a" {
		t.Fatalf("retry: got lease %s existing=%t, want l-a existing=true", res[2].Lease.GetId(), res[2].Existing)
	}
	if got := f.State().Device("GPU-h1-1").AllocatedMemoryMib; got != 0 {
		t.Fatalf("retry allocated %d MiB on GPU-h1-1, want 0", got)
	}
}

func TestEndAndFreeAreIdempotent(t *testing.T) {
	f := New(nil)
	end := &gpupoolv1.EndLeaseCommand{LeaseId: "l-1", EndState: gpupoolv1.LeaseState_LEASE_STATE_RELEASED}
	free := &gpupoolv1.FreeLeaseCommand{LeaseId: "l-1"}
	res := applyAll(t, f, []proto.Message{host("h1", 1), grant("l-1", "h1", 0, 8192, 20), end, end, free, free})
	for i, r := range res {
		if r.Err != nil {
			t.Fatalf("entry %d: %v", i, r.Err)
		}
	}
	if got := f.State().Lease("l-1").State; got != gpupoolv1.LeaseState_LEASE_STATE_RELEASED {
		t.Fatalf("got state %v, want RELEASED", got)
	}
	if got := f.State().Device("GPU-h1-0").AllocatedMemoryMib; got != 0 {
		t.Fatalf("freed twice: allocated memory %d, want 0", got)
	}
}

func TestLockDelayFreeIsANoOpOnceTheHostIsBack(t *testing.T) {
	f := New(nil)
	down := &gpupoolv1.SetHostStatusCommand{HostId: "h1", Status: gpupoolv1.HostStatus_HOST_STATUS_DOWN}
	up := &gpupoolv1.SetHostStatusCommand{HostId: "h1", Status: gpupoolv1.HostStatus_HOST_STATUS_READY}
	free := &gpupoolv1.FreeLeaseCommand{LeaseId: "l-1", RequireHostDown: true}
	applyAll(t, f, []proto.Message{host("h1", 1), grant("l-1", "h1", 0, 8192, 20), down, up, free})
	if got := f.State().Lease("l-1").State; got != gpupoolv1.LeaseState_LEASE_STATE_RELEASING {
		t.Fatalf("got %v, want RELEASING: the host is back, only its agent may free the lease", got)
	}
}

func TestDecodeRejectsUnknownAndCorruptEntries(t *testing.T) {
	tests := []struct {
		name string
		data []byte
	}{
		{"an empty entry", nil},
		{"an unknown type", []byte{99, 1, 2}},
		{"a known type with garbage", []byte{byte(GrantLeaseType), 0xff, 0xff, 0xff}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if _, _, err := Decode(tt.data); err == nil {
				t.Fatal("got nil error, want one")
			}
		})
	}
}

func TestApplySkipsUnknownIgnorableCommands(t *testing.T) {
	f := New(nil)
	res := f.Apply(&raft.Log{Index: 1, Type: raft.LogCommand, Data: []byte{byte(IgnoreUnknownTypeFlag | 77), 1}}).(*Result)
	if res.Err != nil {
		t.Fatalf("got %v, want the entry skipped", res.Err)
	}
}

func FuzzDecode(f *testing.F) {
	for _, m := range testLog() {
		b, _ := Encode(m)
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		typ, msg, err := Decode(b)
		if err != nil {
			return
		}
		again, err := Encode(msg)
		if err != nil {
			t.Fatalf("decoded type %d but cannot encode it again: %v", typ, err)
		}
		if _, _, err := Decode(again); err != nil {
			t.Fatalf("re-encoded entry does not decode: %v", err)
		}
	})
}
