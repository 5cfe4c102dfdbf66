package dataplane

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"

	"google.golang.org/protobuf/proto"
)

// MaxFrame is the largest frame payload either side sends or accepts, in
// bytes.
const MaxFrame = 1 << 20

// FrameTooLargeError is returned for a frame longer than MaxFrame. When
// reading, the payload of such a frame is neither read nor allocated.
type FrameTooLargeError struct {
	Size uint64
}

func (e *FrameTooLargeError) Error() string {
	return fmt.Sprintf("dataplane: frame of %d bytes: must be at most %d (MaxFrame)", e.Size, MaxFrame)
}

// ReadFrame reads one frame from r into m: a uvarint length, then that many
// bytes of m's encoding. It reads nothing past the frame. It returns io.EOF
// only when r ends before the frame starts, and io.ErrUnexpectedEOF when r
// ends inside it.
func ReadFrame(r io.Reader, m proto.Message) error {
	fr := frameReader{r: r}
	return fr.read(m)
}

// WriteFrame writes m to w as one frame, in a single Write.
func WriteFrame(w io.Writer, m proto.Message) error {
	fw := frameWriter{w: w}
	return fw.write(m)
}

// frameReader reads frames, reusing its buffer; it holds at most MaxFrame
// bytes. Not safe for concurrent use.
type frameReader struct {
	r   io.Reader
	buf []byte
	one [1]byte
}

// errMalformed is wrapped by the errors of frames that cannot be decoded;
// see isMalformed.
var errMalformed = errors.New("dataplane: malformed frame")

// errLengthOverflow is returned for a length prefix longer than any uvarint
// of 64 bits.
var errLengthOverflow = fmt.Errorf("%w: the length prefix overflows 64 bits", errMalformed)

// isMalformed reports whether err says that the peer sent a frame that
// breaks the protocol, as opposed to the stream failing.
func isMalformed(err error) bool {
	var tooLarge *FrameTooLargeError
	return errors.As(err, &tooLarge) || errors.Is(err, errMalformed)
}

func (fr *frameReader) read(m proto.Message) error {
	size, err := fr.readLength()
	if err != nil {
		return err
	}
	if size > MaxFrame {
		return &FrameTooLargeError{Size: size}
	}
	if uint64(cap(fr.buf)) < size {
		fr.buf = make([]byte, size)
	}
	b := fr.buf[:size]
	if _, err := io.ReadFull(fr.r, b); err != nil {
		if err == io.EOF {
			return io.ErrUnexpectedEOF
		}
		return err
	}
	if err := proto.Unmarshal(b, m); err != nil {
		return fmt.Errorf("%w: %d bytes: %v", errMalformed, size, err)
	}
	return nil
}

// readLength reads the uvarint length prefix one byte at a time, so that
// nothing after the frame is consumed (a forward stream carries raw bytes
// after its first frame).
func (fr *frameReader) readLength() (uint64, error) {
	var x uint64
	for i := range binary.MaxVarintLen64 {
		if _, err := io.ReadFull(fr.r, fr.one[:]); err != nil {
			if err == io.EOF && i > 0 {
				err = io.ErrUnexpectedEOF
			}
			return 0, err
		}
		b := fr.one[0]
		if b < 0x80 {
			if i == binary.MaxVarintLen64-1 && b > 1 {
				return 0, errLengthOverflow
			}
			return x | uint64(b)<<(7*i), nil
		}
		x |= uint64(b&0x7f) << (7 * i)
	}
	return 0, errLengthOverflow
}

// frameWriter writes frames, reusing its buffer. Not safe for concurrent
// use.
type frameWriter struct {
	w   io.Writer
	buf []byte
}

func (fw *frameWriter) write(m proto.Message) error {
	size := proto.Size(m)
	if size > MaxFrame {
		return &FrameTooLargeError{Size: uint64(size)}
	}
	b := binary.AppendUvarint(fw.buf[:0], uint64(size))
	b, err := proto.MarshalOptions{UseCachedSize: true}.MarshalAppend(b, m)
	if err != nil {
		return fmt.Errorf("dataplane: encoding %T: %w", m, err)
	}
	fw.buf = b
	_, err = fw.w.Write(b)
	return err
}
