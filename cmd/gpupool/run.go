package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path"
	"path/filepath"
	"syscall"
	"time"

	"github.com/google/uuid"
	"github.com/spf13/cobra"

	"github.com/gpupool/gpupool/client"
	"github.com/gpupool/gpupool/dataplane"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// exitError carries the remote command's exit code out of 'gpupool run'.
type exitError struct{ code int }

func (e *exitError) Error() string { return fmt.Sprintf("remote command exited with code %d", e.code) }

// interruptGrace is how long 'run' waits for the remote command after
// forwarding Ctrl-C before it releases the lease anyway.
const interruptGrace = 5 * time.Second

func newRunCmd() *cobra.Command {
	var (
		f         acquireFlags
		uploads   []string
		downloads []string
	)
	cmd := &cobra.Command{
		Use:   "run [--gpus N] [--memory 8GiB --compute 25 | --exclusive] [--upload PATH]... [--download PATH]... -- CMD [ARGS...]",
		Short: "Run a command on a leased GPU slice: acquire, upload, execute, download, release",
		Long: `Run acquires a lease, keeps it alive, and runs CMD on the pool host that holds
its first slice, over the agent's QUIC data plane: stdin, stdout and stderr are
streamed live, and run exits with the remote command's exit code. The command
runs in the lease's own directory with the lease's environment:
GPUPOOL_LEASE_ID, CUDA_VISIBLE_DEVICES (the leased GPUs' UUIDs) and, on MPS
hosts, the memory and thread limits of the slice.

--wait DURATION lets the request wait in the brokers' queue when the pool is
full, printing why it waits (see 'gpupool lease acquire --help').

--upload PATH copies a local file into the lease directory before the command
runs (as its base name); --download PATH copies a file of the lease directory
back to the current directory afterwards. Both check SHA-256 checksums.

Ctrl-C is forwarded to the remote command as SIGINT; if it has not exited
within 5 s, run releases the lease, which stops it, and exits 130. The lease
is always released when run ends.

The lease's --ttl defaults to 1m, not the 5m of 'gpupool lease acquire', on
purpose: run renews its lease itself while it runs, so a short TTL frees the
GPU within a minute of a run that died without releasing; a lease from
'lease acquire' is renewed by a separate command and needs more slack.`,
		Example: `  gpupool run --memory 4GiB --compute 25 -- nvidia-smi
  gpupool run --gpus 1 --exclusive --upload train.py --download model.pt -- python3 train.py
  gpupool run --memory 8GiB --compute 50 -- sh -c 'echo $CUDA_VISIBLE_DEVICES'`,
		Args: commandAfterDash("gpupool run --memory 4GiB --compute 25 -- nvidia-smi"),
		RunE: func(cmd *cobra.Command, args []string) error {
			req, err := f.leaseRequest()
			if err != nil {
				return err
			}
			for _, p := range uploads {
				if st, err := os.Stat(p); err != nil || !st.Mode().IsRegular() {
					return usagef("--upload %s: not a readable regular file", p)
				}
			}
			for _, p := range downloads {
				if path.IsAbs(p) || p == "" {
					return usagef("--download %s: give a path relative to the lease directory", p)
				}
			}
			return withClient(cmd, func(ctx context.Context, c *client.Client) error {
				return runRemote(cmd, c, req, f.wait, f.acquireOptions(cmd.ErrOrStderr()), uploads, downloads, args)
			})
		},
	}
	f.register(cmd)
	f.registerWait(cmd)
	// run renews its lease every 20 s while it runs, so a short TTL frees
	// the GPU soon after a run that died without releasing.
	f.ttl = time.Minute
	cmd.Flags().Lookup("ttl").DefValue = f.ttl.String()
	cmd.Flags().StringArrayVar(&uploads, "upload", nil, "local file to copy into the lease directory first (repeatable)")
	cmd.Flags().StringArrayVar(&downloads, "download", nil, "file of the lease directory to copy back afterwards (repeatable)")
	return cmd
}

// runRemote is 'gpupool run' once the flags are checked.
func runRemote(cmd *cobra.Command, c *client.Client, req *gpupoolv1.LeaseRequest, wait time.Duration, opts []client.AcquireOption, uploads, downloads, argv []string) error {
	// The command's own context ends with Ctrl-C; the lease and the
	// session live on until the remote command had its chance to exit.
	base := context.WithoutCancel(cmd.Context())
	ctx := cmd.Context() // ends with Ctrl-C: stops uploads and downloads
	l, err := acquireForCommand(cmd, c, req, wait, opts)
	if err != nil {
		return err
	}
	defer releaseForCommand(cmd, l, "gpupool run ended")
	h, err := dialLease(ctx, l)
	if err != nil {
		return err
	}
	defer h.Close()
	for _, p := range uploads {
		if err := uploadFile(ctx, h, p); err != nil {
			return err
		}
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("interrupted before the command started: %w", err)
	}
	// Downloads happen whatever the exit code: a failed command's output
	// is often what one wants to see.
	runErr := execOnLease(cmd, base, l, h, argv)
	var exited *exitError
	if runErr != nil && !errors.As(runErr, &exited) {
		return runErr
	}
	for _, p := range downloads {
		if err := downloadFile(ctx, h, p); err != nil {
			return err
		}
	}
	return runErr
}

// acquireForCommand acquires req for a command that runs on the lease,
// waiting up to --timeout plus wait, and says on stderr where it was
// granted. When Ctrl-C interrupts the acquire, it releases the lease the
// brokers may have granted all the same.
func acquireForCommand(cmd *cobra.Command, c *client.Client, req *gpupoolv1.LeaseRequest, wait time.Duration, opts []client.AcquireOption) (*client.Lease, error) {
	stderr := cmd.ErrOrStderr()
	if req.RequestId == "" {
		// Ours, so that an interrupted acquire can find the lease the
		// brokers granted all the same (releaseAbandoned).
		req.RequestId = uuid.NewString()
	}
	acqCtx, cancel := context.WithTimeout(cmd.Context(), global.timeout+wait)
	l, err := c.Acquire(acqCtx, req, opts...)
	cancel()
	if err != nil {
		if cmd.Context().Err() != nil {
			releaseAbandoned(context.WithoutCancel(cmd.Context()), c, req, stderr)
		}
		return nil, err
	}
	info := l.Info()
	fmt.Fprintf(stderr, "gpupool: lease %s on %s (%s)\n", l.ID(), info.GetSlices()[0].GetHost(), sliceSummary(info.GetSlices()))
	return l, nil
}

// releaseForCommand releases the lease acquireForCommand acquired, with
// reason, within 10 s even after Ctrl-C; a failure is said on stderr.
func releaseForCommand(cmd *cobra.Command, l *client.Lease, reason string) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(cmd.Context()), 10*time.Second)
	defer cancel()
	if err := l.Release(ctx, reason); err != nil {
		fmt.Fprintf(cmd.ErrOrStderr(), "gpupool: releasing %s: %s\n", l.ID(), errorMessage(err))
	}
}

// releaseAbandoned releases the lease an interrupted Acquire may have
// been granted: acquiring again with the same request id returns it.
func releaseAbandoned(ctx context.Context, c *client.Client, req *gpupoolv1.LeaseRequest, stderr io.Writer) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	resp, err := c.Lease.Acquire(ctx, &gpupoolv1.AcquireRequest{Request: req})
	if err != nil {
		return // never granted, or the brokers are gone; its TTL frees it
	}
	if _, err := c.Lease.Release(ctx, &gpupoolv1.ReleaseRequest{LeaseId: resp.Lease.Id, Reason: "gpupool run interrupted"}); err != nil {
		fmt.Fprintf(stderr, "gpupool: releasing %s: %s\n", resp.Lease.Id, errorMessage(err))
	}
}

// dialLease opens the data-plane session with the lease's first host.
func dialLease(ctx context.Context, l heldLease) (*client.Host, error) {
	ctx, cancel := context.WithTimeout(ctx, global.timeout)
	defer cancel()
	return l.Dial(ctx, "")
}

// execOnLease runs argv on h with the terminal's stdio, forwarding Ctrl-C
// and SIGTERM to it and giving up interruptGrace later. A non-zero remote
// exit code becomes an *exitError.
func execOnLease(cmd *cobra.Command, base context.Context, l heldLease, h *client.Host, argv []string) error {
	stderr := cmd.ErrOrStderr()
	signals := make(chan os.Signal, 4)
	signal.Notify(signals, os.Interrupt, syscall.SIGTERM)
	defer signal.Stop(signals)
	forwarded := make(chan os.Signal, 4)
	execCtx, stopExec := context.WithCancel(base)
	defer stopExec()
	go func() {
		for s := range signals {
			forwarded <- s
			fmt.Fprintf(stderr, "gpupool: sent %v to the remote command; giving up on it in %s if it does not exit\n", s, interruptGrace)
			time.AfterFunc(interruptGrace, stopExec)
		}
	}()
	go func() {
		select {
		case <-l.Done():
			stopExec()
		case <-execCtx.Done():
		}
	}()
	st, err := h.Exec(execCtx, argv, dataplane.ExecIO{Stdin: os.Stdin, Stdout: cmd.OutOrStdout(), Stderr: stderr, Signals: forwarded})
	if err != nil {
		if lerr := l.Err(); lerr != nil && errors.Is(lerr, client.ErrLeaseEnded) {
			return fmt.Errorf("the lease ended while the command ran: %w", lerr)
		}
		return err
	}
	if st.Code != 0 {
		return &exitError{code: st.Code}
	}
	return nil
}

func uploadFile(ctx context.Context, h *client.Host, p string) error {
	f, err := os.Open(p)
	if err != nil {
		return fmt.Errorf("--upload %s: %w", p, err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return fmt.Errorf("--upload %s: %w", p, err)
	}
	if _, err := h.Put(ctx, f, st.Size(), filepath.Base(p), st.Mode().Perm()); err != nil {
		return fmt.Errorf("--upload %s: %w", p, err)
	}
	return nil
}

func downloadFile(ctx context.Context, h *client.Host, p string) error {
	local := filepath.Base(p)
	tmp, err := os.CreateTemp(".", "."+local+".part-")
	if err != nil {
		return fmt.Errorf("--download %s: %w", p, err)
	}
	defer os.Remove(tmp.Name())
	if _, err := h.Get(ctx, p, tmp); err != nil {
		tmp.Close()
		return fmt.Errorf("--download %s: %w", p, err)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("--download %s: %w", p, err)
	}
	if err := os.Rename(tmp.Name(), local); err != nil {
		return fmt.Errorf("--download %s: %w", p, err)
	}
	return nil
}
