package report

import (
	"context"

	"github.com/gpupool/gpupool/internal/proc"
)

// BuildGpupool builds cmd/gpupool into dir, with the build tags given,
// for a benchmark that was given no built binary. It must run inside the
// module.
func BuildGpupool(ctx context.Context, dir string, tags ...string) (string, error) {
	return proc.GoBuild(ctx, dir, "github.com/gpupool/gpupool/cmd/gpupool", tags...)
}
