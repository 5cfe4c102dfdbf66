package placement

import (
	"fmt"
	"math"
	"path/filepath"
	"runtime"
	"strings"
	"time"

	benchreport "github.com/gpupool/gpupool/bench/report"

	"github.com/gpupool/gpupool/bench/plot"
	"github.com/gpupool/gpupool/broker/placement"
)

// published is the FGD paper's unallocated GPU % at 100 % arrived (mean, sd over seeds
// 42–51) by trace and policy, from its Table. The paper's FGD knows the
// mix in advance: it is fgd-oracle here.
var published = map[string]map[string][2]float64{
	"default":    {"random": {13.70, 0.33}, "dot-product": {9.38, 0.19}, "gpu-clustering": {8.35, 0.61}, "gpu-packing": {8.22, 0.53}, "best-fit": {7.14, 0.14}, FGDOracle: {4.77, 0.11}},
	"gpushare40": {"random": {15.14, 0.34}, "dot-product": {10.70, 0.14}, "gpu-clustering": {10.24, 0.62}, "gpu-packing": {10.23, 0.53}, "best-fit": {8.56, 0.20}, FGDOracle: {6.04, 0.07}},
	"multigpu20": {"random": {13.08, 0.52}, "dot-product": {8.15, 0.32}, "gpu-clustering": {6.66, 0.60}, "gpu-packing": {6.50, 0.64}, "best-fit": {6.27, 0.25}, FGDOracle: {4.47, 0.16}},
	"gpuspec10":  {"random": {13.74, 0.25}, "dot-product": {9.83, 0.39}, "gpu-clustering": {8.04, 0.71}, "gpu-packing": {7.76, 0.65}, "best-fit": {6.90, 0.21}, FGDOracle: {5.34, 0.19}},
}

// reportPoints are the arrived percentages the table reports.
var reportPoints = []int{90, 100, 110, 130}

// stat summarises one figure over seeds.
type stat struct {
	Mean float64 `json:"mean"`
	SD   float64 `json:"sd"`
	Min  float64 `json:"min"`
	Max  float64 `json:"max"`
}

func statOf(xs []float64) stat {
	s := stat{Min: math.Inf(1), Max: math.Inf(-1)}
	for _, x := range xs {
		s.Mean += x
		s.Min, s.Max = min(s.Min, x), max(s.Max, x)
	}
	s.Mean /= float64(len(xs))
	for _, x := range xs {
		s.SD += (x - s.Mean) * (x - s.Mean)
	}
	if len(xs) > 1 {
		s.SD = math.Sqrt(s.SD / float64(len(xs)-1))
	}
	return s
}

// at is the curve's value at pct % arrived; past the curve's end (a replay whose last task
// arrived before pct), its last value.
func at(curve []float64, pct int) float64 {
	if len(curve) == 0 {
		return 100
	}
	return curve[min(pct/curveStep, len(curve)-1)]
}

// reference is a standalone reference of the FGD paper's experiment (written apart from this
// repository; on the default trace it reproduces the paper's published figures), run on each
// trace: unallocated GPU % at 100 % arrived, mean and sd over seeds 42–51, by our policy
// names. Its random, dot-product, gpu-clustering, gpu-packing, best-fit and FGD (the oracle
// mix) are the paper's six policies.
var reference = map[string]map[string][2]float64{
	"default":    {"random": {13.70, 0.35}, "dot-product": {9.38, 0.19}, "gpu-clustering": {8.35, 0.61}, "gpu-packing": {8.22, 0.53}, "best-fit": {7.14, 0.14}, FGDOracle: {4.77, 0.11}},
	"gpushare40": {"random": {15.17, 0.37}, "dot-product": {10.70, 0.14}, "gpu-clustering": {10.24, 0.62}, "gpu-packing": {10.23, 0.53}, "best-fit": {8.56, 0.20}, FGDOracle: {6.04, 0.07}},
	"multigpu20": {"random": {13.20, 0.41}, "dot-product": {8.15, 0.32}, "gpu-clustering": {6.66, 0.60}, "gpu-packing": {6.50, 0.64}, "best-fit": {6.27, 0.25}, FGDOracle: {4.47, 0.16}},
	"gpuspec10":  {"random": {13.76, 0.34}, "dot-product": {9.83, 0.39}, "gpu-clustering": {8.04, 0.71}, "gpu-packing": {7.76, 0.65}, "best-fit": {6.90, 0.21}, FGDOracle: {5.37, 0.22}},
}

type policyReport struct {
	Policy string `json:"policy"`
	// Unalloc maps the arrived % ("90", "100", …) to the unallocated GPU % of capacity.
	Unalloc    map[string]stat `json:"unalloc_pct"`
	FinalAlloc stat            `json:"final_alloc_pct"`
	// Reference is the reference's unallocated % at 100 % arrived, mean and sd; absent when
	// it has no such policy.
	Reference *[2]float64 `json:"reference_unalloc_100,omitempty"`
	// Published is the paper's unallocated % at 100 % arrived, mean and sd; absent when the
	// paper has no figure for this policy and trace.
	Published *[2]float64 `json:"published_unalloc_100,omitempty"`
	// CurveArrived and CurveUnalloc are the mean curve, in % of capacity.
	CurveArrived []float64  `json:"curve_arrived_pct"`
	CurveUnalloc []float64  `json:"curve_unalloc_mean_pct"`
	Seeds        []*outcome `json:"seeds"`
}

// traceReport is every policy on one trace.
type traceReport struct {
	Trace    string          `json:"trace"`
	Policies []*policyReport `json:"policies"`
	// Bound is a lower bound on the unallocated % at 100 % arrived for any placement (see
	// sliverBound), over the seeds.
	Bound stat `json:"bound_unalloc_100"`
}

// scalePoint is the default policy's placement rate on a pool of Hosts hosts.
type scalePoint struct {
	Hosts            int     `json:"hosts"`
	PlacementsPerSec float64 `json:"placements_per_sec"`
	// PerCPUSecond is placements per second of the placing thread's CPU time, and
	// CPUMicrosPerPlacement its inverse: what a placement costs, however loaded the machine.
	PerCPUSecond          float64 `json:"placements_per_cpu_sec"`
	CPUMicrosPerPlacement float64 `json:"cpu_micros_per_placement"`
}

type report struct {
	Date    string `json:"date"`
	Machine struct {
		NumCPU    int    `json:"num_cpu"`
		GOARCH    string `json:"goarch"`
		GOOS      string `json:"goos"`
		GoVersion string `json:"go_version"`
	} `json:"machine"`
	Config        *config         `json:"config"`
	ReplaySeconds float64         `json:"replay_seconds"`
	TotalSeconds  float64         `json:"total_seconds"`
	Notes         []string        `json:"notes"`
	Traces        []*traceReport  `json:"traces"`
	MixShift      *mixShiftReport `json:"mix_shift,omitempty"`
	// Rates is placements/s of each policy on the synthetic pool; Scale the default's curve.
	Rates map[string]rate `json:"placements_per_sec"`
	Scale []scalePoint    `json:"scale"`
}

// notes on the replay, written into every report.
var notes = []string{
	"The replay is the FGD paper's experiment as its artifact runs it: tasks sorted by name and shuffled by the seed, clones of the name-sorted tasks appended up to 130 % of the GPU capacity, ties broken by a seeded permutation of the name-sorted nodes, the artifact's integer scores, and its metric (the mean allocation over the arrivals whose arrived request rounds to each whole percent).",
	"Tasks without GPUs (num_gpu 0) are placed with placement.PlaceHost, which rates hosts by the same policy; the broker itself leases GPUs only.",
	"A share of a GPU is a lease of gpu_milli/10 % compute and gpu_milli × 16 MiB on 16000 MiB GPUs, so it is exact; gpu_spec becomes a model constraint with | alternatives.",
	"The bound: a GPU holds at most one task of a share m above θ ≥ 500, and the rest of it, 1000 − m, only tasks of less than 1000 − θ; so the shares of such tasks leave at least Σ(1000 − m) less the request of the small tasks free, unless tasks are refused, which the unallocated share counts in full (it is capacity − arrived + refused). The bound takes the best θ and the cheapest refusals, per arrival, averaged as the metric averages; it ignores CPU, memory, models and hosts, so the true least is higher.",
	"fgd is the broker's default: FGD with its look-ahead, the mix learned online from the tasks offered so far (never the trace's future). fgd-oracle is the paper's FGD: the mix of the trace's tasks, known in advance.",
}

func newReport(cfg *config) *report {
	shown := *cfg // the report names the trace files, not where this machine keeps them
	shown.Nodes, shown.Pods = filepath.Base(cfg.Nodes), nil
	for _, p := range cfg.Pods {
		shown.Pods = append(shown.Pods, filepath.Base(p))
	}
	r := &report{Date: time.Now().UTC().Format(time.RFC3339), Config: &shown, Notes: notes, Rates: map[string]rate{}}
	r.Machine.NumCPU, r.Machine.GOARCH, r.Machine.GOOS, r.Machine.GoVersion = runtime.NumCPU(), runtime.GOARCH, runtime.GOOS, runtime.Version()
	return r
}

// addTrace adds the outcomes of every policy on one trace.
func (r *report) addTrace(trace string, outcomes map[string][]*outcome, bounds []float64) {
	tr := &traceReport{Trace: trace, Bound: statOf(bounds)}
	for _, p := range r.Config.Policies {
		pr := summarise(p, outcomes[p], r.Config.Inflate)
		if pub, ok := published[trace][p]; ok {
			pr.Published = &pub
		}
		if ref, ok := reference[trace][p]; ok {
			pr.Reference = &ref
		}
		tr.Policies = append(tr.Policies, pr)
	}
	r.Traces = append(r.Traces, tr)
}

// summarise is one policy's outcomes over the seeds.
func summarise(policy string, os []*outcome, inflate float64) *policyReport {
	pr := &policyReport{Policy: policy, Unalloc: map[string]stat{}, Seeds: os}
	for _, pt := range reportPoints {
		var xs []float64
		for _, o := range os {
			xs = append(xs, at(o.Unalloc, pt))
		}
		pr.Unalloc[fmt.Sprint(pt)] = statOf(xs)
	}
	var final []float64
	for _, o := range os {
		final = append(final, o.FinalAlloc)
	}
	pr.FinalAlloc = statOf(final)
	for pct := 75; pct <= int(math.Round(inflate*100)); pct += curveStep {
		var sum float64
		for _, o := range os {
			sum += at(o.Unalloc, pct)
		}
		pr.CurveArrived = append(pr.CurveArrived, float64(pct))
		pr.CurveUnalloc = append(pr.CurveUnalloc, sum/float64(len(os)))
	}
	return pr
}

// write writes placement.json, placement.md, a placement-TRACE.png per trace and
// placement-scale.png to dir and returns their paths.
func (r *report) write(dir string) ([]string, error) {
	var charts []benchreport.Chart
	for _, tr := range r.Traces {
		chart := plot.Chart{
			Title:  fmt.Sprintf("openb %s: unallocated GPU vs arrived GPU request (mean of %d seeds)", tr.Trace, len(r.Config.Seeds)),
			XLabel: "arrived GPU request (% of capacity)", YLabel: "unallocated GPU (% of capacity)",
		}
		for _, p := range tr.Policies {
			chart.Series = append(chart.Series, plot.Series{Name: p.Policy, X: p.CurveArrived, Y: p.CurveUnalloc})
		}
		charts = append(charts, benchreport.Chart{Name: "placement-" + tr.Trace, Chart: chart})
	}
	if len(r.Scale) > 0 {
		chart := plot.Chart{
			Title:  "placement cost of the default policy (fgd, index) vs pool size, hosts × 8 GPUs",
			XLabel: "hosts (thousands)", YLabel: "CPU microseconds per placement", ZeroY: true,
		}
		var xs, ys []float64
		for _, p := range r.Scale {
			if p.PerCPUSecond > 0 {
				xs, ys = append(xs, float64(p.Hosts)/1000), append(ys, p.CPUMicrosPerPlacement)
			}
		}
		if len(xs) == 0 { // too fast for the thread's CPU clock: plot wall time
			for _, p := range r.Scale {
				xs, ys = append(xs, float64(p.Hosts)/1000), append(ys, 1e6/p.PlacementsPerSec)
			}
		}
		chart.Series = append(chart.Series, plot.Series{Name: "fgd", X: xs, Y: ys})
		charts = append(charts, benchreport.Chart{Name: "placement-scale", Chart: chart})
	}
	return benchreport.Write(benchreport.Results{Dir: dir, Name: "placement", JSON: r, Markdown: r.markdown(), Charts: charts})
}

// markdown renders the results tables.
func (r *report) markdown() string {
	var b strings.Builder
	seeds := fmt.Sprintf("seeds %d–%d", r.Config.Seeds[0], r.Config.Seeds[len(r.Config.Seeds)-1])
	b.WriteString("# Placement: the openb traces\n\n")
	fmt.Fprintf(&b, "Unallocated GPU %% of capacity at 100 %% of capacity arrived: mean ± sd over %s (lower is better). "+
		"Reference: the standalone reference of the FGD paper's experiment, run on each trace; published: the paper (ATC '23). "+
		"%s, %d CPUs, %s; replay %.0f s, total %.0f s.\n\n", seeds, r.Date, r.Machine.NumCPU, r.Machine.GOARCH, r.ReplaySeconds, r.TotalSeconds)
	if r.Config.Reuse != "" {
		fmt.Fprintf(&b, "The outcomes of %s were read from an earlier run of the same seeds (`--reuse %s`), not replayed: "+
			"their placements had not changed since.\n\n", strings.Join(r.Config.ReusePolicies, ", "), r.Config.Reuse)
	}
	pm := func(v [2]float64) string { return fmt.Sprintf("%.2f ± %.2f", v[0], v[1]) }
	for _, tr := range r.Traces {
		fmt.Fprintf(&b, "## %s\n\n", tr.Trace)
		b.WriteString("| policy | ours @100 % | reference @100 % | ours − reference | published @100 % | @90 % | @110 % | @130 % | final allocation % |\n")
		b.WriteString("|---|---|---|---|---|---|---|---|---|\n")
		var oracle float64
		for _, p := range tr.Policies {
			if p.Policy == FGDOracle && p.Reference != nil {
				oracle = p.Reference[0]
			}
		}
		for _, p := range tr.Policies {
			u := p.Unalloc["100"]
			ref, diff, pub := "–", "–", "–"
			if p.Reference != nil {
				ref, diff = pm(*p.Reference), fmt.Sprintf("%+.2f", u.Mean-p.Reference[0])
			}
			if p.Published != nil {
				pub = pm(*p.Published)
			}
			name := p.Policy
			if p.Policy == placement.FGD && oracle > 0 {
				name = fmt.Sprintf("**fgd (default, online)**: %.2f× the reference FGD", u.Mean/oracle)
			}
			fmt.Fprintf(&b, "| %s | %.2f ± %.2f | %s | %s | %s | %.2f | %.2f | %.2f | %.2f |\n", name, u.Mean, u.SD, ref, diff, pub,
				p.Unalloc["90"].Mean, p.Unalloc["110"].Mean, p.Unalloc["130"].Mean, p.FinalAlloc.Mean)
		}
		b.WriteString("\n")
		if tr.Bound.Mean > 0 {
			fmt.Fprintf(&b, "No placement, even one knowing every task in advance, can leave less than %.2f ± %.2f %% unallocated "+
				"at 100 %% arrived on this trace (a bound from the GPU shares alone; see the notes)", tr.Bound.Mean, tr.Bound.SD)
			if oracle > 0 {
				fmt.Fprintf(&b, "; 0.8× the reference FGD is %.2f", 0.8*oracle)
			}
			b.WriteString(".\n\n")
		}
	}
	if ms := r.MixShift; ms != nil {
		fmt.Fprintf(&b, "## Mix shift: %s, then %s\n\n", ms.From, ms.To)
		fmt.Fprintf(&b, "The %s trace's tasks until 65 %% of capacity has arrived, then the %s trace's; fgd learns online, "+
			"fgd-oracle knows the mix of both traces in advance.\n\n", ms.From, ms.To)
		b.WriteString("| policy | @90 % | @100 % | @110 % | @130 % |\n|---|---|---|---|---|\n")
		for _, p := range ms.Policies {
			cell := func(pt string) string { return fmt.Sprintf("%.2f ± %.2f", p.Unalloc[pt].Mean, p.Unalloc[pt].SD) }
			fmt.Fprintf(&b, "| %s | %s | %s | %s | %s |\n", p.Policy, cell("90"), cell("100"), cell("110"), cell("130"))
		}
		b.WriteString("\n")
	}
	if len(r.Rates) > 0 {
		fmt.Fprintf(&b, "## Placements/s\n\nThe engine alone with its index, %d hosts × 8 GPUs, every host eligible, the %s trace's GPU tasks in order (up to %d).\n\n",
			r.Config.SyntheticHosts, r.Traces[0].Trace, r.Config.SyntheticTasks)
		b.WriteString("| policy | placements/s | per CPU second |\n|---|---|---|\n")
		for _, p := range r.Config.Policies {
			fmt.Fprintf(&b, "| %s | %.0f | %.0f |\n", p, r.Rates[p].Wall, r.Rates[p].CPU)
		}
		b.WriteString("\n")
	}
	if len(r.Scale) > 0 {
		b.WriteString("## Scale\n\nThe default policy (fgd), the engine alone with its index, as the pool grows (`placement-scale.png`).\n\n")
		b.WriteString("| hosts | GPUs | placements/s | per CPU second | CPU µs per placement |\n|---|---|---|---|---|\n")
		for _, p := range r.Scale {
			fmt.Fprintf(&b, "| %d | %d | %.0f | %.0f | %.1f |\n", p.Hosts, 8*p.Hosts, p.PlacementsPerSec, p.PerCPUSecond, p.CPUMicrosPerPlacement)
		}
		b.WriteString("\n")
	}
	b.WriteString("Notes:\n\n")
	for _, n := range r.Notes {
		fmt.Fprintf(&b, "- %s\n", n)
	}
	return b.String()
}
