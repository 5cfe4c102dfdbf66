package leasebench

import (
	"errors"
	"fmt"
	"path/filepath"
	"time"

	"github.com/gpupool/gpupool/internal/proc"
)

// stopTimeout is how long a child has to exit on SIGTERM before SIGKILL.
const stopTimeout = 10 * time.Second

// startChild starts bin with args, logging to dir/name.log.
func startChild(dir, name, bin string, args ...string) (*proc.Proc, error) {
	c := &proc.Proc{Name: name, Bin: bin, Args: args, Log: filepath.Join(dir, name+".log")}
	if err := c.Start(); err != nil {
		return nil, err
	}
	return c, nil
}

// diedError reports the first of children that has exited, with the tail
// of its log; nil when all are running.
func diedError(children []*proc.Proc) error {
	for _, c := range children {
		if ok, err := c.Exited(); ok {
			return fmt.Errorf("%s exited (%v); the end of %s:\n%s", c.Name, err, c.Log, c.LogTail(2048))
		}
	}
	return nil
}

// freeAddrs returns n free addresses, one on each of 127.0.0.(first),
// 127.0.0.(first+1), ...
func freeAddrs(first, n int) ([]string, error) {
	var addrs []string
	for i := range n {
		a, err := proc.FreeAddr(fmt.Sprintf("127.0.0.%d", first+i))
		if err != nil {
			return nil, err
		}
		addrs = append(addrs, a)
	}
	return addrs, nil
}

// errStopped is returned when the run's context ends while waiting.
var errStopped = errors.New("stopped")
