// Package wire is the framing and encoding between the CUDA shim
// (libcuda.so.1) and the per-lease CUDA server: little-endian, one frame per
// call and one per reply, in the order the calls were made.
//
//	frame   = len:u32 op:u16 flags:u16 seq:u32 word:u64 payload
//	len     = 16 + len(payload), at most 16 + MaxPayload
//	request: word is the calling thread's current context handle (0: none);
//	         flags may have FlagWait
//	reply:   flags has FlagReply; word is the CUresult
//
// Op 0 is the handshake: the request carries Magic, the shim's protocol
// version and its API hash (a fingerprint of every call on the wire), the
// reply the server's version, hash and a message. A server ends the
// session unless both match. The other ops, and the encoding of
// their arguments, are generated from cuda/api/cuda.api.
//
// Arguments are encoded in declaration order: 32-bit and 64-bit integers
// as themselves, floats by their IEEE bits, strings and buffers as a u32
// length and the bytes. In a request, out buffers are sent as their
// requested length only; in a reply, out arguments follow in order.
package wire

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"slices"
)

const (
	// Magic opens the handshake ("GPCU").
	Magic uint32 = 0x55435047
	// HeaderSize is the frame header after the length word.
	HeaderSize = 16
	// Chunk is the most data one copy frame carries; the shim splits
	// larger copies.
	Chunk = 16 << 20
	// MaxPayload bounds every frame either side accepts.
	MaxPayload = Chunk + 64<<10
	// FlagReply marks a reply.
	FlagReply uint16 = 1
	// FlagWait marks a request whose sender has written every request
	// before it and now reads answers until this one's: the server may
	// write its answer at once rather than through its queue.
	FlagWait uint16 = 2
	// OpHello is the handshake.
	OpHello uint16 = 0
)

// Errors a session ends with.
var (
	ErrFrameTooLarge = errors.New("cuda wire: frame larger than the maximum")
	ErrTruncated     = errors.New("cuda wire: truncated frame")
	ErrTrailing      = errors.New("cuda wire: trailing bytes after the arguments")
)

// Header is a frame's header.
type Header struct {
	Op    uint16
	Flags uint16
	Seq   uint32
	Word  uint64
}

// ReadFrame reads one frame. It reuses buf when it is large enough and
// returns the payload, which is valid until the next call with buf.
func ReadFrame(r io.Reader, buf []byte) (Header, []byte, error) {
	h, frame, err := readFrame(r, buf)
	if err != nil {
		return h, nil, err
	}
	return h, frame[HeaderSize:], nil
}

// FrameReader reads frames into one buffer it keeps, so a stream of
// frames costs no allocation beyond its largest frame.
type FrameReader struct {
	r   io.Reader
	buf []byte
}

// NewFrameReader reads frames from r.
func NewFrameReader(r io.Reader) *FrameReader { return &FrameReader{r: r} }

// Next reads one frame; its payload is valid until the next call.
func (fr *FrameReader) Next() (Header, []byte, error) {
	h, frame, err := readFrame(fr.r, fr.buf)
	if err != nil {
		return h, nil, err
	}
	fr.buf = frame
	return h, frame[HeaderSize:], nil
}

// readFrame reads one frame after its length word into buf (or a larger
// buffer it allocates) and returns the header and the frame's bytes.
func readFrame(r io.Reader, buf []byte) (Header, []byte, error) {
	var lb [4]byte
	if _, err := io.ReadFull(r, lb[:]); err != nil {
		return Header{}, nil, err
	}
	n := binary.LittleEndian.Uint32(lb[:])
	if n < HeaderSize {
		return Header{}, nil, fmt.Errorf("%w: length %d is shorter than the header", ErrTruncated, n)
	}
	if n > HeaderSize+MaxPayload {
		return Header{}, nil, fmt.Errorf("%w: %d bytes, at most %d", ErrFrameTooLarge, n, HeaderSize+MaxPayload)
	}
	if cap(buf) < int(n) {
		buf = make([]byte, n)
	}
	buf = buf[:n]
	if _, err := io.ReadFull(r, buf); err != nil {
		if errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF) {
			return Header{}, nil, fmt.Errorf("%w: %v", ErrTruncated, err)
		}
		return Header{}, nil, err
	}
	h := Header{
		Op:    binary.LittleEndian.Uint16(buf[0:]),
		Flags: binary.LittleEndian.Uint16(buf[2:]),
		Seq:   binary.LittleEndian.Uint32(buf[4:]),
		Word:  binary.LittleEndian.Uint64(buf[8:]),
	}
	return h, buf, nil
}

// AppendHeader appends the length word and header of a frame whose
// payload has n bytes.
func AppendHeader(dst []byte, h Header, n int) []byte {
	dst = binary.LittleEndian.AppendUint32(dst, uint32(HeaderSize+n))
	dst = binary.LittleEndian.AppendUint16(dst, h.Op)
	dst = binary.LittleEndian.AppendUint16(dst, h.Flags)
	dst = binary.LittleEndian.AppendUint32(dst, h.Seq)
	return binary.LittleEndian.AppendUint64(dst, h.Word)
}

// AppendFrame appends a frame with payload to dst.
func AppendFrame(dst []byte, h Header, payload []byte) []byte {
	return append(AppendHeader(dst, h, len(payload)), payload...)
}

// Decoder reads arguments from a payload. The first error sticks: later
// reads return zero values, and Err reports it.
type Decoder struct {
	b   []byte
	err error
}

// NewDecoder decodes p.
func NewDecoder(p []byte) *Decoder { return &Decoder{b: p} }

func (d *Decoder) take(n int) []byte {
	if d.err != nil {
		return nil
	}
	if n < 0 || n > len(d.b) {
		d.err = fmt.Errorf("%w: want %d more bytes, have %d", ErrTruncated, n, len(d.b))
		return nil
	}
	p := d.b[:n]
	d.b = d.b[n:]
	return p
}

// U8 reads a byte (sent as 32 bits).
func (d *Decoder) U8() uint8 { return uint8(d.U32()) }

// U16 reads 16 bits (sent as 32 bits).
func (d *Decoder) U16() uint16 { return uint16(d.U32()) }

// U32 reads 32 bits.
func (d *Decoder) U32() uint32 {
	if p := d.take(4); p != nil {
		return binary.LittleEndian.Uint32(p)
	}
	return 0
}

// I32 reads a signed 32-bit integer.
func (d *Decoder) I32() int32 { return int32(d.U32()) }

// U64 reads 64 bits.
func (d *Decoder) U64() uint64 {
	if p := d.take(8); p != nil {
		return binary.LittleEndian.Uint64(p)
	}
	return 0
}

// F32 reads a float.
func (d *Decoder) F32() float32 { return math.Float32frombits(d.U32()) }

// Bytes reads a length-prefixed buffer; the result aliases the payload.
func (d *Decoder) Bytes() []byte {
	n := d.U32()
	if d.err != nil {
		return nil
	}
	if uint64(n) > uint64(len(d.b)) {
		d.err = fmt.Errorf("%w: a buffer of %d bytes with %d left", ErrTruncated, n, len(d.b))
		return nil
	}
	return d.take(int(n))
}

// String reads a length-prefixed string.
func (d *Decoder) String() string { return string(d.Bytes()) }

// UUID reads 16 bytes.
func (d *Decoder) UUID() (u [16]byte) {
	copy(u[:], d.take(16))
	return u
}

// Err is the first error, or ErrTrailing when bytes are left over.
func (d *Decoder) Err() error {
	if d.err == nil && len(d.b) != 0 {
		return fmt.Errorf("%w: %d bytes", ErrTrailing, len(d.b))
	}
	return d.err
}

// Encoder appends arguments.
type Encoder struct{ B []byte }

// U8 appends a byte as 32 bits.
func (e *Encoder) U8(v uint8) { e.U32(uint32(v)) }

// U16 appends 16 bits as 32 bits.
func (e *Encoder) U16(v uint16) { e.U32(uint32(v)) }

// U32 appends 32 bits.
func (e *Encoder) U32(v uint32) { e.B = binary.LittleEndian.AppendUint32(e.B, v) }

// I32 appends a signed 32-bit integer.
func (e *Encoder) I32(v int32) { e.U32(uint32(v)) }

// U64 appends 64 bits.
func (e *Encoder) U64(v uint64) { e.B = binary.LittleEndian.AppendUint64(e.B, v) }

// F32 appends a float.
func (e *Encoder) F32(v float32) { e.U32(math.Float32bits(v)) }

// Bytes appends a length-prefixed buffer.
func (e *Encoder) Bytes(p []byte) {
	e.U32(uint32(len(p)))
	e.B = append(e.B, p...)
}

// Reserve appends a length-prefixed buffer of n zero bytes and returns it,
// to be filled in place (valid until the next append).
func (e *Encoder) Reserve(n int) []byte {
	e.U32(uint32(n))
	e.B = slices.Grow(e.B, n)
	start := len(e.B)
	e.B = e.B[:start+n]
	p := e.B[start:]
	clear(p)
	return p
}

// String appends a length-prefixed string.
func (e *Encoder) String(s string) {
	e.U32(uint32(len(s)))
	e.B = append(e.B, s...)
}

// UUID appends 16 bytes.
func (e *Encoder) UUID(u [16]byte) { e.B = append(e.B, u[:]...) }
