/*
 * The CUDA backend's entry point in a build without CUDA (no nvcc at build
 * time): a clear refusal instead of a link error.
 */
#include "backend/backend.h"
#include "core/status.h"

#ifndef M3_HAVE_CUDA
#include "cuda/cuda_bench.h"
#include "cuda/cuda_comm.h"
#include "cuda/cuda_cp.h"
#include "cuda/cuda_mono.h"

#define NO_CUDA_MSG                                                                        \
    "this build of m3 has no CUDA backend (nvcc was not found when it was built); use " \
    "--device cpu"

m3_status m3_cuda_backend_create(int device, m3_backend **out) {
    *out = NULL;
    return m3_fail(M3_ERR_UNSUPPORTED, NO_CUDA_MSG);
}

m3_status m3_cuda_check_config(const m3_config *cfg) {
    (void)cfg;
    return M3_OK;
}

m3_status m3_cuda_read_bandwidth(m3_backend *be, size_t bytes, int iters, double *gb_per_s) {
    return m3_fail(M3_ERR_UNSUPPORTED, NO_CUDA_MSG);
}

m3_status m3_cuda_read_time(m3_backend *be, size_t bytes, int iters, double *us) {
    return m3_fail(M3_ERR_UNSUPPORTED, NO_CUDA_MSG);
}

m3_status m3_cuda_timed_launch(m3_backend *be, void *graph, double *us) {
    return m3_fail(M3_ERR_UNSUPPORTED, NO_CUDA_MSG);
}

m3_status m3_cuda_fill_random_bf16(m3_backend *be, void *dst, size_t n, uint64_t seed,
                                   float scale) {
    return m3_fail(M3_ERR_UNSUPPORTED, NO_CUDA_MSG);
}

m3_status m3_cuda_moe_unique_experts(m3_backend *be, int *n) {
    return m3_fail(M3_ERR_UNSUPPORTED, NO_CUDA_MSG);
}

m3_status m3_cuda_bench_linear(m3_backend *be, int rows, int64_t n, int64_t k, int iters,
                               double *gemv_us, double *cublas_us, double *one_gemm_us) {
    return m3_fail(M3_ERR_UNSUPPORTED, NO_CUDA_MSG);
}

/* the mono path's CUDA executor (cuda/cuda_mono.h); m3_mono_fault_name is
 * in mono/fault.c, built either way */
m3_status m3_cuda_mono_create(m3_backend *be, const m3_config *cfg, int max_blocks, int tp_rank,
                              int tp_size, m3_cuda_mono **out) {
    *out = NULL;
    return m3_fail(M3_ERR_UNSUPPORTED, NO_CUDA_MSG);
}

void m3_cuda_mono_free(m3_cuda_mono *m) {}

void *m3_cuda_mono_landing(m3_cuda_mono *m) { return NULL; }

m3_status m3_cuda_mono_set_peers(m3_cuda_mono *m, void *const *landings,
                                 int32_t *const *faults, int world) {
    return m3_fail(M3_ERR_UNSUPPORTED, NO_CUDA_MSG);
}

m3_status m3_cuda_mono_abort_all(m3_cuda_mono *m) {
    return m3_fail(M3_ERR_UNSUPPORTED, NO_CUDA_MSG);
}

m3_status m3_cuda_mono_layer(m3_cuda_mono *m, const m3_step *st, int layer,
                             const m3_layer_weights *lw, const m3_cache_layer *cl, bool first,
                             uint32_t epoch, uint16_t *hidden, uint16_t *residual) {
    return m3_fail(M3_ERR_UNSUPPORTED, NO_CUDA_MSG);
}

int32_t *m3_cuda_mono_fault_word(m3_cuda_mono *m) { return NULL; }

m3_status m3_cuda_mono_check_fault(m3_cuda_mono *m) {
    return m3_fail(M3_ERR_UNSUPPORTED, NO_CUDA_MSG);
}

m3_status m3_cuda_mono_set_fault(m3_cuda_mono *m, int code, int layer) {
    return m3_fail(M3_ERR_UNSUPPORTED, NO_CUDA_MSG);
}

m3_status m3_cuda_mono_read_fault(m3_cuda_mono *m, int32_t out[4]) {
    return m3_fail(M3_ERR_UNSUPPORTED, NO_CUDA_MSG);
}

m3_status m3_cuda_mono_clear_fault(m3_cuda_mono *m) {
    return m3_fail(M3_ERR_UNSUPPORTED, NO_CUDA_MSG);
}

m3_status m3_cuda_mono_trace_start(m3_cuda_mono *m) {
    return m3_fail(M3_ERR_UNSUPPORTED, NO_CUDA_MSG);
}

m3_status m3_cuda_mono_trace_write(m3_cuda_mono *m, const char *path) {
    return m3_fail(M3_ERR_UNSUPPORTED, NO_CUDA_MSG);
}

m3_status m3_cuda_cp_check(const m3_cuda_cp_inputs *in, int64_t max_seq_len, int rank, int world,
                           const m3_select_params *p) {
    return m3_fail(M3_ERR_UNSUPPORTED, NO_CUDA_MSG);
}

m3_status m3_cuda_cp_scores(m3_backend *be, const m3_cuda_cp_inputs *in, int64_t max_seq_len,
                            int rank, int world, float scale, float *out, int *err) {
    return m3_fail(M3_ERR_UNSUPPORTED, NO_CUDA_MSG);
}

m3_status m3_cuda_cp_local_topk(m3_backend *be, const m3_cuda_cp_inputs *in, int64_t max_seq_len,
                                int rank, int world, const m3_select_params *p,
                                const float *scores, uint64_t *keys, int *err) {
    return m3_fail(M3_ERR_UNSUPPORTED, NO_CUDA_MSG);
}

m3_status m3_cuda_cp_merge(m3_backend *be, const uint64_t *gathered, int world, int64_t items,
                           int topk, int32_t *out) {
    return m3_fail(M3_ERR_UNSUPPORTED, NO_CUDA_MSG);
}

m3_status m3_cuda_cp_layer_select(m3_backend *be, m3_comm *comm, const m3_cuda_cp_layer *l,
                                  float scale, const m3_select_params *p, int32_t *selected) {
    return m3_fail(M3_ERR_UNSUPPORTED, NO_CUDA_MSG);
}

m3_status m3_cuda_cp_error(m3_backend *be, const int *err) {
    return m3_fail(M3_ERR_UNSUPPORTED, NO_CUDA_MSG);
}

m3_status m3_cuda_bench_indexer(m3_backend *be, int batch, int64_t context, int world, int heads,
                                const m3_select_params *p, int iters, double *us, double *bytes) {
    return m3_fail(M3_ERR_UNSUPPORTED, NO_CUDA_MSG);
}

/* tensor parallelism over GPUs (cuda/cuda_comm.h) */
m3_status m3_gpu_group_create(const int *devices, int world, int64_t timeout_ms,
                              m3_gpu_group **out) {
    *out = NULL;
    return m3_fail(M3_ERR_UNSUPPORTED, NO_CUDA_MSG);
}

void m3_gpu_group_free(m3_gpu_group *g) {}

m3_status m3_gpu_group_enable_peers(m3_gpu_group *g) {
    return m3_fail(M3_ERR_UNSUPPORTED, NO_CUDA_MSG);
}

m3_status m3_cuda_comm_create(m3_gpu_group *g, int rank, m3_backend *be, m3_comm *host,
                              m3_comm **out) {
    *out = NULL;
    return m3_fail(M3_ERR_UNSUPPORTED, NO_CUDA_MSG);
}
#else
typedef int m3_no_cuda_unused; /* ISO C forbids an empty translation unit */
#endif
