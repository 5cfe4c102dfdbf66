/* Pipelining: asynchronous calls are sent without waiting for their
   answers, keep their order on a stream, and a failed one's error is
   returned by the next synchronising call and by every later call, never
   a later success.
   Usage: pipeline PTX_PATH */
#include "check.h"

#define N 4096
#define LAUNCHES 5000 /* more than the shim keeps in flight */

int main(int argc, char **argv)
{
    char *ptx = read_file(argc > 1 ? argv[1] : "kernels.ptx");
    CUdevice dev;
    CUcontext ctx;
    CUmodule mod;
    CUfunction saxpy;
    CUstream s;
    CUevent ev;
    CUdeviceptr x, y;
    float *h = malloc(N * sizeof(float)), one = 1.0f;
    int n = N, failed = 0;
    void *params[] = {&one, &x, &y, &n};
    CUresult r;

    EXPECT(h);
    OK(cuInit(0));
    OK(cuDeviceGet(&dev, 0));
    OK(cuCtxCreate(&ctx, 0, dev));
    OK(cuModuleLoadData(&mod, ptx));
    OK(cuModuleGetFunction(&saxpy, mod, "saxpy"));
    OK(cuStreamCreate(&s, 0));
    OK(cuEventCreate(&ev, 0));
    OK(cuMemAlloc(&x, N * sizeof(float)));
    OK(cuMemAlloc(&y, N * sizeof(float)));

    /* In order on the stream: x = 1, y = 0, then y += x LAUNCHES times,
       then y back to the host, all without a wait until the stream's. */
    OK(cuMemsetD32Async(x, 0x3f800000u, N, s));
    OK(cuMemsetD32Async(y, 0, N, s));
    for (int i = 0; i < LAUNCHES; i++)
        OK(cuLaunchKernel(saxpy, N / 256, 1, 1, 256, 1, 1, 0, s, params, NULL));
    OK(cuEventRecord(ev, s));
    OK(cuMemcpyDtoHAsync(h, y, N * sizeof(float), s));
    OK(cuStreamSynchronize(s));
    for (int i = 0; i < N; i++)
        EXPECT(h[i] == (float)LAUNCHES);
    OK(cuEventQuery(ev));

    /* What the driver refuses at once is refused before it is sent, and
       sticks to nothing. */
    CHECK(cuLaunchKernel(saxpy, 1, 1, 1, 2048, 1, 1, 0, s, params, NULL), CUDA_ERROR_INVALID_VALUE);
    CHECK(cuLaunchKernel(saxpy, 0, 1, 1, 256, 1, 1, 0, s, params, NULL), CUDA_ERROR_INVALID_VALUE);
    OK(cuStreamSynchronize(s));

    /* A failed asynchronous call: its answer is not waited for, so it may
       return success; from the moment its error is known, every call
       returns it. */
    r = cuEventRecord((CUevent)(uintptr_t)0xbad0, s);
    EXPECT(r == CUDA_SUCCESS || r == CUDA_ERROR_INVALID_HANDLE);
    failed = r != CUDA_SUCCESS;
    for (int i = 0; i < LAUNCHES; i++) {
        r = cuLaunchKernel(saxpy, N / 256, 1, 1, 256, 1, 1, 0, s, params, NULL);
        EXPECT(r == CUDA_SUCCESS || r == CUDA_ERROR_INVALID_HANDLE);
        EXPECT(!(failed && r == CUDA_SUCCESS));
        failed |= r != CUDA_SUCCESS;
    }
    EXPECT(failed); /* the window filled, so the shim read the failure */
    CHECK(cuStreamSynchronize(s), CUDA_ERROR_INVALID_HANDLE);
    CHECK(cuMemcpyDtoH(h, y, N * sizeof(float)), CUDA_ERROR_INVALID_HANDLE);
    CHECK(cuMemsetD8Async(x, 0, 1, s), CUDA_ERROR_INVALID_HANDLE);
    CHECK(cuCtxSynchronize(), CUDA_ERROR_INVALID_HANDLE);
    printf("pipeline ok\n");
    return 0;
}
