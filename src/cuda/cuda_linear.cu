/*
 * The linear op on the GPU. Decode row counts (<= 16, or the backend's
 * exact_rows) run on tensor cores (linear_mma_kernel below: bf16 MMAs fed
 * straight from the weight loads, one, two or four 8-row column tiles), so
 * 8-16 rows cost about what one row does, and a row's sums are the same
 * bits at every row count and on every TP world. Larger row counts
 * (prefill) use cuBLAS for bf16 weights, and the MMA kernel 16 rows at a
 * time for MXFP8 weights. Shapes the vector kernels cannot take (K not a
 * multiple of 8, unaligned rows) fall back to a plain one-thread-per-output
 * kernel, so every config the SPEC allows runs. The router's fp32 weights
 * have their own small kernel (cuda_gemv.cuh's FFMA core still serves the
 * MoE experts).
 */
#include <stdio.h>

#include "cuda/cuda_internal.h"
#include "cuda/cuda_lmma.cuh"

static_assert(M3_CUDA_EXACT_ROWS <= GEMV_MAX_T && M3_CUDA_LINEAR_MMA_PASS == 4 * 8,
              "the MMA kernel takes 8, 16 or 32 rows a launch (1, 2 or 4 column tiles)");

/* The weights of one launch: several linears of the same x (a layer's q,
 * k, v and index projections; gate and up) as one grid of tiles, weight i
 * owning tiles [tile_end[i - 1], tile_end[i]). Each output is the bits
 * its linear alone gives: a tile's sums never depend on its neighbours. */
#define LMMA_GROUP_MAX 6
struct lmma_set {
    gemv_weight W[LMMA_GROUP_MAX];
    int64_t N[LMMA_GROUP_MAX];
    void *out[LMMA_GROUP_MAX];
    int64_t tile_end[LMMA_GROUP_MAX];
    int n;
};

/* SPLIT: a one-warp CTA per (tile, chunk blockIdx.y); it stores its
 * chunk's fp32 partial in part_g [chunks, rows, N] and counts itself in
 * count[tile]; the tile's last CTA to arrive combines the partials as the
 * tree, writes out and sets the count back to zero (so the next launch,
 * or a graph's replay, finds it zero). Else the CTA's warps are the
 * tile's chunks, combined in shared memory. */
template <int NT, bool FP8, int U, bool SPLIT, bool OUT_F32, bool WIDE>
__global__ void __launch_bounds__(32 * LMMA_MAX_NC, WIDE ? 2 : 1)
    linear_mma_kernel(const __grid_constant__ lmma_set set, const uint16_t *__restrict__ x,
                      int rows, int K, int n_chunks, float *__restrict__ part_g,
                      int *__restrict__ count) {
    __shared__ float part[SPLIT ? 1 : LMMA_MAX_NC][NT * 4][32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    int wi = 0; /* this CTA's weight */
    while (wi + 1 < set.n && (int64_t)blockIdx.x >= set.tile_end[wi])
        wi++;
    const gemv_weight W = set.W[wi];
    const int64_t N = set.N[wi];
    void *const out = set.out[wi];
    const int64_t n0 = ((int64_t)blockIdx.x - (wi ? set.tile_end[wi - 1] : 0)) * 16;
    const int chunk = SPLIT ? (int)blockIdx.y : warp;
    int k0, k1;
    ksum_bounds(K, n_chunks, chunk, &k0, &k1);
    float acc[NT][4];
    lmma_chunk<NT, FP8, U, false>(W, N, n0, x, rows, K, k0, k1, acc);

    /* this lane's outputs: rows n0 + g (+ 8), x rows 8 j + 2 q (+ 1) */
    auto store = [&](int j, int i, float v) {
        const int64_t n = n0 + g + (i >= 2 ? 8 : 0);
        const int64_t o = (int64_t)(j * 8 + 2 * q + (i & 1)) * N + n;
        if (OUT_F32)
            static_cast<float *>(out)[o] = v;
        else
            static_cast<uint16_t *>(out)[o] = m3_to_bf(v);
    };
    auto live = [&](int j, int i) {
        return n0 + g + (i >= 2 ? 8 : 0) < N && j * 8 + 2 * q + (i & 1) < rows;
    };
    auto at = [&](int c, int j, int i) { /* element of part_g */
        return ((int64_t)c * rows + j * 8 + 2 * q + (i & 1)) * N + n0 + g + (i >= 2 ? 8 : 0);
    };
    if constexpr (SPLIT) {
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int i = 0; i < 4; i++)
                if (live(j, i))
                    part_g[at(chunk, j, i)] = acc[j][i];
        __threadfence(); /* the partial is visible before the arrival is */
        __syncwarp();    /* every lane's partial, before lane 0 arrives */
        int last = 0;
        if (lane == 0)
            last = atomicAdd(&count[blockIdx.x], 1) == n_chunks - 1;
        if (!__shfl_sync(0xffffffffu, last, 0))
            return;
        __threadfence(); /* the others' partials, seen after their arrivals */
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int i = 0; i < 4; i++)
                if (live(j, i))
                    store(j, i, ksum_tree<float>(n_chunks, [&](int c) {
                              return __ldcg(part_g + at(c, j, i)); /* L2: not a stale L1 */
                          }));
        if (lane == 0)
            count[blockIdx.x] = 0;
    } else { /* the CTA's chunks combined by warp 0 */
        lmma_part_put(part, warp, lane, acc);
        __syncthreads();
        if (warp != 0)
            return;
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int i = 0; i < 4; i++)
                if (live(j, i))
                    store(j, i, lmma_part_sum(part, n_chunks, j, i, lane));
    }
}

/* out = the sum of the K slices' partials: in slice order (the router), or
 * as cuda_ksum.cuh's tree over the chunk groups (the bf16 linears). */
__global__ void linear_splitk_finish_kernel(const float *__restrict__ part, int splits,
                                            int64_t n, bool tree, bool out_f32,
                                            void *__restrict__ out) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n)
        return;
    float v = 0.0f;
    if (tree) {
        v = ksum_tree<float>(splits, [&](int s) { return part[(int64_t)s * n + i]; });
    } else {
        for (int s = 0; s < splits; s++)
            v += part[(int64_t)s * n + i];
    }
    if (out_f32)
        static_cast<float *>(out)[i] = v;
    else
        static_cast<uint16_t *>(out)[i] = m3_to_bf(v);
}

/* Sum the partials of `splits` K slices into out (n values). */
static m3_status finish_splitk(m3_cuda *cu, const float *part, int splits, int64_t n, bool tree,
                               bool out_f32, void *out) {
    linear_splitk_finish_kernel<<<(unsigned)((n + 255) / 256), 256, 0, cu->stream>>>(
        part, splits, n, tree, out_f32, out);
    M3_CUDA_LAUNCHED("linear_splitk_finish_kernel");
    return M3_OK;
}

/* Slices of K (multiples of GEMV_KC) so a narrow weight still puts about
 * two CTAs on every multiprocessor: with few output rows the loads in
 * flight, not the bytes, bound the time. (The router's fp32 GEMV.) */
static int k_splits(const m3_cuda *cu, int64_t n_tiles, int K) {
    int chunks = (K + GEMV_KC - 1) / GEMV_KC;
    int64_t want = 2 * (int64_t)cu->sm_count;
    if (n_tiles >= want || chunks < 2)
        return 1;
    int64_t s = (want + n_tiles - 1) / n_tiles;
    return (int)(s < chunks ? s : chunks);
}

/* Launch the tensor-core linear. A CTA per 16-row tile, a warp per chunk
 * (deep stages when that is one or two warps), where the tiles fill the
 * multiprocessors; else (a narrow weight: the index and KV projections,
 * the shared expert's gate/up) a one-warp CTA per tile and chunk, the
 * tile's last CTA combining the chunks as the same tree (no second
 * launch: in a graph that was a dependent node per narrow weight). */
template <int NT, bool FP8, bool OUT_F32>
static m3_status launch_mma_out(m3_cuda *cu, const lmma_set &set, const uint16_t *x, int rows,
                                int K, int n_chunks) {
    constexpr int D = LMMA_DEEP(NT);
    const int64_t tiles = set.tile_end[set.n - 1], N = set.N[0];
    if (tiles < cu->sm_count && n_chunks > 1) { /* (one weight: m3_cuda_linear_group asks) */
        float *part = NULL;
        int *count = NULL;
        M3_TRY(m3_cuda_workspace(cu, M3_CUDA_WS_LINEAR, (size_t)n_chunks * rows * N * 4,
                                 (void **)&part));
        M3_TRY(m3_cuda_workspace_zeroed(cu, M3_CUDA_WS_LINEAR_COUNT, (size_t)tiles * 4,
                                        (void **)&count));
        linear_mma_kernel<NT, FP8, D, true, OUT_F32, false>
            <<<dim3((unsigned)tiles, (unsigned)n_chunks), 32, 0, cu->stream>>>(
                set, x, rows, K, n_chunks, part, count);
    } else if (n_chunks <= 2) {
        linear_mma_kernel<NT, FP8, D, false, OUT_F32, false>
            <<<(unsigned)tiles, 32 * n_chunks, 0, cu->stream>>>(set, x, rows, K, n_chunks,
                                                                nullptr, nullptr);
    } else {
        linear_mma_kernel<NT, FP8, LMMA_WIDE_U(NT), false, OUT_F32, true>
            <<<(unsigned)tiles, 32 * n_chunks, 0, cu->stream>>>(set, x, rows, K, n_chunks,
                                                                nullptr, nullptr);
    }
    M3_CUDA_LAUNCHED("linear_mma_kernel");
    return M3_OK;
}

template <int NT, bool FP8>
static m3_status launch_mma(m3_cuda *cu, const lmma_set &set, const uint16_t *x, int rows, int K,
                            int n_chunks, bool out_f32) {
    return out_f32 ? launch_mma_out<NT, FP8, true>(cu, set, x, rows, K, n_chunks)
                   : launch_mma_out<NT, FP8, false>(cu, set, x, rows, K, n_chunks);
}

/* One thread per output: any K, any alignment; the same chunk tree. */
__global__ void linear_scalar_kernel(gemv_weight W, bool fp8, const uint16_t *x, int rows, int K,
                                     int64_t N, int n_chunks, bool out_f32, void *out) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (int64_t)rows * N)
        return;
    int t = (int)(i / N);
    int64_t n = i % N;
    const uint8_t *row = W.w + n * W.w_row;
    float acc = ksum_tree<float>(n_chunks, [&](int c) {
        int k0, k1;
        ksum_bounds(K, n_chunks, c, &k0, &k1);
        float s = 0.0f;
        for (int k = k0; k < k1; k++) {
            float w = fp8 ? m3_e4m3(row[k]) * m3_e8m0(W.s[n * W.s_row + k / 32])
                          : m3_bf(reinterpret_cast<const uint16_t *>(row)[k]);
            s += w * m3_bf(x[(int64_t)t * K + k]);
        }
        return s;
    });
    if (out_f32)
        static_cast<float *>(out)[i] = acc;
    else
        static_cast<uint16_t *>(out)[i] = m3_to_bf(acc);
}

/* 1-8 rows: one 8-column MMA tile; 9-16: two; 17-32 (M3_LINEAR_MMA_ROWS
 * above 16): four. A row's sums are the same in each (see
 * linear_mma_kernel). */
static m3_status launch_set(m3_cuda *cu, const lmma_set &set, bool fp8, const uint16_t *x,
                            int rows, int K, int n_chunks, bool out_f32) {
    if (n_chunks < 1 || n_chunks > LMMA_MAX_NC)
        return m3_fail(M3_ERR_INTERNAL, "linear: %d K chunks (1..%d)", n_chunks, LMMA_MAX_NC);
    if (rows > M3_CUDA_LINEAR_MMA_PASS)
        return m3_fail(M3_ERR_INTERNAL, "linear: %d rows in one MMA launch (at most %d)", rows,
                       M3_CUDA_LINEAR_MMA_PASS);
    if (fp8)
        return rows <= 8    ? launch_mma<1, true>(cu, set, x, rows, K, n_chunks, out_f32)
               : rows <= 16 ? launch_mma<2, true>(cu, set, x, rows, K, n_chunks, out_f32)
                            : launch_mma<4, true>(cu, set, x, rows, K, n_chunks, out_f32);
    return rows <= 8    ? launch_mma<1, false>(cu, set, x, rows, K, n_chunks, out_f32)
           : rows <= 16 ? launch_mma<2, false>(cu, set, x, rows, K, n_chunks, out_f32)
                        : launch_mma<4, false>(cu, set, x, rows, K, n_chunks, out_f32);
}

static gemv_weight gemv_weight_of(const m3_linear *w) {
    bool fp8 = w->w.dtype == M3_DT_F8_E4M3;
    return {static_cast<const uint8_t *>(w->w.data), w->w.nb[0],
            static_cast<const uint8_t *>(w->scale.data), fp8 ? w->scale.nb[0] : 0};
}

/* A row-parallel weight's chunks when cuBLAS can take them (whole chunks
 * of a multiple of 8 columns), 1 for other weights, 0 for a row-parallel
 * weight it cannot take (the GEMV then runs it at every row count). */
static int cublas_k_chunks(const m3_linear *w) {
    int64_t K = w->w.ne[1];
    if (w->k_chunks <= 0)
        return 1;
    return K % w->k_chunks == 0 && (K / w->k_chunks) % 8 == 0 ? w->k_chunks : 0;
}

/* The vector GEMV needs 16-byte rows and every chunk bound a multiple of 8. */
static bool vector_ok(const m3_linear *w, const void *x, int64_t K) {
    bool fp8 = w->w.dtype == M3_DT_F8_E4M3;
    uintptr_t a = (uintptr_t)w->w.data | (uintptr_t)x;
    return K % (8 * m3_cuda_k_chunks(w)) == 0 && a % 16 == 0 && w->w.nb[0] % 16 == 0 &&
           (!fp8 || K % 32 == 0);
}

/* Rows per cuBLAS pass: fixed, so a pass's shapes never depend on the world. */
#define CUBLAS_ROWS 1024

/* `batch` products out_b[m, nb] = x_b[m, kc] w_b[nb, kc]^T, one cuBLAS call:
 * w_b = w0 + b * w_step elements (rows w's own stride apart), x_b = x + b *
 * x_step (rows K apart), out_b = out + b * o_step (rows ldo apart). */
static m3_status gemm(m3_cuda *cu, int m, int64_t nb, int kc, int batch, const m3_linear *w,
                      const void *w0, int64_t w_step, const uint16_t *x, int64_t K,
                      int64_t x_step, cudaDataType out_t, void *out, int64_t ldo,
                      int64_t o_step) {
    float alpha = 1.0f, beta = 0.0f;
    int lda = (int)(w->w.nb[0] / 2);
    /* row-major out[m,nb] = x[m,kc] w[nb,kc]^T is column-major out^T = w x^T */
    cublasStatus_t s = cublasGemmStridedBatchedEx(
        cu->cublas, CUBLAS_OP_T, CUBLAS_OP_N, (int)nb, m, kc, &alpha, w0, CUDA_R_16BF,
        lda, w_step, x, CUDA_R_16BF, (int)K, x_step, &beta, out, out_t, (int)ldo, o_step, batch,
        CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    if (s != CUBLAS_STATUS_SUCCESS)
        return m3_fail(M3_ERR_DEVICE, "cuBLAS GEMM [%d x %lld x %d] x %d of %s failed: status %d",
                       m, (long long)nb, kc, batch, w->w.name ? w->w.name : "a linear", (int)s);
    return M3_OK;
}

/* Prefill's GEMM (bf16 weights, more than 16 rows), 1024 rows per pass,
 * cut so no world changes a sum (test_cuda_worlds checks both cuts):
 *   - a row-parallel weight's K into its chunks (cuda_ksum.cuh): a call
 *     per chunk (the same shape and batch on every world) gives its fp32
 *     sums, combined as the tree, so a TP rank's partial is a subtree of
 *     TP 1's;
 *   - a column-parallel weight's N into its row blocks of the full N: one
 *     batched call of blocks of the same shape on every world (cuBLAS picks
 *     its kernel, and with it a sum's order, by the shape, N included).
 * Other weights: one GEMM. */
extern "C" m3_status m3_cuda_linear_cublas(m3_cuda *cu, int rows, const uint16_t *x,
                                            const m3_linear *w, m3_dtype out_dtype, void *out) {
    int64_t N = w->w.ne[0], K = w->w.ne[1];
    int kch = cublas_k_chunks(w);
    kch = kch > 0 ? kch : 1; /* (a caller's weight the GEMV should run: uncut) */
    int kc = (int)(K / kch);
    bool out_f32 = out_dtype == M3_DT_F32;
    size_t out_size = out_f32 ? 4 : 2;
    float *part = NULL;
    if (kch > 1) {
        int m_max = rows < CUBLAS_ROWS ? rows : CUBLAS_ROWS;
        M3_TRY(m3_cuda_workspace(cu, M3_CUDA_WS_LINEAR, (size_t)kch * m_max * N * 4,
                                 (void **)&part));
    }
    for (int r0 = 0; r0 < rows; r0 += CUBLAS_ROWS) {
        int m = rows - r0 < CUBLAS_ROWS ? rows - r0 : CUBLAS_ROWS;
        const uint16_t *xr = x + (int64_t)r0 * K;
        char *o = static_cast<char *>(out) + (size_t)r0 * N * out_size;
        if (kch == 1) {
            int nch = w->n_chunks > 0 && N % w->n_chunks == 0 ? w->n_chunks : 1;
            int64_t nb = N / nch;
            M3_TRY(gemm(cu, m, nb, kc, nch, w, w->w.data, nb * (w->w.nb[0] / 2), xr, K, 0,
                        out_f32 ? CUDA_R_32F : CUDA_R_16BF, o, N, nb));
            continue;
        }
        /* one call per chunk, not one batched call: a rank holds fewer
         * chunks than TP 1, and cuBLAS may pick its kernel by the batch */
        for (int c = 0; c < kch; c++)
            M3_TRY(gemm(cu, m, N, kc, 1, w, static_cast<const uint16_t *>(w->w.data) + c * kc, 0,
                        xr + (int64_t)c * kc, K, 0, CUDA_R_32F, part + (size_t)c * m * N, N,
                        0));
        M3_TRY(finish_splitk(cu, part, kch, (int64_t)m * N, true, out_f32, o));
    }
    return M3_OK;
}

static m3_status gemv_dispatch(m3_cuda *cu, int rows, const uint16_t *x, const m3_linear *w,
                               bool out_f32, void *out) {
    int64_t N = w->w.ne[0], K = w->w.ne[1];
    bool fp8 = w->w.dtype == M3_DT_F8_E4M3;
    gemv_weight W = gemv_weight_of(w);
    if (!vector_ok(w, x, K)) {
        int64_t total = (int64_t)rows * N;
        unsigned grid = (unsigned)((total + 255) / 256);
        linear_scalar_kernel<<<grid, 256, 0, cu->stream>>>(W, fp8, x, rows, (int)K, N,
                                                           m3_cuda_k_chunks(w), out_f32, out);
        M3_CUDA_LAUNCHED("linear_scalar_kernel");
        return M3_OK;
    }
    lmma_set set = {};
    set.W[0] = W;
    set.N[0] = N;
    set.out[0] = out;
    set.tile_end[0] = (N + 15) / 16;
    set.n = 1;
    return launch_set(cu, set, fp8, x, rows, (int)K, m3_cuda_k_chunks(w), out_f32);
}

extern "C" m3_status m3_cuda_linear(m3_backend *be, int rows, const uint16_t *x,
                                    const m3_linear *w, m3_dtype out_dtype, void *out) {
    m3_cuda *cu = m3_cuda_of(be);
    if (rows <= 0)
        return M3_OK;
    if (w->w.dtype != M3_DT_BF16 && w->w.dtype != M3_DT_F8_E4M3)
        return m3_fail(M3_ERR_INTERNAL, "linear: weight %s has dtype %s",
                       w->w.name ? w->w.name : "?", m3_dtype_name(w->w.dtype));
    bool out_f32 = out_dtype == M3_DT_F32;
    int64_t N = w->w.ne[0], K = w->w.ne[1];
    /* Decode rows (<= be->exact_rows: 16, or 32 / 64 from
     * M3_LINEAR_MMA_ROWS) stay on our kernel: each
     * row's sums then never depend on how many rows share the step (cuBLAS
     * picks its kernel, and so a sum's order, by the shape), so a 16-row
     * step gives each row the bits of a 1-row step. */
    /* (a row-parallel weight whose chunks cuBLAS cannot take stays on the
     * GEMV, whose sums are cut alike at every row count) */
    if (rows > be->exact_rows && !cu->no_cublas && w->w.dtype == M3_DT_BF16 && K % 8 == 0 &&
        N < INT32_MAX && cublas_k_chunks(w) > 0)
        return m3_cuda_linear_cublas(cu, rows, x, w, out_dtype, out);
    /* past one launch's rows (MXFP8, odd shapes, up to 64 rows, or any
     * rows under M3_LINEAR_CUBLAS=0): a pass of 16 rows at a time (32 where
     * exact_rows asks for more) */
    const int pass = be->exact_rows > GEMV_MAX_T ? M3_CUDA_LINEAR_MMA_PASS : GEMV_MAX_T;
    size_t out_size = out_f32 ? 4 : 2;
    for (int r0 = 0; r0 < rows; r0 += pass) {
        int n = rows - r0 < pass ? rows - r0 : pass;
        M3_TRY(gemv_dispatch(cu, n, x + (int64_t)r0 * K, w, out_f32,
                             static_cast<char *>(out) + (size_t)r0 * N * out_size));
    }
    return M3_OK;
}

/* Several linears of the same x in one launch where they are alike
 * (dtype, K and its chunks, the vector path, 1-16 rows) and together fill
 * the multiprocessors; else one linear each. The same bits either way. */
extern "C" m3_status m3_cuda_linear_group(m3_backend *be, int rows, const uint16_t *x, int n,
                                          const m3_linear *const *w, m3_dtype out_dtype,
                                          void *const *out) {
    m3_cuda *cu = m3_cuda_of(be);
    bool one = rows >= 1 && rows <= GEMV_MAX_T && n >= 2 && n <= LMMA_GROUP_MAX;
    lmma_set set = {};
    int64_t tiles = 0, K = one ? w[0]->w.ne[1] : 0;
    for (int i = 0; one && i < n; i++) {
        const m3_linear *l = w[i];
        one = l->w.dtype == w[0]->w.dtype &&
              (l->w.dtype == M3_DT_BF16 || l->w.dtype == M3_DT_F8_E4M3) && l->w.ne[1] == K &&
              m3_cuda_k_chunks(l) == m3_cuda_k_chunks(w[0]) && vector_ok(l, x, K);
        set.W[i] = gemv_weight_of(l);
        set.N[i] = l->w.ne[0];
        set.out[i] = out[i];
        tiles += (l->w.ne[0] + 15) / 16;
        set.tile_end[i] = tiles;
    }
    set.n = n;
    if (!one || tiles < cu->sm_count || tiles > INT32_MAX) {
        for (int i = 0; i < n; i++)
            M3_TRY(m3_cuda_linear(be, rows, x, w[i], out_dtype, out[i]));
        return M3_OK;
    }
    return launch_set(cu, set, w[0]->w.dtype == M3_DT_F8_E4M3, x, rows, (int)K,
                      m3_cuda_k_chunks(w[0]), out_dtype == M3_DT_F32);
}

/* ------------------------------------------------------------ fp32 weights */

/* out[t, n] = x[t] . w[n] with fp32 weights (the router), split over K:
 * one warp per output row n, each lane 4 consecutive weights per 16-byte
 * load, the T rows of x staged in shared memory a chunk at a time; the
 * partial of K slice blockIdx.y goes to part [splits, rows, N]. */
template <int T>
__global__ void __launch_bounds__(GEMV_THREADS)
    linear_f32w_kernel(const float *__restrict__ w, const uint16_t *__restrict__ x, int rows,
                       int K, int64_t N, int k_slice, float *__restrict__ part) {
    extern __shared__ uint4 smem_x[];
    uint16_t *xs = reinterpret_cast<uint16_t *>(smem_x);
    int64_t n = (int64_t)blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    int k0 = blockIdx.y * k_slice, k1 = min(K, k0 + k_slice);
    float acc[T];
#pragma unroll
    for (int t = 0; t < T; t++)
        acc[t] = 0.0f;
    auto row_ptr = [&](int t) { return x + (int64_t)t * K; };
    for (int kc = k0; kc < k1; kc += GEMV_KC) {
        int kn = k1 - kc < GEMV_KC ? k1 - kc : GEMV_KC;
        __syncthreads();
        gemv_stage_x<T>(xs, row_ptr, rows, kc, kn);
        __syncthreads();
        if (n >= N)
            continue;
        float4 wv[GEMV_KC / 128];
#pragma unroll
        for (int u = 0; u < GEMV_KC / 128; u++) { /* all loads first: many in flight */
            int k = u * 128 + lane * 4;
            wv[u] = k < kn ? ldg16f_pol(w + n * K + kc + k, l2_evict_first())
                           : make_float4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < GEMV_KC / 128; u++) {
            int k = u * 128 + lane * 4;
            if (k >= kn)
                continue;
#pragma unroll
            for (int t = 0; t < T; t++) {
                if (t > 0 && t >= rows) /* a padded row: nobody reads its sum */
                    break;
                const uint16_t *xr = xs + t * GEMV_KC + k;
                acc[t] += wv[u].x * m3_bf(xr[0]) + wv[u].y * m3_bf(xr[1]) +
                          wv[u].z * m3_bf(xr[2]) + wv[u].w * m3_bf(xr[3]);
            }
        }
    }
#pragma unroll
    for (int t = 0; t < T; t++) {
        if (t > 0 && t >= rows)
            break;
        float v = m3_warp_sum(acc[t]);
        if (lane == 0 && n < N)
            part[((int64_t)blockIdx.y * rows + t) * N + n] = v;
    }
}

/* One thread per output: any K, any alignment (the fallback). */
__global__ void linear_f32w_scalar_kernel(const float *w, const uint16_t *x, int rows, int64_t K,
                                          int64_t N, float *out) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (int64_t)rows * N)
        return;
    int64_t t = i / N, n = i % N;
    float acc = 0.0f;
    for (int64_t k = 0; k < K; k++)
        acc += w[n * K + k] * m3_bf(x[t * K + k]);
    out[i] = acc;
}

template <int T>
static m3_status launch_f32w(m3_cuda *cu, const uint16_t *x, const float *w, int rows, int K,
                             int64_t N, float *out) {
    int64_t n_tiles = (N + GEMV_WARPS - 1) / GEMV_WARPS;
    int splits = k_splits(cu, n_tiles, K);
    int chunks = (K + GEMV_KC - 1) / GEMV_KC;
    int k_slice = (chunks + splits - 1) / splits * GEMV_KC;
    float *part = out;
    if (splits > 1)
        M3_TRY(m3_cuda_workspace(cu, M3_CUDA_WS_LINEAR, (size_t)splits * rows * N * 4,
                                 (void **)&part));
    dim3 grid((unsigned)n_tiles, (unsigned)splits);
    size_t smem = (size_t)T * GEMV_KC * sizeof(uint16_t);
    linear_f32w_kernel<T><<<grid, GEMV_THREADS, smem, cu->stream>>>(w, x, rows, K, N, k_slice,
                                                                      part);
    M3_CUDA_LAUNCHED("linear_f32w_kernel");
    return splits > 1 ? finish_splitk(cu, part, splits, (int64_t)rows * N, false, true, out)
                      : M3_OK;
}

extern "C" m3_status m3_cuda_linear_f32w(m3_cuda *cu, int rows, const uint16_t *x,
                                         const float *w, int64_t n, int64_t k, float *out) {
    bool vec = k % 8 == 0 && ((uintptr_t)x | (uintptr_t)w) % 16 == 0 && k < INT32_MAX;
    for (int r0 = 0; r0 < rows; r0 += GEMV_MAX_T) {
        int cnt = rows - r0 < GEMV_MAX_T ? rows - r0 : GEMV_MAX_T;
        const uint16_t *xr = x + (int64_t)r0 * k;
        float *o = out + (int64_t)r0 * n;
        if (!vec) {
            int64_t total = (int64_t)cnt * n;
            linear_f32w_scalar_kernel<<<(unsigned)((total + 255) / 256), 256, 0, cu->stream>>>(
                w, xr, cnt, k, n, o);
            M3_CUDA_LAUNCHED("linear_f32w_scalar_kernel");
        } else if (cnt <= 1) {
            M3_TRY(launch_f32w<1>(cu, xr, w, cnt, (int)k, n, o));
        } else if (cnt <= 4) {
            M3_TRY(launch_f32w<4>(cu, xr, w, cnt, (int)k, n, o));
        } else {
            M3_TRY(launch_f32w<16>(cu, xr, w, cnt, (int)k, n, o));
        }
    }
    return M3_OK;
}
