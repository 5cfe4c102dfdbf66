/* Test helpers: every call's result is checked against the code the test
   expects, and a mismatch names the call, the code and the line. */
#ifndef GPUPOOL_TEST_CHECK_H
#define GPUPOOL_TEST_CHECK_H
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>

#include "cuda.h"

/* Programs that load the driver with dlopen define CHECK_NO_LINK: they
   cannot name a code with cuGetErrorName, so they print its number. */
#ifdef CHECK_NO_LINK
static inline const char *errname(CUresult r)
{
    (void)r;
    return "see the number";
}
#else
static inline const char *errname(CUresult r)
{
    const char *n = NULL;
    if (cuGetErrorName(r, &n) != CUDA_SUCCESS || !n)
        return "?";
    return n;
}
#endif

#define CHECK(call, want)                                                                                   \
    do {                                                                                                    \
        CUresult r_ = (call);                                                                               \
        if (r_ != (want)) {                                                                                 \
            fprintf(stderr, "%s:%d: %s = %d (%s), want %s\n", __FILE__, __LINE__, #call, (int)r_, errname(r_), \
                    #want);                                                                                 \
            exit(1);                                                                                        \
        }                                                                                                   \
    } while (0)

#define OK(call) CHECK(call, CUDA_SUCCESS)

#define EXPECT(cond)                                                                                        \
    do {                                                                                                    \
        if (!(cond)) {                                                                                      \
            fprintf(stderr, "%s:%d: want %s\n", __FILE__, __LINE__, #cond);                                 \
            exit(1);                                                                                        \
        }                                                                                                   \
    } while (0)

/* read_file returns the NUL-terminated contents of path. */
static inline char *read_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    long n;
    char *buf;
    if (!f || fseek(f, 0, SEEK_END) != 0 || (n = ftell(f)) < 0 || fseek(f, 0, SEEK_SET) != 0) {
        perror(path);
        exit(1);
    }
    buf = calloc(1, (size_t)n + 1);
    if (!buf || fread(buf, 1, (size_t)n, f) != (size_t)n) {
        perror(path);
        exit(1);
    }
    fclose(f);
    return buf;
}
#endif
