package dataplane

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"runtime"
	"testing"

	"google.golang.org/protobuf/proto"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// frame encodes payload as a frame.
func frame(payload []byte) []byte {
	return append(binary.AppendUvarint(nil, uint64(len(payload))), payload...)
}

func TestReadFrame(t *testing.T) {
	open := &gpupoolv1.StreamOpen{Token: "t", Op: &gpupoolv1.StreamOpen_Get{Get: &gpupoolv1.GetStart{Path: "a/b"}}}
	valid := frame(mustMarshal(t, open))
	tests := []struct {
		name    string
		in      []byte
		want    proto.Message // nil when an error is expected
		wantErr func(error) bool
	}{
		{name: "a frame decodes to its message", in: valid, want: open},
		{name: "an empty frame decodes to the empty message", in: []byte{0}, want: &gpupoolv1.StreamOpen{}},
		{name: "nothing at all is io.EOF", in: nil, wantErr: func(err error) bool { return err == io.EOF }},
		{name: "a cut length prefix is io.ErrUnexpectedEOF", in: []byte{0x80}, wantErr: func(err error) bool { return err == io.ErrUnexpectedEOF }},
		{name: "a cut payload is io.ErrUnexpectedEOF", in: valid[:len(valid)-1], wantErr: func(err error) bool { return err == io.ErrUnexpectedEOF }},
		{name: "a length over MaxFrame is refused", in: binary.AppendUvarint(nil, MaxFrame+1), wantErr: func(err error) bool {
			var tooLarge *FrameTooLargeError
			return errors.As(err, &tooLarge) && tooLarge.Size == MaxFrame+1
		}},
		{name: "a length prefix over 64 bits is malformed", in: bytes.Repeat([]byte{0xff}, 11), wantErr: isMalformed},
		{name: "a payload that is not the message is malformed", in: frame([]byte{0xff, 0xff}), wantErr: isMalformed},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var got gpupoolv1.StreamOpen
			err := ReadFrame(bytes.NewReader(tt.in), &got)
			if tt.want == nil {
				if err == nil || !tt.wantErr(err) {
					t.Fatalf("got error %v, not the one expected", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !proto.Equal(&got, tt.want) {
				t.Fatalf("got %v, want %v", &got, tt.want)
			}
		})
	}
}

func TestReadFrameReadsNothingPastTheFrame(t *testing.T) {
	in := append(frame(mustMarshal(t, &gpupoolv1.StreamAccept{Error: "x"})), "raw bytes"...)
	r := bytes.NewReader(in)
	if err := ReadFrame(r, &gpupoolv1.StreamAccept{}); err != nil {
		t.Fatal(err)
	}
	rest, _ := io.ReadAll(r)
	if string(rest) != "raw bytes" {
		t.Fatalf("got %q left after the frame, want %q", rest, "raw bytes")
	}
}

func TestReadFrameRefusesAnOversizedFrameWithoutReadingOrAllocatingIt(t *testing.T) {
	// The whole frame is there: a reader that trusted the length would
	// allocate and read 2 MiB.
	const size = 2 * MaxFrame
	prefix := binary.AppendUvarint(nil, size)
	r := bytes.NewReader(append(prefix, make([]byte, size)...))
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	err := ReadFrame(r, &gpupoolv1.StreamOpen{})
	runtime.ReadMemStats(&after)

	var tooLarge *FrameTooLargeError
	if !errors.As(err, &tooLarge) || tooLarge.Size != size {
		t.Fatalf("got %v, want a FrameTooLargeError of %d bytes", err, size)
	}
	if consumed := int(r.Size()) - r.Len(); consumed != len(prefix) {
		t.Errorf("read %d bytes, want only the %d of the length prefix", consumed, len(prefix))
	}
	if allocated := after.TotalAlloc - before.TotalAlloc; allocated > 4096 {
		t.Errorf("allocated %d bytes refusing the frame, want at most 4096", allocated)
	}
}

func TestWriteFrameRefusesAMessageOverMaxFrame(t *testing.T) {
	var buf bytes.Buffer
	big := &gpupoolv1.DataChunk{Data: make([]byte, MaxFrame)}
	var tooLarge *FrameTooLargeError
	if err := WriteFrame(&buf, big); !errors.As(err, &tooLarge) {
		t.Fatalf("got %v, want a FrameTooLargeError", err)
	}
	if buf.Len() != 0 {
		t.Fatalf("wrote %d bytes of a refused frame", buf.Len())
	}
}

func TestWriteFrameRoundTrips(t *testing.T) {
	var buf bytes.Buffer
	msgs := []proto.Message{
		&gpupoolv1.ExecOutput{Output: &gpupoolv1.ExecOutput_Stdout{Stdout: []byte("out")}},
		&gpupoolv1.ExecOutput{Output: &gpupoolv1.ExecOutput_Exit{Exit: &gpupoolv1.ExecExit{Code: 3}}},
		&gpupoolv1.ExecOutput{},
	}
	fw := frameWriter{w: &buf}
	for _, m := range msgs {
		if err := fw.write(m); err != nil {
			t.Fatal(err)
		}
	}
	fr := frameReader{r: &buf}
	for i, want := range msgs {
		var got gpupoolv1.ExecOutput
		if err := fr.read(&got); err != nil {
			t.Fatalf("frame %d: %v", i, err)
		}
		if !proto.Equal(&got, want) {
			t.Fatalf("frame %d: got %v, want %v", i, &got, want)
		}
	}
	if err := fr.read(&gpupoolv1.ExecOutput{}); err != io.EOF {
		t.Fatalf("after the last frame: got %v, want io.EOF", err)
	}
}

func FuzzReadFrame(f *testing.F) {
	f.Add(frame(mustMarshal(f, &gpupoolv1.StreamOpen{Token: "t", Op: &gpupoolv1.StreamOpen_Exec{Exec: &gpupoolv1.ExecStart{Argv: []string{"sh", "-c", "true"}}}})))
	f.Add(frame(mustMarshal(f, &gpupoolv1.StreamOpen{Op: &gpupoolv1.StreamOpen_Put{Put: &gpupoolv1.PutStart{Path: "../x", Size: -1}}})))
	f.Add([]byte{0})
	f.Add([]byte{0x80})
	f.Add(binary.AppendUvarint(nil, MaxFrame))
	f.Add(binary.AppendUvarint(nil, MaxFrame+1))
	f.Add(bytes.Repeat([]byte{0xff}, 11))
	f.Add(frame([]byte{0x12, 0x05, 'a'}))
	f.Fuzz(func(t *testing.T, in []byte) {
		r := bytes.NewReader(in)
		var m gpupoolv1.StreamOpen
		err := ReadFrame(r, &m)
		consumed := len(in) - r.Len()
		if err != nil {
			var tooLarge *FrameTooLargeError
			if errors.As(err, &tooLarge) && tooLarge.Size <= MaxFrame {
				t.Fatalf("refused a frame of %d bytes, within MaxFrame", tooLarge.Size)
			}
			return
		}
		// A frame that decodes re-encodes to a frame that decodes to the
		// same message, and no more than the frame was read.
		size, n := binary.Uvarint(in)
		if n <= 0 || uint64(consumed) != uint64(n)+size || size > MaxFrame {
			t.Fatalf("read %d bytes for a frame of %d (prefix %d)", consumed, size, n)
		}
		var buf bytes.Buffer
		if err := WriteFrame(&buf, &m); err != nil {
			t.Fatal(err)
		}
		var again gpupoolv1.StreamOpen
		if err := ReadFrame(&buf, &again); err != nil {
			t.Fatal(err)
		}
		if !proto.Equal(&m, &again) {
			t.Fatalf("got %v after a round trip, want %v", &again, &m)
		}
	})
}
