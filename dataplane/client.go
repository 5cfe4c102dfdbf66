package dataplane

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/quic-go/quic-go"
	"google.golang.org/protobuf/proto"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// Conn is a client's connection to one agent. Its methods may be called
// concurrently; each runs one operation on a stream of its own and takes
// the lease token the operation runs under. Errors are the agent's
// refusals (*RefusedError), the sentinel errors of this package, ctx's
// error when ctx ended first, or transport errors.
type Conn struct {
	qc *quic.Conn
}

// Dial connects to the agent at addr (host:port, UDP) and checks that its
// certificate's SHA-256 is certSHA256 (hex, as the broker publishes it).
// A different certificate fails with an error wrapping ErrCertMismatch.
func Dial(ctx context.Context, addr, certSHA256 string) (*Conn, error) {
	pin, err := parseFingerprint(certSHA256)
	if err != nil {
		return nil, err
	}
	var check pinCheck
	qc, err := quic.DialAddr(ctx, addr, clientTLS(addr, pin, &check), quicConfig(false, 0))
	if err != nil {
		if mismatch := check.failure(); mismatch != nil {
			return nil, mismatch
		}
		return nil, fmt.Errorf("dataplane: dial %s: %w", addr, err)
	}
	return &Conn{qc: qc}, nil
}

// Close closes the connection, ending every operation on it.
func (c *Conn) Close() error {
	return c.qc.CloseWithError(0, "")
}

// ExecIO is the stdio of a remote process.
type ExecIO struct {
	// Stdin is copied to the process's stdin, which is closed at its end;
	// nil means an empty stdin. A Read in progress when Exec returns is
	// not waited for; what it returns is dropped.
	Stdin io.Reader
	// Stdout and Stderr receive the process's output; nil discards it. A
	// slow writer slows the process down rather than growing a buffer.
	Stdout, Stderr io.Writer
	// Signals are forwarded to the process group while it runs; nil or
	// closed means no more. Only syscall.Signal values are sent, by their
	// Linux number.
	Signals <-chan os.Signal
}

// ExitStatus is how a remote process ended.
type ExitStatus struct {
	// Code is the exit code; 128+N when signal N ended the process.
	Code int
	// Signal names the signal that ended the process ("SIGKILL"), or is
	// empty when it exited.
	Signal string
}

// Exec runs a process of the lease on the pool host and relays its stdio
// and signals until it ends. Canceling ctx stops the process (SIGTERM,
// then SIGKILL) and returns ctx's error.
func (c *Conn) Exec(ctx context.Context, token string, req *gpupoolv1.ExecStart, stdio ExecIO) (ExitStatus, error) {
	cs, err := c.open(ctx, "exec", &gpupoolv1.StreamOpen{Token: token, Op: &gpupoolv1.StreamOpen_Exec{Exec: req}})
	if err != nil {
		return ExitStatus{}, err
	}
	stdout, stderr := orDiscard(stdio.Stdout), orDiscard(stdio.Stderr)

	done := make(chan struct{})
	stdinDone := make(chan struct{})
	go func() {
		defer close(stdinDone)
		cs.relayStdin(stdio.Stdin, done)
	}()
	var relays sync.WaitGroup
	relays.Go(func() {
		// Once stdin has ended and no signal can follow, the client's
		// direction of the stream ends.
		sigs, stdinEnded := stdio.Signals, stdinDone
		for sigs != nil || stdinEnded != nil {
			select {
			case <-stdinEnded:
				stdinEnded = nil
			case sig, ok := <-sigs:
				if !ok {
					sigs = nil
				} else if s, isSys := sig.(syscall.Signal); isSys {
					cs.send(&gpupoolv1.ExecInput{Input: &gpupoolv1.ExecInput_Signal{Signal: int32(s)}})
				}
			case <-done:
				return
			}
		}
		cs.closeSend()
	})
	defer func() {
		close(done)
		cs.close()
		relays.Wait()
	}()

	for {
		var out gpupoolv1.ExecOutput
		if err := cs.fr.read(&out); err != nil {
			return ExitStatus{}, cs.err(err)
		}
		switch x := out.GetOutput().(type) {
		case *gpupoolv1.ExecOutput_Stdout:
			if _, err := stdout.Write(x.Stdout); err != nil {
				cs.abort()
				return ExitStatus{}, fmt.Errorf("dataplane: exec: writing stdout: %w", err)
			}
		case *gpupoolv1.ExecOutput_Stderr:
			if _, err := stderr.Write(x.Stderr); err != nil {
				cs.abort()
				return ExitStatus{}, fmt.Errorf("dataplane: exec: writing stderr: %w", err)
			}
		case *gpupoolv1.ExecOutput_Exit:
			status := ExitStatus{Code: int(x.Exit.GetCode()), Signal: x.Exit.GetSignal()}
			if msg := x.Exit.GetError(); msg != "" {
				return status, fmt.Errorf("dataplane: exec: %s", msg)
			}
			return status, nil
		default:
			cs.abort()
			return ExitStatus{}, fmt.Errorf("%w: an ExecOutput frame with no output set", ErrProtocol)
		}
	}
}

// relayStdin sends r as stdin frames, then stdin_eof, until done.
func (cs *clientStream) relayStdin(r io.Reader, done <-chan struct{}) {
	eof := &gpupoolv1.ExecInput{Input: &gpupoolv1.ExecInput_StdinEof{StdinEof: true}}
	if r == nil {
		cs.send(eof)
		return
	}
	buf := make([]byte, chunkSize)
	for {
		n, err := r.Read(buf)
		select {
		case <-done:
			return
		default:
		}
		if n > 0 {
			if cs.send(&gpupoolv1.ExecInput{Input: &gpupoolv1.ExecInput_Stdin{Stdin: buf[:n]}}) != nil {
				return
			}
		}
		if err != nil {
			// At EOF or a read error alike, the process's stdin ends.
			cs.send(eof)
			return
		}
	}
}

// Put writes the data r holds to remotePath, relative to the lease
// directory, with the permission bits of mode (0 means 0644). size is the
// number of bytes r holds, or -1 when unknown. The file appears whole or
// not at all. Put returns the SHA-256 (hex) the agent checked.
func (c *Conn) Put(ctx context.Context, token string, r io.Reader, size int64, remotePath string, mode fs.FileMode) (string, error) {
	cs, err := c.open(ctx, "put", &gpupoolv1.StreamOpen{Token: token, Op: &gpupoolv1.StreamOpen_Put{Put: &gpupoolv1.PutStart{
		Path: remotePath,
		Mode: uint32(mode.Perm()),
		Size: size,
	}}})
	if err != nil {
		return "", err
	}
	defer cs.close()
	h := sha256.New()
	var n int64
	buf := make([]byte, chunkSize)
	for {
		k, rerr := r.Read(buf)
		if k > 0 {
			n += int64(k)
			if size >= 0 && n > size {
				cs.abort()
				return "", fmt.Errorf("dataplane: put %s: the reader holds more than the %d bytes announced", remotePath, size)
			}
			h.Write(buf[:k])
			if err := cs.send(&gpupoolv1.PutData{Frame: &gpupoolv1.PutData_Chunk{Chunk: &gpupoolv1.DataChunk{Data: buf[:k]}}}); err != nil {
				return "", cs.putFailed(err)
			}
		}
		if rerr == io.EOF {
			break
		}
		if rerr != nil {
			cs.abort()
			return "", fmt.Errorf("dataplane: put %s: reading the data: %w", remotePath, rerr)
		}
	}
	sum := hex.EncodeToString(h.Sum(nil))
	if err := cs.send(&gpupoolv1.PutData{Frame: &gpupoolv1.PutData_End{End: &gpupoolv1.PutEnd{Sha256: sum}}}); err != nil {
		return "", cs.putFailed(err)
	}
	cs.closeSend()
	var res gpupoolv1.PutResult
	if err := cs.fr.read(&res); err != nil {
		return "", cs.err(err)
	}
	if res.GetError() != "" {
		return "", &RefusedError{Code: res.GetCode(), Message: res.GetError()}
	}
	if res.GetSha256() != sum || res.GetBytes() != n {
		return "", fmt.Errorf("%w: put %s: sent %d bytes with sha256 %s, the agent wrote %d bytes with sha256 %s",
			ErrChecksumMismatch, remotePath, n, sum, res.GetBytes(), res.GetSha256())
	}
	return sum, nil
}

// putFailed is the error of a put whose data the agent stopped reading:
// the PutResult's error, which the agent sends first, when it did.
func (cs *clientStream) putFailed(sendErr error) error {
	var res gpupoolv1.PutResult
	if err := cs.fr.read(&res); err == nil && res.GetError() != "" {
		return &RefusedError{Code: res.GetCode(), Message: res.GetError()}
	}
	return cs.err(sendErr)
}

// Get writes the file remotePath, relative to the lease directory, to w
// and returns its SHA-256 (hex). It fails with ErrChecksumMismatch when
// the data does not match the agent's checksum; w has then received data
// that must be discarded, as after any error.
func (c *Conn) Get(ctx context.Context, token, remotePath string, w io.Writer) (string, error) {
	cs, err := c.open(ctx, "get", &gpupoolv1.StreamOpen{Token: token, Op: &gpupoolv1.StreamOpen_Get{Get: &gpupoolv1.GetStart{Path: remotePath}}})
	if err != nil {
		return "", err
	}
	defer cs.close()
	cs.closeSend()
	sum, err := receiveFile(&cs.fr, remotePath, w)
	var readErr *streamReadError
	if errors.As(err, &readErr) {
		return "", cs.err(readErr.err)
	}
	if err != nil {
		cs.abort()
		return "", err
	}
	return sum, nil
}

// streamReadError is a failure to read the stream, as opposed to what was
// read.
type streamReadError struct{ err error }

func (e *streamReadError) Error() string { return e.err.Error() }

// receiveFile reads a get's frames that follow the StreamAccept, writes
// the data to w and checks it against the agent's checksum.
func receiveFile(fr *frameReader, path string, w io.Writer) (string, error) {
	var info gpupoolv1.GetInfo
	if err := fr.read(&info); err != nil {
		return "", &streamReadError{err}
	}
	h := sha256.New()
	var n int64
	for {
		var d gpupoolv1.GetData
		if err := fr.read(&d); err != nil {
			return "", &streamReadError{err}
		}
		switch x := d.GetFrame().(type) {
		case *gpupoolv1.GetData_Chunk:
			data := x.Chunk.GetData()
			n += int64(len(data))
			h.Write(data)
			if _, err := w.Write(data); err != nil {
				return "", fmt.Errorf("dataplane: get %s: writing: %w", path, err)
			}
		case *gpupoolv1.GetData_End:
			sum := hex.EncodeToString(h.Sum(nil))
			if x.End.GetSha256() != sum || x.End.GetBytes() != n {
				return "", fmt.Errorf("%w: get %s: received %d bytes with sha256 %s, the agent sent %d bytes with sha256 %s",
					ErrChecksumMismatch, path, n, sum, x.End.GetBytes(), x.End.GetSha256())
			}
			return sum, nil
		default:
			return "", fmt.Errorf("%w: a GetData frame with no frame set", ErrProtocol)
		}
	}
}

// Forward connects local to the TCP port remotePort on the pool host's
// loopback and carries bytes both ways until both directions have ended;
// each side's end of data is passed on as a half-close (local needs a
// CloseWrite method, as *net.TCPConn has, for that). It closes local.
// Canceling ctx ends the connection and returns ctx's error.
func (c *Conn) Forward(ctx context.Context, token string, remotePort int, local net.Conn) error {
	open := &gpupoolv1.StreamOpen{Token: token, Op: &gpupoolv1.StreamOpen_Forward{Forward: &gpupoolv1.ForwardStart{Port: int32(remotePort)}}}
	return c.relay(ctx, "forward", open, local, forwardSpliceBuffer)
}

// Cuda connects local, a connection of the CUDA shim (libcuda.so.1), to
// the lease's CUDA server on the pool host, which the agent starts on the
// lease's first such stream, and carries bytes both ways until both
// directions have ended. It closes local. When the lease ends the agent
// resets the stream and Cuda returns ErrLeaseEnded; the shim's next call
// fails.
func (c *Conn) Cuda(ctx context.Context, token string, local net.Conn) error {
	open := &gpupoolv1.StreamOpen{Token: token, Op: &gpupoolv1.StreamOpen_Cuda{Cuda: &gpupoolv1.CudaStart{}}}
	return c.relay(ctx, "cuda", open, local, cudaSpliceBuffer)
}

// relay opens the stream of op and splices it with local, through buffers
// of bufSize bytes, until both directions have ended. It closes local.
func (c *Conn) relay(ctx context.Context, op string, open *gpupoolv1.StreamOpen, local net.Conn, bufSize int) error {
	defer local.Close()
	cs, err := c.open(ctx, op, open)
	if err != nil {
		return err
	}
	// splice ends both directions itself; a reset after its FIN could
	// lose the data still in flight.
	defer cs.stopReset()
	if err := splice(ctx, cs.qs, local, bufSize); err != nil {
		return cs.err(err)
	}
	return nil
}

// Usage calls fn with the lease's live usage on the pool host, at once and
// then every interval (0 means a second; at least 100ms), until ctx ends,
// and returns ctx's error. fn runs on Usage's goroutine.
func (c *Conn) Usage(ctx context.Context, token string, interval time.Duration, fn func(*gpupoolv1.LeaseUsage)) error {
	cs, err := c.open(ctx, "usage", &gpupoolv1.StreamOpen{Token: token, Op: &gpupoolv1.StreamOpen_Usage{Usage: &gpupoolv1.UsageStart{IntervalMs: interval.Milliseconds()}}})
	if err != nil {
		return err
	}
	defer cs.close()
	for {
		u := new(gpupoolv1.LeaseUsage)
		if err := cs.fr.read(u); err != nil {
			return cs.err(err)
		}
		fn(u)
	}
}

// clientStream is the client's side of one operation's stream.
type clientStream struct {
	qs  *quic.Stream
	ctx context.Context
	op  string
	fr  frameReader // used by one goroutine at a time
	// stopReset stops ctx from resetting the stream.
	stopReset func() bool

	wmu sync.Mutex  // serializes writes and the close of qs's send direction
	fw  frameWriter // guarded by wmu
	// sendClosed is set, under wmu, once the send direction is closed; it
	// is read without wmu, which a blocked send may hold.
	sendClosed atomic.Bool
}

// open starts an operation: it opens a stream, sends the StreamOpen and
// reads the agent's StreamAccept. Until close, ending ctx resets the
// stream.
func (c *Conn) open(ctx context.Context, op string, open *gpupoolv1.StreamOpen) (*clientStream, error) {
	qs, err := c.qc.OpenStreamSync(ctx)
	if err != nil {
		if cerr := context.Cause(ctx); cerr != nil {
			return nil, cerr
		}
		return nil, fmt.Errorf("dataplane: %s: %w", op, peerError(err))
	}
	cs := &clientStream{qs: qs, ctx: ctx, op: op, fr: frameReader{r: qs}, fw: frameWriter{w: qs}}
	cs.stopReset = context.AfterFunc(ctx, cs.abort)
	if err := cs.send(open); err != nil {
		cs.close()
		return nil, cs.err(err)
	}
	var acc gpupoolv1.StreamAccept
	if err := cs.fr.read(&acc); err != nil {
		cs.close()
		return nil, cs.err(err)
	}
	if acc.GetCode() != gpupoolv1.AcceptCode_ACCEPT_CODE_OK {
		cs.close()
		return nil, &RefusedError{Code: acc.GetCode(), Message: acc.GetError()}
	}
	return cs, nil
}

func (cs *clientStream) send(m proto.Message) error {
	cs.wmu.Lock()
	defer cs.wmu.Unlock()
	if cs.sendClosed.Load() {
		return errors.New("dataplane: send direction already closed")
	}
	return cs.fw.write(m)
}

// closeSend ends the client's direction of the stream cleanly (FIN).
func (cs *clientStream) closeSend() {
	cs.wmu.Lock()
	defer cs.wmu.Unlock()
	if !cs.sendClosed.Swap(true) {
		cs.qs.Close()
	}
}

// abort resets the stream in both directions; the agent ends the
// operation (and stops an exec's process).
func (cs *clientStream) abort() {
	cs.qs.CancelRead(codeCanceled)
	cs.qs.CancelWrite(codeCanceled)
}

// close releases the stream once the operation is over, whatever its
// state: a send direction still open is reset, which also unblocks a send
// waiting for flow control. Data already sent with a FIN is still
// delivered.
func (cs *clientStream) close() {
	cs.stopReset()
	if !cs.sendClosed.Load() {
		cs.qs.CancelWrite(codeCanceled)
	}
	cs.qs.CancelRead(codeCanceled)
}

// err is what the caller sees for a failed stream operation: ctx's error
// when ctx ended, the agent's stream and connection codes as this
// package's sentinel errors, a frame that breaks the protocol as
// ErrProtocol, anything else wrapped with the operation's name.
func (cs *clientStream) err(err error) error {
	if cerr := context.Cause(cs.ctx); cerr != nil {
		return cerr
	}
	switch {
	case isMalformed(err):
		return fmt.Errorf("%w: %s: %v", ErrProtocol, cs.op, err)
	case err == io.EOF || err == io.ErrUnexpectedEOF:
		return fmt.Errorf("%w: %s: the agent ended the stream early", ErrProtocol, cs.op)
	}
	if perr := peerError(err); perr != err {
		return perr
	}
	return fmt.Errorf("dataplane: %s: %w", cs.op, err)
}

func orDiscard(w io.Writer) io.Writer {
	if w == nil {
		return io.Discard
	}
	return w
}
