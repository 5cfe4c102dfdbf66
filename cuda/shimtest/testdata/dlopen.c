/* Loads the driver the way the CUDA runtime and the frameworks do: dlopen
   libcuda.so.1, take cuGetProcAddress with dlsym, and get every other entry
   point through it by base name and CUDA version. Then runs vecadd through
   those pointers. Usage: dlopen PTX_PATH */
#include <dlfcn.h>
#include <string.h>

#define CHECK_NO_LINK
#include "check.h"

typedef CUresult (*getproc_t)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);

static getproc_t getproc;

static void *entry(const char *name)
{
    void *fn = NULL;
    CUdriverProcAddressQueryResult status;
    CHECK(getproc(name, &fn, 12040, CU_GET_PROC_ADDRESS_DEFAULT, &status), CUDA_SUCCESS);
    EXPECT(fn != NULL && status == CU_GET_PROC_ADDRESS_SUCCESS);
    return fn;
}

#define N 4096

int main(int argc, char **argv)
{
    char *ptx = read_file(argc > 1 ? argv[1] : "kernels.ptx");
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    CUresult (*init)(unsigned int);
    CUresult (*ctxCreate)(CUcontext *, unsigned int, CUdevice);
    CUresult (*memAlloc)(CUdeviceptr *, size_t);
    CUresult (*htod)(CUdeviceptr, const void *, size_t);
    CUresult (*dtoh)(void *, CUdeviceptr, size_t);
    CUresult (*load)(CUmodule *, const void *);
    CUresult (*getFunction)(CUfunction *, CUmodule, const char *);
    CUresult (*launch)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                       void **, void **);
    CUcontext ctx;
    CUmodule mod;
    CUfunction f;
    CUdeviceptr a, c;
    float h[N], out[N];
    int n = N;

    EXPECT(lib != NULL);
    getproc = (getproc_t)dlsym(lib, "cuGetProcAddress_v2");
    EXPECT(getproc != NULL);
    *(void **)&init = entry("cuInit");
    *(void **)&ctxCreate = entry("cuCtxCreate");
    *(void **)&memAlloc = entry("cuMemAlloc");
    *(void **)&htod = entry("cuMemcpyHtoD");
    *(void **)&dtoh = entry("cuMemcpyDtoH");
    *(void **)&load = entry("cuModuleLoadData");
    *(void **)&getFunction = entry("cuModuleGetFunction");
    *(void **)&launch = entry("cuLaunchKernel");

    OK(init(0));
    OK(ctxCreate(&ctx, 0, 0));
    OK(load(&mod, ptx));
    OK(getFunction(&f, mod, "vecadd"));
    for (int i = 0; i < N; i++)
        h[i] = (float)i;
    OK(memAlloc(&a, sizeof h));
    OK(memAlloc(&c, sizeof h));
    OK(htod(a, h, sizeof h));
    {
        void *params[] = {&a, &a, &c, &n};
        OK(launch(f, N / 256, 1, 1, 256, 1, 1, 0, NULL, params, NULL));
    }
    OK(dtoh(out, c, sizeof out));
    for (int i = 0; i < N; i++)
        EXPECT(out[i] == 2.0f * (float)i);
    printf("dlopen ok\n");
    return 0;
}
