package workload

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"time"

	"golang.org/x/sys/unix"
)

// pollInterval is how often Stop reads /proc to learn whether a process
// it cannot watch through a pidfd has exited.
const pollInterval = 20 * time.Millisecond

// StopResult says what Stop did. Every distinct Proc given to Stop is
// counted exactly once: in Terminated, Killed, Gone or Remaining.
type StopResult struct {
	// Terminated were sent SIGTERM and exited before killAfter.
	Terminated int
	// Killed outlived killAfter, were sent SIGKILL, and exited.
	Killed int
	// Gone had already exited, or their pid named another process, when
	// Stop came to them; they were not signalled.
	Gone int
	// Remaining had not exited when Stop returned.
	Remaining []Proc
	// Took is how long Stop ran.
	Took time.Duration
}

// Stop stops procs: it sends SIGTERM to each at once, then SIGKILL to
// those still running killAfter later (at once if killAfter <= 0), and
// returns when all have exited or ctx ends. A zombie has exited.
//
// Stop never signals a process whose start time differs from its Proc's,
// which is how it tells a reused pid. Where pidfds work, the check and
// the signals go through one pidfd opened before the check, so the
// process signalled is the one checked; elsewhere a pid reused between
// the check and kill(2) could be signalled.
//
// The error is non-nil when some process could not be stopped: ctx
// ended first (it wraps ctx.Err()), or signalling or watching a process
// failed. The result is meaningful either way.
func Stop(ctx context.Context, procs []Proc, killAfter time.Duration) (StopResult, error) {
	return stopper{procRoot: "/proc"}.stop(ctx, procs, killAfter)
}

// stopper is Stop with its environment injected.
type stopper struct {
	procRoot string
	// noPidfd makes the stopper watch every process by reading /proc,
	// as it does where pidfd_open fails.
	noPidfd bool
}

// target is one process being stopped.
type target struct {
	p Proc
	// fd is a pidfd for p, or -1 when p is watched through /proc.
	fd     int
	termed bool // sent SIGTERM
	killed bool // sent SIGKILL
	done   bool // counted in the result
}

// stopping is the state of one call to Stop.
type stopping struct {
	stopper
	targets []*target
	res     StopResult
	errs    []error
}

func (s stopper) stop(ctx context.Context, procs []Proc, killAfter time.Duration) (StopResult, error) {
	began := time.Now()
	st := &stopping{stopper: s}
	defer st.close()
	seen := make(map[Proc]bool, len(procs))
	for _, p := range procs {
		if !seen[p] {
			seen[p] = true
			st.add(p)
		}
	}

	st.signal(unix.SIGTERM)
	w := newCtxWaker(ctx)
	defer w.Close()
	killAt := time.Now().Add(killAfter)
	killed := false
	for {
		st.pollProc()
		if !st.running() {
			break
		}
		if ctx.Err() != nil {
			st.errs = append(st.errs, fmt.Errorf("workload: stop processes: %w", ctx.Err()))
			break
		}
		if !killed && !time.Now().Before(killAt) {
			killed = true
			st.signal(unix.SIGKILL)
			continue
		}
		timeout := time.Duration(-1)
		if !killed {
			timeout = time.Until(killAt)
		}
		if err := st.wait(w.fd, timeout); err != nil {
			st.errs = append(st.errs, err)
			break
		}
	}
	for _, tg := range st.targets {
		if !tg.done {
			st.res.Remaining = append(st.res.Remaining, tg.p)
		}
	}
	st.res.Took = time.Since(began)
	return st.res, errors.Join(st.errs...)
}

// add prepares to stop p, or counts it if it has already exited.
func (st *stopping) add(p Proc) {
	tg, err := st.open(p)
	switch {
	case err != nil:
		st.res.Remaining = append(st.res.Remaining, p)
		st.errs = append(st.errs, err)
	case tg == nil:
		st.res.Gone++
	default:
		st.targets = append(st.targets, tg)
	}
}

// finish counts tg as exited, or as remaining when err says it cannot be
// stopped.
func (st *stopping) finish(tg *target, err error) {
	tg.done = true
	switch {
	case err != nil:
		st.res.Remaining = append(st.res.Remaining, tg.p)
		st.errs = append(st.errs, err)
	case tg.killed:
		st.res.Killed++
	case tg.termed:
		st.res.Terminated++
	default:
		st.res.Gone++
	}
}

// signal sends sig to every target still running.
func (st *stopping) signal(sig unix.Signal) {
	for _, tg := range st.targets {
		if tg.done {
			continue
		}
		gone, err := st.send(tg, sig)
		if gone || err != nil {
			st.finish(tg, err)
			continue
		}
		tg.termed = tg.termed || sig == unix.SIGTERM
		tg.killed = tg.killed || sig == unix.SIGKILL
	}
}

// pollProc finishes the targets without a pidfd that have exited.
func (st *stopping) pollProc() {
	for _, tg := range st.targets {
		if tg.done || tg.fd >= 0 {
			continue
		}
		if exited, err := st.exited(tg.p); exited || err != nil {
			st.finish(tg, err)
		}
	}
}

// running says whether some target is still running.
func (st *stopping) running() bool {
	return slices.ContainsFunc(st.targets, func(tg *target) bool { return !tg.done })
}

func (st *stopping) close() {
	for _, tg := range st.targets {
		if tg.fd >= 0 {
			unix.Close(tg.fd)
		}
	}
}

// wait blocks until a pidfd target exits, wakeFD becomes readable, or
// timeout passes (never if negative), and finishes the targets that
// exited. It returns after pollInterval at most if some target has no
// pidfd or there is no wakeFD.
func (st *stopping) wait(wakeFD int, timeout time.Duration) error {
	fds := make([]unix.PollFd, 0, len(st.targets)+1)
	watched := make([]*target, 0, len(st.targets))
	polling := wakeFD < 0
	for _, tg := range st.targets {
		switch {
		case tg.done:
		case tg.fd < 0:
			polling = true
		default:
			fds = append(fds, unix.PollFd{Fd: int32(tg.fd), Events: unix.POLLIN})
			watched = append(watched, tg)
		}
	}
	if wakeFD >= 0 {
		fds = append(fds, unix.PollFd{Fd: int32(wakeFD), Events: unix.POLLIN})
	}
	if polling && (timeout < 0 || timeout > pollInterval) {
		timeout = pollInterval
	}
	// poll(2) takes an int of milliseconds; the caller loops anyway.
	timeout = min(timeout, time.Hour)
	ms := -1
	if timeout >= 0 {
		// Round up so the loop does not spin in the last millisecond.
		ms = int((timeout + time.Millisecond - 1) / time.Millisecond)
	}
	if _, err := unix.Poll(fds, ms); err != nil && !errors.Is(err, unix.EINTR) {
		return fmt.Errorf("workload: wait for processes to exit: %w", err)
	}
	for i, tg := range watched {
		// A pidfd is readable once its process has exited, zombie or not.
		if fds[i].Revents&(unix.POLLIN|unix.POLLHUP|unix.POLLERR) != 0 {
			st.finish(tg, nil)
		}
	}
	return nil
}

// open prepares to stop p. It returns nil, and no error, if p has exited
// or its pid now names another process.
func (s stopper) open(p Proc) (*target, error) {
	tg := &target{p: p, fd: -1}
	if !s.noPidfd {
		fd, err := unix.PidfdOpen(p.PID, 0)
		switch {
		case errors.Is(err, unix.ESRCH):
			return nil, nil
		case err == nil:
			tg.fd = fd
		}
		// Any other error (no pidfd support, a seccomp filter, no
		// descriptors left): watch p through /proc.
	}
	exited, err := s.exited(p)
	if exited || err != nil {
		if tg.fd >= 0 {
			unix.Close(tg.fd)
		}
		return nil, err
	}
	return tg, nil
}

// exited says whether p has exited, judging by its stat: it has if its
// pid names no process, a zombie, or a process with another start time.
func (s stopper) exited(p Proc) (bool, error) {
	st, err := readStat(s.procRoot, p.PID)
	switch {
	case vanished(err):
		return true, nil
	case err != nil:
		return false, fmt.Errorf("workload: watch %v: %w", p, err)
	}
	return st.start != p.Start || st.exited(), nil
}

// send sends sig to tg. It reports gone if tg has exited instead.
func (s stopper) send(tg *target, sig unix.Signal) (gone bool, err error) {
	if tg.fd >= 0 {
		err = unix.PidfdSendSignal(tg.fd, sig, nil, 0)
	} else {
		if exited, err := s.exited(tg.p); exited || err != nil {
			return exited, err
		}
		err = unix.Kill(tg.p.PID, sig)
	}
	switch {
	case errors.Is(err, unix.ESRCH):
		return true, nil
	case err != nil:
		return false, fmt.Errorf("workload: send %s to %v: %w", unix.SignalName(sig), tg.p, err)
	}
	return false, nil
}

// ctxWaker is an eventfd that becomes readable when a context ends, so
// that poll(2) can wait for processes and the context at once.
type ctxWaker struct {
	fd   int // -1 if no eventfd could be made
	stop func() bool
	done chan struct{} // closed once the eventfd has been written
}

func newCtxWaker(ctx context.Context) *ctxWaker {
	fd, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
	if err != nil {
		return &ctxWaker{fd: -1, stop: func() bool { return true }}
	}
	w := &ctxWaker{fd: fd, done: make(chan struct{})}
	w.stop = context.AfterFunc(ctx, func() {
		defer close(w.done)
		var one [8]byte
		binary.NativeEndian.PutUint64(one[:], 1)
		unix.Write(fd, one[:])
	})
	return w
}

// Close releases the eventfd once nothing can write to it.
func (w *ctxWaker) Close() {
	if w.fd < 0 {
		return
	}
	if !w.stop() {
		<-w.done
	}
	unix.Close(w.fd)
}
