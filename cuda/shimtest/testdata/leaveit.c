/* Creates a context and allocates, then exits without cleaning up: the
   server must free what the process left. */
#include "check.h"

int main(void)
{
    CUcontext ctx;
    CUdeviceptr d;
    OK(cuInit(0));
    OK(cuCtxCreate(&ctx, 0, 0));
    OK(cuMemAlloc(&d, 1 << 20));
    return 0;
}
