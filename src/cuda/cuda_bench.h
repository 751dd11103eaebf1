/*
 * Measuring instruments for `m3 bench` on the CUDA backend, callable from C
 * (no CUDA types): the device's streaming read bandwidth, timed graph
 * replays with CUDA events, a random fill of device memory (cache contents
 * for long contexts without running a prefill), and the number of distinct
 * experts the last MoE step read. In a build without CUDA they refuse with
 * M3_ERR_UNSUPPORTED.
 */
#ifndef M3_CUDA_CUDA_BENCH_H
#define M3_CUDA_CUDA_BENCH_H

#include <stddef.h>
#include <stdint.h>

#include "backend/backend.h"

/* Read a buffer of `bytes` (several times the L2) iters times with 16-byte
 * loads; *gb_per_s = bytes read / median time. */
m3_status m3_cuda_read_bandwidth(m3_backend *be, size_t bytes, int iters, double *gb_per_s);
/* One read-only kernel over `bytes` (the kernel above, in a graph, each
 * launch over memory the one before did not leave in L2): *us = median
 * microseconds per launch over iters replays. A step of the same bytes
 * cannot stream them faster than this. */
m3_status m3_cuda_read_time(m3_backend *be, size_t bytes, int iters, double *us);
/* Launch graph once between two events; *us = elapsed microseconds. */
m3_status m3_cuda_timed_launch(m3_backend *be, void *graph, double *us);
/* dst[0..n) = bf16 values uniform in [-scale, scale), a function of (seed, i). */
m3_status m3_cuda_fill_random_bf16(m3_backend *be, void *dst, size_t n, uint64_t seed,
                                   float scale);
/* Distinct experts of the last MoE op launched (read back; synchronises). */
m3_status m3_cuda_moe_unique_experts(m3_backend *be, int *n);

/* Time out[rows, N] = x[rows, K] w[N, K]^T (bf16 in, bf16 out) with the
 * linear op (the decode GEMV up to 16 rows), with cuBLAS as a row-parallel
 * weight takes it (K cut into its chunks, then the tree: cuda_linear.cu)
 * and with one cuBLAS GEMM:
 * medians of iters launches each, rotating over enough weight copies to
 * exceed the L2. */
m3_status m3_cuda_bench_linear(m3_backend *be, int rows, int64_t n, int64_t k, int iters,
                               double *gemv_us, double *cublas_us, double *one_gemm_us);

#endif
