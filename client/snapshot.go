package client

import (
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strconv"

	"google.golang.org/grpc/metadata"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
	"github.com/gpupool/gpupool/protocol"
)

// SaveSnapshot streams a point-in-time snapshot of the brokers' replicated
// state into the file path, atomically: the file appears only once
// complete, so an interrupted save never leaves a truncated snapshot. It
// returns the bytes written and the snapshot's Raft index (0 when the
// broker did not say).
func (c *Client) SaveSnapshot(ctx context.Context, path string) (n int64, index uint64, err error) {
	stream, err := c.Operator.SnapshotSave(ctx, &gpupoolv1.SnapshotSaveRequest{})
	if err != nil {
		return 0, 0, err
	}
	n, err = receiveSnapshot(stream.Recv, path)
	if err != nil {
		return n, 0, err
	}
	return n, trailerIndex(stream.Trailer()), nil
}

// RestoreSnapshot replaces the whole replicated state with the snapshot r
// holds (as SaveSnapshot wrote it), on every broker. It returns the bytes
// sent and the brokers' answer.
func (c *Client) RestoreSnapshot(ctx context.Context, r io.Reader) (int64, *gpupoolv1.SnapshotRestoreResponse, error) {
	stream, err := c.Operator.SnapshotRestore(ctx)
	if err != nil {
		return 0, nil, err
	}
	n, err := sendSnapshot(r, stream.Send)
	if err != nil && err != io.EOF {
		return n, nil, err
	}
	// On io.EOF from Send the broker ended the stream; its reason comes
	// from CloseAndRecv.
	resp, err := stream.CloseAndRecv()
	return n, resp, err
}

// trailerIndex reads the snapshot index trailer, 0 when absent.
func trailerIndex(md metadata.MD) uint64 {
	for _, v := range md.Get(protocol.SnapshotIndexTrailer) {
		if n, err := strconv.ParseUint(v, 10, 64); err == nil {
			return n
		}
	}
	return 0
}

// receiveSnapshot writes the chunks recv yields until io.EOF into path,
// atomically: into a temporary file in the same directory, synced and then
// renamed over path. On any error path is left as it was and the temporary
// file is removed. It returns the bytes written.
func receiveSnapshot(recv func() (*gpupoolv1.SnapshotChunk, error), path string) (n int64, err error) {
	tmp, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return 0, err
	}
	defer func() {
		if err != nil {
			tmp.Close()
			os.Remove(tmp.Name())
		}
	}()
	for {
		chunk, err := recv()
		if err == io.EOF {
			break
		}
		if err != nil {
			return n, err
		}
		m, err := tmp.Write(chunk.GetData())
		n += int64(m)
		if err != nil {
			return n, err
		}
	}
	if n == 0 {
		return 0, errors.New("the broker sent an empty snapshot; nothing saved")
	}
	if err := tmp.Sync(); err != nil {
		return n, err
	}
	if err := tmp.Close(); err != nil {
		return n, err
	}
	return n, os.Rename(tmp.Name(), path)
}

// sendSnapshot sends the contents of r in chunks and returns the bytes
// sent.
func sendSnapshot(r io.Reader, send func(*gpupoolv1.SnapshotChunk) error) (int64, error) {
	buf := make([]byte, protocol.SnapshotChunkSize)
	var n int64
	for {
		m, err := io.ReadFull(r, buf)
		if m > 0 {
			if err := send(&gpupoolv1.SnapshotChunk{Data: append([]byte(nil), buf[:m]...)}); err != nil {
				return n, err
			}
			n += int64(m)
		}
		if err == io.EOF || err == io.ErrUnexpectedEOF {
			return n, nil
		}
		if err != nil {
			return n, err
		}
	}
}
