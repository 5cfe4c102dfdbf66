/* The CUDA side of 'gpupool-bench cuda': a driver-API program run through
   gpupool's shim (libcuda.so.1). Each mode prints one line of numbers the
   benchmark reads; times are CLOCK_MONOTONIC nanoseconds.

   cudabench null N               N synchronising calls that do nothing
                                  (cuCtxSynchronize): "null P50 P99 MEAN"
   cudabench launch PTX K         K pipelined launches of a one-thread
                                  kernel, then one synchronisation:
                                  "launch K NS"
   cudabench copy SIZE REPS       REPS synchronous copies of SIZE bytes each
                                  way, from pageable memory: "copy SIZE REPS
                                  HTOD_NS DTOH_NS"
   cudabench release              "ready", then synchronising calls until
                                  one fails: "failed T RESULT" (T the
                                  monotonic clock then) */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cuda.h"

static uint64_t now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void must(CUresult r, const char *what)
{
    if (r != CUDA_SUCCESS) {
        const char *n = "?";
        cuGetErrorName(r, &n);
        fprintf(stderr, "cudabench: %s: %s (%d)\n", what, n, (int)r);
        exit(1);
    }
}

static int cmp(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static char *slurp(const char *path)
{
    FILE *f = fopen(path, "rb");
    long n;
    char *b;
    if (!f || fseek(f, 0, SEEK_END) != 0 || (n = ftell(f)) < 0 || fseek(f, 0, SEEK_SET) != 0) {
        fprintf(stderr, "cudabench: %s: cannot read\n", path);
        exit(1);
    }
    b = calloc(1, (size_t)n + 1);
    if (!b || fread(b, 1, (size_t)n, f) != (size_t)n) {
        fprintf(stderr, "cudabench: %s: cannot read\n", path);
        exit(1);
    }
    fclose(f);
    return b;
}

int main(int argc, char **argv)
{
    CUdevice dev;
    CUcontext ctx;
    if (argc < 2) {
        fprintf(stderr, "usage: cudabench null N | launch PTX K | copy SIZE REPS | release\n");
        return 2;
    }
    must(cuInit(0), "cuInit");
    must(cuDeviceGet(&dev, 0), "cuDeviceGet");
    must(cuCtxCreate(&ctx, 0, dev), "cuCtxCreate");

    if (strcmp(argv[1], "null") == 0 && argc == 3) {
        int n = atoi(argv[2]);
        uint64_t *t = calloc((size_t)n, sizeof *t), sum = 0;
        for (int i = 0; i < 200; i++)
            must(cuCtxSynchronize(), "cuCtxSynchronize");
        for (int i = 0; i < n; i++) {
            uint64_t s = now();
            must(cuCtxSynchronize(), "cuCtxSynchronize");
            t[i] = now() - s;
            sum += t[i];
        }
        qsort(t, (size_t)n, sizeof *t, cmp);
        printf("null %llu %llu %llu\n", (unsigned long long)t[n / 2], (unsigned long long)t[(size_t)n * 99 / 100],
               (unsigned long long)(sum / (uint64_t)n));
    } else if (strcmp(argv[1], "launch") == 0 && argc == 4) {
        char *ptx = slurp(argv[2]);
        int k = atoi(argv[3]), one = 1;
        float a = 1.0f;
        CUmodule mod;
        CUfunction f;
        CUdeviceptr x, y;
        void *params[] = {&a, &x, &y, &one};
        uint64_t s;
        must(cuModuleLoadData(&mod, ptx), "cuModuleLoadData");
        must(cuModuleGetFunction(&f, mod, "saxpy"), "cuModuleGetFunction");
        must(cuMemAlloc(&x, 4), "cuMemAlloc");
        must(cuMemAlloc(&y, 4), "cuMemAlloc");
        for (int i = 0; i < 2000; i++)
            must(cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, NULL, params, NULL), "cuLaunchKernel");
        must(cuCtxSynchronize(), "cuCtxSynchronize");
        s = now();
        for (int i = 0; i < k; i++)
            must(cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, NULL, params, NULL), "cuLaunchKernel");
        must(cuCtxSynchronize(), "cuCtxSynchronize");
        printf("launch %d %llu\n", k, (unsigned long long)(now() - s));
    } else if (strcmp(argv[1], "copy") == 0 && argc == 4) {
        size_t size = strtoull(argv[2], NULL, 10);
        int reps = atoi(argv[3]);
        unsigned char *h = malloc(size);
        CUdeviceptr d;
        uint64_t s, up, down;
        if (!h) {
            fprintf(stderr, "cudabench: no memory for %zu bytes\n", size);
            return 1;
        }
        for (size_t i = 0; i < size; i++)
            h[i] = (unsigned char)(i * 7);
        must(cuMemAlloc(&d, size), "cuMemAlloc");
        must(cuMemcpyHtoD(d, h, size), "cuMemcpyHtoD");
        must(cuMemcpyDtoH(h, d, size), "cuMemcpyDtoH");
        s = now();
        for (int i = 0; i < reps; i++)
            must(cuMemcpyHtoD(d, h, size), "cuMemcpyHtoD");
        up = now() - s;
        s = now();
        for (int i = 0; i < reps; i++)
            must(cuMemcpyDtoH(h, d, size), "cuMemcpyDtoH");
        down = now() - s;
        for (size_t i = 0; i < size; i += 4093)
            if (h[i] != (unsigned char)(i * 7)) {
                fprintf(stderr, "cudabench: byte %zu came back wrong\n", i);
                return 1;
            }
        printf("copy %zu %d %llu %llu\n", size, reps, (unsigned long long)up, (unsigned long long)down);
    } else if (strcmp(argv[1], "release") == 0 && argc == 2) {
        CUresult r;
        printf("ready\n");
        fflush(stdout);
        while ((r = cuCtxSynchronize()) == CUDA_SUCCESS)
            ;
        printf("failed %llu %d\n", (unsigned long long)now(), (int)r);
    } else {
        fprintf(stderr, "cudabench: bad arguments\n");
        return 2;
    }
    fflush(stdout);
    return 0;
}
