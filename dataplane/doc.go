// Package dataplane is the data plane between a lease holder and the agent
// on the pool host that holds its slices: framed protobuf over QUIC
// (docs/architecture.md, "Data plane"; proto/gpupool/v1/dataplane.proto).
//
// The agent runs a Server; a lease holder dials it with Dial, pinning the
// agent's certificate by the SHA-256 fingerprint the broker published, and
// runs operations on the Conn: Exec, Put, Get, Forward and Usage. Each
// operation is one QUIC stream and carries the lease token, which the
// agent checks with its Authorizer before it answers anything else.
//
// Memory stays bounded whatever the client does: frames are at most
// MaxFrame bytes, files and process output are streamed through fixed
// buffers, and a client that stops reading stops the agent reading the
// process's pipes (QUIC flow control is the back-pressure).
//
// Revocation is immediate: Server.Revoke resets every stream of the lease
// and stops the processes exec started for it within a second. Clients see
// ErrLeaseEnded.
//
// Linux only: processes are managed as process groups and signals use
// Linux numbering.
package dataplane
