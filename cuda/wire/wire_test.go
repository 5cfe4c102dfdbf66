package wire

import (
	"bytes"
	"errors"
	"testing"
)

func TestFramesRoundTrip(t *testing.T) {
	var e Encoder
	e.U32(7)
	e.U64(1 << 40)
	e.F32(2.5)
	e.String("vecadd")
	e.Bytes([]byte{1, 2, 3})
	e.I32(-4)
	e.UUID([16]byte{9})
	h := Header{Op: 3, Seq: 9, Word: 0xabc}
	frame := AppendFrame(nil, h, e.B)
	gotH, p, err := ReadFrame(bytes.NewReader(frame), nil)
	if err != nil || gotH != h {
		t.Fatalf("got %+v, %v; want %+v", gotH, err, h)
	}
	d := NewDecoder(p)
	if v := d.U32(); v != 7 {
		t.Errorf("got %d, want 7", v)
	}
	if v := d.U64(); v != 1<<40 {
		t.Errorf("got %d, want 1<<40", v)
	}
	if v := d.F32(); v != 2.5 {
		t.Errorf("got %v, want 2.5", v)
	}
	if v := d.String(); v != "vecadd" {
		t.Errorf("got %q, want vecadd", v)
	}
	if v := d.Bytes(); !bytes.Equal(v, []byte{1, 2, 3}) {
		t.Errorf("got %v, want 1 2 3", v)
	}
	if v := d.I32(); v != -4 {
		t.Errorf("got %d, want -4", v)
	}
	if v := d.UUID(); v[0] != 9 {
		t.Errorf("got %v, want 9 first", v)
	}
	if err := d.Err(); err != nil {
		t.Errorf("got %v, want no error", err)
	}
}

func TestBadFramesAreRefused(t *testing.T) {
	huge := AppendFrame(nil, Header{}, nil)
	huge[3] = 0x7f
	for _, tc := range []struct {
		name  string
		frame []byte
		want  error
	}{
		{"a length shorter than the header", []byte{3, 0, 0, 0, 1, 2, 3}, ErrTruncated},
		{"a length past the maximum", huge, ErrFrameTooLarge},
		{"a frame cut short", AppendFrame(nil, Header{}, []byte{1, 2, 3, 4})[:10], ErrTruncated},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, _, err := ReadFrame(bytes.NewReader(tc.frame), nil)
			if !errors.Is(err, tc.want) {
				t.Errorf("got %v, want %v", err, tc.want)
			}
		})
	}
}

func TestDecoderRefusesShortAndTrailingPayloads(t *testing.T) {
	d := NewDecoder([]byte{1, 0, 0})
	d.U32()
	if !errors.Is(d.Err(), ErrTruncated) {
		t.Errorf("short: got %v, want ErrTruncated", d.Err())
	}
	d = NewDecoder([]byte{0xff, 0xff, 0xff, 0xff, 1})
	d.Bytes()
	if !errors.Is(d.Err(), ErrTruncated) {
		t.Errorf("buffer longer than the payload: got %v, want ErrTruncated", d.Err())
	}
	d = NewDecoder([]byte{1, 0, 0, 0, 9})
	d.U32()
	if !errors.Is(d.Err(), ErrTrailing) {
		t.Errorf("trailing: got %v, want ErrTrailing", d.Err())
	}
}

func FuzzReadFrame(f *testing.F) {
	var e Encoder
	e.String("vecadd")
	e.U64(42)
	f.Add(AppendFrame(nil, Header{Op: 5, Seq: 1}, e.B))
	f.Add([]byte{16, 0, 0, 0})
	f.Fuzz(func(t *testing.T, b []byte) {
		h, p, err := ReadFrame(bytes.NewReader(b), nil)
		if err != nil {
			return
		}
		d := NewDecoder(p)
		for d.err == nil && len(d.b) > 0 {
			switch h.Seq % 3 {
			case 0:
				d.Bytes()
			case 1:
				d.U64()
			default:
				_ = d.String()
			}
		}
		_ = d.Err()
	})
}
