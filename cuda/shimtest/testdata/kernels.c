/* Loads a hand-written PTX module and launches vecadd, saxpy and
   reduce_sum with kernelParams and with extra.
   Usage: kernels PTX_PATH sim|real */
#include <math.h>
#include <string.h>

#include "check.h"

#define N (1 << 20)

int main(int argc, char **argv)
{
    char *ptx = read_file(argc > 1 ? argv[1] : "kernels.ptx");
    int sim = argc > 2 && strcmp(argv[2], "sim") == 0;
    CUdevice dev;
    CUcontext ctx;
    CUmodule mod, mod2;
    CUlibrary lib;
    CUkernel kern;
    CUfunction vecadd, saxpy, reduce, f;
    CUdeviceptr a, b, c, sum, g;
    size_t gsize = 0, off = 0, psize = 0;
    float *ha = malloc(N * sizeof(float)), *hb = malloc(N * sizeof(float)), *hc = malloc(N * sizeof(float));
    float alpha = 2.5f, total = 0, scale = 0;
    int n = N, pi = 0, blocks = 0, minGrid = 0, block = 0;
    unsigned char elf[64] = {0x7f, 'E', 'L', 'F', 2}; /* e_shoff 64, no sections: 64 bytes */

    elf[0x28] = 64;

    EXPECT(ha && hb && hc);
    OK(cuInit(0));
    OK(cuDeviceGet(&dev, 0));
    OK(cuCtxCreate(&ctx, 0, dev));
    CHECK(cuModuleLoadData(&mod, "this is not PTX"), CUDA_ERROR_INVALID_IMAGE);
    if (sim)
        CHECK(cuModuleLoadData(&mod, elf), CUDA_ERROR_NOT_SUPPORTED);
    OK(cuModuleLoadData(&mod, ptx));
    OK(cuModuleGetFunction(&vecadd, mod, "vecadd"));
    OK(cuModuleGetFunction(&saxpy, mod, "saxpy"));
    OK(cuModuleGetFunction(&reduce, mod, "reduce_sum"));
    CHECK(cuModuleGetFunction(&f, mod, "no_such_kernel"), CUDA_ERROR_NOT_FOUND);
    if (sim)
        CHECK(cuModuleGetFunction(&f, mod, "not_simulated"), CUDA_ERROR_NOT_FOUND);

    /* The layout the shim serialises kernelParams with. */
    OK(cuFuncGetParamInfo(saxpy, 1, &off, &psize));
    EXPECT(off == 8 && psize == 8);
    OK(cuFuncGetParamInfo(saxpy, 3, &off, &psize));
    EXPECT(off == 24 && psize == 4);
    CHECK(cuFuncGetParamInfo(saxpy, 4, &off, &psize), CUDA_ERROR_INVALID_VALUE);
    OK(cuFuncGetAttribute(&pi, CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, vecadd));
    EXPECT(pi >= 256);
    OK(cuOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, vecadd, 256, 0));
    EXPECT(blocks > 0);
    OK(cuOccupancyMaxPotentialBlockSize(&minGrid, &block, vecadd, NULL, 0, 0));
    EXPECT(minGrid > 0 && block > 0);

    for (int i = 0; i < N; i++) {
        ha[i] = (float)i;
        hb[i] = 2.0f * (float)i;
    }
    OK(cuMemAlloc(&a, N * sizeof(float)));
    OK(cuMemAlloc(&b, N * sizeof(float)));
    OK(cuMemAlloc(&c, N * sizeof(float)));
    OK(cuMemAlloc(&sum, sizeof(float)));
    OK(cuMemcpyHtoD(a, ha, N * sizeof(float)));
    OK(cuMemcpyHtoD(b, hb, N * sizeof(float)));

    /* vecadd with kernelParams. */
    {
        void *params[] = {&a, &b, &c, &n};
        CHECK(cuLaunchKernel(vecadd, N / 256, 1, 1, 2048, 1, 1, 0, NULL, params, NULL), CUDA_ERROR_INVALID_VALUE);
        CHECK(cuLaunchKernel(vecadd, N / 256, 1, 1, 256, 1, 1, 0, NULL, NULL, NULL), CUDA_ERROR_INVALID_VALUE);
        CHECK(cuLaunchKernel(NULL, 1, 1, 1, 1, 1, 1, 0, NULL, params, NULL), CUDA_ERROR_INVALID_HANDLE);
        OK(cuLaunchKernel(vecadd, N / 256, 1, 1, 256, 1, 1, 0, NULL, params, NULL));
        OK(cuCtxSynchronize());
        OK(cuMemcpyDtoH(hc, c, N * sizeof(float)));
        for (int i = 0; i < N; i++)
            EXPECT(hc[i] == 3.0f * (float)i);
    }

    /* saxpy with extra: the caller lays out the parameter buffer. */
    {
        unsigned char buf[28];
        size_t size = sizeof buf;
        void *extra[] = {CU_LAUNCH_PARAM_BUFFER_POINTER, buf, CU_LAUNCH_PARAM_BUFFER_SIZE, &size, CU_LAUNCH_PARAM_END};
        memset(buf, 0, sizeof buf);
        memcpy(buf, &alpha, 4);
        memcpy(buf + 8, &a, 8);
        memcpy(buf + 16, &c, 8);
        memcpy(buf + 24, &n, 4);
        OK(cuLaunchKernel(saxpy, N / 256, 1, 1, 256, 1, 1, 0, NULL, NULL, extra));
        OK(cuMemcpyDtoH(hc, c, N * sizeof(float)));
        for (int i = 0; i < N; i++)
            EXPECT(hc[i] == alpha * (float)i + 3.0f * (float)i);
    }

    /* reduce_sum over 1000 ones. */
    {
        int m = 1000;
        void *params[] = {&b, &sum, &m};
        for (int i = 0; i < m; i++)
            hb[i] = 1.0f;
        OK(cuMemcpyHtoD(b, hb, m * sizeof(float)));
        OK(cuMemsetD32(sum, 0, 1));
        OK(cuLaunchKernel(reduce, (m + 255) / 256, 1, 1, 256, 1, 1, 0, NULL, params, NULL));
        OK(cuMemcpyDtoH(&total, sum, sizeof total));
        EXPECT(fabsf(total - 1000.0f) < 0.5f);
    }

    /* A module global. */
    OK(cuModuleGetGlobal(&g, &gsize, mod, "scale_factor"));
    EXPECT(gsize == 4);
    OK(cuMemcpyHtoD(g, &alpha, 4));
    OK(cuMemcpyDtoH(&scale, g, 4));
    EXPECT(scale == alpha);
    CHECK(cuModuleGetGlobal(&g, &gsize, mod, "no_such_global"), CUDA_ERROR_NOT_FOUND);

    /* The same kernels through a library. */
    OK(cuLibraryLoadData(&lib, ptx, NULL, NULL, 0, NULL, NULL, 0));
    OK(cuLibraryGetKernel(&kern, lib, "vecadd"));
    OK(cuKernelGetFunction(&f, kern));
    OK(cuLibraryGetModule(&mod2, lib));
    {
        void *params[] = {&a, &a, &c, &n};
        OK(cuLaunchKernel(f, N / 256, 1, 1, 256, 1, 1, 0, NULL, params, NULL));
        OK(cuMemcpyDtoH(hc, c, N * sizeof(float)));
        EXPECT(hc[7] == 14.0f);
        OK(cuLaunchKernel((CUfunction)kern, N / 256, 1, 1, 256, 1, 1, 0, NULL, params, NULL));
    }
    OK(cuLibraryUnload(lib));

    OK(cuModuleUnload(mod));
    CHECK(cuModuleGetFunction(&f, mod, "vecadd"), CUDA_ERROR_INVALID_HANDLE);
    OK(cuCtxDestroy(ctx));
    printf("vecadd ok saxpy ok reduce_sum=%.0f\n", total);
    return 0;
}
