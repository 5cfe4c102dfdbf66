package placement

import (
	"context"
	"path/filepath"
	"testing"

	"github.com/gpupool/gpupool/broker/placement"
)

// BenchmarkThroughput is the engine's placement rate of the default policy on 10k hosts × 8
// GPUs, as the report measures it; one iteration is one run of SyntheticTasks placements.
// Profile it with -cpuprofile.
func BenchmarkThroughput(b *testing.B) {
	dir := filepath.Join("..", "traces", "openb")
	nodes, err := loadNodes(filepath.Join(dir, nodesFile))
	if err != nil {
		b.Fatal(err)
	}
	tasks, err := loadTasks(filepath.Join(dir, podsFiles[0]))
	if err != nil {
		b.Fatal(err)
	}
	a := arrive(nodes, tasks, 42, 1.3)
	cfg := &config{SyntheticTasks: 2000}
	b.ReportAllocs()
	var cpuSeconds float64
	for b.Loop() {
		r, err := throughput(context.Background(), cfg, 10000, nodes, tasks, a, placement.FGD)
		if err != nil {
			b.Fatal(err)
		}
		cpuSeconds += float64(cfg.SyntheticTasks) / r.CPU
	}
	b.ReportMetric(float64(b.N*cfg.SyntheticTasks)/cpuSeconds, "placements/CPU-s")
}
