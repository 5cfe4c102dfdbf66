// Package cudaserver runs CUDA driver calls for one lease: the server end
// of gpupool's libcuda.so.1 shim (docs/remote-cuda.md).
//
// A Server accepts connections (one per client process), speaks the
// protocol of cuda/wire, and runs each connection's calls in a session on a
// Backend: the real driver loaded at run time (NewRealBackend), or a
// simulated GPU (NewSimBackend).
//
// The session enforces "the lease is the GPU", whatever the client sends:
//   - the client sees only the lease's devices, numbered from 0;
//   - every device's total memory is the lease's memory limit, and an
//     allocation that would take the lease past it (summed over all its
//     sessions) fails with CUDA_ERROR_OUT_OF_MEMORY before the backend sees
//     it;
//   - a handle or device pointer the session did not get from the backend
//     is refused, and a copy or memset must lie inside one allocation;
//   - a malformed frame ends the session with an error; it never panics the
//     server.
//
// A session's calls run one at a time on one goroutine locked to its OS
// thread (the driver's current context is per thread). When the connection
// ends, the session closes its backend, which frees everything it holds.
package cudaserver
