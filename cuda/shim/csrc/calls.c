/*
 * gpupool's libcuda.so.1, the driver calls that need more than a generated
 * stub: cuInit, the per-thread context stack, host-pinned memory, pointer
 * attributes, kernel parameter layouts and launches, errors and entry
 * points (docs/remote-cuda.md). They reach the server through the
 * generated rpc_ calls and the transport (transport.c).
 *
 * Rules this file keeps:
 *  - Every piece of process-wide state is in `tab`, guarded by tab.mu, or
 *    is a single word read and written atomically (init_pid, the log-once
 *    flags); the current-context stack is thread-local, as in the driver.
 *  - tab.mu is never held across a call on the wire; the fork handlers
 *    take it after the transport's lock.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "internal.h"

#define SHIM_CTX_DEPTH 32
#define SHIM_MAX_PARAMS 1024

/* The process in which cuInit succeeded (0: none), read without a lock
   (atomically) so that the calls answered in the shim never wait behind a
   call on the wire. A forked child has another pid, so it is not
   initialised. */
static pid_t init_pid;

struct param_layout {
    uint64_t fn;
    unsigned int count;
    uint32_t *offsets, *sizes;
    size_t total;
};

struct host_alloc {
    char *p;
    size_t n;
    unsigned int flags;
    int registered; /* the caller's memory (cuMemHostRegister), not ours to free */
};

static struct {
    pthread_mutex_t mu;
    struct param_layout *layouts; /* guarded by mu */
    size_t nlayouts, caplayouts;  /* guarded by mu */
    struct host_alloc *hosts;     /* guarded by mu */
    size_t nhosts, caphosts;      /* guarded by mu */
} tab = {PTHREAD_MUTEX_INITIALIZER, NULL, 0, 0, NULL, 0, 0};

static __thread CUcontext ctx_stack[SHIM_CTX_DEPTH];
static __thread int ctx_depth;

void shim_calls_lock(void) { pthread_mutex_lock(&tab.mu); }

void shim_calls_unlock(void) { pthread_mutex_unlock(&tab.mu); }

CUcontext shim_current_ctx(void) { return ctx_depth > 0 ? ctx_stack[ctx_depth - 1] : NULL; }

static unsigned char unsupported_logged[4096];

CUresult shim_unsupported(const char *name, int index)
{
    if (index >= 0 && index < (int)sizeof unsupported_logged &&
        !__atomic_exchange_n(&unsupported_logged[index], 1, __ATOMIC_RELAXED))
        shim_log("%s is not supported by gpupool's CUDA remoting: CUDA_ERROR_NOT_SUPPORTED "
                 "(docs/remote-cuda.md lists what is)", name);
    return CUDA_ERROR_NOT_SUPPORTED;
}

static int initialized(void)
{
    return __atomic_load_n(&init_pid, __ATOMIC_ACQUIRE) == getpid();
}

SHIM_EXPORT CUresult cuInit(unsigned int Flags)
{
    CUresult r = shim_ready();
    if (r != CUDA_SUCCESS)
        return r;
    r = rpc_cuInit(Flags);
    if (r == CUDA_SUCCESS)
        __atomic_store_n(&init_pid, getpid(), __ATOMIC_RELEASE);
    return r;
}

/* --- contexts: the stack of current contexts is per thread, as in the
   driver; each request carries the top, and the server binds it. */

static void ctx_forget(CUcontext ctx)
{
    int j = 0;
    for (int i = 0; i < ctx_depth; i++)
        if (ctx_stack[i] != ctx)
            ctx_stack[j++] = ctx_stack[i];
    ctx_depth = j;
}

SHIM_EXPORT CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    CUresult r;
    if (ctx_depth >= SHIM_CTX_DEPTH)
        return CUDA_ERROR_INVALID_VALUE;
    r = rpc_cuCtxCreate_v2(pctx, flags, dev);
    if (r == CUDA_SUCCESS)
        ctx_stack[ctx_depth++] = *pctx;
    return r;
}

SHIM_EXPORT CUresult cuCtxDestroy_v2(CUcontext ctx)
{
    CUresult r;
    if (!ctx)
        return CUDA_ERROR_INVALID_VALUE;
    r = rpc_cuCtxDestroy_v2(ctx);
    if (r == CUDA_SUCCESS)
        ctx_forget(ctx);
    return r;
}

SHIM_EXPORT CUresult cuCtxSetCurrent(CUcontext ctx)
{
    CUresult r;
    if (!ctx) {
        if (!initialized())
            return CUDA_ERROR_NOT_INITIALIZED;
        if (ctx_depth > 0)
            ctx_depth--;
        return CUDA_SUCCESS;
    }
    r = rpc_cuCtxSetCurrent(ctx);
    if (r != CUDA_SUCCESS)
        return r;
    if (ctx_depth == 0)
        ctx_depth = 1;
    ctx_stack[ctx_depth - 1] = ctx;
    return CUDA_SUCCESS;
}

SHIM_EXPORT CUresult cuCtxGetCurrent(CUcontext *pctx)
{
    if (!initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    *pctx = ctx_depth > 0 ? ctx_stack[ctx_depth - 1] : NULL;
    return CUDA_SUCCESS;
}

SHIM_EXPORT CUresult cuCtxPushCurrent_v2(CUcontext ctx)
{
    CUresult r;
    if (!ctx || ctx_depth >= SHIM_CTX_DEPTH)
        return CUDA_ERROR_INVALID_VALUE;
    r = rpc_cuCtxPushCurrent_v2(ctx);
    if (r == CUDA_SUCCESS)
        ctx_stack[ctx_depth++] = ctx;
    return r;
}

SHIM_EXPORT CUresult cuCtxPopCurrent_v2(CUcontext *pctx)
{
    if (!initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (ctx_depth == 0)
        return CUDA_ERROR_INVALID_CONTEXT;
    ctx_depth--;
    if (pctx)
        *pctx = ctx_stack[ctx_depth];
    return CUDA_SUCCESS;
}

/* --- host-pinned memory: ordinary page-aligned host memory the shim keeps
   track of (part 2 may register it with the transport). */

/* host_track records [p, p+n) as host memory the CUDA calls know. */
static CUresult host_track(void *p, size_t bytesize, unsigned int flags, int registered)
{
    pthread_mutex_lock(&tab.mu);
    if (tab.nhosts == tab.caphosts) {
        size_t cap = tab.caphosts ? tab.caphosts * 2 : 16;
        struct host_alloc *h = realloc(tab.hosts, cap * sizeof *h);
        if (!h) {
            pthread_mutex_unlock(&tab.mu);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        tab.hosts = h;
        tab.caphosts = cap;
    }
    tab.hosts[tab.nhosts].p = p;
    tab.hosts[tab.nhosts].n = bytesize;
    tab.hosts[tab.nhosts].flags = flags;
    tab.hosts[tab.nhosts].registered = registered;
    tab.nhosts++;
    pthread_mutex_unlock(&tab.mu);
    return CUDA_SUCCESS;
}

static CUresult host_alloc(void **pp, size_t bytesize, unsigned int flags)
{
    void *p = NULL;
    CUresult r;
    if (!initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!pp || bytesize == 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (posix_memalign(&p, 4096, bytesize) != 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    r = host_track(p, bytesize, flags, 0);
    if (r != CUDA_SUCCESS) {
        free(p);
        return r;
    }
    *pp = p;
    return CUDA_SUCCESS;
}

/* findHostLocked returns the pinned allocation holding p, or -1. */
static long findHostLocked(const void *p)
{
    for (size_t i = 0; i < tab.nhosts; i++)
        if ((const char *)p >= tab.hosts[i].p && (const char *)p < tab.hosts[i].p + tab.hosts[i].n)
            return (long)i;
    return -1;
}

SHIM_EXPORT CUresult cuMemAllocHost_v2(void **pp, size_t bytesize)
{
    return host_alloc(pp, bytesize, 0);
}

SHIM_EXPORT CUresult cuMemHostAlloc(void **pp, size_t bytesize, unsigned int Flags)
{
    if (Flags & ~7u)
        return CUDA_ERROR_INVALID_VALUE;
    return host_alloc(pp, bytesize, Flags);
}

/* host_untrack forgets the host memory host_track recorded at p with the
   same registered, and returns 0; -1, forgetting nothing, when there is
   none. */
static int host_untrack(const void *p, int registered)
{
    long i;
    pthread_mutex_lock(&tab.mu);
    i = findHostLocked(p);
    if (i < 0 || tab.hosts[i].p != p || tab.hosts[i].registered != registered) {
        pthread_mutex_unlock(&tab.mu);
        return -1;
    }
    tab.hosts[i] = tab.hosts[--tab.nhosts];
    pthread_mutex_unlock(&tab.mu);
    return 0;
}

SHIM_EXPORT CUresult cuMemFreeHost(void *p)
{
    if (!initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (host_untrack(p, 0) < 0)
        return CUDA_ERROR_INVALID_VALUE;
    free(p);
    return CUDA_SUCCESS;
}

/* Registered host memory is the caller's; the shim tracks its range so that
   pointer attributes and flags answer for it (copies need nothing more). */
SHIM_EXPORT CUresult cuMemHostRegister_v2(void *p, size_t bytesize, unsigned int Flags)
{
    long i;
    if (!initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!p || bytesize == 0 || (Flags & ~0xfu))
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&tab.mu);
    i = findHostLocked(p);
    if (i < 0)
        i = findHostLocked((char *)p + bytesize - 1);
    pthread_mutex_unlock(&tab.mu);
    if (i >= 0)
        return CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
    return host_track(p, bytesize, Flags, 1);
}

SHIM_EXPORT CUresult cuMemHostUnregister(void *p)
{
    if (!initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (host_untrack(p, 1) < 0)
        return CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;
    return CUDA_SUCCESS;
}

SHIM_EXPORT CUresult cuMemHostGetFlags(unsigned int *pFlags, void *p)
{
    long i;
    if (!initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!pFlags)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&tab.mu);
    i = findHostLocked(p);
    if (i >= 0)
        *pFlags = tab.hosts[i].flags;
    pthread_mutex_unlock(&tab.mu);
    return i >= 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* --- pointer attributes: host allocations here, device ones on the server */

static size_t attribute_width(CUpointer_attribute a)
{
    switch (a) {
    case CU_POINTER_ATTRIBUTE_CONTEXT:
    case CU_POINTER_ATTRIBUTE_DEVICE_POINTER:
    case CU_POINTER_ATTRIBUTE_HOST_POINTER:
    case CU_POINTER_ATTRIBUTE_BUFFER_ID:
    case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR:
    case CU_POINTER_ATTRIBUTE_RANGE_SIZE:
        return 8;
    case CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
    case CU_POINTER_ATTRIBUTE_IS_MANAGED:
    case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL:
        return 4;
    }
    return 0;
}

SHIM_EXPORT CUresult cuPointerGetAttribute(void *data, CUpointer_attribute attribute, CUdeviceptr ptr)
{
    size_t w = attribute_width(attribute);
    cuuint64_t v = 0;
    long i;
    CUresult r = CUDA_SUCCESS;
    if (!initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!data)
        return CUDA_ERROR_INVALID_VALUE;
    if (w == 0)
        return shim_unsupported("cuPointerGetAttribute with this attribute", shim_unsupported_count);
    pthread_mutex_lock(&tab.mu);
    i = findHostLocked((const void *)(uintptr_t)ptr);
    if (i >= 0) {
        switch (attribute) {
        case CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
            v = CU_MEMORYTYPE_HOST;
            break;
        case CU_POINTER_ATTRIBUTE_HOST_POINTER:
            v = ptr;
            break;
        case CU_POINTER_ATTRIBUTE_IS_MANAGED:
            v = 0;
            break;
        case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR:
            v = (uintptr_t)tab.hosts[i].p;
            break;
        case CU_POINTER_ATTRIBUTE_RANGE_SIZE:
            v = tab.hosts[i].n;
            break;
        default:
            r = CUDA_ERROR_INVALID_VALUE;
        }
    }
    pthread_mutex_unlock(&tab.mu);
    if (i < 0)
        r = rpc_gpupoolPointerGetAttribute(&v, attribute, ptr);
    if (r != CUDA_SUCCESS)
        return r;
    if (w == 8) {
        memcpy(data, &v, 8);
    } else {
        uint32_t v32 = (uint32_t)v;
        memcpy(data, &v32, 4);
    }
    return CUDA_SUCCESS;
}

SHIM_EXPORT CUresult cuPointerGetAttributes(unsigned int numAttributes, CUpointer_attribute *attributes, void **data,
                                            CUdeviceptr ptr)
{
    if (numAttributes && (!attributes || !data))
        return CUDA_ERROR_INVALID_VALUE;
    for (unsigned int i = 0; i < numAttributes; i++) {
        CUresult r = cuPointerGetAttribute(data[i], attributes[i], ptr);
        if (r != CUDA_SUCCESS)
            return r;
    }
    return CUDA_SUCCESS;
}

/* --- modules, libraries and kernel parameter layouts */

/* fetch_layout asks the server for f's parameter offsets and sizes and
   keeps them, so launches can serialise kernelParams. Every resolution of a
   function fetches again. */
static CUresult fetch_layout(uint64_t fn)
{
    char info[8 * SHIM_MAX_PARAMS];
    unsigned int count = 0;
    struct param_layout l = {fn, 0, NULL, NULL, 0};
    CUresult r = rpc_gpupoolFuncParams((CUfunction)(uintptr_t)fn, info, sizeof info, &count);
    if (r != CUDA_SUCCESS)
        return r;
    if (count > SHIM_MAX_PARAMS)
        return CUDA_ERROR_UNKNOWN;
    l.count = count;
    l.offsets = calloc(count + 1, sizeof *l.offsets);
    l.sizes = calloc(count + 1, sizeof *l.sizes);
    if (!l.offsets || !l.sizes) {
        free(l.offsets);
        free(l.sizes);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    for (unsigned int i = 0; i < count; i++) {
        l.offsets[i] = get_le32((unsigned char *)info + 8 * i);
        l.sizes[i] = get_le32((unsigned char *)info + 8 * i + 4);
        if ((size_t)l.offsets[i] + l.sizes[i] > l.total)
            l.total = (size_t)l.offsets[i] + l.sizes[i];
    }
    pthread_mutex_lock(&tab.mu);
    for (size_t i = 0; i < tab.nlayouts; i++) {
        /* Replace what was known: the driver may reuse a handle of an
           unloaded module's function for a new one. Launches copy what
           they need under the lock, so the old arrays are free to go. */
        if (tab.layouts[i].fn == fn) {
            free(tab.layouts[i].offsets);
            free(tab.layouts[i].sizes);
            tab.layouts[i] = l;
            pthread_mutex_unlock(&tab.mu);
            return CUDA_SUCCESS;
        }
    }
    if (tab.nlayouts == tab.caplayouts) {
        size_t cap = tab.caplayouts ? tab.caplayouts * 2 : 16;
        struct param_layout *p = realloc(tab.layouts, cap * sizeof *p);
        if (!p) {
            pthread_mutex_unlock(&tab.mu);
            free(l.offsets);
            free(l.sizes);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        tab.layouts = p;
        tab.caplayouts = cap;
    }
    tab.layouts[tab.nlayouts++] = l;
    pthread_mutex_unlock(&tab.mu);
    return CUDA_SUCCESS;
}

SHIM_EXPORT CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name)
{
    CUresult r = rpc_cuModuleGetFunction(hfunc, hmod, name);
    return r == CUDA_SUCCESS ? fetch_layout((uint64_t)(uintptr_t)*hfunc) : r;
}

SHIM_EXPORT CUresult cuLibraryGetKernel(CUkernel *pKernel, CUlibrary library, const char *name)
{
    CUresult r = rpc_cuLibraryGetKernel(pKernel, library, name);
    return r == CUDA_SUCCESS ? fetch_layout((uint64_t)(uintptr_t)*pKernel) : r;
}

SHIM_EXPORT CUresult cuKernelGetFunction(CUfunction *pFunc, CUkernel kernel)
{
    CUresult r = rpc_cuKernelGetFunction(pFunc, kernel);
    return r == CUDA_SUCCESS ? fetch_layout((uint64_t)(uintptr_t)*pFunc) : r;
}

SHIM_EXPORT CUresult cuModuleLoadDataEx(CUmodule *module, const void *image, unsigned int numOptions,
                                        CUjit_option *options, void **optionValues)
{
    (void)numOptions; /* JIT options are hints; the server's defaults apply */
    (void)options;
    (void)optionValues;
    return rpc_cuModuleLoadData(module, image);
}

SHIM_EXPORT CUresult cuModuleLoad(CUmodule *module, const char *fname)
{
    FILE *f;
    char *buf;
    long n;
    CUresult r;
    if (!fname || !module)
        return CUDA_ERROR_INVALID_VALUE;
    f = fopen(fname, "rb");
    if (!f)
        return CUDA_ERROR_FILE_NOT_FOUND;
    if (fseek(f, 0, SEEK_END) != 0 || (n = ftell(f)) < 0 || (size_t)n > SHIM_CHUNK || fseek(f, 0, SEEK_SET) != 0) {
        fclose(f);
        return CUDA_ERROR_INVALID_VALUE;
    }
    buf = calloc(1, (size_t)n + 1);
    if (!buf) {
        fclose(f);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (fread(buf, 1, (size_t)n, f) != (size_t)n) {
        fclose(f);
        free(buf);
        return CUDA_ERROR_FILE_NOT_FOUND;
    }
    fclose(f);
    r = rpc_cuModuleLoadData(module, buf);
    free(buf);
    return r;
}

SHIM_EXPORT CUresult cuLibraryLoadData(CUlibrary *library, const void *code, CUjit_option *jitOptions,
                                       void **jitOptionsValues, unsigned int numJitOptions,
                                       CUlibraryOption *libraryOptions, void **libraryOptionValues,
                                       unsigned int numLibraryOptions)
{
    (void)jitOptions;
    (void)jitOptionsValues;
    (void)numJitOptions;
    (void)libraryOptions;
    (void)libraryOptionValues;
    (void)numLibraryOptions;
    return rpc_gpupoolLibraryLoadData(library, code);
}

/* --- launch */

SHIM_EXPORT CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ,
                                    unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ,
                                    unsigned int sharedMemBytes, CUstream hStream, void **kernelParams, void **extra)
{
    uint64_t fn = (uint64_t)(uintptr_t)f;
    struct param_layout l = {0, 0, NULL, NULL, 0};
    char *blob = NULL;
    size_t len = 0;
    int found = 0;
    CUresult r;

    if (!f)
        return CUDA_ERROR_INVALID_HANDLE;
    if (kernelParams && extra)
        return CUDA_ERROR_INVALID_VALUE;
    /* A launch is pipelined, so what the driver refuses at once is refused
       here, before it is sent: empty dimensions, and more threads in a
       block than any CUDA device runs (1024). */
    if (!gridDimX || !gridDimY || !gridDimZ || !blockDimX || !blockDimY || !blockDimZ ||
        (uint64_t)blockDimX * blockDimY * blockDimZ > 1024)
        return CUDA_ERROR_INVALID_VALUE;
    for (int attempt = 0; attempt < 2 && !found; attempt++) {
        pthread_mutex_lock(&tab.mu);
        for (size_t i = 0; i < tab.nlayouts; i++) {
            if (tab.layouts[i].fn == fn) {
                l = tab.layouts[i];
                found = 1;
                if (kernelParams) {
                    blob = calloc(1, l.total ? l.total : 1);
                    for (unsigned int p = 0; blob && p < l.count; p++) {
                        if (!kernelParams[p]) {
                            free(blob);
                            blob = NULL;
                            pthread_mutex_unlock(&tab.mu);
                            return CUDA_ERROR_INVALID_VALUE;
                        }
                        memcpy(blob + l.offsets[p], kernelParams[p], l.sizes[p]);
                    }
                }
                break;
            }
        }
        pthread_mutex_unlock(&tab.mu);
        if (!found) {
            r = fetch_layout(fn);
            if (r != CUDA_SUCCESS)
                return r;
        }
    }
    if (!found)
        return CUDA_ERROR_INVALID_HANDLE;
    len = l.total;
    if (kernelParams) {
        if (!blob)
            return CUDA_ERROR_OUT_OF_MEMORY;
    } else if (extra) {
        void *buf = NULL;
        size_t size = 0;
        for (void **e = extra; *e != CU_LAUNCH_PARAM_END; e += 2) {
            if (*e == CU_LAUNCH_PARAM_BUFFER_POINTER)
                buf = e[1];
            else if (*e == CU_LAUNCH_PARAM_BUFFER_SIZE && e[1])
                size = *(size_t *)e[1];
            else
                return CUDA_ERROR_INVALID_VALUE;
        }
        if (l.total > 0 && (!buf || size < l.total))
            return CUDA_ERROR_INVALID_VALUE;
        blob = malloc(len ? len : 1);
        if (!blob)
            return CUDA_ERROR_OUT_OF_MEMORY;
        if (len)
            memcpy(blob, buf, len);
    } else if (l.count > 0) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    r = rpc_gpupoolLaunchKernel(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes,
                                hStream, blob ? blob : "", (unsigned int)len);
    free(blob);
    return r;
}

SHIM_EXPORT CUresult cuOccupancyMaxPotentialBlockSize(int *minGridSize, int *blockSize, CUfunction func,
                                                      CUoccupancyB2DSize blockSizeToDynamicSMemSize,
                                                      size_t dynamicSMemSize, int blockSizeLimit)
{
    if (blockSizeToDynamicSMemSize)
        return shim_unsupported("cuOccupancyMaxPotentialBlockSize with a block-size callback",
                                shim_unsupported_count + 1);
    return rpc_gpupoolOccupancyMaxPotentialBlockSize(minGridSize, blockSize, func, dynamicSMemSize, blockSizeLimit);
}

/* --- errors and entry points: work before cuInit, as in the driver */

const struct shim_error *shim_error_of(CUresult r)
{
    for (const struct shim_error *e = shim_errors; e->name; e++)
        if (e->value == r)
            return e;
    return NULL;
}

SHIM_EXPORT CUresult cuGetErrorName(CUresult error, const char **pStr)
{
    if (!pStr)
        return CUDA_ERROR_INVALID_VALUE;
    const struct shim_error *e = shim_error_of(error);
    *pStr = e ? e->name : NULL;
    return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

SHIM_EXPORT CUresult cuGetErrorString(CUresult error, const char **pStr)
{
    if (!pStr)
        return CUDA_ERROR_INVALID_VALUE;
    const struct shim_error *e = shim_error_of(error);
    *pStr = e ? e->text : NULL;
    return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* The newest version of symbol available at cudaVersion; unsupported stubs
   only when nothing supported has the name. Flags (per-thread default
   stream variants) are accepted and ignored: streams are remoted as given. */
SHIM_EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                         CUdriverProcAddressQueryResult *symbolStatus)
{
    const struct shim_proc *best = NULL;
    int named = 0;
    (void)flags;
    if (!symbol || !pfn)
        return CUDA_ERROR_INVALID_VALUE;
    for (const struct shim_proc *p = shim_procs; p->base; p++) {
        if (strcmp(p->base, symbol) != 0)
            continue;
        named = 1;
        if (p->since > cudaVersion)
            continue;
        if (!best || p->supported > best->supported || (p->supported == best->supported && p->since > best->since))
            best = p;
    }
    if (!best) {
        *pfn = NULL;
        if (symbolStatus)
            *symbolStatus = named ? CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
        return CUDA_ERROR_NOT_FOUND;
    }
    *pfn = best->fn;
    if (symbolStatus)
        *symbolStatus = CU_GET_PROC_ADDRESS_SUCCESS;
    return CUDA_SUCCESS;
}

SHIM_EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags)
{
    return cuGetProcAddress_v2(symbol, pfn, cudaVersion, flags, NULL);
}

/* cudart's private tables are not remoted: see docs/remote-cuda.md. Under
   GPUPOOL_CUDA_TRACE each table asked for is logged by its UUID, the first
   thing to learn about a runtime version. */
SHIM_EXPORT CUresult cuGetExportTable(const void **ppExportTable, const CUuuid *pExportTableId)
{
    if (ppExportTable)
        *ppExportTable = NULL;
    if (shim_trace && pExportTableId) {
        const unsigned char *u = (const unsigned char *)pExportTableId->bytes;
        shim_log("trace: cuGetExportTable %02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x "
                 "-> CUDA_ERROR_NOT_SUPPORTED",
                 u[0], u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]);
    }
    return shim_unsupported("cuGetExportTable (used by the CUDA runtime, cudart)", shim_unsupported_count + 2);
}
