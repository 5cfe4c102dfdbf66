/* Internal interface between the shim's hand-written C (transport.c,
   calls.c) and the generated stubs (stubs_gen.c). Nothing here is exported. */
#ifndef GPUPOOL_SHIM_H
#define GPUPOOL_SHIM_H

#include <stddef.h>
#include <stdint.h>

#include "cuda.h"

#define SHIM_EXPORT __attribute__((visibility("default")))
/* The most data one frame may carry (cuda/wire.Chunk). */
#define SHIM_CHUNK ((size_t)16 << 20)
/* The data of one frame of a copy: copies stream in frames of this size,
   sent without waiting, so neither side ever holds a copy whole. */
#define SHIM_COPY_CHUNK ((size_t)1 << 20)

/* One call: the request being built, then the reply being read. */
struct shim_call {
    uint16_t op;
    unsigned char *req;
    size_t len, cap;
    int oom;
    /* A large in buffer is written from the caller's memory, not copied
       into req: ext's extlen bytes go at offset extat of the frame. */
    const void *ext;
    size_t extlen, extat;
    unsigned char *resp;
    size_t rlen, roff;
    int bad;
};

CUresult shim_begin(struct shim_call *c, uint16_t op);
void shim_put_u32(struct shim_call *c, uint32_t v);
void shim_put_u64(struct shim_call *c, uint64_t v);
void shim_put_f32(struct shim_call *c, float v);
void shim_put_bytes(struct shim_call *c, const void *p, size_t n);
void shim_put_str(struct shim_call *c, const char *s);
void shim_put_image(struct shim_call *c, const void *image);
/* Sends the request and reads the reply; returns the reply's CUresult, or
   the transport's error. */
CUresult shim_roundtrip(struct shim_call *c);

/* The answers a synchronous copy sent in chunks waits for. */
struct shim_group {
    unsigned outstanding; /* guarded by the transport's mutex */
    CUresult err;         /* guarded by the transport's mutex; the first failure */
};
#define SHIM_GROUP_INIT {0, CUDA_SUCCESS}
/* Sends the request without waiting for its answer and frees c. The
   answer is read later (by the next synchronising call, a full window, or
   shim_wait); an out buffer in it is copied to dst (at most cap bytes)
   then. With g, the answer's error is g's to return; without, it is
   asynchronous work whose failure becomes the session's sticky error. */
CUresult shim_send(struct shim_call *c, void *dst, size_t cap, struct shim_group *g);
/* Waits for every answer of g and returns r if it is an error, else g's
   first error. */
CUresult shim_wait(struct shim_group *g, CUresult r);
uint32_t shim_get_u32(struct shim_call *c);
uint64_t shim_get_u64(struct shim_call *c);
float shim_get_f32(struct shim_call *c);
void shim_get_raw(struct shim_call *c, void *dst, size_t n);
/* Copies a length-prefixed buffer of at most cap bytes into dst. */
void shim_get_buf(struct shim_call *c, void *dst, size_t cap);
/* Frees the call; returns r, or an error when the reply was malformed. */
CUresult shim_end(struct shim_call *c, CUresult r);
CUresult shim_unsupported(const char *name, int index);

struct shim_proc {
    const char *base;
    int since;
    int supported;
    void *fn;
};
extern const struct shim_proc shim_procs[];
extern const int shim_unsupported_count;

struct shim_error {
    CUresult value;
    const char *name;
    const char *text;
};
extern const struct shim_error shim_errors[];
/* The entry of shim_errors for r, or NULL when the table has none. */
const struct shim_error *shim_error_of(CUresult r);
extern const char *const shim_op_names[];
extern const int shim_op_count;

/* The generated wire calls the hand-written entry points use. */
CUresult rpc_cuInit(unsigned int Flags);
CUresult rpc_cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev);
CUresult rpc_cuCtxDestroy_v2(CUcontext ctx);
CUresult rpc_cuCtxSetCurrent(CUcontext ctx);
CUresult rpc_cuCtxPushCurrent_v2(CUcontext ctx);
CUresult rpc_cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name);
CUresult rpc_cuModuleLoadData(CUmodule *module, const void *image);
CUresult rpc_cuLibraryGetKernel(CUkernel *pKernel, CUlibrary library, const char *name);
CUresult rpc_cuKernelGetFunction(CUfunction *pFunc, CUkernel kernel);
CUresult rpc_gpupoolLibraryLoadData(CUlibrary *library, const void *code);
CUresult rpc_gpupoolFuncParams(CUfunction f, char *info, unsigned int cap, unsigned int *count);
CUresult rpc_gpupoolLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ,
                                 unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ,
                                 unsigned int sharedMemBytes, CUstream hStream, const char *params,
                                 unsigned int paramsLen);
CUresult rpc_gpupoolPointerGetAttribute(cuuint64_t *value, CUpointer_attribute attribute, CUdeviceptr ptr);
CUresult rpc_gpupoolOccupancyMaxPotentialBlockSize(int *minGridSize, int *blockSize, CUfunction func,
                                                   size_t dynamicSMemSize, int blockSizeLimit);

#endif
