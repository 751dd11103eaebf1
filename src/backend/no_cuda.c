/*
 * The CUDA backend's entry point in a build without CUDA (no nvcc at build
 * time): a clear refusal instead of a link error.
 */
#include "backend/backend.h"
#include "core/status.h"

#ifndef M3_HAVE_CUDA
#include "cuda/cuda_bench.h"

#define NO_CUDA_MSG                                                                        \
    "this build of m3 has no CUDA backend (nvcc was not found when it was built); use " \
    "--device cpu"

m3_status m3_cuda_backend_create(int device, m3_backend **out) {
    *out = NULL;
    return m3_fail(M3_ERR_UNSUPPORTED, NO_CUDA_MSG);
}

m3_status m3_cuda_read_bandwidth(m3_backend *be, size_t bytes, int iters, double *gb_per_s) {
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
                               double *gemv_us, double *cublas_us) {
    return m3_fail(M3_ERR_UNSUPPORTED, NO_CUDA_MSG);
}
#else
typedef int m3_no_cuda_unused; /* ISO C forbids an empty translation unit */
#endif
