/* Internal interface between the shim's transport (transport.c) and its
   hand-written calls (calls.c). Nothing here is exported; shim.h is what
   both share with the generated stubs (stubs_gen.c). */
#ifndef GPUPOOL_SHIM_INTERNAL_H
#define GPUPOOL_SHIM_INTERNAL_H

#include <stdint.h>

#include "shim.h"

/* Set once when the library loads (GPUPOOL_CUDA_TRACE), only read after:
   log every remoted call and its result. */
extern int shim_trace;

/* Writes "gpupool cuda: " and the message, and a newline, to stderr in one
   go; safe from any thread, takes no lock. */
void shim_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* Connects to the lease's server unless connected. It returns
   CUDA_SUCCESS once calls can be made, the sticky error once the
   connection is lost, and CUDA_ERROR_NOT_INITIALIZED in a child forked
   after the connection was made (logged once). */
CUresult shim_ready(void);

/* Provided by calls.c for the transport. */

/* The calling thread's current context, which every request carries. */
CUcontext shim_current_ctx(void);
/* Take and release the calls' lock; the fork handlers take it after the
   transport's, and nothing else takes the transport's while holding it. */
void shim_calls_lock(void);
void shim_calls_unlock(void);

/* Little-endian words, as on the wire. */
static inline void put_le32(unsigned char *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}

static inline void put_le64(unsigned char *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}

static inline uint32_t get_le32(const unsigned char *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static inline uint64_t get_le64(const unsigned char *p)
{
    return (uint64_t)get_le32(p) | (uint64_t)get_le32(p + 4) << 32;
}

#endif
