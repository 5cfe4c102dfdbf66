package broker

// maxStreamsPerConn is how many calls one connection may have open on a
// broker at once (HTTP/2's SETTINGS_MAX_CONCURRENT_STREAMS): a client
// sending more waits in its own gRPC transport for one of its calls to end,
// instead of handing the broker thousands of calls to decode and hold.
// Far above what a process needs (each Watch, heartbeat stream and call
// in flight is one; the lease benchmark's 256 clients share one
// connection).
const maxStreamsPerConn = 1024
