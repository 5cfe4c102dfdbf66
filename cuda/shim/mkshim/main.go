// Command mkshim builds gpupool's libcuda.so.1 into a directory:
// `go run ./cuda/shim/mkshim bin/lib` (make build does).
package main

import (
	"fmt"
	"os"

	"github.com/gpupool/gpupool/cuda/shim"
)

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: mkshim DIR")
		os.Exit(2)
	}
	path, err := shim.Build(os.Args[1])
	if err != nil {
		fmt.Fprintln(os.Stderr, "mkshim:", err)
		os.Exit(1)
	}
	fmt.Println(path)
}
