package scale

import "github.com/gpupool/gpupool/bench/internal/benchproc"

// The process helpers are shared with the other benchmarks.
type (
	proc        = benchproc.Proc
	backoffStop = benchproc.Stop
)

var (
	buildGpupool = benchproc.BuildGpupool
	freeAddr     = benchproc.FreeAddr
	poll         = benchproc.Poll
)
