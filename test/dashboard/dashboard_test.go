// Package dashboard_test checks the Grafana dashboards in deploy/grafana
// against the metrics the broker and the agent really register: every
// query must parse as PromQL (Prometheus' own parser) and every metric it
// names must exist. It is a module of its own so that the product's
// go.mod does not carry Prometheus' server.
package dashboard_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/prometheus/promql/parser"

	"github.com/gpupool/gpupool/agent"
	"github.com/gpupool/gpupool/agent/device"
	"github.com/gpupool/gpupool/broker"
)

const (
	grafanaDir     = "../../deploy/grafana"
	chartDashboard = "../../deploy/helm/gpupool/dashboards/gpupool.json"
)

var fqName = regexp.MustCompile(`fqName: "([^"]+)"`)

// namesOf lists what reg can expose: every described metric, and for the
// histograms and summaries it gathers, their _bucket, _sum and _count
// series.
func namesOf(t *testing.T, reg *prometheus.Registry, into map[string]string) {
	t.Helper()
	ch := make(chan *prometheus.Desc)
	go func() {
		reg.Describe(ch)
		close(ch)
	}()
	for d := range ch {
		m := fqName.FindStringSubmatch(d.String())
		if m == nil {
			t.Fatalf("cannot read the name of %s", d)
		}
		into[m[1]] = "described"
	}
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range fams {
		into[f.GetName()] = f.GetType().String()
		switch f.GetType() {
		case dto.MetricType_HISTOGRAM, dto.MetricType_GAUGE_HISTOGRAM:
			into[f.GetName()+"_bucket"] = "histogram bucket"
			fallthrough
		case dto.MetricType_SUMMARY:
			into[f.GetName()+"_sum"] = "sum"
			into[f.GetName()+"_count"] = "count"
		}
	}
}

func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// registered starts a real broker and a real agent (simulated GPUs) in
// this process and returns the metric names their registries expose, as
// 'gpupool broker' and 'gpupool agent' serve them.
func registered(t *testing.T) map[string]string {
	t.Helper()
	names := map[string]string{}
	s, err := broker.New(broker.Config{DataDir: t.TempDir(), BindAddr: freeAddr(t), RaftBindAddr: freeAddr(t), BootstrapExpect: 1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Shutdown() })
	namesOf(t, s.Metrics(), names)

	backend, err := device.NewSimulated("2xA100-80GB", "host-1")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { backend.Close() })
	a, err := agent.New(agent.Config{Brokers: []string{s.Addr()}, HostID: "host-1", Backend: backend, DataDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(a.Collector(), collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	namesOf(t, reg, names)
	return names
}

type dashboard struct {
	Title  string  `json:"title"`
	UID    string  `json:"uid"`
	Panels []panel `json:"panels"`
}

type panel struct {
	ID         int    `json:"id"`
	Title      string `json:"title"`
	Type       string `json:"type"`
	Datasource *struct {
		UID string `json:"uid"`
	} `json:"datasource"`
	Targets []struct {
		RefID string `json:"refId"`
		Expr  string `json:"expr"`
	} `json:"targets"`
	Panels []panel `json:"panels"` // a collapsed row's
}

func flatten(ps []panel) []panel {
	var out []panel
	for _, p := range ps {
		out = append(out, p)
		out = append(out, flatten(p.Panels)...)
	}
	return out
}

// check returns what is wrong with a dashboard: expressions that do not
// parse, metrics that nothing registers, panels without queries or
// without the datasource variable, duplicate panel ids.
func check(d dashboard, names map[string]string) []string {
	var bad []string
	p := parser.NewParser(parser.Options{})
	ids := map[int]bool{}
	for _, pn := range flatten(d.Panels) {
		if ids[pn.ID] {
			bad = append(bad, fmt.Sprintf("panel %q: id %d used twice", pn.Title, pn.ID))
		}
		ids[pn.ID] = true
		if pn.Type == "row" {
			continue
		}
		if len(pn.Targets) == 0 {
			bad = append(bad, fmt.Sprintf("panel %q: no query", pn.Title))
		}
		if pn.Datasource == nil || pn.Datasource.UID != "${datasource}" {
			bad = append(bad, fmt.Sprintf("panel %q: datasource must be the ${datasource} variable", pn.Title))
		}
		for _, tg := range pn.Targets {
			expr, err := p.ParseExpr(tg.Expr)
			if err != nil {
				bad = append(bad, fmt.Sprintf("panel %q query %s: %q does not parse: %v", pn.Title, tg.RefID, tg.Expr, err))
				continue
			}
			metrics := 0
			parser.Inspect(expr, func(n parser.Node, _ []parser.Node) error {
				vs, ok := n.(*parser.VectorSelector)
				if !ok {
					return nil
				}
				name := vs.Name
				for _, m := range vs.LabelMatchers {
					if m.Name == "__name__" {
						name = m.Value
					}
				}
				metrics++
				if _, ok := names[name]; !ok {
					bad = append(bad, fmt.Sprintf("panel %q query %s: metric %s is not registered by the broker or the agent", pn.Title, tg.RefID, name))
				}
				return nil
			})
			if metrics == 0 {
				bad = append(bad, fmt.Sprintf("panel %q query %s: names no metric", pn.Title, tg.RefID))
			}
		}
	}
	return bad
}

func TestEveryDashboardQueryParsesAndNamesARegisteredMetric(t *testing.T) {
	names := registered(t)
	for _, want := range []string{"gpupool_hosts", "gpupool_raft_apply_seconds_bucket", "gpupool_agent_lease_violations_total"} {
		if _, ok := names[want]; !ok {
			t.Fatalf("the registries lack %s: the name gathering is broken (got %d names)", want, len(names))
		}
	}
	files, _ := filepath.Glob(filepath.Join(grafanaDir, "*.json"))
	if len(files) == 0 {
		t.Fatalf("no dashboard in %s", grafanaDir)
	}
	for _, f := range files {
		t.Run(filepath.Base(f), func(t *testing.T) {
			b, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			var d dashboard
			if err := json.Unmarshal(b, &d); err != nil {
				t.Fatalf("not JSON: %v", err)
			}
			if d.Title == "" || d.UID == "" {
				t.Errorf("title %q, uid %q: want both set", d.Title, d.UID)
			}
			queries := 0
			for _, p := range flatten(d.Panels) {
				queries += len(p.Targets)
			}
			if queries < 10 {
				t.Errorf("got %d queries, want a dashboard (10 or more)", queries)
			}
			for _, msg := range check(d, names) {
				t.Error(msg)
			}
		})
	}
}

func TestTheCheckFindsUnknownMetricsAndBadQueries(t *testing.T) {
	names := map[string]string{"gpupool_hosts": "GAUGE"}
	d := dashboard{Panels: []panel{{ID: 1, Title: "p"}}}
	d.Panels[0].Datasource = &struct {
		UID string `json:"uid"`
	}{"${datasource}"}
	d.Panels[0].Targets = append(d.Panels[0].Targets,
		struct {
			RefID string `json:"refId"`
			Expr  string `json:"expr"`
		}{"A", "max by (status) (gpupool_hosts)"},
		struct {
			RefID string `json:"refId"`
			Expr  string `json:"expr"`
		}{"B", `rate(gpupool_no_such_total[5m]) / on() {__name__="gpupool_hosts"}`},
		struct {
			RefID string `json:"refId"`
			Expr  string `json:"expr"`
		}{"C", "sum(gpupool_hosts"})
	got := check(d, names)
	sort.Strings(got)
	want := []string{
		`panel "p" query B: metric gpupool_no_such_total is not registered by the broker or the agent`,
		`panel "p" query C: "sum(gpupool_hosts" does not parse`,
	}
	if len(got) != len(want) || !strings.HasPrefix(got[1], want[1]) || got[0] != want[0] {
		t.Errorf("got %q, want %q", got, want)
	}
}

func TestTheChartShipsTheSameDashboard(t *testing.T) {
	want, err := os.ReadFile(filepath.Join(grafanaDir, "gpupool.json"))
	if err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile(chartDashboard)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Errorf("%s differs from %s: copy it (cp deploy/grafana/gpupool.json deploy/helm/gpupool/dashboards/)", chartDashboard, filepath.Join(grafanaDir, "gpupool.json"))
	}
}
