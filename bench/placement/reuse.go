package placement

import (
	"encoding/json"
	"fmt"
	"os"
	"slices"
)

// reused is the outcomes of an earlier run (--reuse) for the policies of --reuse-policies:
// policies whose placements have not changed since need not be replayed again.
type reused struct {
	file     string
	policies []string
	// traces maps a trace name to each reused policy's outcomes, in --seeds order;
	// shift is the same for the mix-shift replay.
	traces map[string]map[string][]*outcome
	shift  map[string][]*outcome
}

// loadReused reads file, a placement.json, and keeps the outcomes of policies. It refuses a
// report whose inflation or seeds differ from cfg's, since its outcomes would not be those of
// this run.
func loadReused(file string, policies []string, cfg *config) (*reused, error) {
	data, err := os.ReadFile(file)
	if err != nil {
		return nil, fmt.Errorf("--reuse %s: %v", file, err)
	}
	var rep report
	if err := json.Unmarshal(data, &rep); err != nil {
		return nil, fmt.Errorf("--reuse %s: not a placement report: %v", file, err)
	}
	if rep.Config == nil || rep.Config.Inflate != cfg.Inflate || !slices.Equal(rep.Config.Seeds, cfg.Seeds) {
		return nil, fmt.Errorf("--reuse %s: its run had other seeds or --inflate: reuse only a run of the same --seeds and --inflate", file)
	}
	r := &reused{file: file, policies: policies, traces: map[string]map[string][]*outcome{}, shift: map[string][]*outcome{}}
	for _, tr := range rep.Traces {
		r.traces[tr.Trace] = map[string][]*outcome{}
		for _, p := range tr.Policies {
			if slices.Contains(policies, p.Policy) {
				r.traces[tr.Trace][p.Policy] = p.Seeds
			}
		}
	}
	if rep.MixShift != nil {
		for _, p := range rep.MixShift.Policies {
			if slices.Contains(policies, p.Policy) {
				r.shift[p.Policy] = p.Seeds
			}
		}
	}
	return r, nil
}

// has reports whether policy's outcomes are reused.
func (r *reused) has(policy string) bool { return r != nil && slices.Contains(r.policies, policy) }

// outcomes are policy's reused outcomes on trace (or the mix shift, when shift), one per seed
// of seeds, or an error naming what the file lacks.
func (r *reused) outcomes(trace, policy string, shift bool, seeds []int64) ([]*outcome, error) {
	os := r.traces[trace][policy]
	where := "trace " + trace
	if shift {
		os, where = r.shift[policy], "the mix-shift replay"
	}
	if len(os) != len(seeds) {
		return nil, fmt.Errorf("--reuse %s: no outcomes of %s on %s for every seed: replay it (leave it out of --reuse-policies)",
			r.file, policy, where)
	}
	for i, o := range os {
		if o == nil || o.Seed != seeds[i] {
			return nil, fmt.Errorf("--reuse %s: %s on %s: seed %d missing: replay it (leave it out of --reuse-policies)",
				r.file, policy, where, seeds[i])
		}
	}
	return os, nil
}
