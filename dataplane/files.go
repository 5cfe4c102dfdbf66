package dataplane

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"syscall"

	"github.com/gpupool/gpupool/internal/atomicfile"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// checkLeasePath refuses a path that is empty, absolute or leaves its
// directory lexically ("..").
func checkLeasePath(field, path string) *RefusedError {
	if path == "" {
		return refusef(gpupoolv1.AcceptCode_ACCEPT_CODE_INVALID_ARGUMENT, "%s: must not be empty", field)
	}
	if !filepath.IsLocal(path) {
		return refusef(gpupoolv1.AcceptCode_ACCEPT_CODE_INVALID_ARGUMENT, "%s %q: must be relative to the lease directory and stay inside it", field, path)
	}
	return nil
}

// pathRefusal is the refusal for an error of an os.Root operation on path.
func pathRefusal(field, path string, err error) *RefusedError {
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return refusef(gpupoolv1.AcceptCode_ACCEPT_CODE_NOT_FOUND, "%s %q: no such file or directory in the lease directory", field, path)
	case escapes(err):
		return refusef(gpupoolv1.AcceptCode_ACCEPT_CODE_PERMISSION_DENIED, "%s %q: escapes the lease directory through a symlink", field, path)
	case errors.Is(err, fs.ErrPermission):
		return refusef(gpupoolv1.AcceptCode_ACCEPT_CODE_PERMISSION_DENIED, "%s %q: %v", field, path, unwrapPath(err))
	case errors.Is(err, syscall.ENOTDIR), errors.Is(err, syscall.EISDIR), errors.Is(err, syscall.ELOOP), errors.Is(err, syscall.ENAMETOOLONG):
		return refusef(gpupoolv1.AcceptCode_ACCEPT_CODE_INVALID_ARGUMENT, "%s %q: %v", field, path, unwrapPath(err))
	default:
		return refusef(gpupoolv1.AcceptCode_ACCEPT_CODE_INTERNAL, "%s %q: %v", field, path, unwrapPath(err))
	}
}

// escapes reports whether an os.Root operation failed because the path
// leaves the root. os.Root does not export that error, only its text.
func escapes(err error) bool {
	for {
		inner := errors.Unwrap(err)
		if inner == nil {
			return err.Error() == "path escapes from parent"
		}
		err = inner
	}
}

// unwrapPath strips the *fs.PathError, whose path is the server's.
func unwrapPath(err error) error {
	var pe *fs.PathError
	if errors.As(err, &pe) {
		return pe.Err
	}
	return err
}

// openLeaseRoot opens the lease directory as an os.Root, through which no
// path can leave it.
func (st *serverStream) openLeaseRoot() (*os.Root, *RefusedError) {
	dir, err := st.srv.leases.Dir(st.leaseID)
	if err != nil {
		return nil, refusef(gpupoolv1.AcceptCode_ACCEPT_CODE_INTERNAL, "lease directory: %v", err)
	}
	root, err := os.OpenRoot(dir)
	if err != nil {
		return nil, refusef(gpupoolv1.AcceptCode_ACCEPT_CODE_INTERNAL, "lease directory: %v", err)
	}
	return root, nil
}

// put runs a PutStart: the data goes to a temporary file next to the
// target, which replaces the target once its size and checksum are right
// and it is synced. Memory use does not depend on the file's size.
func (st *serverStream) put(req *gpupoolv1.PutStart) *RefusedError {
	const invalid = gpupoolv1.AcceptCode_ACCEPT_CODE_INVALID_ARGUMENT
	path := req.GetPath()
	if refused := checkLeasePath("path", path); refused != nil {
		return refused
	}
	if req.GetMode()&^0o777 != 0 {
		return refusef(invalid, "mode %#o: must be permission bits only (at most 0777)", req.GetMode())
	}
	if req.GetSize() < -1 {
		return refusef(invalid, "size %d: must be -1 (unknown) or at least 0", req.GetSize())
	}
	root, refused := st.openLeaseRoot()
	if refused != nil {
		return refused
	}
	defer root.Close()
	owner := leaseOwner(root)
	parent := filepath.Dir(path)
	if parent != "." {
		if err := root.MkdirAll(parent, 0o755); err != nil {
			return pathRefusal("path", path, err)
		}
		for p := parent; p != "."; p = filepath.Dir(p) {
			owner.chown(root, p)
		}
	}
	if fi, err := root.Lstat(path); err == nil && fi.IsDir() {
		return refusef(invalid, "path %q: is a directory", path)
	}
	tmp, err := tempName(path)
	if err != nil {
		return refusef(gpupoolv1.AcceptCode_ACCEPT_CODE_INTERNAL, "%v", err)
	}
	f, err := root.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return pathRefusal("path", path, err)
	}
	owner.chown(root, tmp)
	committed := false
	defer func() {
		if !committed {
			f.Close()
			root.Remove(tmp)
		}
	}()
	if err := st.accept(); err != nil {
		st.cancel(fmt.Errorf("accepting: %w", err))
		return nil
	}

	fail := func(code gpupoolv1.AcceptCode, format string, args ...any) *RefusedError {
		st.send(&gpupoolv1.PutResult{Code: code, Error: fmt.Sprintf(format, args...)})
		return nil
	}
	h := sha256.New()
	var n int64
	var end *gpupoolv1.PutEnd
	for end == nil {
		var d gpupoolv1.PutData
		err := st.fr.read(&d)
		switch {
		case err == io.EOF:
			return fail(invalid, "the data ended without a PutEnd")
		case err != nil && isMalformed(err):
			st.protocolError(err)
			return nil
		case err != nil:
			st.cancel(fmt.Errorf("client gone: %w", err))
			return nil
		}
		switch x := d.GetFrame().(type) {
		case *gpupoolv1.PutData_Chunk:
			data := x.Chunk.GetData()
			n += int64(len(data))
			if req.GetSize() >= 0 && n > req.GetSize() {
				return fail(invalid, "size %d: the client sent more", req.GetSize())
			}
			if _, err := f.Write(data); err != nil {
				return fail(gpupoolv1.AcceptCode_ACCEPT_CODE_INTERNAL, "writing %q: %v", path, unwrapPath(err))
			}
			h.Write(data)
		case *gpupoolv1.PutData_End:
			end = x.End
		default:
			st.protocolError(errors.New("a PutData frame with no frame set"))
			return nil
		}
	}
	sum := hex.EncodeToString(h.Sum(nil))
	if req.GetSize() >= 0 && n != req.GetSize() {
		return fail(invalid, "size %d: the client sent %d bytes", req.GetSize(), n)
	}
	if end.GetSha256() != sum {
		return fail(invalid, "sha256 %s: does not match the %d bytes received (sha256 %s)", end.GetSha256(), n, sum)
	}
	mode := fs.FileMode(req.GetMode())
	if mode == 0 {
		mode = 0o644
	}
	if err := atomicfile.Commit(root, f, tmp, path, mode); err != nil {
		return fail(gpupoolv1.AcceptCode_ACCEPT_CODE_INTERNAL, "%q: %v", path, unwrapPath(err))
	}
	committed = true
	st.log.Info("put", "path", path, "bytes", n)
	if err := st.send(&gpupoolv1.PutResult{Bytes: n, Sha256: sum}); err != nil {
		st.cancel(fmt.Errorf("sending the result: %w", err))
	}
	return nil
}

// tempName is a fresh name for a put's temporary file, in path's
// directory.
func tempName(path string) (string, error) {
	var b [8]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", fmt.Errorf("naming a temporary file: %w", err)
	}
	base := filepath.Base(path)
	if len(base) > 100 {
		base = base[:100]
	}
	return filepath.Join(filepath.Dir(path), fmt.Sprintf(".%s.gpupool-put-%x", base, b)), nil
}

// get runs a GetStart: GetInfo, the file in chunks, then its checksum.
func (st *serverStream) get(req *gpupoolv1.GetStart) *RefusedError {
	path := req.GetPath()
	if refused := checkLeasePath("path", path); refused != nil {
		return refused
	}
	root, refused := st.openLeaseRoot()
	if refused != nil {
		return refused
	}
	defer root.Close()
	// O_NONBLOCK: opening a FIFO must not wait for a writer.
	f, err := root.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return pathRefusal("path", path, err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return refusef(gpupoolv1.AcceptCode_ACCEPT_CODE_INTERNAL, "path %q: %v", path, unwrapPath(err))
	}
	if !fi.Mode().IsRegular() {
		return refusef(gpupoolv1.AcceptCode_ACCEPT_CODE_INVALID_ARGUMENT, "path %q: not a regular file", path)
	}
	if err := st.accept(); err != nil {
		st.cancel(fmt.Errorf("accepting: %w", err))
		return nil
	}
	if err := st.send(&gpupoolv1.GetInfo{Size: fi.Size(), Mode: uint32(fi.Mode().Perm())}); err != nil {
		st.cancel(fmt.Errorf("sending: %w", err))
		return nil
	}
	h := sha256.New()
	var n int64
	buf := make([]byte, chunkSize)
	for {
		k, rerr := f.Read(buf)
		if k > 0 {
			n += int64(k)
			h.Write(buf[:k])
			if err := st.send(&gpupoolv1.GetData{Frame: &gpupoolv1.GetData_Chunk{Chunk: &gpupoolv1.DataChunk{Data: buf[:k]}}}); err != nil {
				st.cancel(fmt.Errorf("sending: %w", err))
				return nil
			}
		}
		if rerr == io.EOF {
			break
		}
		if rerr != nil {
			// The client sees the stream reset, and our log says why.
			st.log.Error("get: reading the file", "path", path, "err", rerr)
			st.abort(codeInternal, rerr)
			return nil
		}
	}
	end := &gpupoolv1.GetEnd{Sha256: hex.EncodeToString(h.Sum(nil)), Bytes: n}
	if err := st.send(&gpupoolv1.GetData{Frame: &gpupoolv1.GetData_End{End: end}}); err != nil {
		st.cancel(fmt.Errorf("sending: %w", err))
		return nil
	}
	st.log.Info("get", "path", path, "bytes", n)
	return nil
}

// owner is the user and group that own a lease's directory.
type owner struct {
	uid, gid int
	differs  bool // from the agent's
}

// leaseOwner is the owner of the lease directory root: in a sandbox, the
// lease's own user, who must own what put creates.
func leaseOwner(root *os.Root) owner {
	fi, err := root.Stat(".")
	if err != nil {
		return owner{}
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return owner{}
	}
	return owner{uid: int(st.Uid), gid: int(st.Gid), differs: int(st.Uid) != os.Geteuid()}
}

// chown hands path, under root, to the owner.
func (o owner) chown(root *os.Root, path string) {
	if o.differs {
		root.Lchown(path, o.uid, o.gid)
	}
}
