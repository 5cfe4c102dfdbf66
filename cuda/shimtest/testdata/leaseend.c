/* Holds memory until told (a line on stdin) that the lease has ended, then
   checks that the next call fails with CUDA_ERROR_DEVICE_UNAVAILABLE. */
#include "check.h"

int main(void)
{
    CUcontext ctx;
    CUdeviceptr d;
    char line[16];
    int n = 0;

    OK(cuInit(0));
    OK(cuCtxCreate(&ctx, 0, 0));
    OK(cuMemAlloc(&d, 1 << 20));
    printf("ready\n");
    fflush(stdout);
    if (!fgets(line, sizeof line, stdin))
        return 2;
    CHECK(cuMemAlloc(&d, 16), CUDA_ERROR_DEVICE_UNAVAILABLE);
    CHECK(cuDeviceGetCount(&n), CUDA_ERROR_DEVICE_UNAVAILABLE);
    printf("lease ended\n");
    return 0;
}
