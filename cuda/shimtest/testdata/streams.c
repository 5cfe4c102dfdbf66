/* Orders work on streams with events: async copies, a launch, a wait on
   another stream's event, and timing. Usage: streams PTX_PATH */
#include <string.h>

#include "check.h"

#define N 4096

int main(int argc, char **argv)
{
    char *ptx = read_file(argc > 1 ? argv[1] : "kernels.ptx");
    CUdevice dev;
    CUcontext ctx, sctx;
    CUmodule mod;
    CUfunction vecadd;
    CUstream s1, s2;
    CUevent start, copied, done, untimed;
    CUdeviceptr a, c;
    float h[N], out[N], ms = -1;
    int n = N, prio = 1, least = 0, greatest = 0;
    unsigned int flags = 9;

    OK(cuInit(0));
    OK(cuDeviceGet(&dev, 0));
    OK(cuCtxCreate(&ctx, 0, dev));
    OK(cuModuleLoadData(&mod, ptx));
    OK(cuModuleGetFunction(&vecadd, mod, "vecadd"));
    OK(cuCtxGetStreamPriorityRange(&least, &greatest));
    OK(cuStreamCreate(&s1, CU_STREAM_NON_BLOCKING));
    OK(cuStreamCreateWithPriority(&s2, CU_STREAM_DEFAULT, greatest));
    OK(cuStreamGetFlags(s1, &flags));
    EXPECT(flags == CU_STREAM_NON_BLOCKING);
    OK(cuStreamGetPriority(s2, &prio));
    EXPECT(prio == greatest);
    OK(cuStreamGetCtx(s1, &sctx));
    EXPECT(sctx == ctx);
    OK(cuEventCreate(&start, CU_EVENT_DEFAULT));
    OK(cuEventCreate(&copied, CU_EVENT_DEFAULT));
    OK(cuEventCreate(&done, CU_EVENT_DEFAULT));
    OK(cuEventCreate(&untimed, CU_EVENT_DISABLE_TIMING));
    CHECK(cuEventElapsedTime(&ms, start, done), CUDA_ERROR_NOT_READY);

    for (int i = 0; i < N; i++)
        h[i] = (float)i;
    OK(cuMemAlloc(&a, sizeof h));
    OK(cuMemAlloc(&c, sizeof h));
    OK(cuEventRecord(start, s1));
    OK(cuMemcpyHtoDAsync(a, h, sizeof h, s1));
    OK(cuMemsetD32Async(c, 0, N, s1));
    OK(cuEventRecord(copied, s1));
    OK(cuStreamWaitEvent(s2, copied, 0));
    {
        void *params[] = {&a, &a, &c, &n};
        OK(cuLaunchKernel(vecadd, N / 128, 1, 1, 128, 1, 1, 0, s2, params, NULL));
    }
    OK(cuEventRecord(done, s2));
    OK(cuMemcpyDtoHAsync(out, c, sizeof out, s2));
    OK(cuStreamSynchronize(s2));
    OK(cuEventSynchronize(done));
    OK(cuEventQuery(done));
    OK(cuStreamQuery(s1));
    OK(cuEventElapsedTime(&ms, start, done));
    EXPECT(ms >= 0);
    OK(cuEventRecord(untimed, s1));
    CHECK(cuEventElapsedTime(&ms, start, untimed), CUDA_ERROR_INVALID_HANDLE);
    for (int i = 0; i < N; i++)
        EXPECT(out[i] == 2.0f * (float)i);

    /* The legacy default stream, and handles that are not the session's. */
    OK(cuMemcpyDtoDAsync(c, a, sizeof h, CU_STREAM_LEGACY));
    OK(cuStreamSynchronize(NULL));
    CHECK(cuStreamSynchronize((CUstream)(uintptr_t)0xbad0), CUDA_ERROR_INVALID_HANDLE);

    OK(cuEventDestroy(start));
    CHECK(cuEventQuery(start), CUDA_ERROR_INVALID_HANDLE);
    OK(cuStreamDestroy(s1));
    CHECK(cuStreamQuery(s1), CUDA_ERROR_INVALID_HANDLE);
    OK(cuStreamDestroy(s2));
    OK(cuCtxDestroy(ctx));
    printf("streams ok\n");
    return 0;
}
