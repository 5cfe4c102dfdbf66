// Command gpupool is the one binary of gpupool: broker, agent, dev cluster
// and the CLI that talks to them.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"

	"github.com/spf13/cobra"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/gpupool/gpupool/client"
)

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

// run executes the CLI with args and returns the process exit code:
// 0 success, 1 failure, 2 usage (bad flags or input the API refused as
// InvalidArgument).
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
	fmt.Fprintf(stderr, "error: %s\n", errorMessage(err))
	return exitCode(err)
}

// usageError marks a mistake in how the command was called.
type usageError struct{ msg string }

func (e *usageError) Error() string { return e.msg }

// usagef returns a usage error: the CLI exits with code 2.
func usagef(format string, a ...any) error { return &usageError{fmt.Sprintf(format, a...)} }

func exitCode(err error) int {
	var ee *exitError
	if errors.As(err, &ee) {
		return ee.code
	}
	var ue *usageError
	if errors.As(err, &ue) {
		return 2
	}
	if st, ok := status.FromError(err); ok && st.Code() == codes.InvalidArgument {
		return 2
	}
	return 1
}

// errorMessage strips gRPC's "rpc error: code = X desc =" wrapping so users
// read the broker's own sentence.
func errorMessage(err error) string {
	if st, ok := status.FromError(err); ok {
		if st.Code() == codes.Unavailable && client.IsTLSError(err) {
			if !global.tls.set() {
				return "cannot talk to the brokers: " + st.Message() + " (--tls-ca, --tls-cert and --tls-key, or GPUPOOL_TLS_CA, GPUPOOL_TLS_CERT and GPUPOOL_TLS_KEY)"
			}
			return "cannot talk to the brokers over TLS: " + st.Message() + " (check --tls-ca, --tls-cert and --tls-key)"
		}
		if st.Code() == codes.Unavailable {
			return "no broker reachable: " + st.Message() + " (is the cluster up? set --addr or GPUPOOL_ADDR)"
		}
		if st.Code() == codes.DeadlineExceeded {
			return "timed out waiting for the brokers: " + st.Message()
		}
		if st.Code() == codes.Unauthenticated {
			return "unauthenticated: " + st.Message()
		}
		if st.Code() == codes.PermissionDenied {
			return "permission denied: " + st.Message()
		}
		return st.Message()
	}
	return err.Error()
}

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
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return &usageError{err.Error()} })
	addGlobalFlags(root)
	root.AddCommand(
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
		newOperatorCmd(),
		newK8sNodePluginCmd(),
		newK8sControllerCmd(),
	)
	return root
}
