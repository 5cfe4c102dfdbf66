package placement

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

const (
	nodesCSV = "sn,cpu_milli,memory_mib,gpu,model\n" +
		"n0,32000,131072,2,T4\nn1,64000,262144,4,V100M16\nn2,8000,32768,1,T4\nn3,96000,393216,8,G2\nn4,48000,376832,4,V100M32\n"
	podsCSV = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec\n" +
		"p0,4000,8192,1,500,\np1,8000,16384,1,1000,\np2,2000,4096,0,0,\np3,16000,65536,2,1000,\n" +
		"p4,1000,2048,1,250,T4\np5,6000,12288,1,460,V100M16|V100M32\np6,32000,131072,4,1000,\np7,3000,8192,1,300,\n"
)

// writeFile writes content to name in a temporary directory and returns its path.
func writeFile(t *testing.T, name, content string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

func TestTraceLoaderRefusesBadFilesWithFileAndLine(t *testing.T) {
	for _, tc := range []struct {
		name, nodes, pods, want string
	}{
		{"a node list without the model column", "sn,cpu_milli,memory_mib,gpu\nn0,1,1,1\n", podsCSV,
			"nodes.csv:1: missing column model"},
		{"a node list with a bad number", "sn,cpu_milli,memory_mib,gpu,model\nn0,1,1,1,T4\nn1,lots,1,1,T4\n", podsCSV,
			`nodes.csv:3: column cpu_milli: "lots" is not a whole number`},
		{"a pod list without gpu_milli", nodesCSV, "name,cpu_milli,memory_mib,num_gpu\np0,1,1,1\n",
			"pods.csv:1: missing column gpu_milli"},
		{"a pod list with a share over 1000", nodesCSV, "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np0,1,1,1,1500\n",
			"pods.csv:2: column gpu_milli: 1500: must be between 0 and 1000"},
		{"a pod list with a short row", nodesCSV, "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np0,1,1\n",
			"pods.csv:2: record on line 2: wrong number of fields"},
		{"a pod list with a model no node has", nodesCSV, "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec\np0,1,1,1,500,T4\np1,1,1,1,500,T4|H100\n",
			`pods.csv:3: column gpu_spec: unknown model "H100": the node list has T4, V100M16, G2, V100M32`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var stderr bytes.Buffer
			code := Run(context.Background(), []string{"--nodes", writeFile(t, "nodes.csv", tc.nodes),
				"--pods", writeFile(t, "pods.csv", tc.pods), "--out", t.TempDir()}, &bytes.Buffer{}, &stderr)
			if code != 1 || !strings.Contains(stderr.String(), tc.want) {
				t.Errorf("got exit %d and %q, want exit 1 and %q", code, stderr.String(), tc.want)
			}
		})
	}
}

func TestRunRefusesBadFlagsAsUsageErrors(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--policy", "fgd,worst-fit"}, `unknown policy "worst-fit": must be all or one or more of binpack, spread, best-fit, dot-product, gpu-packing, gpu-clustering, random, fgd, fgd-oracle`},
		{[]string{"--seeds", "0"}, "--seeds 0: must be at least 1"},
		{[]string{"--scale-hosts", "1000,lots"}, `--scale-hosts "1000,lots": "lots": want whole numbers of hosts between 1 and 1000000`},
		{[]string{"extra"}, `unexpected argument "extra"`},
		{[]string{"--reuse-policies", "random"}, `--reuse-policies "random": needs --reuse FILE`},
		{[]string{"--reuse", "old.json"}, "--reuse old.json: needs --reuse-policies naming the policies to read from it"},
		{[]string{"--reuse", "old.json", "--reuse-policies", "first-fit"}, `--reuse-policies: --policy "first-fit": unknown policy`},
		{[]string{"--policy", "fgd", "--reuse", "old.json", "--reuse-policies", "random"}, `--reuse-policies "random": random is not in --policy`},
	} {
		var stderr bytes.Buffer
		args := append([]string{"--nodes", "n.csv", "--pods", "p.csv"}, tc.args...)
		if code := Run(context.Background(), args, &bytes.Buffer{}, &stderr); code != 2 || !strings.Contains(stderr.String(), tc.want) {
			t.Errorf("%v: got exit %d and %q, want exit 2 and %q", tc.args, code, stderr.String(), tc.want)
		}
	}
}

func TestRunWritesTheSameFiguresForTheSameSeeds(t *testing.T) {
	nodes, pods := writeFile(t, "nodes.csv", nodesCSV), writeFile(t, "openb_pod_list_default.csv", podsCSV)
	results := func() []*policyReport {
		out := t.TempDir()
		var stdout, stderr bytes.Buffer
		args := []string{"--nodes", nodes, "--pods", pods, "--seeds", "2", "--out", out,
			"--synthetic-hosts", "20", "--synthetic-tasks", "5", "--scale-hosts", "10,20"}
		if code := Run(context.Background(), args, &stdout, &stderr); code != 0 {
			t.Fatalf("Run: exit %d: %s", code, stderr.String())
		}
		for _, f := range []string{"placement.json", "placement.md", "placement-default.png", "placement-scale.png"} {
			if _, err := os.Stat(filepath.Join(out, f)); err != nil {
				t.Errorf("want %s written: %v", f, err)
			}
		}
		if !strings.Contains(stderr.String(), "fgd-oracle seed 43") {
			t.Errorf("stderr: want progress per policy and seed, got %q", stderr.String())
		}
		data, err := os.ReadFile(filepath.Join(out, "placement.json"))
		if err != nil {
			t.Fatal(err)
		}
		var rep report
		if err := json.Unmarshal(data, &rep); err != nil {
			t.Fatal(err)
		}
		if len(rep.Traces) != 1 || len(rep.Traces[0].Policies) != len(benchPolicies) {
			t.Fatalf("got %d traces, want 1 with %d policies", len(rep.Traces), len(benchPolicies))
		}
		return rep.Traces[0].Policies
	}
	a, b := results(), results()
	for i := range a {
		for s := range a[i].Seeds {
			x, y := a[i].Seeds[s], b[i].Seeds[s]
			if x.FinalAlloc != y.FinalAlloc || x.Placed != y.Placed || len(x.Unalloc) != len(y.Unalloc) {
				t.Errorf("%s seed %d: got %+v then %+v, want the same", x.Policy, x.Seed, x, y)
			}
		}
	}
}

func TestArrivalInflatesToTheTargetAndFollowsTheSeed(t *testing.T) {
	nodes, err := parseNodes("nodes.csv", strings.NewReader(nodesCSV))
	if err != nil {
		t.Fatal(err)
	}
	tasks, err := parseTasks("pods.csv", strings.NewReader(podsCSV))
	if err != nil {
		t.Fatal(err)
	}
	a, b := arrive(nodes, tasks, 42, 1.3), arrive(nodes, tasks, 42, 1.3)
	var asked int64
	for i := range a.tasks {
		asked += a.tasks[i].gpuMilli()
		if a.tasks[i] != b.tasks[i] {
			t.Fatalf("task %d: got %s then %s for the same seed", i, a.tasks[i].name, b.tasks[i].name)
		}
	}
	if target := int64(1.3 * float64(a.capacity)); asked < target || asked-a.tasks[len(a.tasks)-1].gpuMilli() >= target {
		t.Errorf("asked %d milli, want the first total to reach %d", asked, target)
	}
}

func TestRunOutsideTheRepositoryAsksForTheTraces(t *testing.T) {
	t.Chdir(t.TempDir())
	var stderr bytes.Buffer
	code := Run(context.Background(), []string{"--seeds", "1"}, &bytes.Buffer{}, &stderr)
	if want := "give --traces DIR"; code != 2 || !strings.Contains(stderr.String(), want) {
		t.Errorf("got exit %d and %q, want exit 2 and %q", code, stderr.String(), want)
	}
}

func TestTheOpenbTracesLoad(t *testing.T) {
	dir := defaultTraces()
	if nodes, err := loadNodes(filepath.Join(dir, nodesFile)); err != nil || len(nodes) != 1213 {
		t.Errorf("nodes: got %d, %v; want 1213", len(nodes), err)
	}
	for _, v := range []string{"default", "gpushare40", "multigpu20", "gpuspec10"} {
		tasks, err := loadTasks(filepath.Join(dir, "openb_pod_list_"+v+".csv"))
		if err != nil || len(tasks) < 8000 {
			t.Errorf("%s: got %d tasks, %v; want 8000 or more", v, len(tasks), err)
		}
	}
}

func TestRunReusesTheOutcomesOfAnEarlierRun(t *testing.T) {
	nodes, pods := writeFile(t, "nodes.csv", nodesCSV), writeFile(t, "openb_pod_list_default.csv", podsCSV)
	run := func(out string, extra ...string) (string, int) {
		var stdout, stderr bytes.Buffer
		args := append([]string{"--nodes", nodes, "--pods", pods, "--seeds", "2", "--out", out, "--policy", "random,best-fit,fgd",
			"--synthetic-hosts", "0"}, extra...)
		code := Run(context.Background(), args, &stdout, &stderr)
		return stderr.String(), code
	}
	first := t.TempDir()
	if msg, code := run(first); code != 0 {
		t.Fatalf("first run: exit %d: %s", code, msg)
	}
	old := filepath.Join(first, "placement.json")
	second := t.TempDir()
	msg, code := run(second, "--reuse", old, "--reuse-policies", "random,best-fit")
	if code != 0 {
		t.Fatalf("second run: exit %d: %s", code, msg)
	}
	if strings.Contains(msg, "random seed") || strings.Contains(msg, "best-fit seed") || !strings.Contains(msg, "fgd seed 43") {
		t.Errorf("stderr: want only fgd replayed, got %q", msg)
	}
	read := func(dir string) *report {
		data, err := os.ReadFile(filepath.Join(dir, "placement.json"))
		if err != nil {
			t.Fatal(err)
		}
		var rep report
		if err := json.Unmarshal(data, &rep); err != nil {
			t.Fatal(err)
		}
		return &rep
	}
	a, b := read(first), read(second)
	for i, p := range a.Traces[0].Policies {
		q := b.Traces[0].Policies[i]
		if p.Policy != q.Policy || p.Unalloc["100"] != q.Unalloc["100"] {
			t.Errorf("%s: got %+v, want the first run's %+v", p.Policy, q.Unalloc["100"], p.Unalloc["100"])
		}
	}
	if msg, code := run(t.TempDir(), "--seeds", "3", "--reuse", old, "--reuse-policies", "random"); code != 1 ||
		!strings.Contains(msg, "its run had other seeds or --inflate") {
		t.Errorf("reusing a run of other seeds: got exit %d and %q, want exit 1 and a refusal", code, msg)
	}
}
