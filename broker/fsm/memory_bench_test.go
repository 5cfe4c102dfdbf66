package fsm

import (
	"bytes"
	"flag"
	"fmt"
	"io"
	"os"
	"runtime"
	"runtime/pprof"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"google.golang.org/protobuf/proto"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// scaleGrant is a grant as the leader proposes it in 'gpupool-bench
// scale': one fractional slice, the request kept on the lease, an actor.
func scaleGrant(i, hosts, gpus int) *gpupoolv1.GrantLeaseCommand {
	h := fmt.Sprintf("host-%05d", i%hosts)
	d := (i / hosts) % gpus
	r := &gpupoolv1.LeaseRequest{
		Count: 1, MemoryMib: 4096, ComputePercent: 10, TtlMs: 86_400_000,
		RequestId: fmt.Sprintf("scale-s1-%d", i), Holder: "bench-scale", Tenant: "default",
		Class: gpupoolv1.LeaseClass_LEASE_CLASS_GUARANTEED,
	}
	return &gpupoolv1.GrantLeaseCommand{NowMs: 2000, Lease: &gpupoolv1.Lease{
		Id: fmt.Sprintf("l-%016x", i), Tenant: r.Tenant, Holder: r.Holder, Request: r, Class: r.Class, TtlMs: r.TtlMs,
		CreatedAtMs: 2000, RequestId: r.RequestId,
		GrantedBy: &gpupoolv1.Actor{Name: "anonymous"},
		Slices: []*gpupoolv1.Slice{{
			Host: h, Device: fmt.Sprintf("GPU-%s-%d", h, d), MemoryMib: 4096, ComputePercent: 10,
			Model: "A100-SXM4-80GB", DeviceIndex: int32(d), Isolation: gpupoolv1.Isolation_ISOLATION_MPS,
		}},
	}}
}

// scaleLoader applies commands to an FSM at consecutive Raft indexes.
type scaleLoader struct {
	tb  testing.TB
	f   *FSM
	idx uint64
}

func (l *scaleLoader) apply(m proto.Message) *Result {
	l.tb.Helper()
	b, err := Encode(m)
	if err != nil {
		l.tb.Fatal(err)
	}
	l.idx++
	return l.f.Apply(&raft.Log{Index: l.idx, Type: raft.LogCommand, Data: b}).(*Result)
}

// hosts registers n hosts of gpus GPUs each.
func (l *scaleLoader) hosts(n, gpus int) {
	for i := range n {
		if res := l.apply(host(fmt.Sprintf("host-%05d", i), gpus)); res.Err != nil {
			l.tb.Fatal(res.Err)
		}
	}
}

// grants grants leases [from, to) spread over hosts × gpus.
func (l *scaleLoader) grants(from, to, hosts, gpus int) {
	for i := from; i < to; i++ {
		if res := l.apply(scaleGrant(i, hosts, gpus)); res.Err != nil {
			l.tb.Fatalf("grant %d: %v", i, res.Err)
		}
	}
}

var stateHeapProfile = flag.String("state-heap-profile", "", "BenchmarkStateMemory writes a heap profile of the loaded state to this `file`")

func liveHeap() uint64 {
	var ms runtime.MemStats
	runtime.GC()
	runtime.GC()
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc
}

// BenchmarkStateMemory reports the live heap of the state (go-memdb
// tables, their indexes, the pool view and the placement index) per
// granted lease on 10k hosts × 8 GPUs, what 'gpupool-bench scale' loads.
// Run it with -memprofile and read inuse_space to see where it goes.
func BenchmarkStateMemory(b *testing.B) {
	const hosts, gpus = 10_000, 8
	for _, leases := range []int{10_000, 100_000} {
		if testing.Short() && leases > 10_000 {
			continue
		}
		b.Run(fmt.Sprintf("leases=%d", leases), func(b *testing.B) {
			for b.Loop() {
				base := liveHeap()
				l := &scaleLoader{tb: b, f: New(nil)}
				l.hosts(hosts, gpus)
				pool := liveHeap()
				l.grants(0, leases, hosts, gpus)
				all := liveHeap()
				if *stateHeapProfile != "" {
					writeHeapProfile(b, *stateHeapProfile)
				}
				b.ReportMetric(float64(pool-base)/(1<<20), "pool-MiB")
				b.ReportMetric(float64(all-pool)/float64(leases), "B/lease")
				b.ReportMetric(float64(all-base)/(1<<20), "heap-MiB")
				save, restore, size, restored := snapshotTimes(b, l.f)
				b.ReportMetric(float64(restored)/(1<<20), "restored-heap-MiB")
				b.ReportMetric(save.Seconds(), "save-s")
				b.ReportMetric(restore.Seconds(), "restore-s")
				b.ReportMetric(float64(size)/(1<<20), "snap-MiB")
				runtime.KeepAlive(l)
			}
		})
	}
}

func writeHeapProfile(tb testing.TB, path string) {
	f, err := os.Create(path)
	if err != nil {
		tb.Fatal(err)
	}
	defer f.Close()
	if err := pprof.Lookup("heap").WriteTo(f, 0); err != nil {
		tb.Fatal(err)
	}
}

// snapshotTimes takes a snapshot of f as Raft does (Snapshot, then
// Persist) and restores it into a new FSM, returning how long each took
// and the snapshot's size, and the live heap of the restored state.
func snapshotTimes(tb testing.TB, f *FSM) (save, restore time.Duration, size int, heap uint64) {
	tb.Helper()
	start := time.Now()
	snap, err := f.Snapshot()
	if err != nil {
		tb.Fatal(err)
	}
	sink := &memSink{}
	if err := snap.Persist(sink); err != nil {
		tb.Fatal(err)
	}
	snap.Release()
	save = time.Since(start)
	data := bytes.Clone(sink.Bytes())
	size = len(data)
	before := liveHeap()
	g := New(nil)
	start = time.Now()
	if err := g.Restore(io.NopCloser(bytes.NewReader(data))); err != nil {
		tb.Fatal(err)
	}
	restore = time.Since(start)
	if got, want := g.State().Index(), f.State().Index(); got != want {
		tb.Fatalf("restored index %d, want %d", got, want)
	}
	heap = liveHeap() + uint64(size) - before
	runtime.KeepAlive(g)
	return save, restore, size, heap
}
