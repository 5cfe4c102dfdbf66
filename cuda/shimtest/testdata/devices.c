/* Enumerates the lease's devices: one, numbered 0, with the slice's memory.
   Usage: devices WANT_TOTAL_BYTES */
#include <string.h>

#include "check.h"

int main(int argc, char **argv)
{
    unsigned long long want = argc > 1 ? strtoull(argv[1], NULL, 10) : 0;
    int n = -1, version = 0, major = 0, minor = 0, sms = 0, pi = 0;
    char name[256];
    CUdevice dev = -1;
    CUuuid uuid;
    size_t total = 0, free_ = 0;
    CUcontext ctx = NULL, cur = NULL;
    void *fn = NULL;
    CUdriverProcAddressQueryResult status;
    const char *s = NULL;

    /* Before cuInit, as with the driver. */
    CHECK(cuDeviceGetCount(&n), CUDA_ERROR_NOT_INITIALIZED);
    CHECK(cuCtxGetCurrent(&cur), CUDA_ERROR_NOT_INITIALIZED);
    OK(cuDriverGetVersion(&version));
    EXPECT(version >= 12000);

    CHECK(cuInit(1), CUDA_ERROR_INVALID_VALUE);
    OK(cuInit(0));
    OK(cuDeviceGetCount(&n));
    EXPECT(n == 1);
    CHECK(cuDeviceGet(&dev, 1), CUDA_ERROR_INVALID_DEVICE);
    CHECK(cuDeviceGet(&dev, -1), CUDA_ERROR_INVALID_DEVICE);
    CHECK(cuDeviceGet(NULL, 0), CUDA_ERROR_INVALID_VALUE);
    OK(cuDeviceGet(&dev, 0));
    EXPECT(dev == 0);
    OK(cuDeviceGetName(name, sizeof name, dev));
    CHECK(cuDeviceGetName(name, -1, dev), CUDA_ERROR_INVALID_VALUE);
    CHECK(cuDeviceGetName(name, sizeof name, 7), CUDA_ERROR_INVALID_DEVICE);
    OK(cuDeviceGetUuid(&uuid, dev));
    OK(cuDeviceTotalMem(&total, dev));
    EXPECT(total == want);
    OK(cuDeviceComputeCapability(&major, &minor, dev));
    OK(cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev));
    OK(cuDeviceGetAttribute(&pi, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev));
    EXPECT(pi == major && sms > 0);
    OK(cuDeviceGetAttribute(&pi, CU_DEVICE_ATTRIBUTE_WARP_SIZE, dev));
    EXPECT(pi == 32);
    CHECK(cuDeviceGetAttribute(&pi, (CUdevice_attribute)100000, dev), CUDA_ERROR_INVALID_VALUE);
    {
        char bus[32];
        CUdevice found = -1;
        OK(cuDeviceGetPCIBusId(bus, sizeof bus, dev));
        OK(cuDeviceGetByPCIBusId(&found, bus));
        EXPECT(found == dev);
        /* The host's first two devices (buses 01 and 02), but for the
           lease's own, are not the lease's. */
        for (int b = 1; b <= 2; b++) {
            char other[32];
            snprintf(other, sizeof other, "00000000:%02X:00.0", b);
            if (strcmp(other, bus) != 0)
                CHECK(cuDeviceGetByPCIBusId(&found, other), CUDA_ERROR_INVALID_DEVICE);
        }
        OK(cuDeviceCanAccessPeer(&pi, dev, dev));
        EXPECT(pi == 0);
    }

    /* Memory info needs a context, and shows the slice too. */
    CHECK(cuMemGetInfo(&free_, &total), CUDA_ERROR_INVALID_CONTEXT);
    OK(cuDevicePrimaryCtxRetain(&ctx, dev));
    OK(cuCtxSetCurrent(ctx));
    OK(cuCtxGetCurrent(&cur));
    EXPECT(cur == ctx);
    OK(cuMemGetInfo(&free_, &total));
    EXPECT(total == want && free_ == want);
    OK(cuCtxGetDevice(&dev));
    EXPECT(dev == 0);
    {
        CUfunc_cache cache = CU_FUNC_CACHE_PREFER_NONE;
        OK(cuCtxSetCacheConfig(CU_FUNC_CACHE_PREFER_L1));
        OK(cuCtxGetCacheConfig(&cache));
        EXPECT(cache == CU_FUNC_CACHE_PREFER_L1);
    }
    CHECK(cuCtxSetCurrent((CUcontext)(uintptr_t)0xdead0), CUDA_ERROR_INVALID_CONTEXT);
    OK(cuDevicePrimaryCtxRelease(dev));

    /* Entry points by name, as the CUDA runtime looks them up. */
    OK(cuGetProcAddress_v2("cuMemAlloc", &fn, 12000, 0, &status));
    EXPECT(fn == (void *)cuMemAlloc_v2 && status == CU_GET_PROC_ADDRESS_SUCCESS);
    CHECK(cuGetProcAddress_v2("cuMemAlloc", &fn, 3000, 0, &status), CUDA_ERROR_NOT_FOUND);
    EXPECT(status == CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT);
    CHECK(cuGetProcAddress_v2("cuNoSuchCall", &fn, 12040, 0, &status), CUDA_ERROR_NOT_FOUND);
    EXPECT(status == CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND && fn == NULL);
    OK(cuGetProcAddress_v2("cuMemAllocManaged", &fn, 12040, 0, &status));
    CHECK(((CUresult(*)(CUdeviceptr *, size_t, unsigned int))fn)(NULL, 0, 0), CUDA_ERROR_NOT_SUPPORTED);
    CHECK(((CUresult(*)(CUdeviceptr *, size_t, unsigned int))fn)(NULL, 0, 0), CUDA_ERROR_NOT_SUPPORTED);
    {
        const void *table = (const void *)1;
        CUuuid id;
        memset(&id, 0, sizeof id);
        CHECK(cuGetExportTable(&table, &id), CUDA_ERROR_NOT_SUPPORTED);
        EXPECT(table == NULL);
    }

    /* Error names and strings. */
    OK(cuGetErrorName(CUDA_ERROR_OUT_OF_MEMORY, &s));
    EXPECT(strcmp(s, "CUDA_ERROR_OUT_OF_MEMORY") == 0);
    OK(cuGetErrorString(CUDA_ERROR_OUT_OF_MEMORY, &s));
    EXPECT(strcmp(s, "out of memory") == 0);
    CHECK(cuGetErrorName((CUresult)12345, &s), CUDA_ERROR_INVALID_VALUE);
    EXPECT(s == NULL);

    printf("devices=%d name=%s cc=%d.%d total=%zu\n", n, name, major, minor, total);
    return 0;
}
