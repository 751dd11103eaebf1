/*
 * The GPU group and its ranks' communicators (see cuda_comm.h): NCCL
 * loaded at run time, device collectives as an NCCL all-gather followed by
 * a sum in a fixed tree over rank ids on the rank's stream (graph-capturable: NCCL calls
 * are recorded into the step's graph like any kernel), host decisions
 * through the ranks-as-threads communicator, and a bounded stream wait
 * that ends every rank's collectives when one rank fails.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cuda/cuda_common.cuh"
#include "cuda/cuda_internal.h"
#include "cuda/cuda_ksum.cuh"

extern "C" {
#include "cuda/cuda_comm.h"
}

/* ------------------------------------------------------------ sums over ranks */

/* buf[i] = the sum over r of gathered[r * n + i] as cuda_ksum.cuh's
 * pairwise tree over rank ids (the top levels of TP 1's chunk tree, so a
 * row-parallel sum has TP 1's bits): fp32 for fp32 and bf16 values (bf16:
 * rounded once at the end), fp64 for fp64. */
__device__ __forceinline__ float sum_load(const float *p) { return *p; }
__device__ __forceinline__ double sum_load(const double *p) { return *p; }
__device__ __forceinline__ float sum_load(const uint16_t *p) { return m3_bf(*p); }
__device__ __forceinline__ void sum_store(float *p, float v) { *p = v; }
__device__ __forceinline__ void sum_store(double *p, double v) { *p = v; }
__device__ __forceinline__ void sum_store(uint16_t *p, float v) { *p = m3_to_bf(v); }

template <typename T>
__global__ void rank_sum_kernel(const T *__restrict__ gathered, int world, int64_t n,
                                T *__restrict__ buf) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        using F = decltype(sum_load(gathered));
        F s = ksum_tree<F>(world, [&](int r) { return sum_load(gathered + r * n + i); });
        sum_store(buf + i, s);
    }
}

#if M3_HAVE_NCCL
#include <nccl.h>

/* ------------------------------------------------------------ NCCL, loaded */

typedef struct nccl_api {
    bool loaded;
    char error[512];
    decltype(&ncclCommInitAll) comm_init_all;
    decltype(&ncclCommDestroy) comm_destroy;
    decltype(&ncclCommAbort) comm_abort;
    decltype(&ncclAllGather) all_gather;
    decltype(&ncclGetErrorString) error_string;
    decltype(&ncclGetVersion) get_version;
} nccl_api;

static nccl_api g_nccl;
static pthread_once_t g_nccl_once = PTHREAD_ONCE_INIT;

static void nccl_load(void) {
    const char *env = getenv("M3_NCCL_LIB");
    const char *names[] = {env && *env ? env : NULL, "libnccl.so.2", "libnccl.so"};
    void *lib = NULL;
    for (int i = 0; i < 3 && !lib; i++)
        if (names[i])
            lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        snprintf(g_nccl.error, sizeof g_nccl.error,
                 "NCCL could not be loaded (%s); set M3_NCCL_LIB to libnccl.so.2's path or add "
                 "its folder to LD_LIBRARY_PATH",
                 dlerror());
        return;
    }
#define NCCL_SYM(field, name)                                                               \
    if (!(g_nccl.field = (decltype(g_nccl.field))dlsym(lib, name))) {                       \
        snprintf(g_nccl.error, sizeof g_nccl.error, "NCCL has no symbol %s", name);         \
        return;                                                                             \
    }
    NCCL_SYM(comm_init_all, "ncclCommInitAll")
    NCCL_SYM(comm_destroy, "ncclCommDestroy")
    NCCL_SYM(comm_abort, "ncclCommAbort")
    NCCL_SYM(all_gather, "ncclAllGather")
    NCCL_SYM(error_string, "ncclGetErrorString")
    NCCL_SYM(get_version, "ncclGetVersion")
#undef NCCL_SYM
    g_nccl.loaded = true;
}

static m3_status nccl_ready(void) {
    pthread_once(&g_nccl_once, nccl_load);
    if (!g_nccl.loaded)
        return m3_fail(M3_ERR_UNSUPPORTED, "%s", g_nccl.error);
    return M3_OK;
}

static m3_status nccl_error(ncclResult_t r, const char *what) {
    return m3_fail(M3_ERR_DEVICE, "NCCL: %s failed: %s", what, g_nccl.error_string(r));
}

/* ------------------------------------------------------------ the group */

struct m3_gpu_group {
    int world;
    int devices[M3_MAX_TP];
    ncclComm_t comms[M3_MAX_TP]; /* NULL once aborted by its rank */
    int64_t timeout_ms;
    pthread_mutex_t lock;
    bool dead;                   /* a rank failed: every collective ends */
    int killer;                  /* the rank whose failure killed it */
    char why[512];
};

static bool group_dead(m3_gpu_group *g, char *why, size_t size, int *killer) {
    pthread_mutex_lock(&g->lock);
    bool dead = g->dead;
    if (dead && why)
        snprintf(why, size, "%s", g->why);
    if (killer)
        *killer = g->killer;
    pthread_mutex_unlock(&g->lock);
    return dead;
}

static void group_kill(m3_gpu_group *g, int rank, const char *why) {
    pthread_mutex_lock(&g->lock);
    if (!g->dead) {
        g->dead = true;
        g->killer = rank;
        snprintf(g->why, sizeof g->why, "%s", why);
    }
    pthread_mutex_unlock(&g->lock);
}

/* Abort rank r's NCCL communicator, from rank r's own thread: its pending
 * collectives end, so its stream drains. */
static void rank_abort_nccl(m3_gpu_group *g, int r) {
    pthread_mutex_lock(&g->lock);
    ncclComm_t c = g->comms[r];
    g->comms[r] = NULL;
    pthread_mutex_unlock(&g->lock);
    if (c)
        g_nccl.comm_abort(c);
}

extern "C" m3_status m3_gpu_group_create(const int *devices, int world, int64_t timeout_ms,
                                         m3_gpu_group **out) {
    *out = NULL;
    if (world < 2 || world > M3_MAX_TP)
        return m3_fail(M3_ERR_INVALID_ARG, "a GPU group of %d ranks (2 to %d)", world, M3_MAX_TP);
    int count = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess || count == 0)
        return m3_fail(M3_ERR_DEVICE, "no usable CUDA device: %s",
                       err != cudaSuccess ? cudaGetErrorString(err) : "none found");
    for (int r = 0; r < world; r++) {
        if (devices[r] < 0 || devices[r] >= count)
            return m3_fail(M3_ERR_INVALID_ARG, "TP rank %d would run on GPU %d, and this machine "
                           "has %d GPU%s (%d ranks need GPUs %d to %d)", r, devices[r], count,
                           count == 1 ? "" : "s", world, devices[0], devices[0] + world - 1);
        for (int q = 0; q < r; q++)
            if (devices[q] == devices[r])
                return m3_fail(M3_ERR_INVALID_ARG, "TP ranks %d and %d on the same GPU %d", q, r,
                               devices[r]);
    }
    M3_TRY(nccl_ready());
    setenv("NCCL_NVLS_ENABLE", "0", 0); /* never NVLink multicast (cuda_comm.h) */
    m3_gpu_group *g = (m3_gpu_group *)calloc(1, sizeof *g);
    if (!g)
        return m3_fail(M3_ERR_NO_MEMORY, "out of memory creating a GPU group");
    g->world = world;
    memcpy(g->devices, devices, (size_t)world * sizeof *devices);
    g->timeout_ms = timeout_ms > 0 ? timeout_ms : 60000;
    pthread_mutex_init(&g->lock, NULL);
    ncclResult_t r = g_nccl.comm_init_all(g->comms, world, g->devices);
    if (r != ncclSuccess) {
        m3_status st = nccl_error(r, "ncclCommInitAll");
        pthread_mutex_destroy(&g->lock);
        free(g);
        return st;
    }
    *out = g;
    return M3_OK;
}

extern "C" void m3_gpu_group_free(m3_gpu_group *g) {
    if (!g)
        return;
    for (int r = 0; r < g->world; r++)
        if (g->comms[r]) {
            cudaSetDevice(g->devices[r]);
            if (g->dead)
                g_nccl.comm_abort(g->comms[r]);
            else
                g_nccl.comm_destroy(g->comms[r]);
        }
    pthread_mutex_destroy(&g->lock);
    free(g);
}

extern "C" m3_status m3_gpu_group_enable_peers(m3_gpu_group *g) {
    for (int a = 0; a < g->world; a++) {
        M3_CUDA_TRY(cudaSetDevice(g->devices[a]));
        for (int b = 0; b < g->world; b++) {
            if (a == b)
                continue;
            int ok = 0;
            M3_CUDA_TRY(cudaDeviceCanAccessPeer(&ok, g->devices[a], g->devices[b]));
            if (!ok)
                return m3_fail(M3_ERR_UNSUPPORTED, "GPU %d cannot access GPU %d's memory (no "
                               "peer access between them)", g->devices[a], g->devices[b]);
            cudaError_t err = cudaDeviceEnablePeerAccess(g->devices[b], 0);
            if (err == cudaErrorPeerAccessAlreadyEnabled)
                cudaGetLastError();
            else if (err != cudaSuccess)
                return m3_cuda_error(err, "cudaDeviceEnablePeerAccess", __FILE__, __LINE__);
        }
    }
    return M3_OK;
}

/* ------------------------------------------------------------ a rank's comm */

typedef struct cuda_comm {
    m3_gpu_group *g;
    int rank;
    m3_backend *be;
    m3_comm *host;
} cuda_comm;

static cuda_comm *impl(m3_comm *c) { return (cuda_comm *)c->impl; }

/* A dead group's collective: this rank's NCCL ends too; the first
 * failure's message, as this rank's own when it was this rank's (so the
 * TP front reports it as the root cause). */
static m3_status dead_fail(cuda_comm *x) {
    char why[512];
    int killer = -1;
    group_dead(x->g, why, sizeof why, &killer);
    rank_abort_nccl(x->g, x->rank);
    if (killer == x->rank)
        return m3_fail(M3_ERR_FAULT, "%s (the GPU TP group is stopped: the engine must be "
                       "created again)", why);
    return m3_fail(M3_ERR_FAULT, "the GPU TP group was aborted (%s); the engine must be "
                   "created again", why);
}

static m3_status check_live(cuda_comm *x) {
    if (group_dead(x->g, NULL, 0, NULL))
        return dead_fail(x);
    return M3_OK;
}

/* The stream wait of a rank's backend: polls, so a peer's failure or the
 * timeout ends it (cudaStreamSynchronize would wait on a collective whose
 * peer never comes). */
static m3_status group_wait(m3_cuda *cu, void *arg) {
    cuda_comm *x = (cuda_comm *)arg;
    struct timespec t0, now;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long spins = 0;; spins++) {
        cudaError_t err = cudaStreamQuery(cu->stream);
        if (err == cudaSuccess)
            return M3_OK;
        if (err != cudaErrorNotReady) {
            m3_status st = m3_cuda_error(err, "a TP rank's step", __FILE__, __LINE__);
            group_kill(x->g, x->rank, m3_last_error());
            rank_abort_nccl(x->g, x->rank);
            return st;
        }
        if (group_dead(x->g, NULL, 0, NULL)) {
            m3_status st = dead_fail(x);
            cudaStreamSynchronize(cu->stream); /* its collectives have ended */
            return st;
        }
        clock_gettime(CLOCK_MONOTONIC, &now);
        double ms = (now.tv_sec - t0.tv_sec) * 1e3 + (now.tv_nsec - t0.tv_nsec) / 1e6;
        if (ms > (double)x->g->timeout_ms) {
            char why[160];
            snprintf(why, sizeof why, "TP rank %d's step did not finish within %lld ms", x->rank,
                     (long long)x->g->timeout_ms);
            group_kill(x->g, x->rank, why);
            return dead_fail(x);
        }
        if (spins > 2000) { /* past the first ~ms: yield the core */
            struct timespec nap = {0, 20000};
            nanosleep(&nap, NULL);
        }
    }
}

/* out [world * count] <- every rank's in [count], rank-major, on the rank's
 * stream; an NCCL failure kills the group. */
static m3_status rank_gather(cuda_comm *x, const void *in, void *out, size_t count,
                             ncclDataType_t type) {
    ncclResult_t r = g_nccl.all_gather(in, out, count, type, x->g->comms[x->rank],
                                       m3_cuda_of(x->be)->stream);
    if (r == ncclSuccess)
        return M3_OK;
    m3_status st = nccl_error(r, "ncclAllGather");
    group_kill(x->g, x->rank, m3_last_error());
    return st;
}

/* buf [n] <- the ranks' buf, gathered by NCCL into the workspace, then
 * summed as a tree over rank ids on the rank's stream. */
template <typename T>
static m3_status gather_sum(m3_comm *c, T *buf, int64_t n, ncclDataType_t type) {
    cuda_comm *x = impl(c);
    M3_TRY(check_live(x));
    if (n <= 0)
        return M3_OK;
    m3_cuda *cu = m3_cuda_of(x->be);
    void *ws;
    M3_TRY(m3_cuda_workspace(cu, M3_CUDA_WS_COMM, (size_t)x->g->world * n * sizeof(T), &ws));
    M3_TRY(rank_gather(x, buf, ws, (size_t)n, type));
    int64_t blocks = (n + 255) / 256;
    rank_sum_kernel<T><<<(unsigned)(blocks < 1024 ? blocks : 1024), 256, 0, cu->stream>>>(
        (const T *)ws, x->g->world, n, buf);
    M3_CUDA_LAUNCHED("rank_sum_kernel");
    return M3_OK;
}

static m3_status cc_sum_f32(m3_comm *c, float *buf, int64_t n) {
    return gather_sum(c, buf, n, ncclFloat32);
}
static m3_status cc_sum_f64(m3_comm *c, double *buf, int64_t n) {
    return gather_sum(c, buf, n, ncclFloat64);
}
static m3_status cc_sum_bf16(m3_comm *c, uint16_t *buf, int64_t n) {
    return gather_sum(c, buf, n, ncclBfloat16);
}

static m3_status cc_all_gather(m3_comm *c, const void *in, void *out, int64_t bytes) {
    cuda_comm *x = impl(c);
    M3_TRY(check_live(x));
    return bytes > 0 ? rank_gather(x, in, out, (size_t)bytes, ncclUint8) : M3_OK;
}

/* Host decisions through the threads communicator; a dead group (or a
 * failed agreement) ends this rank's NCCL, so nothing it launched hangs. */
static m3_status cc_agree_min(m3_comm *c, int64_t local, int64_t *global) {
    cuda_comm *x = impl(c);
    m3_status st = x->host->ops->agree_min(x->host, local, global);
    if (st) {
        group_kill(x->g, x->rank, m3_last_error());
        rank_abort_nccl(x->g, x->rank);
        return st;
    }
    if (group_dead(x->g, NULL, 0, NULL)) {
        *global = INT64_MIN; /* a dead group agrees on nothing */
        rank_abort_nccl(x->g, x->rank);
    }
    return M3_OK;
}

static void cc_abort(m3_comm *c, const char *msg) {
    cuda_comm *x = impl(c);
    char why[400];
    snprintf(why, sizeof why, "TP rank %d: %s", x->rank, msg ? msg : "aborted");
    group_kill(x->g, x->rank, why);
    x->host->ops->abort(x->host, msg);
    rank_abort_nccl(x->g, x->rank);
}

static void cc_destroy(m3_comm *c) {
    cuda_comm *x = impl(c);
    if (x) {
        m3_cuda *cu = m3_cuda_of(x->be);
        if (cu->wait_arg == x) {
            cu->wait = NULL;
            cu->wait_arg = NULL;
        }
    }
    free(x);
    free(c);
}

static const m3_comm_ops cuda_comm_ops = {cc_sum_f32, cc_sum_f64,  cc_sum_bf16, cc_all_gather,
                                          cc_agree_min, cc_abort, cc_destroy};

extern "C" m3_status m3_cuda_comm_create(m3_gpu_group *g, int rank, m3_backend *be,
                                         m3_comm *host, m3_comm **out) {
    *out = NULL;
    if (!g || !be || !host || rank < 0 || rank >= g->world || strcmp(be->ops->name, "cuda"))
        return m3_fail(M3_ERR_INVALID_ARG, "a GPU TP rank needs its group, a CUDA backend and "
                       "a host communicator (rank %d)", rank);
    if (m3_cuda_of(be)->device != g->devices[rank])
        return m3_fail(M3_ERR_INVALID_ARG, "TP rank %d's backend is on GPU %d, its group slot "
                       "on GPU %d", rank, m3_cuda_of(be)->device, g->devices[rank]);
    m3_comm *c = (m3_comm *)calloc(1, sizeof *c);
    cuda_comm *x = (cuda_comm *)calloc(1, sizeof *x);
    if (!c || !x) {
        free(c);
        free(x);
        return m3_fail(M3_ERR_NO_MEMORY, "out of memory creating a GPU communicator");
    }
    *x = (cuda_comm){g, rank, be, host};
    *c = (m3_comm){&cuda_comm_ops, rank, g->world, x};
    m3_cuda *cu = m3_cuda_of(be);
    cu->wait = group_wait;
    cu->wait_arg = x;
    *out = c;
    return M3_OK;
}

#else /* no NCCL header at build time */

#define NO_NCCL_MSG                                                                          \
    "this build of m3 has no NCCL (nccl.h was not found when it was built), so tensor "    \
    "parallelism over GPUs is off; build where NCCL's header is installed"

extern "C" m3_status m3_gpu_group_create(const int *devices, int world, int64_t timeout_ms,
                                         m3_gpu_group **out) {
    *out = NULL;
    return m3_fail(M3_ERR_UNSUPPORTED, NO_NCCL_MSG);
}
extern "C" void m3_gpu_group_free(m3_gpu_group *g) {}
extern "C" m3_status m3_gpu_group_enable_peers(m3_gpu_group *g) {
    return m3_fail(M3_ERR_UNSUPPORTED, NO_NCCL_MSG);
}
extern "C" m3_status m3_cuda_comm_create(m3_gpu_group *g, int rank, m3_backend *be,
                                         m3_comm *host, m3_comm **out) {
    *out = NULL;
    return m3_fail(M3_ERR_UNSUPPORTED, NO_NCCL_MSG);
}

#endif
