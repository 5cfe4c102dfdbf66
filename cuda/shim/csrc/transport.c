/*
 * gpupool's libcuda.so.1, the transport: the one connection to the lease's
 * CUDA server, its framing, the pipelining of calls on it, its loss, and
 * fork() (docs/remote-cuda.md). The calls that need more than a generated
 * stub are in calls.c; internal.h is what the two share.
 *
 * Rules this file keeps:
 *  - Every piece of process-wide state is in `st`, guarded by st.mu, or is
 *    a single word set once when the library loads (shim_trace).
 *  - One call is one request frame and one reply frame, in order, written
 *    and read under st.mu. A synchronous call writes its request and reads
 *    answers up to its own. An asynchronous one (async in cuda.api) only
 *    queues its request: its answer is read by a later call, and its
 *    failure becomes st.sticky, which every later call returns, as CUDA's
 *    sticky errors do. Copies stream in SHIM_COPY_CHUNK frames the same way.
 *  - fork(): pthread_atfork takes st.mu, then the calls' lock, around the
 *    fork, so the child never inherits one held mid-call. A child forked
 *    after the connection was made closes its copy and fails every call
 *    with CUDA_ERROR_NOT_INITIALIZED, as the NVIDIA driver does; the
 *    parent's connection is untouched.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <unistd.h>

#include "internal.h"

#define SHIM_MAGIC 0x55435047u
#define SHIM_HEADER 20 /* length word + cuda/wire.HeaderSize */
#define SHIM_MAX_PAYLOAD (SHIM_CHUNK + ((size_t)64 << 10))

/* Pipelining: how much may be in flight. The server sizes its queue of
   answers to these (agent/cudaserver), so a client that keeps to them never
   waits on a server that waits on it. */
#define SHIM_WINDOW 1024                          /* calls sent, not answered */
#define SHIM_REPLY_WINDOW ((size_t)8 << 20)       /* out-buffer bytes those answers carry */
#define SHIM_OUTBUF ((size_t)64 << 10)            /* requests batched into one write */
#define SHIM_DIRECT ((size_t)64 << 10)            /* in buffers from this size are not copied */

/* A call sent whose answer is not read yet. */
struct pending {
    uint32_t seq;
    uint16_t op;
    void *dst; /* where its out buffer goes, or NULL */
    size_t cap;
    struct shim_group *g; /* NULL: asynchronous work */
};

static struct {
    pthread_mutex_t mu;
    int fd;              /* guarded by mu; -1 when not connected */
    pid_t pid;           /* guarded by mu; the process that connected */
    int forked;          /* guarded by mu; this process is a child forked after connecting */
    CUresult sticky;     /* guarded by mu; a connection failure or an asynchronous call's, every later call returns */
    uint32_t seq;        /* guarded by mu */
    struct pending ring[SHIM_WINDOW]; /* guarded by mu; in the order sent */
    unsigned head, n;    /* guarded by mu; the oldest pending and how many */
    size_t expect;       /* guarded by mu; out-buffer bytes the pending answers carry */
    unsigned char out[SHIM_OUTBUF]; /* guarded by mu; requests not written yet */
    size_t outlen;       /* guarded by mu */
} st = {.mu = PTHREAD_MUTEX_INITIALIZER, .fd = -1, .sticky = CUDA_SUCCESS};

/* GPUPOOL_CUDA_TRACE=1 logs every remoted call and its result. Set once
   when the library loads, before any thread can call, and only read after. */
int shim_trace;

void shim_log(const char *fmt, ...)
{
    char buf[512];
    va_list ap;
    int n;
    va_start(ap, fmt);
    n = vsnprintf(buf, sizeof buf - 1, fmt, ap);
    va_end(ap);
    if (n < 0)
        return;
    if ((size_t)n > sizeof buf - 2)
        n = sizeof buf - 2;
    buf[n++] = '\n';
    if (write(2, "gpupool cuda: ", 14) < 0 || write(2, buf, (size_t)n) < 0)
        return;
}

/* --- fork */

static void atfork_prepare(void)
{
    pthread_mutex_lock(&st.mu);
    shim_calls_lock();
}

static void atfork_parent(void)
{
    shim_calls_unlock();
    pthread_mutex_unlock(&st.mu);
}

static void atfork_child(void)
{
    if (st.fd >= 0) {
        close(st.fd);
        st.fd = -1;
        st.forked = 1;
    }
    /* The parent's calls in flight are the parent's. */
    st.n = 0;
    st.expect = 0;
    st.outlen = 0;
    shim_calls_unlock();
    pthread_mutex_unlock(&st.mu);
}

__attribute__((constructor)) static void shim_load(void)
{
    const char *t = getenv("GPUPOOL_CUDA_TRACE");
    shim_trace = t && *t && strcmp(t, "0") != 0;
    pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
}

/* --- transport */

static int write_all(int fd, const void *p, size_t n)
{
    const char *c = p;
    while (n > 0) {
        ssize_t w = send(fd, c, n, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return -1;
        c += w;
        n -= (size_t)w;
    }
    return 0;
}

static int read_all(int fd, void *p, size_t n)
{
    char *c = p;
    while (n > 0) {
        ssize_t r = read(fd, c, n);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return -1;
        c += r;
        n -= (size_t)r;
    }
    return 0;
}

static const char *op_name(uint16_t op)
{
    return op < shim_op_count ? shim_op_names[op] : "?";
}

static const char *result_name(CUresult r)
{
    const struct shim_error *e = shim_error_of(r);
    return e ? e->name : "?";
}

/* The connection is gone: every later call fails the same way, and so do
   the calls in flight. */
static CUresult lostLocked(const char *why)
{
    if (st.fd >= 0) {
        close(st.fd);
        st.fd = -1;
    }
    if (st.sticky == CUDA_SUCCESS) {
        shim_log("the connection to the lease's GPU server is lost (%s): the lease may have ended; "
                 "every CUDA call now fails with CUDA_ERROR_DEVICE_UNAVAILABLE", why);
        st.sticky = CUDA_ERROR_DEVICE_UNAVAILABLE;
    }
    for (; st.n > 0; st.n--, st.head = (st.head + 1) % SHIM_WINDOW) {
        struct shim_group *g = st.ring[st.head].g;
        if (g) {
            g->outstanding--;
            if (g->err == CUDA_SUCCESS)
                g->err = st.sticky;
        }
    }
    st.expect = 0;
    st.outlen = 0;
    return st.sticky;
}

static CUresult flushLocked(void)
{
    if (st.outlen == 0)
        return CUDA_SUCCESS;
    if (write_all(st.fd, st.out, st.outlen) < 0)
        return lostLocked("write failed");
    st.outlen = 0;
    return CUDA_SUCCESS;
}

/* writeLocked stamps c's header with the next seq and writes it: a small
   request into st.out (written later, with others), a large one directly,
   its in buffer from the caller's memory. */
static CUresult writeLocked(struct shim_call *c, uint32_t *seq, int wait)
{
    unsigned char *frame = c->req;
    size_t total = c->len + c->extlen;
    *seq = ++st.seq;
    put_le32(frame, (uint32_t)(total - 4));
    frame[4] = (unsigned char)c->op;
    frame[5] = (unsigned char)(c->op >> 8);
    frame[6] = wait ? 2 : 0; /* cuda/wire.FlagWait: the answer is read at once */
    frame[7] = 0;
    put_le32(frame + 8, *seq);
    put_le64(frame + 12, (uint64_t)(uintptr_t)shim_current_ctx());
    if (c->extlen == 0 && total <= SHIM_OUTBUF / 4) {
        if (st.outlen + total > SHIM_OUTBUF && flushLocked() != CUDA_SUCCESS)
            return st.sticky;
        memcpy(st.out + st.outlen, frame, total);
        st.outlen += total;
        return CUDA_SUCCESS;
    }
    if (flushLocked() != CUDA_SUCCESS)
        return st.sticky;
    if (c->extlen == 0)
        return write_all(st.fd, frame, total) < 0 ? lostLocked("write failed") : CUDA_SUCCESS;
    {
        struct iovec iov[3] = {
            {frame, c->extat},
            {(void *)c->ext, c->extlen},
            {frame + c->extat, c->len - c->extat},
        };
        struct msghdr m = {.msg_iov = iov, .msg_iovlen = 3};
        while (m.msg_iovlen > 0) {
            ssize_t w = sendmsg(st.fd, &m, MSG_NOSIGNAL);
            if (w < 0 && errno == EINTR)
                continue;
            if (w <= 0)
                return lostLocked("write failed");
            while (m.msg_iovlen > 0 && (size_t)w >= m.msg_iov->iov_len) {
                w -= (ssize_t)m.msg_iov->iov_len;
                m.msg_iov++;
                m.msg_iovlen--;
            }
            if (m.msg_iovlen > 0) {
                m.msg_iov->iov_base = (char *)m.msg_iov->iov_base + w;
                m.msg_iov->iov_len -= (size_t)w;
            }
        }
    }
    return CUDA_SUCCESS;
}

/* readHeaderLocked reads an answer's header and checks it answers seq/op. */
static CUresult readHeaderLocked(uint32_t seq, uint16_t op, CUresult *res, size_t *plen)
{
    unsigned char h[SHIM_HEADER];
    uint32_t n;
    if (read_all(st.fd, h, sizeof h) < 0)
        return lostLocked("the server closed the connection");
    n = get_le32(h);
    if (n < SHIM_HEADER - 4 || n - (SHIM_HEADER - 4) > SHIM_MAX_PAYLOAD)
        return lostLocked("a reply frame with a bad length");
    if ((h[4] | h[5] << 8) != op || (h[6] & 1) == 0 || get_le32(h + 8) != seq)
        return lostLocked("a reply to another call");
    *plen = n - (SHIM_HEADER - 4);
    *res = (CUresult)(uint32_t)get_le64(h + 12);
    return CUDA_SUCCESS;
}

static CUresult discardLocked(size_t n)
{
    unsigned char buf[4096];
    while (n > 0) {
        size_t k = n < sizeof buf ? n : sizeof buf;
        if (read_all(st.fd, buf, k) < 0)
            return lostLocked("a truncated reply");
        n -= k;
    }
    return CUDA_SUCCESS;
}

/* drainOneLocked reads the oldest pending call's answer and delivers it:
   its out buffer straight into the caller's memory, its error to its
   group, or, for asynchronous work, to st.sticky. */
static CUresult drainOneLocked(void)
{
    struct pending p = st.ring[st.head];
    CUresult res = CUDA_SUCCESS;
    size_t plen = 0;
    if (readHeaderLocked(p.seq, p.op, &res, &plen) != CUDA_SUCCESS)
        return st.sticky;
    st.head = (st.head + 1) % SHIM_WINDOW;
    st.n--;
    st.expect -= p.cap;
    if (res == CUDA_SUCCESS && p.dst) {
        unsigned char lb[4];
        uint32_t n;
        if (plen < 4 || read_all(st.fd, lb, 4) < 0)
            return lostLocked("a truncated reply");
        n = get_le32(lb);
        if (n > p.cap || (size_t)n != plen - 4)
            return lostLocked("a reply whose buffer is not the size asked for");
        if (n && read_all(st.fd, p.dst, n) < 0)
            return lostLocked("a truncated reply");
    } else if (discardLocked(plen) != CUDA_SUCCESS) {
        return st.sticky;
    }
    if (shim_trace)
        shim_log("trace: %s answered -> %s (%d)", op_name(p.op), result_name(res), (int)res);
    if (p.g) {
        p.g->outstanding--;
        if (res != CUDA_SUCCESS && p.g->err == CUDA_SUCCESS)
            p.g->err = res;
    } else if (res != CUDA_SUCCESS && st.sticky == CUDA_SUCCESS) {
        shim_log("an asynchronous call, %s, failed with %s: as with CUDA's sticky errors, every later CUDA "
                 "call in this process returns it",
                 op_name(p.op), result_name(res));
        st.sticky = res;
    }
    return CUDA_SUCCESS;
}

/* drainLocked writes what is queued and reads answers until at most keep
   calls are in flight. */
static CUresult drainLocked(unsigned keep)
{
    if (st.n > keep && flushLocked() != CUDA_SUCCESS)
        return st.sticky;
    while (st.n > keep)
        if (drainOneLocked() != CUDA_SUCCESS)
            return st.sticky;
    return CUDA_SUCCESS;
}

/* exchangeLocked writes a synchronous call, reads the answers of every call
   before it, and reads its own reply into *payload (malloc'd). */
static CUresult exchangeLocked(struct shim_call *c, unsigned char **payload, size_t *plen)
{
    uint32_t seq;
    CUresult res = CUDA_SUCCESS;
    if (writeLocked(c, &seq, 1) != CUDA_SUCCESS || drainLocked(0) != CUDA_SUCCESS || flushLocked() != CUDA_SUCCESS)
        return st.sticky;
    if (readHeaderLocked(seq, c->op, &res, plen) != CUDA_SUCCESS)
        return st.sticky;
    *payload = malloc(*plen ? *plen : 1);
    if (!*payload)
        return lostLocked("out of memory for a reply");
    if (read_all(st.fd, *payload, *plen) < 0) {
        free(*payload);
        *payload = NULL;
        return lostLocked("a truncated reply");
    }
    return res;
}

static CUresult connectLocked(void)
{
    const char *path = getenv("GPUPOOL_CUDA_SOCKET");
    struct sockaddr_un addr;
    unsigned char hello[SHIM_HEADER + 12], *payload = NULL;
    struct shim_call hc;
    size_t plen = 0;
    CUresult r;
    uint32_t server = 0, server_hash = 0;

    if (!path || !*path) {
        shim_log("GPUPOOL_CUDA_SOCKET is not set: set it to the socket of the lease's CUDA proxy or "
                 "server (gpupool's docs/remote-cuda.md); no devices");
        return st.sticky = CUDA_ERROR_NO_DEVICE;
    }
    if (strlen(path) >= sizeof addr.sun_path) {
        shim_log("GPUPOOL_CUDA_SOCKET %s: longer than a unix socket path may be", path);
        return st.sticky = CUDA_ERROR_NO_DEVICE;
    }
    memset(&addr, 0, sizeof addr);
    addr.sun_family = AF_UNIX;
    memcpy(addr.sun_path, path, strlen(path));
    st.fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (st.fd < 0 || connect(st.fd, (struct sockaddr *)&addr, sizeof addr) < 0) {
        shim_log("cannot connect to GPUPOOL_CUDA_SOCKET %s: %s; no devices", path, strerror(errno));
        if (st.fd >= 0)
            close(st.fd);
        st.fd = -1;
        return st.sticky = CUDA_ERROR_NO_DEVICE;
    }
    st.pid = getpid();
    memset(&hc, 0, sizeof hc);
    put_le32(hello + SHIM_HEADER, SHIM_MAGIC);
    put_le32(hello + SHIM_HEADER + 4, GPUPOOL_CUDA_PROTOCOL);
    put_le32(hello + SHIM_HEADER + 8, GPUPOOL_CUDA_API_HASH);
    hc.op = 0;
    hc.req = hello;
    hc.len = sizeof hello;
    r = exchangeLocked(&hc, &payload, &plen);
    if (st.fd < 0) {
        free(payload);
        return st.sticky;
    }
    if (plen >= 8) {
        server = get_le32(payload);
        server_hash = get_le32(payload + 4);
    }
    if (r != CUDA_SUCCESS || server != GPUPOOL_CUDA_PROTOCOL || server_hash != GPUPOOL_CUDA_API_HASH) {
        shim_log("this libcuda.so.1 speaks gpupool CUDA protocol %d (API %08x) but the server speaks %u (API %08x): "
                 "use the libcuda.so.1 of the same gpupool release as the pool host",
                 GPUPOOL_CUDA_PROTOCOL, GPUPOOL_CUDA_API_HASH, server, server_hash);
        free(payload);
        close(st.fd);
        st.fd = -1;
        return st.sticky = CUDA_ERROR_SYSTEM_DRIVER_MISMATCH;
    }
    free(payload);
    return CUDA_SUCCESS;
}

/* readyLocked connects on first use and says whether calls may be made. */
static CUresult readyLocked(void)
{
    if (st.forked || (st.fd >= 0 && st.pid != getpid())) {
        st.forked = 1;
        return CUDA_ERROR_NOT_INITIALIZED;
    }
    if (st.sticky != CUDA_SUCCESS)
        return st.sticky;
    if (st.fd < 0)
        return connectLocked();
    return CUDA_SUCCESS;
}

CUresult shim_begin(struct shim_call *c, uint16_t op)
{
    CUresult r;
    memset(c, 0, sizeof *c);
    c->op = op;
    pthread_mutex_lock(&st.mu);
    r = readyLocked();
    pthread_mutex_unlock(&st.mu);
    if (r != CUDA_SUCCESS)
        return r;
    c->cap = 256;
    c->req = malloc(c->cap);
    if (!c->req)
        return CUDA_ERROR_OUT_OF_MEMORY;
    c->len = SHIM_HEADER;
    return CUDA_SUCCESS;
}

static unsigned char *put(struct shim_call *c, size_t n)
{
    if (c->oom)
        return NULL;
    if (c->len + n > c->cap) {
        size_t cap = c->cap * 2;
        unsigned char *p;
        while (cap < c->len + n)
            cap *= 2;
        p = realloc(c->req, cap);
        if (!p) {
            c->oom = 1;
            return NULL;
        }
        c->req = p;
        c->cap = cap;
    }
    c->len += n;
    return c->req + c->len - n;
}

void shim_put_u32(struct shim_call *c, uint32_t v)
{
    unsigned char *p = put(c, 4);
    if (p)
        put_le32(p, v);
}

void shim_put_u64(struct shim_call *c, uint64_t v)
{
    unsigned char *p = put(c, 8);
    if (p)
        put_le64(p, v);
}

void shim_put_f32(struct shim_call *c, float v)
{
    uint32_t u;
    memcpy(&u, &v, 4);
    shim_put_u32(c, u);
}

void shim_put_bytes(struct shim_call *c, const void *src, size_t n)
{
    unsigned char *p;
    if (n > SHIM_MAX_PAYLOAD) {
        c->oom = 1;
        return;
    }
    shim_put_u32(c, (uint32_t)n);
    if (n >= SHIM_DIRECT && !c->ext) {
        c->ext = src;
        c->extlen = n;
        c->extat = c->len;
        return;
    }
    p = put(c, n);
    if (p && n)
        memcpy(p, src, n);
}

void shim_put_str(struct shim_call *c, const char *s)
{
    shim_put_bytes(c, s, strlen(s));
}

/* The length of a module image: an ELF cubin's from its section headers, a
   fatbin's from its header, else PTX text up to its NUL (included). */
void shim_put_image(struct shim_call *c, const void *image)
{
    const unsigned char *p = image;
    size_t n;
    if (p[0] == 0x7f && p[1] == 'E' && p[2] == 'L' && p[3] == 'F' && p[4] == 2) {
        uint64_t shoff = get_le64(p + 0x28);
        unsigned shentsize = p[0x3a] | p[0x3b] << 8, shnum = p[0x3c] | p[0x3d] << 8;
        n = (size_t)(shoff + (uint64_t)shentsize * shnum);
    } else if (get_le32(p) == 0xba55ed50u) {
        n = (size_t)((p[6] | p[7] << 8) + get_le64(p + 8));
    } else {
        n = strlen(image) + 1;
    }
    shim_put_bytes(c, image, n);
}

CUresult shim_roundtrip(struct shim_call *c)
{
    CUresult r;
    if (c->oom)
        return CUDA_ERROR_INVALID_VALUE; /* a request larger than a frame may be */
    pthread_mutex_lock(&st.mu);
    r = readyLocked();
    if (r == CUDA_SUCCESS)
        r = exchangeLocked(c, &c->resp, &c->rlen);
    pthread_mutex_unlock(&st.mu);
    if (shim_trace)
        shim_log("trace: %s (%zu bytes) -> %s (%d)", op_name(c->op), c->len + c->extlen, result_name(r), (int)r);
    return r;
}

CUresult shim_send(struct shim_call *c, void *dst, size_t cap, struct shim_group *g)
{
    CUresult r;
    uint32_t seq;
    size_t len = c->len + c->extlen;
    if (c->oom) {
        shim_end(c, CUDA_SUCCESS);
        return CUDA_ERROR_INVALID_VALUE;
    }
    pthread_mutex_lock(&st.mu);
    r = readyLocked();
    /* Keep to the windows: the oldest answers are read first. */
    if (r == CUDA_SUCCESS && st.n == SHIM_WINDOW)
        r = drainLocked(SHIM_WINDOW / 2);
    while (r == CUDA_SUCCESS && st.n > 0 && st.expect + cap > SHIM_REPLY_WINDOW)
        r = drainLocked(st.n - 1);
    if (r == CUDA_SUCCESS)
        r = st.sticky; /* an answer just read may have failed */
    if (r == CUDA_SUCCESS && writeLocked(c, &seq, 0) != CUDA_SUCCESS)
        r = st.sticky;
    if (r == CUDA_SUCCESS) {
        struct pending *p = &st.ring[(st.head + st.n) % SHIM_WINDOW];
        p->seq = seq;
        p->op = c->op;
        p->dst = dst;
        p->cap = dst ? cap : 0;
        p->g = g;
        st.n++;
        st.expect += p->cap;
        if (g)
            g->outstanding++;
        /* A large frame went out directly: let it not wait behind the batch. */
        if (c->extlen)
            r = flushLocked();
    }
    pthread_mutex_unlock(&st.mu);
    if (shim_trace)
        shim_log("trace: %s (%zu bytes) -> sent, answered later", op_name(c->op), len);
    shim_end(c, CUDA_SUCCESS);
    return r;
}

CUresult shim_wait(struct shim_group *g, CUresult r)
{
    pthread_mutex_lock(&st.mu);
    if (g->outstanding > 0 && flushLocked() == CUDA_SUCCESS)
        while (g->outstanding > 0 && drainOneLocked() == CUDA_SUCCESS)
            ;
    pthread_mutex_unlock(&st.mu);
    return r != CUDA_SUCCESS ? r : g->err;
}

static const unsigned char *get(struct shim_call *c, size_t n)
{
    if (c->bad || !c->resp || c->rlen - c->roff < n) {
        c->bad = 1;
        return NULL;
    }
    c->roff += n;
    return c->resp + c->roff - n;
}

uint32_t shim_get_u32(struct shim_call *c)
{
    const unsigned char *p = get(c, 4);
    return p ? get_le32(p) : 0;
}

uint64_t shim_get_u64(struct shim_call *c)
{
    const unsigned char *p = get(c, 8);
    return p ? get_le64(p) : 0;
}

float shim_get_f32(struct shim_call *c)
{
    uint32_t u = shim_get_u32(c);
    float f;
    memcpy(&f, &u, 4);
    return f;
}

void shim_get_raw(struct shim_call *c, void *dst, size_t n)
{
    const unsigned char *p = get(c, n);
    if (p)
        memcpy(dst, p, n);
}

void shim_get_buf(struct shim_call *c, void *dst, size_t cap)
{
    uint32_t n = shim_get_u32(c);
    const unsigned char *p;
    if (n > cap) {
        c->bad = 1;
        return;
    }
    p = get(c, n);
    if (p && n)
        memcpy(dst, p, n);
}

CUresult shim_end(struct shim_call *c, CUresult r)
{
    if (r == CUDA_SUCCESS && (c->bad || c->roff != c->rlen)) {
        shim_log("a malformed reply to op %u", c->op);
        r = CUDA_ERROR_UNKNOWN;
    }
    free(c->req);
    free(c->resp);
    return r;
}

CUresult shim_ready(void)
{
    CUresult r;
    pthread_mutex_lock(&st.mu);
    r = readyLocked();
    if (r == CUDA_ERROR_NOT_INITIALIZED && st.forked) {
        static int logged;
        if (!__atomic_exchange_n(&logged, 1, __ATOMIC_RELAXED))
            shim_log("this process was forked after CUDA was initialised: the child cannot use CUDA "
                     "(as with the NVIDIA driver); exec a program, or initialise CUDA after fork()");
    }
    pthread_mutex_unlock(&st.mu);
    return r;
}
