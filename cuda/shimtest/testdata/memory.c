/* Memory within the slice: allocation past it fails, 256 MiB goes in and
   out intact, and pointers the session does not own are refused.
   Usage: memory SLICE_BYTES */
#include <stdint.h>
#include <string.h>

#include "check.h"

static uint64_t checksum(const uint32_t *p, size_t n)
{
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++)
        h = (h ^ p[i]) * 1099511628211ull;
    return h;
}

int main(int argc, char **argv)
{
    size_t slice = argc > 1 ? strtoull(argv[1], NULL, 10) : 0;
    const size_t big = (size_t)256 << 20, words = big / 4;
    CUdevice dev;
    CUcontext ctx;
    CUdeviceptr d = 0, d2 = 0, e = 0, base = 0;
    size_t free_ = 0, total = 0, size = 0;
    uint32_t *in, *out, *pinned = NULL;
    unsigned int mt = 0, flags = 0;
    unsigned long long range = 0;
    CUcontext owner = NULL;

    OK(cuInit(0));
    OK(cuDeviceGet(&dev, 0));
    CHECK(cuMemAlloc(&d, 1024), CUDA_ERROR_INVALID_CONTEXT);
    OK(cuCtxCreate(&ctx, 0, dev));

    /* The slice is the limit, whatever the device has. */
    CHECK(cuMemAlloc(&d, slice + 1), CUDA_ERROR_OUT_OF_MEMORY);
    CHECK(cuMemAlloc(&d, 0), CUDA_ERROR_INVALID_VALUE);
    OK(cuMemAlloc(&d, big));
    CHECK(cuMemAlloc(&e, slice - big + 1), CUDA_ERROR_OUT_OF_MEMORY);
    OK(cuMemGetInfo(&free_, &total));
    EXPECT(total == slice && free_ == slice - big);

    /* 256 MiB in and out, checksummed. */
    in = malloc(big);
    out = malloc(big);
    EXPECT(in && out);
    for (size_t i = 0; i < words; i++)
        in[i] = (uint32_t)(i * 2654435761u);
    OK(cuMemcpyHtoD(d, in, big));
    memset(out, 0, big);
    OK(cuMemcpyDtoH(out, d, big));
    EXPECT(checksum(in, words) == checksum(out, words));
    EXPECT(memcmp(in, out, big) == 0);

    /* Device to device, and memsets of each width. */
    OK(cuMemAlloc(&d2, 4096));
    OK(cuMemcpyDtoD(d2, d + 4, 4096));
    OK(cuMemcpyDtoH(out, d2, 4096));
    EXPECT(memcmp(out, in + 1, 4096) == 0);
    OK(cuMemsetD8(d2, 0xab, 16));
    OK(cuMemsetD16(d2 + 16, 0x1234, 8));
    OK(cuMemsetD32(d2 + 32, 0xdeadbeef, 4));
    OK(cuMemcpyDtoH(out, d2, 48));
    EXPECT(((unsigned char *)out)[15] == 0xab && ((uint16_t *)out)[8] == 0x1234 && out[8] == 0xdeadbeef &&
           out[11] == 0xdeadbeef);

    /* Ranges outside the session's allocations are refused. */
    CHECK(cuMemcpyHtoD(d2 + 4000, in, 4096), CUDA_ERROR_INVALID_VALUE);
    CHECK(cuMemcpyDtoH(out, d2, 8192), CUDA_ERROR_INVALID_VALUE);
    CHECK(cuMemcpyDtoH(out, 0x1000, 16), CUDA_ERROR_INVALID_VALUE);
    CHECK(cuMemsetD32(d2, 0, 2000), CUDA_ERROR_INVALID_VALUE);
    CHECK(cuMemcpyDtoD(d2, d2 + 8, 4096), CUDA_ERROR_INVALID_VALUE);
    CHECK(cuMemFree(d2 + 8), CUDA_ERROR_INVALID_VALUE);
    CHECK(cuMemcpyHtoD(d2, NULL, 16), CUDA_ERROR_INVALID_VALUE);

    /* Pointer attributes and address ranges. */
    OK(cuPointerGetAttribute(&mt, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, d2 + 100));
    EXPECT(mt == CU_MEMORYTYPE_DEVICE);
    OK(cuPointerGetAttribute(&range, CU_POINTER_ATTRIBUTE_RANGE_SIZE, d2 + 100));
    EXPECT(range == 4096);
    OK(cuPointerGetAttribute(&owner, CU_POINTER_ATTRIBUTE_CONTEXT, d2));
    EXPECT(owner == ctx);
    OK(cuMemGetAddressRange(&base, &size, d2 + 100));
    EXPECT(base == d2 && size == 4096);
    CHECK(cuPointerGetAttribute(&mt, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, 0x1000), CUDA_ERROR_INVALID_VALUE);

    /* Host-pinned memory. */
    OK(cuMemAllocHost((void **)&pinned, 1 << 20));
    OK(cuMemHostGetFlags(&flags, pinned));
    OK(cuPointerGetAttribute(&mt, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, (CUdeviceptr)(uintptr_t)pinned));
    EXPECT(mt == CU_MEMORYTYPE_HOST);
    OK(cuMemcpyHtoD(d2, in, 4096));
    OK(cuMemcpyDtoH(pinned, d2, 4096));
    EXPECT(memcmp(pinned, in, 4096) == 0);
    OK(cuMemFreeHost(pinned));
    CHECK(cuMemFreeHost(pinned), CUDA_ERROR_INVALID_VALUE);

    /* Registered host memory stays the caller's. */
    OK(cuMemHostRegister(out, 4096, CU_MEMHOSTREGISTER_PORTABLE));
    CHECK(cuMemHostRegister((char *)out + 100, 16, 0), CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED);
    OK(cuPointerGetAttribute(&mt, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, (CUdeviceptr)(uintptr_t)out));
    EXPECT(mt == CU_MEMORYTYPE_HOST);
    CHECK(cuMemFreeHost(out), CUDA_ERROR_INVALID_VALUE);
    OK(cuMemHostUnregister(out));
    CHECK(cuMemHostUnregister(out), CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED);

    /* Free, and free again. */
    OK(cuMemFree(d2));
    CHECK(cuMemFree(d2), CUDA_ERROR_INVALID_VALUE);
    CHECK(cuMemcpyDtoH(out, d2, 16), CUDA_ERROR_INVALID_VALUE);
    OK(cuMemFree(d));
    OK(cuMemGetInfo(&free_, &total));
    EXPECT(free_ == slice);
    OK(cuCtxDestroy(ctx));
    CHECK(cuMemAlloc(&d, 16), CUDA_ERROR_INVALID_CONTEXT);
    printf("copied=%zu checksum=%016llx\n", big, (unsigned long long)checksum(out, 16));
    return 0;
}
