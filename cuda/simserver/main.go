// Command simserver serves one simulated lease's CUDA calls on a unix
// socket, so that the shim can be tried without a pool (with a pool,
// 'gpupool attach' reaches the lease's own server through the agent):
//
//	go run ./cuda/simserver -socket /tmp/gpu.sock -memory 8GiB &
//	GPUPOOL_CUDA_SOCKET=/tmp/gpu.sock LD_LIBRARY_PATH=bin/lib bin/examples/vecadd
//
// The device is a simulated A100-SXM4-40GB; -memory is the lease's slice.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"syscall"

	"github.com/gpupool/gpupool/agent/cudaserver"
	"github.com/gpupool/gpupool/internal/quantity"
)

func main() {
	os.Exit(run(os.Args[1:], os.Stderr))
}

// run returns the exit code: 0, 1 for a failure, 2 for bad usage.
func run(args []string, stderr io.Writer) int {
	fs := flag.NewFlagSet("simserver", flag.ContinueOnError)
	fs.SetOutput(stderr)
	socket := fs.String("socket", "", "the unix socket to serve (GPUPOOL_CUDA_SOCKET for the shim); required")
	memory := fs.String("memory", "", "the lease's memory, e.g. 8GiB (default: the whole 40 GiB device)")
	verbose := fs.Bool("v", false, "log every session and refusal")
	fs.Usage = func() {
		fmt.Fprintln(stderr, "usage: simserver -socket PATH [-memory 8GiB] [-v]")
		fmt.Fprintln(stderr, "Serves a simulated lease's CUDA calls for gpupool's libcuda.so.1.")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if *socket == "" || fs.NArg() != 0 {
		fs.Usage()
		return 2
	}
	dev := cudaserver.DefaultSimDevice([16]byte{0x67, 0x70, 0x75, 0x70, 0x6f, 0x6f, 0x6c})
	var limit uint64
	if *memory != "" {
		mib, err := quantity.ParseMemoryMiB(*memory)
		if err == nil && (mib <= 0 || uint64(mib)<<20 > dev.MemoryBytes) {
			err = fmt.Errorf("must be between 1MiB and %dGiB (the simulated device)", dev.MemoryBytes>>30)
		}
		if err != nil {
			fmt.Fprintf(stderr, "simserver: -memory %q: %v\n", *memory, err)
			return 2
		}
		limit = uint64(mib) << 20
	}
	level := slog.LevelWarn
	if *verbose {
		level = slog.LevelDebug
	}
	srv, err := cudaserver.New(cudaserver.Config{
		Devices: []cudaserver.Device{{Index: 0, MemoryBytes: limit}},
		NewBackend: func() (cudaserver.Backend, error) {
			return cudaserver.NewSimBackend([]cudaserver.SimDevice{dev}, nil), nil
		},
		Logger: slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: level})),
	})
	if err != nil {
		fmt.Fprintln(stderr, "simserver:", err)
		return 1
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	shown := limit
	if shown == 0 {
		shown = dev.MemoryBytes
	}
	fmt.Fprintf(stderr, "simserver: serving a simulated %s with %d MiB on %s (GPUPOOL_CUDA_SOCKET); Ctrl-C stops\n",
		dev.Name, shown>>20, *socket)
	if err := srv.ListenAndServe(ctx, *socket); err != nil {
		fmt.Fprintln(stderr, "simserver:", err)
		return 1
	}
	return 0
}
