package dataplane

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

const (
	// defaultPath is the PATH of a process whose lease sets none.
	defaultPath = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
	// termGrace is how long a stopped process group has between SIGTERM
	// and SIGKILL.
	termGrace = 500 * time.Millisecond
	// killWait bounds how long stopping a process takes in all.
	killWait = time.Second
	// After the process exits, its pipes are drained until they stay empty
	// for drainIdle (a descendant may hold them open), or for drainMax at
	// most.
	drainIdle = 100 * time.Millisecond
	drainMax  = 10 * time.Second
)

// exec runs an ExecStart: it starts the process, accepts the stream and
// relays stdio, signals and the exit status until the process has exited
// and its output is drained, or the stream ends early, which stops the
// process.
func (st *serverStream) exec(req *gpupoolv1.ExecStart) *RefusedError {
	cmd, refused := st.command(req)
	if refused != nil {
		return refused
	}
	st.mu.Lock()
	if st.ctx.Err() != nil {
		st.mu.Unlock()
		return nil
	}
	p, err := st.start(cmd)
	if err == nil {
		st.proc = p
	}
	st.mu.Unlock()
	if err != nil {
		return startRefusal(req.Argv[0], err)
	}
	st.srv.leases.Started(st.leaseID, p.pid)
	log := st.log.With("pid", p.pid)
	log.Info("exec started", "argv0", req.Argv[0])

	stopOnCancel := context.AfterFunc(st.ctx, func() {
		p.unblock()
		p.stop()
	})
	if err := st.accept(); err != nil {
		st.cancel(fmt.Errorf("accepting: %w", err))
	}
	var pumps sync.WaitGroup
	pumps.Go(func() {
		st.pumpOutput(p, p.stdout, func(b []byte) *gpupoolv1.ExecOutput {
			return &gpupoolv1.ExecOutput{Output: &gpupoolv1.ExecOutput_Stdout{Stdout: b}}
		})
	})
	pumps.Go(func() {
		st.pumpOutput(p, p.stderr, func(b []byte) *gpupoolv1.ExecOutput {
			return &gpupoolv1.ExecOutput{Output: &gpupoolv1.ExecOutput_Stderr{Stderr: b}}
		})
	})
	inputDone := make(chan struct{})
	go func() {
		defer close(inputDone)
		st.relayInput(p)
	}()

	pumps.Wait()
	<-p.done
	stopOnCancel()
	if st.ctx.Err() == nil {
		if err := st.send(&gpupoolv1.ExecOutput{Output: &gpupoolv1.ExecOutput_Exit{Exit: p.exit}}); err != nil {
			st.cancel(fmt.Errorf("sending the exit status: %w", err))
		}
		st.closeSend()
	}
	// Stop relaying input: the client may still be sending stdin or
	// signals nobody will read.
	st.qs.CancelRead(codeCanceled)
	p.stdin.SetWriteDeadline(time.Now())
	<-inputDone
	p.closePipes()
	if err := context.Cause(st.ctx); err != nil {
		log.Info("exec ended early", "cause", err, "code", p.exit.GetCode(), "signal", p.exit.GetSignal())
	} else {
		log.Info("exec ended", "code", p.exit.GetCode(), "signal", p.exit.GetSignal())
	}
	return nil
}

// pumpOutput relays one of the process's output pipes to the client until
// the pipe is done. While the client does not read, send blocks and the
// pipe fills, which blocks the process: nothing is buffered beyond one
// chunk here and QUIC's flow-control window.
func (st *serverStream) pumpOutput(p *process, f *os.File, frame func([]byte) *gpupoolv1.ExecOutput) {
	buf := make([]byte, chunkSize)
	for st.ctx.Err() == nil {
		if exited := p.exitedAt(); !exited.IsZero() {
			if time.Since(exited) > drainMax {
				return
			}
			f.SetReadDeadline(time.Now().Add(drainIdle))
		}
		n, err := f.Read(buf)
		if n > 0 {
			if err := st.send(frame(buf[:n])); err != nil {
				st.cancel(fmt.Errorf("sending output: %w", err))
				return
			}
		}
		if err != nil {
			// io.EOF: every writer closed the pipe. A deadline: drained, or
			// the stream ended. Anything else ends the relay too.
			return
		}
	}
}

// relayInput applies the client's ExecInput frames until the client ends
// its direction or the stream ends.
func (st *serverStream) relayInput(p *process) {
	stdinOpen := true
	closeStdin := func() {
		if stdinOpen {
			stdinOpen = false
			p.stdin.Close()
		}
	}
	defer closeStdin()
	for {
		var in gpupoolv1.ExecInput
		err := st.fr.read(&in)
		switch {
		case err == io.EOF:
			// The client closed its direction: no more stdin or signals.
			return
		case err != nil && isMalformed(err):
			st.protocolError(err)
			return
		case err != nil:
			if p.exitedAt().IsZero() {
				st.cancel(fmt.Errorf("client gone: %w", err))
			}
			return
		}
		switch x := in.GetInput().(type) {
		case *gpupoolv1.ExecInput_Stdin:
			if stdinOpen {
				if _, err := p.stdin.Write(x.Stdin); err != nil {
					// The process closed its stdin (EPIPE) or the stream
					// ended: later stdin is dropped.
					closeStdin()
				}
			}
		case *gpupoolv1.ExecInput_StdinEof:
			closeStdin()
		case *gpupoolv1.ExecInput_Signal:
			if x.Signal < 1 || x.Signal > 64 {
				st.protocolError(fmt.Errorf("signal %d: must be between 1 and 64", x.Signal))
				return
			}
			p.signal(syscall.Signal(x.Signal))
		default:
			st.protocolError(errors.New("an ExecInput frame with no input set"))
			return
		}
	}
}

// command checks an ExecStart and builds the command it asks for.
func (st *serverStream) command(req *gpupoolv1.ExecStart) (*exec.Cmd, *RefusedError) {
	const invalid = gpupoolv1.AcceptCode_ACCEPT_CODE_INVALID_ARGUMENT
	if len(req.GetArgv()) == 0 || req.Argv[0] == "" {
		return nil, refusef(invalid, "argv: must name a program")
	}
	if req.GetTty() {
		return nil, refusef(invalid, "tty: not supported yet, must be false")
	}
	leaseEnv, ok := st.srv.leases.Env(st.leaseID)
	if !ok {
		return nil, refusef(gpupoolv1.AcceptCode_ACCEPT_CODE_PERMISSION_DENIED, "lease %s is not enforced on this host", st.leaseID)
	}
	leaseKeys := make(map[string]bool, len(leaseEnv))
	for _, kv := range leaseEnv {
		k, _, _ := strings.Cut(kv, "=")
		leaseKeys[k] = true
	}
	for i, kv := range req.GetEnv() {
		k, _, ok := strings.Cut(kv, "=")
		if !ok || k == "" || strings.ContainsRune(kv, 0) {
			return nil, refusef(invalid, "env[%d] %q: must be KEY=VALUE", i, kv)
		}
		if leaseKeys[k] {
			return nil, refusef(invalid, "env[%d] %s: set by the lease, cannot be overridden", i, k)
		}
	}
	dir, err := st.srv.leases.Dir(st.leaseID)
	if err != nil {
		return nil, refusef(gpupoolv1.AcceptCode_ACCEPT_CODE_INTERNAL, "lease directory: %v", err)
	}
	workDir := dir
	if cwd := req.GetCwd(); cwd != "" && cwd != "." {
		if refused := checkLeasePath("cwd", cwd); refused != nil {
			return nil, refused
		}
		root, err := os.OpenRoot(dir)
		if err != nil {
			return nil, refusef(gpupoolv1.AcceptCode_ACCEPT_CODE_INTERNAL, "lease directory: %v", err)
		}
		fi, err := root.Stat(cwd)
		root.Close()
		if err != nil {
			return nil, pathRefusal("cwd", cwd, err)
		}
		if !fi.IsDir() {
			return nil, refusef(invalid, "cwd %q: not a directory", cwd)
		}
		workDir = filepath.Join(dir, cwd)
	}

	// The agent's own environment is not passed on. The lease's entries
	// come last, so they win.
	env := append([]string{"PATH=" + defaultPath, "HOME=" + dir}, req.GetEnv()...)
	env = append(env, leaseEnv...)
	prog := req.Argv[0]
	if !strings.Contains(prog, "/") {
		if prog, err = lookPath(prog, envValue(env, "PATH")); err != nil {
			return nil, refusef(gpupoolv1.AcceptCode_ACCEPT_CODE_NOT_FOUND, "argv[0] %q: %v", req.Argv[0], err)
		}
	}
	return &exec.Cmd{
		Path: prog, // a relative path is relative to Dir
		Args: req.Argv,
		Env:  env,
		Dir:  workDir,
	}, nil
}

// envValue is the value of key in env; the last entry wins, as for exec.
func envValue(env []string, key string) string {
	var v string
	for _, kv := range env {
		if k, val, ok := strings.Cut(kv, "="); ok && k == key {
			v = val
		}
	}
	return v
}

// lookPath finds an executable named file in the absolute directories of
// path, the PATH of the process to start (not the agent's).
func lookPath(file, path string) (string, error) {
	for _, dir := range filepath.SplitList(path) {
		if !filepath.IsAbs(dir) {
			continue
		}
		p := filepath.Join(dir, file)
		if fi, err := os.Stat(p); err == nil && fi.Mode().IsRegular() && fi.Mode().Perm()&0o111 != 0 {
			return p, nil
		}
	}
	return "", fmt.Errorf("no executable in PATH %s", path)
}

// start starts a process of the stream's lease, in the lease's sandbox:
// how exec and the lease's CUDA server both start.
func (st *serverStream) start(cmd *exec.Cmd) (*process, error) {
	return startProcess(cmd, func(cmd *exec.Cmd) error { return st.srv.leases.Sandbox(st.leaseID, cmd) })
}

// startRefusal is the refusal for a process that did not start.
func startRefusal(argv0 string, err error) *RefusedError {
	var sb errSandbox
	switch {
	case errors.As(err, &sb):
		return refusef(gpupoolv1.AcceptCode_ACCEPT_CODE_PERMISSION_DENIED, "%v", sb.err)
	case errors.Is(err, fs.ErrNotExist):
		return refusef(gpupoolv1.AcceptCode_ACCEPT_CODE_NOT_FOUND, "argv[0] %q: %v", argv0, err)
	case errors.Is(err, fs.ErrPermission):
		return refusef(gpupoolv1.AcceptCode_ACCEPT_CODE_PERMISSION_DENIED, "argv[0] %q: %v", argv0, err)
	default:
		return refusef(gpupoolv1.AcceptCode_ACCEPT_CODE_INTERNAL, "starting %q: %v", argv0, err)
	}
}

// process is a process exec started, the leader of its own process group,
// with the server's ends of its stdio pipes.
type process struct {
	pid            int
	stdin          *os.File // write end; nil when the command came with its own stdin
	stdout, stderr *os.File // read ends

	exited atomic.Int64 // Unix nanoseconds of the exit, 0 while running
	// exit is how the process ended; set before done is closed.
	exit *gpupoolv1.ExecExit
	done chan struct{} // closed once the process is reaped
}

// errSandbox wraps why the lease's sandbox refused a process.
type errSandbox struct{ err error }

func (e errSandbox) Error() string { return e.err.Error() }

// startProcess starts cmd in a process group of its own, within what
// sandbox makes of it, with pipes for its stdout and stderr, and for its
// stdin unless cmd.Stdin is set (to an *os.File), and reaps it when it
// exits. It is how every process of a lease starts (serverStream.start):
// exec's and the lease's CUDA server.
func startProcess(cmd *exec.Cmd, sandbox func(*exec.Cmd) error) (*process, error) {
	var files []*os.File
	closeAll := func() {
		for _, f := range files {
			f.Close()
		}
	}
	pipe := func() (r, w *os.File, err error) {
		r, w, err = os.Pipe()
		if err == nil {
			files = append(files, r, w)
		}
		return r, w, err
	}
	// A command that comes with its stdin (a CUDA server's listening
	// socket) keeps it; the others get a pipe.
	inR, inW := (*os.File)(nil), (*os.File)(nil)
	if cmd.Stdin == nil {
		var err error
		if inR, inW, err = pipe(); err != nil {
			return nil, err
		}
	}
	outR, outW, err := pipe()
	if err != nil {
		closeAll()
		return nil, err
	}
	errR, errW, err := pipe()
	if err != nil {
		closeAll()
		return nil, err
	}
	if inR != nil {
		cmd.Stdin = inR
	}
	cmd.Stdout, cmd.Stderr = outW, errW
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := sandbox(cmd); err != nil {
		closeAll()
		return nil, errSandbox{err}
	}
	if err := cmd.Start(); err != nil {
		closeAll()
		return nil, err
	}
	// The child holds its ends now; the pipes report EOF once it and its
	// descendants have closed them.
	if inR != nil {
		inR.Close()
	}
	outW.Close()
	errW.Close()
	p := &process{
		pid:    cmd.Process.Pid,
		stdin:  inW,
		stdout: outR,
		stderr: errR,
		done:   make(chan struct{}),
	}
	go func() {
		err := cmd.Wait()
		now := time.Now()
		p.exited.Store(now.UnixNano())
		// Pumps blocked in Read stop once the pipes stay empty.
		p.stdout.SetReadDeadline(now.Add(drainIdle))
		p.stderr.SetReadDeadline(now.Add(drainIdle))
		p.exit = exitStatus(cmd.ProcessState, err)
		close(p.done)
	}()
	return p, nil
}

// exitStatus says how a reaped process ended.
func exitStatus(ps *os.ProcessState, err error) *gpupoolv1.ExecExit {
	if ps == nil {
		return &gpupoolv1.ExecExit{Code: -1, Error: fmt.Sprintf("waiting for the process: %v", err)}
	}
	if ws, ok := ps.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
		return &gpupoolv1.ExecExit{Code: 128 + int32(ws.Signal()), Signal: unix.SignalName(ws.Signal())}
	}
	return &gpupoolv1.ExecExit{Code: int32(ps.ExitCode())}
}

// exitedAt is when the process exited, or zero while it runs.
func (p *process) exitedAt() time.Time {
	if ns := p.exited.Load(); ns != 0 {
		return time.Unix(0, ns)
	}
	return time.Time{}
}

// signal sends sig to the process group.
func (p *process) signal(sig syscall.Signal) {
	// The group outlives its leader while members remain; when none
	// remain the kernel reports ESRCH.
	syscall.Kill(-p.pid, sig)
}

// stop ends the process group: SIGTERM, then SIGKILL once the leader has
// exited or termGrace has passed. It returns when the leader is reaped, or
// after killWait at most. It may be called several times, concurrently.
func (p *process) stop() {
	deadline := time.NewTimer(killWait)
	defer deadline.Stop()
	grace := time.NewTimer(termGrace)
	defer grace.Stop()
	p.signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-grace.C:
	}
	p.signal(syscall.SIGKILL)
	select {
	case <-p.done:
	case <-deadline.C:
	}
}

// unblock makes the relays' pending and future pipe I/O return at once.
func (p *process) unblock() {
	now := time.Now()
	p.stdout.SetReadDeadline(now)
	p.stderr.SetReadDeadline(now)
	p.stdin.SetWriteDeadline(now)
}

// closePipes closes the server's ends of the pipes, once nothing uses them.
func (p *process) closePipes() {
	p.stdin.Close()
	p.stdout.Close()
	p.stderr.Close()
}
