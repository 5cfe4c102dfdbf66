package client

import (
	"bytes"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
	"github.com/gpupool/gpupool/protocol"
)

// chunks yields the given chunks, then err (io.EOF for a clean end).
func chunks(err error, data ...string) func() (*gpupoolv1.SnapshotChunk, error) {
	return func() (*gpupoolv1.SnapshotChunk, error) {
		if len(data) == 0 {
			return nil, err
		}
		c := &gpupoolv1.SnapshotChunk{Data: []byte(data[0])}
		data = data[1:]
		return c, nil
	}
}

func TestReceiveSnapshotWritesTheWholeFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "backup.snap")
	n, err := receiveSnapshot(chunks(io.EOF, "hello ", "snap", "shot"), path)
	if err != nil {
		t.Fatal(err)
	}
	got, _ := os.ReadFile(path)
	if n != 14 || string(got) != "hello snapshot" {
		t.Errorf("wrote %d bytes %q, want 14 bytes %q", n, got, "hello snapshot")
	}
	assertOnlyFiles(t, filepath.Dir(path), "backup.snap")
}

func TestReceiveSnapshotLeavesTheOldFileOnError(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "backup.snap")
	if err := os.WriteFile(path, []byte("old"), 0o600); err != nil {
		t.Fatal(err)
	}
	for name, recv := range map[string]func() (*gpupoolv1.SnapshotChunk, error){
		"a stream that breaks": chunks(errors.New("stream broke"), "partial"),
		"an empty snapshot":    chunks(io.EOF),
	} {
		if _, err := receiveSnapshot(recv, path); err == nil {
			t.Errorf("%s: receiveSnapshot succeeded, want an error", name)
		}
		if got, _ := os.ReadFile(path); string(got) != "old" {
			t.Errorf("%s: file now %q, want the old %q", name, got, "old")
		}
		assertOnlyFiles(t, dir, "backup.snap")
	}
}

// assertOnlyFiles checks that dir holds exactly names (no temporary files).
func assertOnlyFiles(t *testing.T, dir string, names ...string) {
	t.Helper()
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, e := range entries {
		got = append(got, e.Name())
	}
	if strings.Join(got, ",") != strings.Join(names, ",") {
		t.Errorf("%s holds %v, want %v", dir, got, names)
	}
}

func TestSendSnapshotChunksTheFile(t *testing.T) {
	data := bytes.Repeat([]byte("x"), 2*protocol.SnapshotChunkSize+10)
	var sizes []int
	var total bytes.Buffer
	n, err := sendSnapshot(bytes.NewReader(data), func(c *gpupoolv1.SnapshotChunk) error {
		sizes = append(sizes, len(c.GetData()))
		total.Write(c.GetData())
		return nil
	})
	if err != nil || n != int64(len(data)) || !bytes.Equal(total.Bytes(), data) {
		t.Fatalf("sent %d bytes, err %v; want all %d bytes intact", n, err, len(data))
	}
	if len(sizes) != 3 || sizes[0] != protocol.SnapshotChunkSize || sizes[2] != 10 {
		t.Errorf("chunk sizes %v, want [%d %d 10]", sizes, protocol.SnapshotChunkSize, protocol.SnapshotChunkSize)
	}
}
