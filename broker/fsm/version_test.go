package fsm

import (
	"bytes"
	"errors"
	"io"
	"strings"
	"testing"

	"github.com/hashicorp/raft"
	"google.golang.org/protobuf/proto"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

func TestAnUnknownCommandIsRefusedWithoutPanicOrChange(t *testing.T) {
	f := New(nil)
	applyAll(t, f, testLog())
	before := snapshotBytes(t, f)
	var res *Result
	func() {
		defer func() {
			if r := recover(); r != nil {
				t.Fatalf("Apply panicked on an unknown command: %v", r)
			}
		}()
		res = f.Apply(&raft.Log{Index: 1000, Type: raft.LogCommand, Data: []byte{99, 1, 2}}).(*Result)
	}()
	if !errors.Is(res.Err, ErrUnknownCommand) {
		t.Fatalf("got error %v, want %v", res.Err, ErrUnknownCommand)
	}
	if got := f.UnknownCommands(); got != 1 {
		t.Fatalf("got %d unknown commands counted, want 1", got)
	}
	if !bytes.Equal(snapshotBytes(t, f), before) {
		t.Fatal("the state changed on an unknown command")
	}
}

func TestEveryCommandTypeHasAVersionThisBinaryApplies(t *testing.T) {
	for typ := MessageType(1); typ < IgnoreUnknownTypeFlag; typ++ {
		known := newMessage(typ) != nil
		v, ok := CommandVersion(typ)
		switch {
		case known && !ok:
			t.Errorf("command type %d has no entry in commandVersion", typ)
		case !known && ok:
			t.Errorf("commandVersion names type %d, which this binary does not decode", typ)
		case ok && (v < 1 || v > Version):
			t.Errorf("command type %d: got version %d, want 1..%d", typ, v, Version)
		}
	}
}

func snapshotOfVersion(t *testing.T, v uint32) []byte {
	t.Helper()
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(&gpupoolv1.StateSnapshot{Version: v, Index: 7})
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestRestoreReadsOlderSnapshotsAndRefusesNewerOnes(t *testing.T) {
	tests := []struct {
		name    string
		version uint32
		wantErr string
	}{
		{"a snapshot from before versions existed", 0, ""},
		{"a snapshot of this version", SnapshotVersion, ""},
		{"a snapshot of a newer version", SnapshotVersion + 1, "snapshot version 2 is newer than this server reads (version 1)"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := New(nil)
			err := f.Restore(io.NopCloser(bytes.NewReader(snapshotOfVersion(t, tt.version))))
			if tt.wantErr == "" {
				if err != nil {
					t.Fatalf("got %v, want nil", err)
				}
				if got := f.State().Index(); got != 7 {
					t.Fatalf("got index %d, want 7", got)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) || !errors.Is(err, ErrSnapshotVersion) {
				t.Fatalf("got %v, want an error containing %q", err, tt.wantErr)
			}
			if err := CheckSnapshot(snapshotOfVersion(t, tt.version)); err == nil {
				t.Fatal("CheckSnapshot accepted it")
			}
		})
	}
}

func TestSnapshotsCarryTheirVersion(t *testing.T) {
	f := New(nil)
	applyAll(t, f, testLog())
	var snap gpupoolv1.StateSnapshot
	if err := proto.Unmarshal(snapshotBytes(t, f), &snap); err != nil {
		t.Fatal(err)
	}
	if snap.Version != SnapshotVersion {
		t.Fatalf("got version %d, want %d", snap.Version, SnapshotVersion)
	}
}
