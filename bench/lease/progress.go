package leasebench

import "github.com/gpupool/gpupool/bench/internal/benchproc"

// progress is the benchmarks' shared progress printer.
type progress = benchproc.Progress

var newProgress = benchproc.NewProgress
