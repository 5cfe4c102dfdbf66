package dataplane

import (
	"time"

	"github.com/quic-go/quic-go"
)

// The QUIC flow-control windows of both ends. A stream starts at its
// initial window and quic-go doubles it, up to the maximum, as the peer
// keeps filling it. The initial windows hold a whole CUDA copy frame (1
// MiB and its header) and a put's first chunks, so a copy's first round
// trip over a real network does not wait for a window update (quic-go's
// default is 512 KiB). The maxima stay quic-go's defaults: they bound
// what an agent buffers for a peer that sends and a lease process that
// does not read (6 MiB a stream, 15 MiB a connection), and larger ones
// (16 and 64 MiB) moved nothing faster on loopback, where QUIC is bound
// by the CPU it spends on each packet, not by its windows (bench-cuda's
// raw QUIC rows, with and without these settings).
const (
	initialStreamWindow = 2 << 20
	maxStreamWindow     = 6 << 20
	initialConnWindow   = 3 << 20
	maxConnWindow       = 15 << 20
)

// quicConfig is the quic.Config of the data plane: the server's when
// server is set (at most maxStreams streams a connection), else the
// client's. UDP socket buffers and GSO are quic-go's: it raises the
// socket's buffers to 7 MiB (past net.core.rmem_max and wmem_max with
// SO_RCVBUFFORCE and SO_SNDBUFFORCE when it runs as root; it logs once
// when it cannot) and sends with GSO where the kernel has it (unless
// QUIC_GO_DISABLE_GSO is set).
func quicConfig(server bool, maxStreams int64) *quic.Config {
	c := &quic.Config{
		MaxIncomingStreams:             -1,
		MaxIncomingUniStreams:          -1,
		KeepAlivePeriod:                10 * time.Second,
		InitialStreamReceiveWindow:     initialStreamWindow,
		MaxStreamReceiveWindow:         maxStreamWindow,
		InitialConnectionReceiveWindow: initialConnWindow,
		MaxConnectionReceiveWindow:     maxConnWindow,
	}
	if server {
		c.MaxIncomingStreams = maxStreams
		c.KeepAlivePeriod = 15 * time.Second
	}
	return c
}

// QUICConfig is the quic.Config the data plane's client dials with. The
// benchmarks use it to measure QUIC itself with the data plane's
// settings; its ALPN is ALPN.
func QUICConfig() *quic.Config { return quicConfig(false, 0) }
