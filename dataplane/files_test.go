package dataplane

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// randomData is n pseudo-random bytes from seed, generated as read: it
// never holds more than the caller's buffer.
func randomData(seed uint64, n int64) io.Reader {
	var key [32]byte
	binary.LittleEndian.PutUint64(key[:], seed)
	return io.LimitReader(rand.NewChaCha8(key), n)
}

// sha256Of hashes what r holds.
func sha256Of(t *testing.T, r io.Reader) string {
	t.Helper()
	h := sha256.New()
	if _, err := io.Copy(h, r); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(h.Sum(nil))
}

// countingWriter counts the bytes written to it.
type countingWriter struct {
	w io.Writer
	n int64
}

func (c *countingWriter) Write(p []byte) (int, error) {
	c.n += int64(len(p))
	return c.w.Write(p)
}

func TestPutGetRoundTripOfAFileOfManyFrames(t *testing.T) {
	a := newTestAgent(t)
	c := a.dial(t)
	const size = 64 << 20
	want := sha256Of(t, randomData(1, size))

	got, err := c.Put(t.Context(), testToken, randomData(1, size), size, "data/big.bin", 0o640)
	if err != nil {
		t.Fatal(err)
	}
	if got != want {
		t.Fatalf("Put returned sha256 %s, want %s", got, want)
	}
	f, err := os.Open(filepath.Join(a.dir, "data", "big.bin"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if onDisk := sha256Of(t, f); onDisk != want {
		t.Fatalf("the file on the pool host has sha256 %s, want %s", onDisk, want)
	}
	if fi, err := f.Stat(); err != nil || fi.Mode().Perm() != 0o640 {
		t.Fatalf("got mode %v (%v), want 0640", fi.Mode().Perm(), err)
	}

	h := sha256.New()
	w := &countingWriter{w: h}
	got, err = c.Get(t.Context(), testToken, "data/big.bin", w)
	if err != nil {
		t.Fatal(err)
	}
	if got != want || hex.EncodeToString(h.Sum(nil)) != want || w.n != size {
		t.Fatalf("Get returned sha256 %s and %d bytes hashing to %x, want %d bytes of %s", got, w.n, h.Sum(nil), size, want)
	}
}

func TestPutOfUnknownSizeReplacesTheFile(t *testing.T) {
	a := newTestAgent(t)
	c := a.dial(t)
	for _, content := range []string{"first version, longer", "second"} {
		if _, err := c.Put(t.Context(), testToken, strings.NewReader(content), -1, "f.txt", 0); err != nil {
			t.Fatal(err)
		}
	}
	b, err := os.ReadFile(filepath.Join(a.dir, "f.txt"))
	if err != nil {
		t.Fatal(err)
	}
	if string(b) != "second" {
		t.Fatalf("got %q, want %q", b, "second")
	}
	fi, err := os.Stat(filepath.Join(a.dir, "f.txt"))
	if err != nil || fi.Mode().Perm() != 0o644 {
		t.Fatalf("got mode %v (%v), want the default 0644", fi.Mode().Perm(), err)
	}
}

func TestFilePathsThatEscapeTheLeaseDirectoryAreRefused(t *testing.T) {
	a := newTestAgent(t)
	c := a.dial(t)
	outside := t.TempDir()
	if err := os.WriteFile(filepath.Join(outside, "secret"), []byte("s"), 0o600); err != nil {
		t.Fatal(err)
	}
	for name, target := range map[string]string{"outdir": outside, "outfile": filepath.Join(outside, "secret")} {
		if err := os.Symlink(target, filepath.Join(a.dir, name)); err != nil {
			t.Fatal(err)
		}
	}
	const (
		invalid = gpupoolv1.AcceptCode_ACCEPT_CODE_INVALID_ARGUMENT
		denied  = gpupoolv1.AcceptCode_ACCEPT_CODE_PERMISSION_DENIED
	)
	tests := []struct {
		name string
		path string
		code gpupoolv1.AcceptCode
		msg  string
	}{
		{"a parent reference", "../x", invalid, "must be relative to the lease directory and stay inside it"},
		{"a parent reference inside the path", "a/../../x", invalid, "must be relative"},
		{"an absolute path", "/etc/passwd", invalid, "must be relative"},
		{"a symlinked directory pointing out", "outdir/secret", denied, "escapes the lease directory through a symlink"},
		{"a symlink to a file out of the directory", "outfile", denied, "escapes the lease directory"},
		{"an empty path", "", invalid, "path: must not be empty"},
	}
	for _, tt := range tests {
		t.Run("get "+tt.name, func(t *testing.T) {
			_, err := c.Get(t.Context(), testToken, tt.path, io.Discard)
			wantRefused(t, err, tt.code, tt.msg)
		})
		if tt.path == "outfile" {
			continue // see below
		}
		t.Run("put "+tt.name, func(t *testing.T) {
			_, err := c.Put(t.Context(), testToken, strings.NewReader("x"), 1, tt.path, 0)
			wantRefused(t, err, tt.code, tt.msg)
		})
	}
	t.Run("put over a symlink out of the directory replaces the symlink", func(t *testing.T) {
		if _, err := c.Put(t.Context(), testToken, strings.NewReader("new"), 3, "outfile", 0); err != nil {
			t.Fatal(err)
		}
		fi, err := os.Lstat(filepath.Join(a.dir, "outfile"))
		if err != nil || !fi.Mode().IsRegular() {
			t.Fatalf("got %v (%v), want a regular file", fi.Mode(), err)
		}
	})
	if b, err := os.ReadFile(filepath.Join(outside, "secret")); err != nil || string(b) != "s" {
		t.Fatalf("the file outside was changed: %q, %v", b, err)
	}
	if entries, _ := os.ReadDir(outside); len(entries) != 1 {
		t.Fatalf("got %d files outside the lease directory, want 1", len(entries))
	}
}

func TestFileRefusals(t *testing.T) {
	a := newTestAgent(t)
	c := a.dial(t)
	if err := os.Mkdir(filepath.Join(a.dir, "adir"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Mkfifo(filepath.Join(a.dir, "fifo"), 0o600); err != nil {
		t.Fatal(err)
	}
	const (
		invalid  = gpupoolv1.AcceptCode_ACCEPT_CODE_INVALID_ARGUMENT
		notFound = gpupoolv1.AcceptCode_ACCEPT_CODE_NOT_FOUND
	)
	t.Run("get of a missing file", func(t *testing.T) {
		_, err := c.Get(t.Context(), testToken, "missing", io.Discard)
		wantRefused(t, err, notFound, `path "missing": no such file`)
	})
	t.Run("get of a directory", func(t *testing.T) {
		_, err := c.Get(t.Context(), testToken, "adir", io.Discard)
		wantRefused(t, err, invalid, "not a regular file")
	})
	t.Run("get of a FIFO, without waiting for a writer", func(t *testing.T) {
		_, err := c.Get(t.Context(), testToken, "fifo", io.Discard)
		wantRefused(t, err, invalid, "not a regular file")
	})
	t.Run("put over a directory", func(t *testing.T) {
		_, err := c.Put(t.Context(), testToken, strings.NewReader("x"), 1, "adir", 0)
		wantRefused(t, err, invalid, "is a directory")
	})
	t.Run("put of fewer bytes than announced", func(t *testing.T) {
		_, err := c.Put(t.Context(), testToken, strings.NewReader("abc"), 10, "short", 0)
		wantRefused(t, err, invalid, "size 10: the client sent 3 bytes")
	})
	t.Run("put of more bytes than announced is stopped by the client", func(t *testing.T) {
		_, err := c.Put(t.Context(), testToken, strings.NewReader("abcdef"), 2, "long", 0)
		if err == nil || !strings.Contains(err.Error(), "more than the 2 bytes announced") {
			t.Fatalf("got %v, want an error about the size", err)
		}
	})
	// Stopping the agent waits for every stream to be done with its files.
	a.stop(t)
	assertNoTempFiles(t, a.dir)
}

// assertNoTempFiles fails the test if a put left a temporary file in dir.
func assertNoTempFiles(t *testing.T, dir string) {
	t.Helper()
	filepath.WalkDir(dir, func(path string, d os.DirEntry, err error) error {
		if err == nil && strings.Contains(d.Name(), ".gpupool-put-") {
			t.Errorf("a temporary file was left behind: %s", path)
		}
		return nil
	})
}

func TestPutChecksAndSizeOnTheWire(t *testing.T) {
	a := newTestAgent(t)
	c := a.dial(t)
	chunk := func(s string) *gpupoolv1.PutData {
		return &gpupoolv1.PutData{Frame: &gpupoolv1.PutData_Chunk{Chunk: &gpupoolv1.DataChunk{Data: []byte(s)}}}
	}
	end := func(sum string) *gpupoolv1.PutData {
		return &gpupoolv1.PutData{Frame: &gpupoolv1.PutData_End{End: &gpupoolv1.PutEnd{Sha256: sum}}}
	}
	sumOf := func(s string) string {
		h := sha256.Sum256([]byte(s))
		return hex.EncodeToString(h[:])
	}
	tests := []struct {
		name   string
		start  *gpupoolv1.PutStart
		frames []*gpupoolv1.PutData
		code   gpupoolv1.AcceptCode // of the StreamAccept, or else of the PutResult
		msg    string
	}{
		{"a checksum that does not match the data", &gpupoolv1.PutStart{Path: "f", Size: -1}, []*gpupoolv1.PutData{chunk("abc"), end(sumOf("abd"))}, gpupoolv1.AcceptCode_ACCEPT_CODE_INVALID_ARGUMENT, "does not match the 3 bytes received"},
		{"more data than announced", &gpupoolv1.PutStart{Path: "f", Size: 2}, []*gpupoolv1.PutData{chunk("abc")}, gpupoolv1.AcceptCode_ACCEPT_CODE_INVALID_ARGUMENT, "size 2: the client sent more"},
		{"mode bits beyond 0777", &gpupoolv1.PutStart{Path: "f", Size: -1, Mode: 0o4755}, nil, gpupoolv1.AcceptCode_ACCEPT_CODE_INVALID_ARGUMENT, "mode 04755: must be permission bits only"},
		{"a size below -1", &gpupoolv1.PutStart{Path: "f", Size: -2}, nil, gpupoolv1.AcceptCode_ACCEPT_CODE_INVALID_ARGUMENT, "size -2: must be -1"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cs := rawStream(t, c)
			if err := cs.send(&gpupoolv1.StreamOpen{Token: testToken, Op: &gpupoolv1.StreamOpen_Put{Put: tt.start}}); err != nil {
				t.Fatal(err)
			}
			acc := readAccept(t, cs)
			if tt.frames == nil {
				wantRefused(t, &RefusedError{Code: acc.Code, Message: acc.Error}, tt.code, tt.msg)
				return
			}
			if acc.Code != gpupoolv1.AcceptCode_ACCEPT_CODE_OK {
				t.Fatalf("refused: %s", acc.Error)
			}
			for _, f := range tt.frames {
				if err := cs.send(f); err != nil {
					t.Fatal(err)
				}
			}
			var res gpupoolv1.PutResult
			if err := cs.fr.read(&res); err != nil {
				t.Fatal(err)
			}
			wantRefused(t, &RefusedError{Code: res.Code, Message: res.Error}, tt.code, tt.msg)
		})
	}
	a.stop(t)
	if _, err := os.Stat(filepath.Join(a.dir, "f")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("a refused put left the file: %v", err)
	}
	assertNoTempFiles(t, a.dir)
}

func TestAnOversizedFrameIsRefused(t *testing.T) {
	a := newTestAgent(t)
	c := a.dial(t)
	cs := rawStream(t, c)
	// Only the length prefix: the agent must answer without the payload.
	if _, err := cs.qs.Write(binary.AppendUvarint(nil, MaxFrame+1)); err != nil {
		t.Fatal(err)
	}
	acc := readAccept(t, cs)
	wantRefused(t, &RefusedError{Code: acc.Code, Message: acc.Error}, gpupoolv1.AcceptCode_ACCEPT_CODE_INVALID_ARGUMENT, "frame of 1048577 bytes: must be at most 1048576")
}

func TestGetChecksTheAgentsChecksum(t *testing.T) {
	chunk := &gpupoolv1.GetData{Frame: &gpupoolv1.GetData_Chunk{Chunk: &gpupoolv1.DataChunk{Data: []byte("abc")}}}
	sum := sha256.Sum256([]byte("abc"))
	tests := []struct {
		name    string
		end     *gpupoolv1.GetEnd
		wantErr error
	}{
		{"the data's checksum", &gpupoolv1.GetEnd{Sha256: hex.EncodeToString(sum[:]), Bytes: 3}, nil},
		{"another checksum", &gpupoolv1.GetEnd{Sha256: strings.Repeat("0", 64), Bytes: 3}, ErrChecksumMismatch},
		{"another length", &gpupoolv1.GetEnd{Sha256: hex.EncodeToString(sum[:]), Bytes: 4}, ErrChecksumMismatch},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			// The agent's side, played by hand.
			var wire bytes.Buffer
			fw := frameWriter{w: &wire}
			fw.write(&gpupoolv1.GetInfo{Size: 3})
			fw.write(chunk)
			fw.write(&gpupoolv1.GetData{Frame: &gpupoolv1.GetData_End{End: tt.end}})
			var got bytes.Buffer
			_, err := receiveFile(&frameReader{r: &wire}, "f", &got)
			if !errors.Is(err, tt.wantErr) {
				t.Fatalf("got %v, want %v", err, tt.wantErr)
			}
			if got.String() != "abc" {
				t.Fatalf("got %q written, want %q", got.String(), "abc")
			}
		})
	}
}
