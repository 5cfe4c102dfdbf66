package dataplanebench

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/gpupool/gpupool/dataplane"
)

// The baseline's protocol: the least that does what the data plane does,
// over one TCP + TLS 1.3 connection. One operation runs at a time; an
// error ends the connection. Every message is a frame: a type byte, the
// payload's length (4 bytes, big-endian), the payload.
//
//	put:  client msgPut(token NUL path), msgData..., msgEnd(bytes, sha256)
//	      server msgEnd(bytes, sha256) once the file is in place and synced
//	get:  client msgGet(token NUL path)
//	      server msgData..., msgEnd(bytes, sha256)
//	exec: client msgExec(token NUL argv[0] NUL argv[1] ...)
//	      server msgStdout and msgStderr..., msgExit(code)
//
// The server answers a failed operation with msgError(text) and closes
// the connection.
const (
	msgPut byte = iota + 1
	msgGet
	msgExec
	msgData
	msgEnd
	msgStdout
	msgStderr
	msgExit
	msgError
)

const (
	// chunkSize is the most data one msgData or output frame carries: the
	// size of the data plane's DataChunk.
	chunkSize = 64 << 10
	// tcpALPN is the baseline's TLS application protocol.
	tcpALPN = "gpupool-bench-tcp"
)

// errProtocol is wrapped by the errors of frames the baseline's protocol
// does not allow where they came.
var errProtocol = errors.New("baseline protocol violation")

// framer reads and writes frames on one connection, reusing its buffers.
// One goroutine at a time may read, and one at a time may write.
type framer struct {
	rw   io.ReadWriter
	hdr  [5]byte
	rbuf []byte
	wbuf []byte
}

// write sends one frame whose payload is the concatenation of parts, in a
// single Write.
func (f *framer) write(typ byte, parts ...[]byte) error {
	size := 0
	for _, p := range parts {
		size += len(p)
	}
	if size > dataplane.MaxFrame {
		return fmt.Errorf("frame of %d bytes: must be at most %d", size, dataplane.MaxFrame)
	}
	b := append(f.wbuf[:0], typ)
	b = binary.BigEndian.AppendUint32(b, uint32(size))
	for _, p := range parts {
		b = append(b, p...)
	}
	f.wbuf = b
	_, err := f.rw.Write(b)
	return err
}

// read receives one frame. The payload is valid until the next read.
func (f *framer) read() (byte, []byte, error) {
	if _, err := io.ReadFull(f.rw, f.hdr[:]); err != nil {
		return 0, nil, err
	}
	size := binary.BigEndian.Uint32(f.hdr[1:])
	if size > dataplane.MaxFrame {
		return 0, nil, fmt.Errorf("%w: frame of %d bytes: must be at most %d", errProtocol, size, dataplane.MaxFrame)
	}
	if uint32(cap(f.rbuf)) < size {
		f.rbuf = make([]byte, size)
	}
	b := f.rbuf[:size]
	if _, err := io.ReadFull(f.rw, b); err != nil {
		if err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
		return 0, nil, err
	}
	return f.hdr[0], b, nil
}

// endPayload is the payload of a msgEnd: the byte count, then the raw
// SHA-256.
func endPayload(n int64, sum []byte) []byte {
	return append(binary.BigEndian.AppendUint64(nil, uint64(n)), sum...)
}

func parseEnd(p []byte) (int64, []byte, error) {
	if len(p) != 8+sha256.Size {
		return 0, nil, fmt.Errorf("%w: msgEnd of %d bytes, want %d", errProtocol, len(p), 8+sha256.Size)
	}
	return int64(binary.BigEndian.Uint64(p)), bytes.Clone(p[8:]), nil
}

// request is the payload of an operation's first frame: the token and
// args, separated by NULs.
func request(args ...string) []byte {
	return []byte(strings.Join(append([]string{benchToken}, args...), "\x00"))
}

// unexpected is the error for a frame the client did not expect, which
// may be the server's msgError.
func unexpected(typ byte, p []byte) error {
	if typ == msgError {
		return fmt.Errorf("the server failed: %s", p)
	}
	return fmt.Errorf("%w: unexpected frame type %d", errProtocol, typ)
}

// tcpSide is the baseline: a tcpServer and one TLS connection to it.
type tcpSide struct {
	srv   *tcpServer
	conn  *tls.Conn
	f     *framer
	suite string // the negotiated TLS cipher suite
}

// startTCPTLS starts a tcpServer on a free loopback port with cert,
// serving dir (which it creates), and connects to it, pinning certSHA256
// as dataplane.Dial does.
func startTCPTLS(ctx context.Context, cert tls.Certificate, certSHA256, dir string) (*tcpSide, error) {
	pin, err := hex.DecodeString(certSHA256)
	if err != nil {
		return nil, fmt.Errorf("certificate sha256 %q: %w", certSHA256, err)
	}
	if err := os.Mkdir(dir, 0o755); err != nil {
		return nil, err
	}
	ln, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{
		Certificates: []tls.Certificate{cert},
		MinVersion:   tls.VersionTLS13,
		NextProtos:   []string{tcpALPN},
	})
	if err != nil {
		return nil, err
	}
	srv := &tcpServer{ln: ln, dir: dir, conns: make(map[net.Conn]struct{})}
	srv.wg.Go(srv.serve)
	d := tls.Dialer{Config: &tls.Config{
		// The pin is the whole trust, as in the data plane.
		InsecureSkipVerify: true,
		MinVersion:         tls.VersionTLS13,
		NextProtos:         []string{tcpALPN},
		VerifyConnection: func(cs tls.ConnectionState) error {
			if len(cs.PeerCertificates) == 0 {
				return errors.New("the server presented no certificate")
			}
			if got := sha256.Sum256(cs.PeerCertificates[0].Raw); !bytes.Equal(got[:], pin) {
				return fmt.Errorf("the server presented certificate sha256 %x, want %x", got, pin)
			}
			return nil
		},
	}}
	c, err := d.DialContext(ctx, "tcp", ln.Addr().String())
	if err != nil {
		srv.close()
		return nil, err
	}
	conn := c.(*tls.Conn)
	return &tcpSide{
		srv:   srv,
		conn:  conn,
		f:     &framer{rw: conn},
		suite: tls.CipherSuiteName(conn.ConnectionState().CipherSuite),
	}, nil
}

func (s *tcpSide) name() string { return "TCP+TLS" }

func (s *tcpSide) does() string {
	return "crypto/tls over one TCP connection (TLS 1.3, " + s.suite + ", the same certificate, pinned the same way), " +
		"one operation at a time with the token in its first frame, no separate accept. " +
		"Put: 64 KiB chunks, each a 5-byte header and the data, SHA-256 on both ends; the server writes a temporary file " +
		"(os.Root), then chmods, fsyncs, renames it and fsyncs the directory, as the agent does. " +
		"Get: the server streams the file in 64 KiB chunks with a SHA-256 at the end, checked by the client. " +
		"Exec: the server fork-execs the command in its own process group with stdin/stdout/stderr pipes " +
		"(stdin closed at once, output relayed) and sends the exit code."
}

// op runs fn, which uses the connection; when ctx ends first, the
// connection fails and op returns ctx's error.
func (s *tcpSide) op(ctx context.Context, fn func() error) error {
	stop := context.AfterFunc(ctx, func() { s.conn.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	err := fn()
	if err != nil && ctx.Err() != nil {
		return context.Cause(ctx)
	}
	return err
}

func (s *tcpSide) put(ctx context.Context, r io.Reader, size int64, name string) (string, error) {
	var sum []byte
	err := s.op(ctx, func() error {
		if err := s.f.write(msgPut, request(name)); err != nil {
			return err
		}
		h := sha256.New()
		var n int64
		buf := make([]byte, chunkSize)
		for {
			k, rerr := r.Read(buf)
			if k > 0 {
				n += int64(k)
				h.Write(buf[:k])
				if err := s.f.write(msgData, buf[:k]); err != nil {
					return err
				}
			}
			if rerr == io.EOF {
				break
			}
			if rerr != nil {
				return fmt.Errorf("reading the data: %w", rerr)
			}
		}
		if n != size {
			return fmt.Errorf("the reader held %d bytes, %d were announced", n, size)
		}
		sum = h.Sum(nil)
		if err := s.f.write(msgEnd, endPayload(n, sum)); err != nil {
			return err
		}
		typ, p, err := s.f.read()
		if err != nil {
			return err
		}
		if typ != msgEnd {
			return unexpected(typ, p)
		}
		gotN, gotSum, err := parseEnd(p)
		if err != nil {
			return err
		}
		if gotN != n || !bytes.Equal(gotSum, sum) {
			return fmt.Errorf("sent %d bytes with sha256 %x, the server wrote %d with sha256 %x", n, sum, gotN, gotSum)
		}
		return nil
	})
	return hex.EncodeToString(sum), err
}

func (s *tcpSide) get(ctx context.Context, name string, w io.Writer) (string, error) {
	var sum []byte
	err := s.op(ctx, func() error {
		if err := s.f.write(msgGet, request(name)); err != nil {
			return err
		}
		h := sha256.New()
		var n int64
		for {
			typ, p, err := s.f.read()
			if err != nil {
				return err
			}
			switch typ {
			case msgData:
				n += int64(len(p))
				h.Write(p)
				if _, err := w.Write(p); err != nil {
					return err
				}
			case msgEnd:
				wantN, wantSum, err := parseEnd(p)
				if err != nil {
					return err
				}
				sum = h.Sum(nil)
				if wantN != n || !bytes.Equal(wantSum, sum) {
					return fmt.Errorf("received %d bytes with sha256 %x, the server sent %d with sha256 %x", n, sum, wantN, wantSum)
				}
				return nil
			default:
				return unexpected(typ, p)
			}
		}
	})
	return hex.EncodeToString(sum), err
}

func (s *tcpSide) exec(ctx context.Context, argv []string) (int, error) {
	code := -1
	err := s.op(ctx, func() error {
		if err := s.f.write(msgExec, request(argv...)); err != nil {
			return err
		}
		for {
			typ, p, err := s.f.read()
			if err != nil {
				return err
			}
			switch typ {
			case msgStdout, msgStderr:
				// Discarded, as dataplane.Conn.Exec does without writers.
			case msgExit:
				if len(p) != 4 {
					return fmt.Errorf("%w: msgExit of %d bytes, want 4", errProtocol, len(p))
				}
				code = int(int32(binary.BigEndian.Uint32(p)))
				return nil
			default:
				return unexpected(typ, p)
			}
		}
	})
	return code, err
}

func (s *tcpSide) close() error {
	err := s.conn.Close()
	s.srv.close()
	return err
}

// tcpServer is the baseline's server: it runs the operations its clients
// ask for on the files of dir.
type tcpServer struct {
	ln  net.Listener
	dir string

	mu    sync.Mutex
	conns map[net.Conn]struct{} // guarded by mu

	wg sync.WaitGroup // serve and the connections being served
}

func (s *tcpServer) serve() {
	for {
		c, err := s.ln.Accept()
		if err != nil {
			return
		}
		s.mu.Lock()
		s.conns[c] = struct{}{}
		s.mu.Unlock()
		s.wg.Go(func() { s.serveConn(c) })
	}
}

// close stops accepting, closes every connection and waits for them.
func (s *tcpServer) close() {
	s.ln.Close()
	s.mu.Lock()
	for c := range s.conns {
		c.Close()
	}
	s.mu.Unlock()
	s.wg.Wait()
}

// serveConn runs the connection's operations, one after the other, until
// it ends or one fails.
func (s *tcpServer) serveConn(c net.Conn) {
	defer func() {
		c.Close()
		s.mu.Lock()
		delete(s.conns, c)
		s.mu.Unlock()
	}()
	f := &framer{rw: c}
	for {
		typ, p, err := f.read()
		if err != nil {
			return
		}
		if err := s.serveOp(f, typ, string(p)); err != nil {
			f.write(msgError, []byte(err.Error()))
			return
		}
	}
}

// serveOp runs the operation whose first frame is of type typ with
// payload p.
func (s *tcpServer) serveOp(f *framer, typ byte, p string) error {
	fields := strings.Split(p, "\x00")
	if fields[0] != benchToken {
		return errors.New("unauthenticated: not the benchmark's token")
	}
	args := fields[1:]
	switch typ {
	case msgPut, msgGet:
		if len(args) != 1 || !filepath.IsLocal(args[0]) {
			return fmt.Errorf("path %q: must be one path relative to the directory and stay inside it", strings.Join(args, "\x00"))
		}
		if typ == msgPut {
			return s.put(f, args[0])
		}
		return s.get(f, args[0])
	case msgExec:
		if len(args) == 0 || args[0] == "" {
			return errors.New("argv: must name a program")
		}
		return s.exec(f, args)
	default:
		return fmt.Errorf("%w: frame type %d: an operation starts with msgPut, msgGet or msgExec", errProtocol, typ)
	}
}

// put receives a file into path: into a temporary file next to it, which
// replaces path once its size and checksum are right and it is synced.
func (s *tcpServer) put(f *framer, path string) error {
	root, err := os.OpenRoot(s.dir)
	if err != nil {
		return err
	}
	defer root.Close()
	tmp := filepath.Join(filepath.Dir(path), "."+filepath.Base(path)+".bench-put-"+rand.Text())
	file, err := root.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	committed := false
	defer func() {
		if !committed {
			file.Close()
			root.Remove(tmp)
		}
	}()
	h := sha256.New()
	var n int64
	for {
		typ, p, err := f.read()
		if err != nil {
			return err
		}
		switch typ {
		case msgData:
			n += int64(len(p))
			if _, err := file.Write(p); err != nil {
				return err
			}
			h.Write(p)
		case msgEnd:
			wantN, wantSum, err := parseEnd(p)
			if err != nil {
				return err
			}
			sum := h.Sum(nil)
			if wantN != n || !bytes.Equal(wantSum, sum) {
				return fmt.Errorf("received %d bytes with sha256 %x, the client sent %d with sha256 %x", n, sum, wantN, wantSum)
			}
			if err := commitFile(root, file, tmp, path); err != nil {
				return err
			}
			committed = true
			return f.write(msgEnd, endPayload(n, sum))
		default:
			return fmt.Errorf("%w: frame type %d inside a put", errProtocol, typ)
		}
	}
}

// commitFile makes the temporary file f, named tmp, the file path with
// mode 0644: it syncs it, renames it and syncs the directory. It closes f.
func commitFile(root *os.Root, f *os.File, tmp, path string) error {
	err := f.Chmod(0o644)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = root.Rename(tmp, path)
	}
	if err != nil {
		return err
	}
	d, err := root.Open(filepath.Dir(path))
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}

// get sends the regular file path in chunks, then its size and checksum.
func (s *tcpServer) get(f *framer, path string) error {
	root, err := os.OpenRoot(s.dir)
	if err != nil {
		return err
	}
	defer root.Close()
	file, err := root.Open(path)
	if err != nil {
		return err
	}
	defer file.Close()
	if fi, err := file.Stat(); err != nil {
		return err
	} else if !fi.Mode().IsRegular() {
		return fmt.Errorf("path %q: not a regular file", path)
	}
	h := sha256.New()
	var n int64
	buf := make([]byte, chunkSize)
	for {
		k, rerr := file.Read(buf)
		if k > 0 {
			n += int64(k)
			h.Write(buf[:k])
			if err := f.write(msgData, buf[:k]); err != nil {
				return err
			}
		}
		if rerr == io.EOF {
			break
		}
		if rerr != nil {
			return rerr
		}
	}
	return f.write(msgEnd, endPayload(n, h.Sum(nil)))
}

// exec runs argv in dir, in a process group of its own with pipes for its
// stdio, relays its output and then its exit code.
func (s *tcpServer) exec(f *framer, argv []string) error {
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Dir = s.dir
	cmd.Env = []string{"PATH=" + os.Getenv("PATH"), "HOME=" + s.dir, "GPUPOOL_LEASE_ID=" + benchLease}
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return err
	}
	stderr, err := cmd.StderrPipe()
	if err != nil {
		return err
	}
	if err := cmd.Start(); err != nil {
		return err
	}
	// The client sends no stdin.
	stdin.Close()

	var wmu sync.Mutex // serializes the relays' writes to f
	relay := func(r io.Reader, typ byte) error {
		var werr error
		buf := make([]byte, chunkSize)
		for {
			n, rerr := r.Read(buf)
			if n > 0 && werr == nil {
				wmu.Lock()
				werr = f.write(typ, buf[:n])
				wmu.Unlock()
			}
			if rerr != nil {
				// Drained: every writer closed the pipe.
				return werr
			}
		}
	}
	var relays sync.WaitGroup
	var outErr, errErr error
	relays.Go(func() { outErr = relay(stdout, msgStdout) })
	relays.Go(func() { errErr = relay(stderr, msgStderr) })
	relays.Wait()
	waitErr := cmd.Wait()
	if err := errors.Join(outErr, errErr); err != nil {
		return err
	}
	if cmd.ProcessState == nil {
		return waitErr
	}
	code := cmd.ProcessState.ExitCode()
	if ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
		code = 128 + int(ws.Signal())
	}
	return f.write(msgExit, binary.BigEndian.AppendUint32(nil, uint32(int32(code))))
}
