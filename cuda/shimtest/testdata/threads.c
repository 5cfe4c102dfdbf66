/* Two threads, each with its own context current, allocate, copy and
   launch at once. Usage: threads PTX_PATH */
#include <pthread.h>
#include <string.h>

#include "check.h"

#define N 65536
#define ROUNDS 20

static char *ptx;
static CUcontext shared;

static void *worker(void *arg)
{
    int id = (int)(intptr_t)arg, n = N;
    CUcontext ctx, cur;
    CUmodule mod;
    CUfunction vecadd;
    CUdeviceptr a, c;
    static __thread float h[N], out[N];

    if (id == 0) {
        OK(cuCtxCreate(&ctx, 0, 0));
    } else {
        ctx = shared;
        OK(cuCtxPushCurrent(ctx));
    }
    OK(cuCtxGetCurrent(&cur));
    EXPECT(cur == ctx);
    OK(cuModuleLoadData(&mod, ptx));
    OK(cuModuleGetFunction(&vecadd, mod, "vecadd"));
    OK(cuMemAlloc(&a, sizeof h));
    OK(cuMemAlloc(&c, sizeof h));
    for (int r = 0; r < ROUNDS; r++) {
        void *params[] = {&a, &a, &c, &n};
        for (int i = 0; i < N; i++)
            h[i] = (float)(i + r + 1000 * id);
        OK(cuMemcpyHtoD(a, h, sizeof h));
        OK(cuLaunchKernel(vecadd, N / 256, 1, 1, 256, 1, 1, 0, NULL, params, NULL));
        OK(cuMemcpyDtoH(out, c, sizeof out));
        for (int i = 0; i < N; i++)
            EXPECT(out[i] == 2.0f * h[i]);
    }
    OK(cuMemFree(a));
    OK(cuMemFree(c));
    if (id == 0) {
        OK(cuCtxDestroy(ctx));
    } else {
        OK(cuCtxPopCurrent(&cur));
        EXPECT(cur == ctx);
    }
    return NULL;
}

int main(int argc, char **argv)
{
    pthread_t t[2];
    CUcontext cur = (CUcontext)1;
    ptx = read_file(argc > 1 ? argv[1] : "kernels.ptx");
    OK(cuInit(0));
    OK(cuDevicePrimaryCtxRetain(&shared, 0));
    for (int i = 0; i < 2; i++)
        EXPECT(pthread_create(&t[i], NULL, worker, (void *)(intptr_t)i) == 0);
    for (int i = 0; i < 2; i++)
        EXPECT(pthread_join(t[i], NULL) == 0);
    /* The main thread never made a context current. */
    OK(cuCtxGetCurrent(&cur));
    EXPECT(cur == NULL);
    OK(cuDevicePrimaryCtxRelease(0));
    printf("threads ok\n");
    return 0;
}
