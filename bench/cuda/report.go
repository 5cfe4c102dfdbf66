package cudabench

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
)

// The goals on loopback.
const (
	goalNullRatio      = 5.0    // null call p50 over the TCP round trip, at most
	goalLaunchesPerSec = 50_000 // at least
	goalBulkRatio      = 0.8    // copies over QUIC get/put, at least
	goalReleaseMs      = 1000.0 // release to the first failed call, under
)

type results struct {
	Benchmark          string       `json:"benchmark"`
	Env                environment  `json:"env"`
	Config             config       `json:"config"`
	Null               latency      `json:"null_call"`
	TCPPingPong        latency      `json:"tcp_ping_pong"`
	LaunchesPerSec     float64      `json:"pipelined_launches_per_second"`
	Copies             []copyResult `json:"copies"`
	ReleaseToFailureMs float64      `json:"release_to_first_failed_call_ms"`
	ElapsedSeconds     float64      `json:"elapsed_seconds"`
}

type environment struct {
	GoVersion   string  `json:"go_version"`
	OS          string  `json:"os"`
	Arch        string  `json:"arch"`
	CPUs        int     `json:"cpus"`
	LoadAverage float64 `json:"load_average_1m"`
}

type config struct {
	Calls    int    `json:"calls"`
	Launches int    `json:"launches"`
	Backend  string `json:"backend"`
}

type latency struct {
	P50us  float64 `json:"p50_us"`
	P99us  float64 `json:"p99_us"`
	MeanUs float64 `json:"mean_us"`
}

// pair is a rate each way in GiB/s: host to device (put) and back (get).
type pair struct {
	HtoD float64 `json:"htod_gib_per_s"`
	DtoH float64 `json:"dtoh_gib_per_s"`
}

type copyResult struct {
	Bytes int64 `json:"bytes"`
	Reps  int   `json:"reps"`
	CUDA  pair  `json:"cuda"`
	QUIC  pair  `json:"quic_put_get"`
	TCP   pair  `json:"raw_tcp"`
}

func met(ok bool) string {
	if ok {
		return "met"
	}
	return "NOT met"
}

func writeTable(w io.Writer, r *results) {
	fmt.Fprintf(w, "# Remote CUDA on loopback\n\n")
	fmt.Fprintf(w, "A C program on gpupool's libcuda.so.1 → local proxy → QUIC data plane → the lease's CUDA server "+
		"(`gpupool agent cuda-server`, %s backend), against a raw TCP connection and the data plane's own QUIC put/get "+
		"in the same run. %d CPUs, load average %.1f, %s.\n\n", r.Config.Backend, r.Env.CPUs, r.Env.LoadAverage, r.Env.GoVersion)
	ratio := r.Null.P50us / r.TCPPingPong.P50us
	fmt.Fprintf(w, "| Measure | Remote CUDA | Baseline | Ratio | Goal |\n|---|---|---|---|---|\n")
	fmt.Fprintf(w, "| null synchronising call (cuCtxSynchronize), p50 | %.1f µs | TCP ping-pong %.1f µs | %.2f× | ≤ %.0f×: %s |\n",
		r.Null.P50us, r.TCPPingPong.P50us, ratio, goalNullRatio, met(ratio <= goalNullRatio))
	fmt.Fprintf(w, "| null synchronising call, p99 | %.1f µs | TCP ping-pong %.1f µs | %.2f× | |\n",
		r.Null.P99us, r.TCPPingPong.P99us, r.Null.P99us/r.TCPPingPong.P99us)
	fmt.Fprintf(w, "| pipelined launches | %.0f /s | | | ≥ %d/s: %s |\n", r.LaunchesPerSec, goalLaunchesPerSec, met(r.LaunchesPerSec >= goalLaunchesPerSec))
	for _, c := range r.Copies {
		for _, d := range []struct {
			name, base  string
			cuda, q, tc float64
		}{
			{"HtoD", "put", c.CUDA.HtoD, c.QUIC.HtoD, c.TCP.HtoD},
			{"DtoH", "get", c.CUDA.DtoH, c.QUIC.DtoH, c.TCP.DtoH},
		} {
			fmt.Fprintf(w, "| %s %s ×%d | %.3f GiB/s | QUIC %s %.3f GiB/s; raw TCP %.3f GiB/s | %.2f× QUIC; %.2f× TCP | ≥ %.1f× QUIC: %s |\n",
				d.name, human(c.Bytes), c.Reps, d.cuda, d.base, d.q, d.tc, d.cuda/d.q, d.cuda/d.tc, goalBulkRatio, met(d.cuda/d.q >= goalBulkRatio))
		}
	}
	fmt.Fprintf(w, "| the lease released on the agent → the program's first failed call | %.1f ms | | | < %.0f ms: %s |\n",
		r.ReleaseToFailureMs, goalReleaseMs, met(r.ReleaseToFailureMs < goalReleaseMs))
	fmt.Fprintf(w, "\nCopies are synchronous (cuMemcpyHtoD/DtoH from pageable memory), one after another; QUIC put "+
		"writes, fsyncs and renames a file on the agent as the data plane always does, and get reads it back. "+
		"Times are the whole run of %.0f s.\n", r.ElapsedSeconds)
}

func write(dir string, r *results, stdout io.Writer) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	b, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "cuda.json"), append(b, '\n'), 0o644); err != nil {
		return err
	}
	var md strings.Builder
	writeTable(&md, r)
	if err := os.WriteFile(filepath.Join(dir, "cuda.md"), []byte(md.String()), 0o644); err != nil {
		return err
	}
	_, err = io.WriteString(stdout, md.String())
	return err
}
