/*
 * The decode matrix-vector product: out[t, n] = sum_k x[t, k] w[n, k] for a
 * handful of rows (T <= 16). Decode is memory-bound, so the kernel is built
 * to stream each weight byte from HBM exactly once with many 16-byte loads
 * in flight: every warp owns GEMV_R output rows and walks K with 8 elements
 * per lane per load, GEMV_U loads deep; the T activation rows are staged in
 * shared memory a chunk of K at a time and shared by all warps of the CTA.
 * Weights are bf16 or MXFP8 (e4m3 + one power-of-two scale per 32 columns),
 * read under the L2 evict-first policy (l2_evict_first): a step streams far
 * more weight bytes than L2 holds, and they should not evict what it reads
 * again (activations, norm weights, cache pages of the next op).
 *
 * It serves the MoE experts (cuda_moe.cu), whose rows are gathered through
 * a member list and whose weights are picked by expert id on the device,
 * so a CUDA graph replays them without knowing the routing in advance; a
 * routed expert's pass mostly has one or two rows. The dense linear op
 * runs its decode rows on tensor cores instead (cuda_linear.cu), which
 * takes only gemv_weight from here (and its fp32 router kernel the
 * staging of x).
 */
#ifndef M3_CUDA_CUDA_GEMV_CUH
#define M3_CUDA_CUDA_GEMV_CUH

#include <cuda_fp8.h>

#include "cuda/cuda_async.cuh"
#include "cuda/cuda_common.cuh"
#include "cuda/cuda_ksum.cuh"

#define GEMV_WARPS 8
#define GEMV_THREADS (GEMV_WARPS * 32)
#define GEMV_R 2      /* output rows per warp */
#define GEMV_KC 1024  /* K elements staged in shared memory per chunk */
#define GEMV_U (GEMV_KC / 256) /* 16-byte loads per lane per chunk and row */
#define GEMV_MAX_T 16

/* A weight matrix [N, K] on the device: bf16, or e4m3 + u8 scales. */
struct gemv_weight {
    const uint8_t *w;      /* row n at w + n * w_row */
    int64_t w_row;         /* bytes */
    const uint8_t *s;      /* MXFP8 scales [N, K/32]; NULL for bf16 */
    int64_t s_row;         /* bytes */
};

__device__ __forceinline__ void e4m3x8_to_f32(uint2 v, float scale, float f[8]) {
    const uint32_t words[2] = {v.x, v.y};
#pragma unroll
    for (int i = 0; i < 2; i++) {
#pragma unroll
        for (int j = 0; j < 2; j++) {
            __nv_fp8x2_storage_t pair = (__nv_fp8x2_storage_t)(words[i] >> (16 * j));
            __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3);
            float2 p = __half22float2(*reinterpret_cast<__half2 *>(&h));
            f[i * 4 + j * 2] = p.x * scale;
            f[i * 4 + j * 2 + 1] = p.y * scale;
        }
    }
}

/* Stage rows [0, T) of x's chunk [kc, kc + kn) into xs [T][GEMV_KC]; rows
 * at or past `rows` and columns past kn are zero. row_ptr(t) gives row t's
 * start (bf16, 16-byte aligned, K % 8 == 0). */
template <int T, typename RowPtr>
__device__ __forceinline__ void gemv_stage_x(uint16_t *xs, RowPtr row_ptr, int rows, int kc,
                                             int kn) {
    for (int i = threadIdx.x; i < T * (GEMV_KC / 8); i += blockDim.x) {
        int t = i / (GEMV_KC / 8), c = (i % (GEMV_KC / 8)) * 8;
        uint4 v = make_uint4(0, 0, 0, 0);
        if (t < rows && c < kn)
            v = *reinterpret_cast<const uint4 *>(row_ptr(t) + kc + c);
        *reinterpret_cast<uint4 *>(xs + t * GEMV_KC + c) = v;
    }
}

/* No work between a chunk's steps (see gemv_chunk). */
struct gemv_no_step {
    __device__ __forceinline__ void operator()(int) const {}
};

/* The bf16 half of gemv_chunk. */
template <int T, typename Step>
__device__ __forceinline__ void gemv_chunk_bf16(float (&acc)[GEMV_R][T], const gemv_weight &W,
                                                int64_t n0, int64_t N, int kc, int kn,
                                                const uint16_t *xs, int lane, int rows,
                                                Step after_step) {
    uint4 wv[GEMV_R][GEMV_U];
    const uint64_t pol = l2_evict_first();
#pragma unroll
    for (int r = 0; r < GEMV_R; r++)
#pragma unroll
        for (int u = 0; u < GEMV_U; u++) {
            int k = lane * 8 + u * 256;
            bool ok = n0 + r < N && k < kn;
            const uint8_t *row = W.w + (n0 + r) * W.w_row + (int64_t)(kc + k) * 2;
            wv[r][u] = ok ? ldg16_pol(row, pol) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
    for (int u = 0; u < GEMV_U; u++) {
        int k = lane * 8 + u * 256;
        if (k < kn) {
            float wf[GEMV_R][8];
#pragma unroll
            for (int r = 0; r < GEMV_R; r++)
                unpack8(wv[r][u], wf[r]);
#pragma unroll
            for (int t = 0; t < T; t++) {
                if (t > 0 && t >= rows) /* a padded row: nobody reads its sums */
                    break;
                float xf[8];
                unpack8(*reinterpret_cast<const uint4 *>(xs + t * GEMV_KC + k), xf);
#pragma unroll
                for (int r = 0; r < GEMV_R; r++)
#pragma unroll
                    for (int j = 0; j < 8; j++)
                        acc[r][t] += wf[r][j] * xf[j];
            }
        }
        if (u * 256 < kn)
            after_step(u);
    }
}

/* acc[r][t] += w[n0 + r, kc + k] x[t, k] over this lane's k of the chunk,
 * for the real rows t < rows (a bucket's padded rows are zeros nobody
 * reads; a routed expert's pass mostly has one member in a bucket of 2-4),
 * in steps of 256 columns (8 per lane), after_step(u) after step u (every
 * lane; the whole warp's FMAs of the step are done). */
template <int T, bool FP8, typename Step = gemv_no_step>
__device__ __forceinline__ void gemv_chunk(float (&acc)[GEMV_R][T], const gemv_weight &W,
                                           int64_t n0, int64_t N, int kc, int kn,
                                           const uint16_t *xs, int lane, int rows,
                                           Step after_step = Step()) {
    if constexpr (FP8) {
        uint2 wv[GEMV_R][GEMV_U];
        float sc[GEMV_R][GEMV_U];
        const uint64_t pol = l2_evict_first();
#pragma unroll
        for (int r = 0; r < GEMV_R; r++)
#pragma unroll
            for (int u = 0; u < GEMV_U; u++) {
                int k = lane * 8 + u * 256;
                bool ok = n0 + r < N && k < kn;
                const uint8_t *row = W.w + (n0 + r) * W.w_row + kc + k;
                wv[r][u] = ok ? ldg8_pol(row, pol) : make_uint2(0, 0);
                sc[r][u] = ok ? m3_e8m0(W.s[(n0 + r) * W.s_row + (kc + k) / 32]) : 0.0f;
            }
#pragma unroll
        for (int u = 0; u < GEMV_U; u++) {
            int k = lane * 8 + u * 256;
            if (k < kn) {
                float wf[GEMV_R][8];
#pragma unroll
                for (int r = 0; r < GEMV_R; r++)
                    e4m3x8_to_f32(wv[r][u], sc[r][u], wf[r]);
#pragma unroll
                for (int t = 0; t < T; t++) {
                    if (t > 0 && t >= rows)
                        break;
                    float xf[8];
                    unpack8(*reinterpret_cast<const uint4 *>(xs + t * GEMV_KC + k), xf);
#pragma unroll
                    for (int r = 0; r < GEMV_R; r++)
#pragma unroll
                        for (int j = 0; j < 8; j++)
                            acc[r][t] += wf[r][j] * xf[j];
                }
            }
            if (u * 256 < kn)
                after_step(u);
        }
    } else {
        gemv_chunk_bf16<T>(acc, W, n0, N, kc, kn, xs, lane, rows, after_step);
    }
}

/* The K loop over [k0, k1) (k0 a multiple of 8) for one warp's rows; x
 * rows via row_ptr (row t starts at element 0 of its K); acc holds this
 * lane's share of the sums (not reduced over the warp). Every thread of the
 * CTA must call it (it synchronises the CTA). */
template <int T, bool FP8, typename RowPtr, typename Step = gemv_no_step>
__device__ __forceinline__ void gemv_rows_lane(float (&acc)[GEMV_R][T], const gemv_weight &W,
                                               int64_t n0, int64_t N, int k0, int k1,
                                               RowPtr row_ptr, int rows, uint16_t *xs,
                                               Step after_step = Step()) {
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < GEMV_R; r++)
#pragma unroll
        for (int t = 0; t < T; t++)
            acc[r][t] = 0.0f;
    for (int kc = k0; kc < k1; kc += GEMV_KC) {
        int kn = k1 - kc < GEMV_KC ? k1 - kc : GEMV_KC;
        __syncthreads(); /* the previous chunk is consumed */
        gemv_stage_x<T>(xs, row_ptr, rows, kc, kn);
        __syncthreads();
        if (n0 < N)
            gemv_chunk<T, FP8>(acc, W, n0, N, kc, kn, xs, lane, rows, after_step);
    }
}

/* gemv_rows_lane, then the sums reduced over the warp (valid in every lane). */
template <int T, bool FP8, typename RowPtr>
__device__ __forceinline__ void gemv_rows(float (&acc)[GEMV_R][T], const gemv_weight &W,
                                          int64_t n0, int64_t N, int k0, int k1, RowPtr row_ptr,
                                          int rows, uint16_t *xs) {
    gemv_rows_lane<T, FP8>(acc, W, n0, N, k0, k1, row_ptr, rows, xs);
#pragma unroll
    for (int r = 0; r < GEMV_R; r++)
#pragma unroll
        for (int t = 0; t < T; t++)
            if (t == 0 || t < rows) /* the padded rows' sums: nobody reads them */
                acc[r][t] = m3_warp_sum(acc[r][t]);
}

/* The world-invariant sum (cuda_ksum.cuh) of chunks [c0, c0 + group) of
 * n_chunks over K for one warp's rows: each chunk summed over the warp,
 * the chunks combined as a pairwise tree. Returns the sum this lane holds:
 * value j = r * T + t of ksum_lane_value<GEMV_R * T>. Every thread of the
 * CTA must call it.
 *
 * Chunks of a multiple of 256 columns (m3_k_chunks prefers them) end
 * between the K loop's steps: the loop streams the chunks' columns as one
 * range, every load of a 1,024-column piece in flight, and reduces at each
 * chunk's last step. Other chunks (multiples of 8) are staged and summed
 * one at a time, from their own first column. */
template <int T, bool FP8, typename RowPtr>
__device__ __forceinline__ float gemv_tree(const gemv_weight &W, int64_t n0, int64_t N,
                                           int64_t K, int n_chunks, int c0, int group,
                                           RowPtr row_ptr, int rows, uint16_t *xs) {
    float lv[KSUM_LEVELS] = {0.0f, 0.0f, 0.0f, 0.0f};
    int k0, k1, kl, kend;
    ksum_bounds(K, n_chunks, c0, &k0, &k1);
    ksum_bounds(K, n_chunks, c0 + group - 1, &kl, &kend);
    const int chunk_len = k1 - k0;
    if (K % n_chunks == 0 && chunk_len % 256 == 0) {
        const int steps = chunk_len / 256;
        int step = 0, i = 0;
        float acc[GEMV_R][T];
        auto chunk_end = [&](int) {
            if (++step < steps)
                return;
            step = 0;
            ksum_push(lv, i++, ksum_warp_scatter(acc));
#pragma unroll
            for (int r = 0; r < GEMV_R; r++)
#pragma unroll
                for (int t = 0; t < T; t++)
                    acc[r][t] = 0.0f;
        };
        gemv_rows_lane<T, FP8>(acc, W, n0, N, k0, kend, row_ptr, rows, xs, chunk_end);
        return ksum_fold(lv, group);
    }
    for (int i = 0; i < group; i++) {
        ksum_bounds(K, n_chunks, c0 + i, &k0, &k1);
        float acc[GEMV_R][T];
        gemv_rows_lane<T, FP8>(acc, W, n0, N, k0, k1, row_ptr, rows, xs);
        ksum_push(lv, i, ksum_warp_scatter(acc));
    }
    return ksum_fold(lv, group);
}

#endif
