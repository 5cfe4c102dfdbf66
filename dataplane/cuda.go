package dataplane

import (
	"bytes"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"sync"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// CudaServerFunc returns the command line of a lease's CUDA server: an
// absolute program path and its arguments. The server starts it like an
// exec (the lease's directory, environment and process tracking) with one
// difference: its stdin is a listening unix socket, on which it accepts
// the shim's connections (one per client process) until it is stopped
// with SIGTERM. What the lease may use (its slices, their memory) must be
// in the arguments, which the lease's own processes cannot change.
type CudaServerFunc func(leaseID string) ([]string, error)

// cudaServer is a lease's running CUDA server: the agent's socket, whose
// listening end the process holds as its stdin, and the process.
type cudaServer struct {
	path string
	ln   *net.UnixListener
	proc *process
}

// cudaServers are the CUDA servers of the leases, at most one each, with
// the private directory their sockets are in.
type cudaServers struct {
	newCmd CudaServerFunc // nil: this agent serves no CUDA

	mu    sync.Mutex             // serializes starting and stopping servers
	dir   string                 // guarded by mu; made on first use
	byID  map[string]*cudaServer // guarded by mu
	ended bool                   // guarded by mu; the data plane shut down
}

// cuda runs a CudaStart: it connects the stream to the lease's CUDA
// server, starting it first if it does not run, then carries raw bytes
// both ways until either side ends.
func (st *serverStream) cuda(*gpupoolv1.CudaStart) *RefusedError {
	if st.srv.cuda.newCmd == nil {
		return refusef(gpupoolv1.AcceptCode_ACCEPT_CODE_NOT_FOUND, "this pool host's agent does not serve CUDA")
	}
	cs, refused := st.cudaServer()
	if refused != nil {
		return refused
	}
	if cs == nil {
		return nil // the lease ended meanwhile: the stream is reset
	}
	c, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: cs.path, Net: "unix"})
	if err != nil {
		return refusef(gpupoolv1.AcceptCode_ACCEPT_CODE_INTERNAL, "the lease's CUDA server: %v", err)
	}
	if err := st.accept(); err != nil {
		c.Close()
		st.cancel(err)
		return nil
	}
	st.log.Info("cuda session started", "pid", cs.proc.pid)
	if err := splice(st.ctx, st.qs, c, cudaSpliceBuffer); err != nil {
		st.log.Info("cuda session ended early", "err", err)
	}
	return nil
}

// cudaServer returns the lease's running CUDA server, starting it if
// there is none or it exited. It returns nil, nil when the stream was
// revoked, which also means Revoke stops whatever was started.
func (st *serverStream) cudaServer() (*cudaServer, *RefusedError) {
	s := &st.srv.cuda
	s.mu.Lock()
	defer s.mu.Unlock()
	// Revoke cancels the lease's streams before it takes mu to stop the
	// lease's server: a stream not canceled yet is one Revoke will stop
	// the server after.
	if st.ctx.Err() != nil || s.ended {
		return nil, nil
	}
	if cs := s.byID[st.leaseID]; cs != nil {
		select {
		case <-cs.proc.done:
			st.log.Warn("the lease's CUDA server had exited; starting it again", "code", cs.proc.exit.GetCode(), "signal", cs.proc.exit.GetSignal())
			cs.close()
			delete(s.byID, st.leaseID)
		default:
			return cs, nil
		}
	}
	argv, err := s.newCmd(st.leaseID)
	if err != nil {
		return nil, refusef(gpupoolv1.AcceptCode_ACCEPT_CODE_INTERNAL, "the lease's CUDA server: %v", err)
	}
	// The same command builder as exec: the lease's directory and
	// environment, nothing of the agent's.
	cmd, refused := st.command(&gpupoolv1.ExecStart{Argv: argv})
	if refused != nil {
		return nil, refused
	}
	if s.dir == "" {
		if s.dir, err = os.MkdirTemp("", "gpupool-cuda-"); err != nil {
			return nil, refusef(gpupoolv1.AcceptCode_ACCEPT_CODE_INTERNAL, "the CUDA servers' directory: %v", err)
		}
	}
	path := filepath.Join(s.dir, st.leaseID)
	os.Remove(path)
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, refusef(gpupoolv1.AcceptCode_ACCEPT_CODE_INTERNAL, "the lease's CUDA socket: %v", err)
	}
	ln.SetUnlinkOnClose(true)
	lf, err := ln.File()
	if err != nil {
		ln.Close()
		return nil, refusef(gpupoolv1.AcceptCode_ACCEPT_CODE_INTERNAL, "the lease's CUDA socket: %v", err)
	}
	defer lf.Close() // the child has its copy once started
	cmd.Stdin = lf
	p, err := st.start(cmd) // as exec starts: in the lease's sandbox
	if err != nil {
		ln.Close()
		return nil, startRefusal(argv[0], err)
	}
	st.srv.leases.Started(st.leaseID, p.pid)
	log := st.log.With("cuda_server", p.pid)
	go logLines(log, p.stdout)
	go logLines(log, p.stderr)
	go func() {
		<-p.done
		log.Info("the lease's CUDA server exited", "code", p.exit.GetCode(), "signal", p.exit.GetSignal())
	}()
	log.Info("the lease's CUDA server started")
	cs := &cudaServer{path: path, ln: ln, proc: p}
	if s.byID == nil {
		s.byID = make(map[string]*cudaServer)
	}
	s.byID[st.leaseID] = cs
	return cs, nil
}

// stop stops the lease's CUDA server, if it runs, and waits for it as
// process.stop does.
func (s *cudaServers) stop(leaseID string) bool {
	s.mu.Lock()
	cs := s.byID[leaseID]
	delete(s.byID, leaseID)
	s.mu.Unlock()
	if cs == nil {
		return false
	}
	cs.proc.stop()
	cs.close()
	return true
}

// shutdown stops every CUDA server and removes their directory; later
// streams start none.
func (s *cudaServers) shutdown() {
	s.mu.Lock()
	s.ended = true
	ids := make([]string, 0, len(s.byID))
	for id := range s.byID {
		ids = append(ids, id)
	}
	s.mu.Unlock()
	var wg sync.WaitGroup
	for _, id := range ids {
		wg.Go(func() { s.stop(id) })
	}
	wg.Wait()
	s.mu.Lock()
	if s.dir != "" {
		os.RemoveAll(s.dir)
	}
	s.mu.Unlock()
}

// close closes the agent's end of the socket, which removes it.
func (cs *cudaServer) close() {
	cs.ln.Close()
}

// logLines logs what a CUDA server writes, line by line, until the pipe
// ends; the pipe is closed then.
func logLines(log *slog.Logger, f *os.File) {
	defer f.Close()
	buf := make([]byte, 4096)
	var line []byte
	for {
		n, err := f.Read(buf)
		line = append(line, buf[:n]...)
		for {
			i := bytes.IndexByte(line, '\n')
			if i < 0 {
				break
			}
			log.Info("cuda server: " + string(line[:i]))
			line = line[i+1:]
		}
		if len(line) > 4096 {
			log.Info("cuda server: " + string(line))
			line = line[:0]
		}
		if err != nil {
			if len(line) > 0 {
				log.Info("cuda server: " + string(line))
			}
			return
		}
	}
}
