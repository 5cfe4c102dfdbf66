/* fork() after cuInit: the child's calls fail cleanly, as with the NVIDIA
   driver, and the parent goes on unharmed. */
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check.h"

int main(void)
{
    CUcontext ctx;
    CUdeviceptr d, e;
    int v = 7, got = 0, status = 0;
    pid_t pid;

    OK(cuInit(0));
    OK(cuCtxCreate(&ctx, 0, 0));
    OK(cuMemAlloc(&d, sizeof v));
    OK(cuMemcpyHtoD(d, &v, sizeof v));
    fflush(NULL);
    pid = fork();
    EXPECT(pid >= 0);
    if (pid == 0) {
        int n = 0;
        const char *s = NULL;
        CHECK(cuMemAlloc(&e, 16), CUDA_ERROR_NOT_INITIALIZED);
        CHECK(cuMemcpyDtoH(&got, d, sizeof got), CUDA_ERROR_NOT_INITIALIZED);
        CHECK(cuInit(0), CUDA_ERROR_NOT_INITIALIZED);
        CHECK(cuDeviceGetCount(&n), CUDA_ERROR_NOT_INITIALIZED);
        OK(cuGetErrorName(CUDA_ERROR_NOT_INITIALIZED, &s)); /* local calls still work */
        _exit(0);
    }
    EXPECT(waitpid(pid, &status, 0) == pid);
    EXPECT(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    OK(cuMemcpyDtoH(&got, d, sizeof got));
    EXPECT(got == 7);
    OK(cuMemAlloc(&e, 16));
    OK(cuCtxDestroy(ctx));
    printf("fork ok\n");
    return 0;
}
