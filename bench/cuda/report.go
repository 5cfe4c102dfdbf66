package cudabench

import (
	"fmt"
	"io"
	"strings"

	"github.com/gpupool/gpupool/bench/report"
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
	DirectNull         latency      `json:"null_call_direct"`
	TCPPingPong        latency      `json:"tcp_ping_pong"`
	QUICPingPong       latency      `json:"quic_ping_pong"`
	UnixPingPong       latency      `json:"unix_ping_pong"`
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
	// RawQUIC is one QUIC stream with the data plane's settings and none
	// of its protocol: what QUIC itself moves.
	RawQUIC pair `json:"raw_quic"`
	// UntunedQUIC is the same with quic-go's default windows: before the
	// data plane's tuning, side by side.
	UntunedQUIC pair `json:"raw_quic_quic_go_defaults"`
	TCP         pair `json:"raw_tcp"`
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
	fmt.Fprintf(w, "| null call with the shim connected to the server directly (no proxy, no QUIC), p50 | %.1f µs | TCP ping-pong %.1f µs | %.2f× | |\n",
		r.DirectNull.P50us, r.TCPPingPong.P50us, r.DirectNull.P50us/r.TCPPingPong.P50us)
	fmt.Fprintf(w, "| QUIC ping-pong (one stream, the data plane's settings, 16 bytes), p50 | %.1f µs | TCP ping-pong %.1f µs | %.2f× | |\n",
		r.QUICPingPong.P50us, r.TCPPingPong.P50us, r.QUICPingPong.P50us/r.TCPPingPong.P50us)
	fmt.Fprintf(w, "| unix socket ping-pong (16 bytes), p50 | %.1f µs | TCP ping-pong %.1f µs | %.2f× | |\n",
		r.UnixPingPong.P50us, r.TCPPingPong.P50us, r.UnixPingPong.P50us/r.TCPPingPong.P50us)
	fmt.Fprintf(w, "| pipelined launches | %.0f /s | | | ≥ %d/s: %s |\n", r.LaunchesPerSec, goalLaunchesPerSec, met(r.LaunchesPerSec >= goalLaunchesPerSec))
	for _, c := range r.Copies {
		for _, d := range []struct {
			name, base          string
			cuda, q, rq, uq, tc float64
		}{
			{"HtoD", "put", c.CUDA.HtoD, c.QUIC.HtoD, c.RawQUIC.HtoD, c.UntunedQUIC.HtoD, c.TCP.HtoD},
			{"DtoH", "get", c.CUDA.DtoH, c.QUIC.DtoH, c.RawQUIC.DtoH, c.UntunedQUIC.DtoH, c.TCP.DtoH},
		} {
			fmt.Fprintf(w, "| %s %s ×%d | %.3f GiB/s | QUIC %s %.3f GiB/s; raw QUIC %.3f GiB/s (quic-go's defaults: %.3f); raw TCP %.3f GiB/s | %.2f× QUIC; %.2f× raw QUIC; %.2f× TCP | ≥ %.1f× QUIC: %s |\n",
				d.name, human(c.Bytes), c.Reps, d.cuda, d.base, d.q, d.rq, d.uq, d.tc, d.cuda/d.q, d.cuda/d.rq, d.cuda/d.tc, goalBulkRatio, met(d.cuda/d.q >= goalBulkRatio))
		}
	}
	fmt.Fprintf(w, "| the lease released on the agent → the program's first failed call | %.1f ms | | | < %.0f ms: %s |\n",
		r.ReleaseToFailureMs, goalReleaseMs, met(r.ReleaseToFailureMs < goalReleaseMs))
	writeHops(w, r)
	fmt.Fprintf(w, "\nCopies are synchronous (cuMemcpyHtoD/DtoH from pageable memory), one after another; QUIC put "+
		"writes, fsyncs and renames a file on the agent as the data plane always does, and get reads it back; raw QUIC "+
		"and raw TCP move the bytes between two goroutines on one stream, in writes of at most 1 MiB. The per-hop cost of "+
		"a null call: the direct call is the shim and the server; the full call adds the proxy's and the agent's splices "+
		"(two more unix-socket round trips) and one QUIC round trip. "+
		"Times are the whole run of %.0f s.\n", r.ElapsedSeconds)
}

// writeHops splits the null call's p50 into the parts the baselines
// measure, and the floor they put under it.
func writeHops(w io.Writer, r *results) {
	splices := 2 * r.UnixPingPong.P50us
	floor := r.DirectNull.P50us + r.QUICPingPong.P50us + splices
	rest := r.Null.P50us - floor
	fmt.Fprintf(w, "\nWhere the null call's p50 goes (each part measured on its own in this run):\n\n")
	fmt.Fprintf(w, "| Part | µs | share |\n|---|---|---|\n")
	for _, h := range []struct {
		name string
		us   float64
	}{
		{"the shim and the lease's server (the call made directly on the server's socket)", r.DirectNull.P50us},
		{"QUIC's own round trip (raw QUIC ping-pong)", r.QUICPingPong.P50us},
		{"the proxy's and the agent's unix-socket hops (two unix ping-pongs)", splices},
		{"the rest: the splices' hand-offs between goroutines and the thread wake-ups of four processes' worth of hops", rest},
	} {
		fmt.Fprintf(w, "| %s | %.1f | %.0f%% |\n", h.name, h.us, 100*h.us/r.Null.P50us)
	}
	fmt.Fprintf(w, "\nThe floor of the path (every part but the rest) is %.1f µs, %.2f× the TCP round trip; "+
		"QUIC's round trip alone is %.2f× it.\n", floor, floor/r.TCPPingPong.P50us, r.QUICPingPong.P50us/r.TCPPingPong.P50us)
}

func write(dir string, r *results, stdout io.Writer) error {
	var md strings.Builder
	writeTable(&md, r)
	_, err := report.Write(report.Results{Dir: dir, Name: "cuda", JSON: r, Markdown: md.String(), Echo: stdout})
	return err
}
