// Package robustness runs clusters of built gpupool binaries under
// injected faults (kill -9, restarts, partitions, slow or lossy links, a
// cut-off agent), records every client operation and checks the history
// with porcupine against a model of the lease table. See
// docs/robustness.md.
package robustness

import (
	"errors"
	"fmt"
	"os/exec"
	"time"
)

// ErrUnsupported is returned by a Network for a fault it cannot inject;
// the fault scheduler records the fault as skipped, with the reason.
var ErrUnsupported = errors.New("not supported by this network")

// Network places each process (a broker, an agent) on a node and injects
// faults between nodes. The test process itself is not a node: it always
// reaches every broker, so that a partition is between the servers, never
// between the servers and the observer.
//
// Two implementations: network namespaces with veth pairs on a bridge
// (netns.go), and, where namespaces cannot be created, a fault-injecting
// TCP proxy in front of every broker (proxy.go).
type Network interface {
	// Kind is "netns" or "proxy".
	Kind() string
	// Describe says, in one line, what the network can and cannot do.
	Describe() string
	// AddNode creates node name and returns the IP its processes bind to.
	AddNode(name string) (ip string, err error)
	// Command returns cmd adjusted to run inside node's network.
	Command(node string, cmd *exec.Cmd) *exec.Cmd
	// BrokerAddr is the address node from (or "" for the test process)
	// dials to reach the gRPC listener addr of broker node to.
	BrokerAddr(from, to, addr string) (string, error)
	// Block drops everything node from sends to node to, until Heal. It
	// is one-way: Block(a, b) and Block(b, a) make a full partition.
	Block(from, to string) error
	// Degrade slows node's links down by delay, and loses lossPct percent
	// of its packets, until Heal. It reports what it did.
	Degrade(node string, delay time.Duration, lossPct float64) (string, error)
	// Heal lifts every Block and Degrade.
	Heal() error
	// Close removes everything the network created; it is idempotent.
	Close() error
}

// NewNetwork returns a netns network when namespaces can be created, else
// a proxy network (always with forceProxy); why says why it chose it.
// Namespaces and links left by runs whose process is gone are removed
// first.
func NewNetwork(forceProxy bool) (n Network, why string) {
	if forceProxy {
		return newProxyNetwork(), "GPUPOOL_ROBUSTNESS_NET=proxy"
	}
	nn, err := newNetnsNetwork()
	if err != nil {
		return newProxyNetwork(), fmt.Sprintf("network namespaces unavailable (%v)", err)
	}
	return nn, "network namespaces are available"
}
