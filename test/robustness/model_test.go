package robustness

import (
	"strings"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

const gpu = "GPU-0"

func acq(client int, lease string, mem int64, comp int32, fence uint64, call, ret int64) Record {
	return Record{Client: client, Kind: OpAcquire, RequestID: "req-" + lease, Lease: lease, Device: gpu, Memory: mem, Compute: comp, Fence: fence, Outcome: "ok", Call: call, Ret: ret}
}

func op(client int, kind OpKind, lease, outcome string, fence uint64, call, ret int64) Record {
	return Record{Client: client, Kind: kind, Lease: lease, Outcome: outcome, Fence: fence, Call: call, Ret: ret}
}

func TestCheckFindsWhatTheModelForbids(t *testing.T) {
	devices := []*gpupoolv1.Device{{Uuid: gpu, MemoryMib: 81920}}
	tests := []struct {
		name    string
		records []Record
		final   []*gpupoolv1.Lease
		want    porcupine.CheckResult
	}{
		{"two leases that fit side by side", []Record{
			acq(0, "a", 40960, 50, 10, 1, 2), acq(1, "b", 40960, 50, 11, 1, 3),
			op(0, OpGet, "a", "granted", 10, 4, 5), op(1, OpKeepAlive, "b", "ok", 0, 4, 5),
		}, nil, porcupine.Ok},
		{"a third lease over the device's memory", []Record{
			acq(0, "a", 40960, 10, 10, 1, 2), acq(1, "b", 40960, 10, 11, 3, 4), acq(2, "c", 1024, 10, 12, 5, 6),
		}, nil, porcupine.Illegal},
		{"compute over 100 percent", []Record{
			acq(0, "a", 1024, 60, 10, 1, 2), acq(1, "b", 1024, 60, 11, 3, 4),
		}, nil, porcupine.Illegal},
		{"room made by an acknowledged release", []Record{
			acq(0, "a", 81920, 100, 10, 1, 2), op(0, OpRelease, "a", "released", 0, 3, 4), acq(1, "b", 81920, 100, 11, 5, 6),
		}, nil, porcupine.Ok},
		{"room made by an expiry the final table dates", []Record{
			acq(0, "a", 81920, 100, 10, 1, 2), acq(1, "b", 81920, 100, 11, 5e6, 6e6),
		}, []*gpupoolv1.Lease{{Id: "a", RequestId: "req-a", State: gpupoolv1.LeaseState_LEASE_STATE_EXPIRED, StateChangedAtMs: 3}}, porcupine.Ok},
		{"a renewal acknowledged after the lease's expiry", []Record{
			acq(0, "a", 1024, 1, 10, 1, 2), op(1, OpKeepAlive, "a", "ok", 0, 5e6, 6e6),
		}, []*gpupoolv1.Lease{{Id: "a", RequestId: "req-a", State: gpupoolv1.LeaseState_LEASE_STATE_EXPIRED, StateChangedAtMs: 3}}, porcupine.Illegal},
		{"a renewal acknowledged while the expiry is being decided", []Record{
			acq(0, "a", 1024, 1, 10, 1, 2), op(1, OpKeepAlive, "a", "ok", 0, 2e6, 5e6),
		}, []*gpupoolv1.Lease{{Id: "a", RequestId: "req-a", State: gpupoolv1.LeaseState_LEASE_STATE_EXPIRED, StateChangedAtMs: 3}}, porcupine.Ok},
		{"a renewal acknowledged after a revocation was stamped, before it committed", []Record{
			acq(0, "a", 1024, 1, 10, 1, 2), op(1, OpKeepAlive, "a", "ok", 0, 5e6, 6e6),
		}, []*gpupoolv1.Lease{{Id: "a", RequestId: "req-a", State: gpupoolv1.LeaseState_LEASE_STATE_REVOKED, StateChangedAtMs: 3}}, porcupine.Ok},
		{"a fencing token that goes backwards", []Record{
			acq(0, "a", 1024, 1, 10, 1, 2), acq(1, "b", 1024, 1, 9, 3, 4),
		}, nil, porcupine.Illegal},
		{"concurrent grants whose fencing order is their linearization", []Record{
			acq(0, "a", 1024, 1, 10, 1, 4), acq(1, "b", 1024, 1, 9, 2, 3),
		}, nil, porcupine.Ok},
		{"a renewal after an acknowledged release", []Record{
			acq(0, "a", 1024, 1, 10, 1, 2), op(0, OpRelease, "a", "released", 0, 3, 4), op(1, OpKeepAlive, "a", "ok", 0, 5, 6),
		}, nil, porcupine.Illegal},
		{"a released lease seen granted again", []Record{
			acq(0, "a", 1024, 1, 10, 1, 2), op(0, OpRelease, "a", "released", 0, 3, 4), op(1, OpGet, "a", "granted", 10, 5, 6),
		}, nil, porcupine.Illegal},
		{"a granted lease that vanishes", []Record{
			acq(0, "a", 1024, 1, 10, 1, 2), op(1, OpGet, "a", "missing", 0, 3, 4),
		}, nil, porcupine.Illegal},
		{"a get with another fencing token", []Record{
			acq(0, "a", 1024, 1, 10, 1, 2), op(1, OpGet, "a", "granted", 11, 3, 4),
		}, nil, porcupine.Illegal},
		{"an acquire without an answer that the final table shows granted", []Record{
			acq(0, "a", 81920, 100, 10, 1, 2),
			{Client: 1, Kind: OpAcquire, RequestID: "req-x", Unknown: true, Call: 3, Ret: 4},
		}, []*gpupoolv1.Lease{{Id: "x", RequestId: "req-x", FencingToken: 11, State: gpupoolv1.LeaseState_LEASE_STATE_GRANTED,
			Slices: []*gpupoolv1.Slice{{Device: gpu, MemoryMib: 1024, ComputePercent: 1}}}}, porcupine.Illegal},
		{"an unanswered release that took effect makes room", []Record{
			acq(0, "a", 81920, 100, 10, 1, 2), {Client: 0, Kind: OpRelease, Lease: "a", Unknown: true, Call: 3, Ret: 4},
			acq(1, "b", 81920, 100, 11, 5, 6),
		}, []*gpupoolv1.Lease{{Id: "a", RequestId: "req-a", State: gpupoolv1.LeaseState_LEASE_STATE_RELEASED}}, porcupine.Ok},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			res := Check(tt.records, tt.final, devices, t.TempDir(), 10*time.Second)
			if res.Result != tt.want {
				t.Fatalf("got %s, want %s; violations: %+v", res.Result, tt.want, res.Violations)
			}
			if tt.want == porcupine.Illegal {
				if len(res.Violations) != 1 || !strings.Contains(res.Violations[0].Window, "acquire") {
					t.Fatalf("got violations %+v, want one with the history window", res.Violations)
				}
			}
		})
	}
}
