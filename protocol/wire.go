package protocol

import (
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
)

// LeaderHeader is the response header in which every broker names the
// gRPC address of the leader it knows ("" when it knows none). Clients
// learn where to send writes from it.
const LeaderHeader = "gpupool-leader"

// SnapshotIndexTrailer is the gRPC trailer in which a broker reports the
// Raft index of a snapshot it saved.
const SnapshotIndexTrailer = "gpupool-snapshot-index"

// SnapshotChunkSize is how much of a snapshot goes in one message.
const SnapshotChunkSize = 1 << 20

// Reconnect timings every gRPC connection between the components uses: a
// connection tries a server again within a second of it coming back
// (gRPC's default backoff grows to two minutes, and a broker that was
// down for a while may be the next leader).
const (
	ReconnectBaseDelay         = 100 * time.Millisecond
	ReconnectMultiplier        = 1.6
	ReconnectJitter            = 0.2
	ReconnectMaxDelay          = time.Second
	ReconnectMinConnectTimeout = 5 * time.Second
)

// Reconnect is the dial option that applies the reconnect timings.
var Reconnect = grpc.WithConnectParams(grpc.ConnectParams{
	Backoff: backoff.Config{
		BaseDelay: ReconnectBaseDelay, Multiplier: ReconnectMultiplier,
		Jitter: ReconnectJitter, MaxDelay: ReconnectMaxDelay,
	},
	MinConnectTimeout: ReconnectMinConnectTimeout,
})
