/* The covered calls the other programs do not make, each checked.
   Usage: misc PTX_PATH */
#include <string.h>

#include "check.h"

int main(int argc, char **argv)
{
    const char *path = argc > 1 ? argv[1] : "kernels.ptx";
    char *ptx = read_file(path);
    CUdevice dev = 0;
    CUcontext primary, ctx;
    CUmodule mod, mod2;
    CUlibrary lib;
    CUfunction vecadd;
    CUstream s;
    CUevent e;
    CUdeviceptr d, g;
    size_t limit = 0, gsize = 0, smem = 0;
    unsigned int flags = 99, version = 0;
    int active = -1, blocks = 0, pi = 0;
    void *host = NULL, *fn = NULL;

    OK(cuInit(0));

    /* Primary context state, flags and reset. */
    OK(cuDevicePrimaryCtxGetState(dev, &flags, &active));
    EXPECT(active == 0);
    OK(cuDevicePrimaryCtxSetFlags(dev, 0));
    OK(cuDevicePrimaryCtxRetain(&primary, dev));
    OK(cuDevicePrimaryCtxGetState(dev, &flags, &active));
    EXPECT(active == 1 && flags == 0);
    OK(cuCtxPushCurrent(primary));
    OK(cuMemAlloc(&d, 4096));
    OK(cuDevicePrimaryCtxReset(dev));
    CHECK(cuMemsetD8(d, 0, 16), CUDA_ERROR_INVALID_VALUE); /* the reset freed it */
    OK(cuCtxPopCurrent(&ctx));
    EXPECT(ctx == primary);

    OK(cuCtxCreate(&ctx, 0, dev));
    OK(cuCtxGetApiVersion(ctx, &version));
    EXPECT(version > 0);
    OK(cuCtxGetFlags(&flags));
    OK(cuCtxGetLimit(&limit, CU_LIMIT_STACK_SIZE));
    OK(cuCtxSetLimit(CU_LIMIT_STACK_SIZE, limit * 2));
    OK(cuCtxGetLimit(&limit, CU_LIMIT_STACK_SIZE));
    EXPECT(limit > 0);

    /* Host memory from cuMemHostAlloc, and memsets of each width on a stream. */
    OK(cuMemHostAlloc(&host, 4096, CU_MEMHOSTALLOC_PORTABLE));
    OK(cuMemHostGetFlags(&flags, host));
    EXPECT(flags == CU_MEMHOSTALLOC_PORTABLE);
    CHECK(cuMemHostAlloc(&host, 4096, 0x100), CUDA_ERROR_INVALID_VALUE);
    OK(cuStreamCreate(&s, 0));
    OK(cuMemAlloc(&d, 64));
    OK(cuMemsetD8Async(d, 1, 8, s));
    OK(cuMemsetD16Async(d + 8, 0x0202, 4, s));
    OK(cuStreamSynchronize(s));
    OK(cuMemcpyDtoH(host, d, 16));
    EXPECT(((unsigned char *)host)[7] == 1 && ((unsigned char *)host)[8] == 2 && ((unsigned char *)host)[15] == 2);
    OK(cuMemFreeHost(host));

    /* Several pointer attributes at once. */
    {
        unsigned int mt = 0;
        unsigned long long start = 0;
        CUpointer_attribute attrs[] = {CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR};
        void *data[] = {&mt, &start};
        OK(cuPointerGetAttributes(2, attrs, data, d + 10));
        EXPECT(mt == CU_MEMORYTYPE_DEVICE && start == d);
    }

    /* Modules from a file and with JIT options; a library's global. */
    OK(cuModuleLoad(&mod, path));
    CHECK(cuModuleLoad(&mod2, "/nonexistent/kernels.ptx"), CUDA_ERROR_FILE_NOT_FOUND);
    OK(cuModuleLoadDataEx(&mod2, ptx, 0, NULL, NULL));
    OK(cuLibraryLoadData(&lib, ptx, NULL, NULL, 0, NULL, NULL, 0));
    OK(cuLibraryGetGlobal(&g, &gsize, lib, "scale_factor"));
    EXPECT(gsize == 4);

    /* Function attributes and occupancy. */
    OK(cuModuleGetFunction(&vecadd, mod, "vecadd"));
    OK(cuFuncSetAttribute(vecadd, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, 65536));
    OK(cuFuncGetAttribute(&pi, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, vecadd));
    EXPECT(pi == 65536);
    CHECK(cuFuncSetAttribute(vecadd, CU_FUNC_ATTRIBUTE_NUM_REGS, 1), CUDA_ERROR_INVALID_VALUE);
    OK(cuFuncSetCacheConfig(vecadd, CU_FUNC_CACHE_PREFER_SHARED));
    OK(cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(&blocks, vecadd, 128, 0, 0));
    EXPECT(blocks > 0);
    CHECK(cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(&blocks, vecadd, 0, 0, 0), CUDA_ERROR_INVALID_VALUE);
    OK(cuOccupancyAvailableDynamicSMemPerBlock(&smem, vecadd, 2, 128));
    EXPECT(smem > 0);

    /* Events recorded with flags. */
    OK(cuEventCreate(&e, CU_EVENT_DEFAULT));
    OK(cuEventRecordWithFlags(e, s, 0));
    OK(cuEventSynchronize(e));

    /* The version-1 entry-point lookup. */
    OK(cuGetProcAddress("cuInit", &fn, 12000, CU_GET_PROC_ADDRESS_DEFAULT));
    EXPECT(fn == (void *)cuInit);

    OK(cuLibraryUnload(lib));
    OK(cuModuleUnload(mod2));
    OK(cuModuleUnload(mod));
    OK(cuCtxDestroy(ctx));
    OK(cuDevicePrimaryCtxRelease(dev));
    printf("misc ok\n");
    return 0;
}
