// Package mps runs CUDA MPS control daemons: one per GPU that holds
// fractional (shared) leases, so that the lease's processes share the
// GPU through MPS within the memory and compute limits of their slice.
//
// Daemons are run through the nvidia-cuda-mps-control binary. What this
// package assumes of it, from NVIDIA's documentation:
//   - "nvidia-cuda-mps-control -d" starts a control daemon in the
//     background and returns. CUDA_VISIBLE_DEVICES selects its GPU,
//     CUDA_MPS_PIPE_DIRECTORY where it listens, CUDA_MPS_LOG_DIRECTORY
//     where it logs.
//   - Run again with the same pipe directory, it fails with a message
//     containing "already running".
//   - Run without arguments and the same environment, it reads commands
//     from stdin; "quit" stops the daemon.
//   - A client uses the daemon whose CUDA_MPS_PIPE_DIRECTORY it has. Its
//     CUDA_MPS_PINNED_DEVICE_MEM_LIMIT ("<ordinal>=<MiB>M", the ordinal
//     counting the client's visible devices) and
//     CUDA_MPS_ACTIVE_THREAD_PERCENTAGE (a whole percentage) limit it.
//   - The daemon serves clients of one user at a time: clients of
//     another user wait until the first user's clients are done.
//     "start_server -uid UID" on stdin starts the server for UID ahead
//     of its first client.
//
// So all clients run as one user: the agent's (pipe directories are then
// private to it, mode 0700), or the client user set with SetClientUser
// (the agent's sandbox gives every lease with an MPS slice that one
// shared user), who owns the pipe directories, and for whom Start starts
// the server at once.
package mps

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Binary is the name of the program that runs MPS control daemons.
const Binary = "nvidia-cuda-mps-control"

const (
	// commandTimeout bounds each run of Binary.
	commandTimeout = 10 * time.Second
	// waitDelay bounds how long output is awaited after Binary exited:
	// a daemon it started may hold its stdout open.
	waitDelay = time.Second
	// outputTail is how much of a failed command's output errors quote.
	outputTail = 1024
)

// Find looks Binary up on PATH.
func Find() (path string, ok bool) {
	path, err := exec.LookPath(Binary)
	return path, err == nil
}

// CommandError is a run of Binary that failed.
type CommandError struct {
	// Command is the command line, with what was written to its stdin.
	Command string
	// GPU is the UUID of the GPU whose daemon the command was for.
	GPU string
	// Output is the end of what the command wrote to stdout and stderr.
	Output string
	// Err is why it failed: its exit status (*exec.ExitError), a
	// timeout (wrapping context.DeadlineExceeded), the caller's context
	// ending, or why it could not be started.
	Err error
}

func (e *CommandError) Error() string {
	if e.Output == "" {
		return fmt.Sprintf("%s for %s: %v", e.Command, e.GPU, e.Err)
	}
	return fmt.Sprintf("%s for %s: %v: %s", e.Command, e.GPU, e.Err, e.Output)
}

func (e *CommandError) Unwrap() error { return e.Err }

// Controller runs the MPS control daemons of one agent. It is safe for
// concurrent use; commands for one GPU run one at a time.
type Controller struct {
	binary string
	dir    string
	log    *slog.Logger
	// timeout bounds each command; waitDelay bounds waiting for its
	// output after it exited.
	timeout, waitDelay time.Duration

	// clientUser is the user MPS clients run as; 0 for the agent's own.
	// Set before Start is first called.
	clientUser int

	mu sync.Mutex
	// gpus holds the GPUs Start was called for; entries are never
	// removed. Guarded by mu.
	gpus map[string]*daemon
}

// SetClientUser makes uid the user of every MPS client: Start hands it
// the GPU's pipe and log directories and starts the daemon's server for
// it. Call it before Start.
func (c *Controller) SetClientUser(uid int) { c.clientUser = uid }

// daemon is the control daemon of one GPU.
type daemon struct {
	// turn is held (a value sent) while a command for the GPU runs.
	turn chan struct{}
	// running says the daemon was started or found running, and not
	// quit since. Guarded by Controller.mu.
	running bool
}

// New returns a Controller that runs binary, keeping each GPU's pipe
// directory in dir/<uuid>/pipe and its logs in dir/<uuid>/log. A relative
// dir is made absolute, since clients resolve the pipe directory from
// their own working directory. A nil log discards messages.
func New(binary, dir string, log *slog.Logger) *Controller {
	if abs, err := filepath.Abs(dir); err == nil {
		dir = abs
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Controller{
		binary:    binary,
		dir:       dir,
		log:       log,
		timeout:   commandTimeout,
		waitDelay: waitDelay,
		gpus:      make(map[string]*daemon),
	}
}

// Start ensures that uuid's daemon runs. A daemon already running on
// uuid's pipe directory, such as one started before the agent restarted,
// is taken over: Stop will quit it.
func (c *Controller) Start(ctx context.Context, uuid string) error {
	if err := checkUUID(uuid); err != nil {
		return err
	}
	d := c.addDaemon(uuid)
	if err := d.wait(ctx); err != nil {
		return fmt.Errorf("mps: start daemon for %s: %w", uuid, err)
	}
	defer d.done()
	if c.isRunning(d) {
		return nil
	}
	pipe, logDir := c.pipeDir(uuid), c.logDir(uuid)
	for _, d := range []string{pipe, logDir} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return fmt.Errorf("mps: start daemon for %s: %w", uuid, err)
		}
	}
	err := c.run(ctx, uuid, "", "-d")
	var cerr *CommandError
	switch {
	case err == nil:
		c.log.Info("started MPS control daemon", "gpu", uuid, "pipe_dir", pipe)
	case errors.As(err, &cerr) && alreadyRunning(cerr):
		c.log.Info("MPS control daemon was already running", "gpu", uuid, "pipe_dir", pipe)
	default:
		return fmt.Errorf("mps: start daemon: %w", err)
	}
	if c.clientUser != 0 {
		if err := c.serveClientUser(ctx, uuid); err != nil {
			return err
		}
	}
	c.setRunning(d, true)
	return nil
}

// serveClientUser lets the client user reach uuid's pipe directory (the
// directories above it only to pass through) and starts its server.
func (c *Controller) serveClientUser(ctx context.Context, uuid string) error {
	for _, dir := range []string{c.dir, filepath.Join(c.dir, uuid)} {
		if err := os.Chmod(dir, 0o711); err != nil {
			return fmt.Errorf("mps: start daemon for %s: %w", uuid, err)
		}
	}
	for _, dir := range []string{c.pipeDir(uuid), c.logDir(uuid)} {
		if err := os.Chown(dir, c.clientUser, c.clientUser); err != nil {
			return fmt.Errorf("mps: start daemon for %s: %w", uuid, err)
		}
	}
	if err := c.run(ctx, uuid, fmt.Sprintf("start_server -uid %d\n", c.clientUser)); err != nil {
		return fmt.Errorf("mps: start the server of user %d: %w", c.clientUser, err)
	}
	return nil
}

// alreadyRunning says whether err is Binary refusing to start a second
// daemon on a pipe directory.
func alreadyRunning(err *CommandError) bool {
	var exit *exec.ExitError
	return errors.As(err.Err, &exit) && strings.Contains(strings.ToLower(err.Output), "already running")
}

// Stop quits uuid's daemon if this Controller started it or took it over
// in Start, and does nothing otherwise: a daemon of an earlier agent
// process is quit only once Start took it over. If quitting fails, the
// daemon counts as running, so Stop may be called again.
func (c *Controller) Stop(ctx context.Context, uuid string) error {
	if err := checkUUID(uuid); err != nil {
		return err
	}
	d := c.findDaemon(uuid)
	if d == nil {
		return nil
	}
	if err := d.wait(ctx); err != nil {
		return fmt.Errorf("mps: stop daemon for %s: %w", uuid, err)
	}
	defer d.done()
	if !c.isRunning(d) {
		return nil
	}
	if err := c.run(ctx, uuid, "quit\n"); err != nil {
		return fmt.Errorf("mps: stop daemon: %w", err)
	}
	c.setRunning(d, false)
	c.log.Info("quit MPS control daemon", "gpu", uuid)
	return nil
}

// Running returns the GPUs whose daemon this Controller started or took
// over and has not quit, sorted.
func (c *Controller) Running() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []string
	for _, uuid := range slices.Sorted(maps.Keys(c.gpus)) {
		if c.gpus[uuid].running {
			out = append(out, uuid)
		}
	}
	return out
}

// ClientEnv is the environment, as KEY=value entries, that a lease's
// process needs to use its slice of uuid through MPS: at most memMiB of
// device memory and computePercent of the GPU's threads. The caller sets
// CUDA_VISIBLE_DEVICES so that uuid is the process's device 0.
//
// ClientEnv formats what it is given: uuid should be one Start accepted,
// memMiB at least 1 and computePercent between 1 and 100.
func (c *Controller) ClientEnv(uuid string, memMiB int64, computePercent int) []string {
	return []string{
		"CUDA_MPS_PIPE_DIRECTORY=" + c.pipeDir(uuid),
		"CUDA_MPS_LOG_DIRECTORY=" + c.logDir(uuid),
		"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=" + strconv.FormatInt(memMiB, 10) + "M",
		"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=" + strconv.Itoa(computePercent),
	}
}

func (c *Controller) pipeDir(uuid string) string { return filepath.Join(c.dir, uuid, "pipe") }
func (c *Controller) logDir(uuid string) string  { return filepath.Join(c.dir, uuid, "log") }

// addDaemon returns the daemon of uuid, adding it if it is not known.
func (c *Controller) addDaemon(uuid string) *daemon {
	c.mu.Lock()
	defer c.mu.Unlock()
	d := c.gpus[uuid]
	if d == nil {
		d = &daemon{turn: make(chan struct{}, 1)}
		c.gpus[uuid] = d
	}
	return d
}

// findDaemon returns the daemon of uuid, nil if Start was never called
// for it.
func (c *Controller) findDaemon(uuid string) *daemon {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.gpus[uuid]
}

func (c *Controller) isRunning(d *daemon) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return d.running
}

func (c *Controller) setRunning(d *daemon, running bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	d.running = running
}

// wait takes d's turn to run a command, or returns ctx's error.
func (d *daemon) wait(ctx context.Context) error {
	select {
	case d.turn <- struct{}{}:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// done ends the turn taken by wait.
func (d *daemon) done() { <-d.turn }

// run runs Binary with args for uuid's daemon, writing stdin to it.
func (c *Controller) run(ctx context.Context, uuid, stdin string, args ...string) error {
	runCtx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	cmd := exec.CommandContext(runCtx, c.binary, args...)
	// Later entries win, so these override the agent's own.
	cmd.Env = append(os.Environ(),
		"CUDA_VISIBLE_DEVICES="+uuid,
		"CUDA_MPS_PIPE_DIRECTORY="+c.pipeDir(uuid),
		"CUDA_MPS_LOG_DIRECTORY="+c.logDir(uuid),
	)
	if stdin != "" {
		cmd.Stdin = strings.NewReader(stdin)
	}
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	cmd.WaitDelay = c.waitDelay

	err := cmd.Run()
	switch {
	case err == nil:
		return nil
	case errors.Is(err, exec.ErrWaitDelay):
		// It succeeded, but left its output open: the daemon it
		// started holds it.
		return nil
	case runCtx.Err() != nil && ctx.Err() != nil:
		err = ctx.Err()
	case runCtx.Err() != nil:
		err = fmt.Errorf("timed out after %v: %w", c.timeout, context.DeadlineExceeded)
	}
	return &CommandError{Command: commandLine(c.binary, args, stdin), GPU: uuid, Output: tail(out.Bytes()), Err: err}
}

// commandLine formats a command for errors.
func commandLine(binary string, args []string, stdin string) string {
	s := strings.Join(append([]string{binary}, args...), " ")
	if stdin != "" {
		s += fmt.Sprintf(" (stdin %q)", stdin)
	}
	return s
}

// tail returns the end of output, trimmed, on one line.
func tail(output []byte) string {
	s := strings.TrimSpace(string(output))
	if len(s) > outputTail {
		s = "..." + s[len(s)-outputTail:]
	}
	return strings.Join(strings.Fields(s), " ")
}

// validUUID is what a GPU or MIG device UUID may look like. It keeps
// UUIDs safe as path components; MIG identifiers of the older
// "MIG-GPU-<uuid>/<gi>/<ci>" form are refused.
var validUUID = regexp.MustCompile(`^(GPU|MIG)-[A-Za-z0-9-]{1,100}$`)

func checkUUID(uuid string) error {
	if !validUUID.MatchString(uuid) {
		return fmt.Errorf("mps: GPU uuid %q: want GPU-... or MIG-... with 1 to 100 letters, digits or '-' after the prefix", uuid)
	}
	return nil
}
