package leasebench

import "github.com/gpupool/gpupool/bench/report"

// progress is the benchmarks' shared progress printer.
type progress = report.Progress

var newProgress = report.NewProgress
