/*
 * vecadd: adds two vectors on the GPU with the CUDA driver API, and shows
 * the device it ran on. Under `gpupool attach` the device is the lease's
 * remote GPU (or slice of one): the sums are computed on the pool host.
 *
 *   make examples
 *   bin/gpupool attach --memory 8GiB --compute 25 -- bin/examples/vecadd
 *
 * It builds with gpupool's cuda.h (cuda/shim/csrc) or NVIDIA's, and links
 * with -lcuda.
 */
#include <stdio.h>
#include <stdlib.h>

#include "cuda.h"

#define N (1 << 20)

/* One thread per element: c[i] = a[i] + b[i] for i < n. */
static const char ptx[] =
    ".version 7.0\n"
    ".target sm_70\n"
    ".address_size 64\n"
    ".visible .entry vecadd(.param .u64 vecadd_a, .param .u64 vecadd_b, .param .u64 vecadd_c, .param .u32 vecadd_n)\n"
    "{\n"
    "  .reg .pred %p<2>; .reg .b32 %r<6>; .reg .f32 %f<4>; .reg .b64 %rd<11>;\n"
    "  ld.param.u64 %rd1, [vecadd_a]; ld.param.u64 %rd2, [vecadd_b]; ld.param.u64 %rd3, [vecadd_c];\n"
    "  ld.param.u32 %r2, [vecadd_n];\n"
    "  mov.u32 %r3, %ctaid.x; mov.u32 %r4, %ntid.x; mov.u32 %r5, %tid.x;\n"
    "  mad.lo.s32 %r1, %r3, %r4, %r5;\n"
    "  setp.ge.s32 %p1, %r1, %r2;\n"
    "  @%p1 bra DONE;\n"
    "  cvta.to.global.u64 %rd4, %rd1; cvta.to.global.u64 %rd5, %rd2; cvta.to.global.u64 %rd6, %rd3;\n"
    "  mul.wide.s32 %rd7, %r1, 4;\n"
    "  add.s64 %rd8, %rd4, %rd7; add.s64 %rd9, %rd5, %rd7; add.s64 %rd10, %rd6, %rd7;\n"
    "  ld.global.f32 %f1, [%rd8]; ld.global.f32 %f2, [%rd9];\n"
    "  add.f32 %f3, %f1, %f2;\n"
    "  st.global.f32 [%rd10], %f3;\n"
    "DONE:\n"
    "  ret;\n"
    "}\n";

#define TRY(call)                                                                                      \
    do {                                                                                               \
        CUresult r_ = (call);                                                                          \
        if (r_ != CUDA_SUCCESS) {                                                                      \
            const char *name_ = "?", *text_ = "?";                                                     \
            cuGetErrorName(r_, &name_);                                                                \
            cuGetErrorString(r_, &text_);                                                              \
            fprintf(stderr, "vecadd: %s: %s (%s)\n", #call, name_, text_);                             \
            return 1;                                                                                  \
        }                                                                                              \
    } while (0)

int main(void)
{
    CUdevice dev;
    CUcontext ctx;
    CUmodule mod;
    CUfunction fn;
    CUdeviceptr a, b, c;
    char name[256];
    size_t total = 0;
    int count = 0, n = N, wrong = 0;
    float *ha = malloc(N * sizeof(float)), *hb = malloc(N * sizeof(float)), *hc = malloc(N * sizeof(float));

    if (!ha || !hb || !hc)
        return 1;
    TRY(cuInit(0));
    TRY(cuDeviceGetCount(&count));
    TRY(cuDeviceGet(&dev, 0));
    TRY(cuDeviceGetName(name, sizeof name, dev));
    TRY(cuDeviceTotalMem(&total, dev));
    printf("%d device(s); device 0: %s, %zu MiB\n", count, name, total >> 20);

    TRY(cuCtxCreate(&ctx, 0, dev));
    TRY(cuModuleLoadData(&mod, ptx));
    TRY(cuModuleGetFunction(&fn, mod, "vecadd"));
    for (int i = 0; i < N; i++) {
        ha[i] = (float)i;
        hb[i] = (float)(2 * i);
    }
    TRY(cuMemAlloc(&a, N * sizeof(float)));
    TRY(cuMemAlloc(&b, N * sizeof(float)));
    TRY(cuMemAlloc(&c, N * sizeof(float)));
    TRY(cuMemcpyHtoD(a, ha, N * sizeof(float)));
    TRY(cuMemcpyHtoD(b, hb, N * sizeof(float)));
    {
        void *params[] = {&a, &b, &c, &n};
        TRY(cuLaunchKernel(fn, N / 256, 1, 1, 256, 1, 1, 0, NULL, params, NULL));
    }
    TRY(cuCtxSynchronize());
    TRY(cuMemcpyDtoH(hc, c, N * sizeof(float)));
    for (int i = 0; i < N; i++)
        wrong += hc[i] != ha[i] + hb[i];
    printf("c[1] = %.0f, c[1000] = %.0f, c[%d] = %.0f\n", hc[1], hc[1000], N - 1, hc[N - 1]);
    printf("%d of %d sums right\n", N - wrong, N);
    TRY(cuMemFree(a));
    TRY(cuMemFree(b));
    TRY(cuMemFree(c));
    TRY(cuModuleUnload(mod));
    TRY(cuCtxDestroy(ctx));
    return wrong != 0;
}
