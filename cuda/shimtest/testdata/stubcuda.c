/*
 * A stand-in libcuda for tests without a GPU: just enough of the driver
 * API, with its own declarations, for the real backend to load it and run
 * vecadd through it. Device memory is host memory; the one kernel,
 * vecadd, runs on the CPU. Not thread-safe beyond what the tests need.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define EXPORT __attribute__((visibility("default")))

enum { OK = 0, INVALID_VALUE = 1, NOT_INITIALIZED = 3, INVALID_DEVICE = 101, INVALID_IMAGE = 200,
       INVALID_CONTEXT = 201, INVALID_HANDLE = 400, NOT_FOUND = 500 };

struct ctx { int dev; };
struct mod { int has_vecadd; };
struct fn { int vecadd; };

static int initialized;
static __thread struct ctx *current;

/* note appends an event to the file STUB_CUDA_LOG names, for the tests. */
static void note(const char *event)
{
    const char *path = getenv("STUB_CUDA_LOG");
    FILE *f;
    if (!path || !(f = fopen(path, "a")))
        return;
    fprintf(f, "%s\n", event);
    fclose(f);
}

EXPORT int cuInit(unsigned flags) { initialized = flags == 0; return flags ? INVALID_VALUE : OK; }
EXPORT int cuDriverGetVersion(int *v) { *v = 12040; return OK; }
EXPORT int cuDeviceGetCount(int *n) { *n = 2; return initialized ? OK : NOT_INITIALIZED; }
EXPORT int cuDeviceGet(int *d, int ordinal)
{
    if (ordinal < 0 || ordinal > 1)
        return INVALID_DEVICE;
    *d = ordinal;
    return OK;
}
EXPORT int cuDeviceGetName(char *name, int len, int dev)
{
    const char *n = dev == 0 ? "Stub GPU 0" : "Stub GPU 1";
    if (len <= 0 || dev < 0 || dev > 1)
        return INVALID_VALUE;
    strncpy(name, n, (size_t)len - 1);
    name[len - 1] = 0;
    return OK;
}
EXPORT int cuDeviceTotalMem_v2(size_t *bytes, int dev)
{
    if (dev < 0 || dev > 1)
        return INVALID_DEVICE;
    *bytes = (size_t)16 << 30;
    return OK;
}
EXPORT int cuDeviceGetAttribute(int *pi, int attr, int dev)
{
    (void)dev;
    *pi = attr == 16 ? 4 : 0;
    return OK;
}
EXPORT int cuCtxCreate_v2(struct ctx **pctx, unsigned flags, int dev)
{
    (void)flags;
    *pctx = calloc(1, sizeof **pctx);
    (*pctx)->dev = dev;
    current = *pctx;
    note("context created");
    return OK;
}
EXPORT int cuCtxDestroy_v2(struct ctx *c)
{
    if (current == c)
        current = NULL;
    free(c);
    note("context destroyed");
    return OK;
}
EXPORT int cuCtxSetCurrent(struct ctx *c) { current = c; return OK; }
EXPORT int cuCtxGetDevice(int *dev)
{
    if (!current)
        return INVALID_CONTEXT;
    *dev = current->dev;
    return OK;
}
EXPORT int cuCtxSynchronize(void) { return current ? OK : INVALID_CONTEXT; }
EXPORT int cuMemAlloc_v2(unsigned long long *p, size_t n)
{
    if (!current)
        return INVALID_CONTEXT;
    *p = (unsigned long long)(uintptr_t)calloc(1, n);
    return OK;
}
EXPORT int cuMemFree_v2(unsigned long long p) { free((void *)(uintptr_t)p); return OK; }
EXPORT int cuMemGetInfo_v2(size_t *free_, size_t *total)
{
    *free_ = *total = (size_t)16 << 30;
    return current ? OK : INVALID_CONTEXT;
}
EXPORT int cuMemcpyHtoD_v2(unsigned long long dst, const void *src, size_t n)
{
    memcpy((void *)(uintptr_t)dst, src, n);
    return OK;
}
EXPORT int cuMemcpyDtoH_v2(void *dst, unsigned long long src, size_t n)
{
    memcpy(dst, (void *)(uintptr_t)src, n);
    return OK;
}
EXPORT int cuModuleLoadData(struct mod **m, const void *image)
{
    if (!current)
        return INVALID_CONTEXT;
    if (!strstr(image, ".version"))
        return INVALID_IMAGE;
    *m = calloc(1, sizeof **m);
    (*m)->has_vecadd = strstr(image, ".entry vecadd") != NULL;
    return OK;
}
EXPORT int cuModuleUnload(struct mod *m) { free(m); return OK; }
EXPORT int cuModuleGetFunction(struct fn **f, struct mod *m, const char *name)
{
    if (!m->has_vecadd || strcmp(name, "vecadd") != 0)
        return NOT_FOUND;
    *f = calloc(1, sizeof **f);
    (*f)->vecadd = 1;
    return OK;
}
EXPORT int cuFuncGetParamInfo(struct fn *f, size_t i, size_t *off, size_t *size)
{
    static const size_t offs[] = {0, 8, 16, 24}, sizes[] = {8, 8, 8, 4};
    if (!f)
        return INVALID_HANDLE;
    if (i >= 4)
        return INVALID_VALUE;
    *off = offs[i];
    *size = sizes[i];
    return OK;
}
EXPORT int cuLaunchKernel(struct fn *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                          unsigned shared, void *stream, void **params, void **extra)
{
    float *a, *b, *c;
    int n;
    (void)gy, (void)gz, (void)by, (void)bz, (void)shared, (void)stream, (void)extra;
    if (!f || !f->vecadd)
        return INVALID_HANDLE;
    memcpy(&a, params[0], 8);
    memcpy(&b, params[1], 8);
    memcpy(&c, params[2], 8);
    memcpy(&n, params[3], 4);
    for (unsigned long long i = 0; i < (unsigned long long)gx * bx && i < (unsigned long long)n; i++)
        c[i] = a[i] + b[i];
    return OK;
}
