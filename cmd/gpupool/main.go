// Command gpupool is the one binary of gpupool: broker, agent, dev cluster
// and the CLI that talks to them.
package main

import (
	"context"
	"errors"
	"fmt"
	"github.com/gpupool/gpupool/agent/sandbox"
	"io"
	"os"
	"os/signal"
	"syscall"

	"github.com/spf13/cobra"

	"github.com/gpupool/gpupool/internal/version"
)

func main() {
	// A sandbox's init is this binary, re-executed by the agent.
	sandbox.Init()
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

// run executes the CLI with args and returns the process exit code:
// 0 success, 1 failure, 2 usage (bad flags, an unknown command, or input
// the API refused as InvalidArgument), 130 when interrupted (Ctrl-C).
func run(args []string, stdout, stderr io.Writer) int {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	root := newRootCmd()
	root.SetArgs(args)
	root.SetOut(stdout)
	root.SetErr(stderr)
	err := root.ExecuteContext(ctx)
	if err == nil {
		return 0
	}
	var ee *exitError
	if errors.As(err, &ee) {
		return ee.code // the remote command spoke for itself
	}
	if ctx.Err() != nil {
		var ie *interruptedError
		if errors.As(err, &ie) {
			fmt.Fprintf(stderr, "interrupted: %s\n", ie.msg)
		} else {
			fmt.Fprintln(stderr, "interrupted")
		}
		return exitInterrupted
	}
	fmt.Fprintf(stderr, "error: %s\n", errorMessage(err))
	return exitCode(err)
}

// usageError marks a mistake in how the command was called.
type usageError struct{ msg string }

func (e *usageError) Error() string { return e.msg }

// usagef returns a usage error: the CLI exits with code 2.
func usagef(format string, a ...any) error { return &usageError{fmt.Sprintf(format, a...)} }

func newRootCmd() *cobra.Command {
	root := &cobra.Command{
		Use:   "gpupool",
		Short: "Remote GPU pooling broker: lease whole GPUs or fractional slices from pool hosts",
		Long: `gpupool leases whole GPUs and fractional slices (memory MiB + compute %) from
pool hosts. A Raft-replicated broker cluster knows every host and GPU; an agent
on each pool host registers its GPUs and enforces the leases placed on it.

Start a local cluster with 'gpupool dev', then try:
  gpupool status
  gpupool lease acquire --memory 20GiB --compute 25 --ttl 10m
  gpupool lease ls`,
		Version:       version.Get().String(),
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.SetVersionTemplate("gpupool {{.Version}}\n")
	root.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return &usageError{err.Error()} })
	addGlobalFlags(root)
	newGroupCmd(root,
		newVersionCmd(),
		newBrokerCmd(),
		newAgentCmd(),
		newDevCmd(),
		newLeaseCmd(),
		newRunCmd(),
		newAttachCmd(),
		newExecCmd(),
		newForwardCmd(),
		newHostCmd(),
		newStatusCmd(),
		newTopCmd(),
		newOperatorCmd(),
		newK8sNodePluginCmd(),
		newK8sControllerCmd(),
	)
	return root
}
