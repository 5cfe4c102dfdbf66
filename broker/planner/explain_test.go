package planner

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/gpupool/gpupool/broker/placement"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

func TestWhyAPendingLeaseWaits(t *testing.T) {
	now := time.UnixMilli(10_000)
	leaving := held("p", pre, 0, 100, "h1/0")
	leaving.PreemptedFor, leaving.PreemptAtMs = "g", 12_000
	tests := []struct {
		name  string
		w     world
		lease string
		want  string
	}{
		{"a lease that fits is granted next",
			world{gpus: map[string]int{"h1": 1}, leases: []*gpupoolv1.Lease{waiting("a", gua, 0, 1)}}, "a",
			"fits now: the queue grants it next"},
		{"a lease preempting others names them and when they go",
			world{gpus: map[string]int{"h1": 1}, leases: []*gpupoolv1.Lease{leaving, waiting("g", gua, 0, 1)}}, "g",
			"preempting 1 lease (p), revoked in 2s"},
		{"a lease behind others counts the requests ahead",
			world{gpus: map[string]int{"h1": 2}, leases: []*gpupoolv1.Lease{waiting("a", gua, 0, 1), waiting("b", gua, 0, 1)}}, "b",
			"fits now: the queue grants it next; 1 request ahead in the queue"},
		{"a tenant at its quota is named",
			world{gpus: map[string]int{"h1": 2}, leases: []*gpupoolv1.Lease{held("k", gua, 0, 1, "h1/0"), waiting("a", gua, 0, 1)},
				quotas: []*gpupoolv1.Quota{{Tenant: "default", Gpus: 1}}}, "a",
			"tenant default at 100% of gpus quota"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			st := tt.w.state(t)
			if got := NewExplainer(st, binpack, now).Why(st.Lease(tt.lease)); !strings.Contains(got, tt.want) {
				t.Fatalf("why %s waits: got %q, want it to say %q", tt.lease, got, tt.want)
			}
		})
	}
}

func TestPreemptionHintSaysWhenPreemptingWouldMakeRoom(t *testing.T) {
	w := world{gpus: map[string]int{"h1": 1}, leases: []*gpupoolv1.Lease{held("p", pre, 0, 100, "h1/0")}}
	st := w.state(t)
	full := &placement.Error{Reason: "no GPU free"}
	tests := []struct {
		name  string
		class gpupoolv1.LeaseClass
		want  string
	}{
		{"a guaranteed request learns how to get the room", gua,
			"no GPU free; preempting 1 preemptible lease would make room: acquire with a wait of more than the 30s grace (e.g. --wait 2m)"},
		{"a preemptible request gets placement's reason alone", pre, "no GPU free"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := &gpupoolv1.LeaseRequest{Count: 1, Exclusive: true, Class: tt.class}
			err := PreemptionHint(st, st.HostsWithDevices(), r, full, binpack, 30*time.Second)
			var pe *placement.Error
			if !errors.As(err, &pe) || err.Error() != tt.want {
				t.Fatalf("got %v, want a placement error %q", err, tt.want)
			}
		})
	}
}
