package placement

import (
	"context"
	"fmt"
	"io"
	"slices"

	"github.com/gpupool/gpupool/broker/placement"
)

// mixShiftReport is the replay whose mix changes halfway: the first trace's tasks until half
// the inflated request has arrived, then the second's.
type mixShiftReport struct {
	From, To string
	// Policies are fgd (learning online) and fgd-oracle (the mix of both traces, known in
	// advance).
	Policies []*policyReport `json:"policies"`
}

// shiftArrival is seed's arrival of from's tasks up to half of inflate × capacity, then to's
// up to as much again, ties broken by from's node order.
func shiftArrival(nodes []node, from, to []task, seed int64, inflate float64) *arrival {
	a := arrive(nodes, from, seed, inflate/2)
	b := arrive(nodes, to, seed, inflate/2)
	a.tasks = append(slices.Clone(a.tasks), b.tasks...)
	return a
}

// mixShift replays fgd and fgd-oracle on every seed over the shifting mix.
// The outcomes of the policies reuse has are read from it.
func mixShift(ctx context.Context, cfg *config, nodes []node, fromName string, from []task, toName string, to []task, reuse *reused, stderr io.Writer) (*mixShiftReport, error) {
	both := append(slices.Clone(from), to...)
	rep := &mixShiftReport{From: fromName, To: toName}
	for _, p := range []string{placement.FGD, FGDOracle} {
		if reuse.has(p) {
			os, err := reuse.outcomes("", p, true, cfg.Seeds)
			if err != nil {
				return nil, err
			}
			rep.Policies = append(rep.Policies, summarise(p, os, cfg.Inflate))
			continue
		}
		var os []*outcome
		for _, s := range cfg.Seeds {
			if err := ctx.Err(); err != nil {
				return nil, err
			}
			o, err := replay(ctx, nodes, both, shiftArrival(nodes, from, to, s, cfg.Inflate), p, nil)
			if err != nil {
				return nil, err
			}
			fmt.Fprintf(stderr, "placement: mix shift %s → %s: %s seed %d: unallocated %.2f%% at 100%% arrived\n",
				fromName, toName, p, s, at(o.Unalloc, 100))
			os = append(os, o)
		}
		rep.Policies = append(rep.Policies, summarise(p, os, cfg.Inflate))
	}
	return rep, nil
}
