/*
 * The DSpark drafter's attention on the GPU (backend op draft_attention,
 * docs/DSPARK.md; the CPU's is cpu/cpu_draft.c): each block row's query
 * heads over the context keys of the drafter's paged cache (positions
 * below the anchor's, optionally windowed) and then every row of the block,
 * with no causal order inside the block.
 *
 * One CTA per (row, query head), eight warps each taking runs of KB
 * consecutive keys (every eighth run), each lane holding D / 32 of the
 * head's dims. A warp asks for its run's page ids, then for all KB keys'
 * K and V rows at once, and only then computes: KB loads of each in flight
 * where the first version had one (a key's K, then its V, one dependent
 * round trip each: ~0.25 ms a draft layer over a 1K context on an H100,
 * docs/PERF.md, forty-first session). A warp keeps an online softmax (fp32)
 * over its runs, rescaled once a run, and the warps merge at the end.
 * Every query head of a KV group reads the group's keys again (from L2
 * after the first), so from cu->draft_split_from context keys (256 by
 * default) the split kernels of cuda_draft_split.cu run instead: this
 * kernel leaves such positions at once. Every request of a step in one
 * launch (request_view). The arithmetic is fp32 with its own order, so
 * tests compare it with the CPU's within bf16 tolerance.
 * Capturable (cu->stream only, nothing else; the block's position read
 * from device memory), so the draft step replays a graph.
 *
 * draft_argmax, the Markov head's step: the bias added to the row in one
 * elementwise kernel, the argmax by the greedy sampler's kernels
 * (cuda_sample.cu), and a one-thread kernel mapping its "every value NaN"
 * (-1) to token 0, so the next row's gather stays in range: the drafts
 * stay on the device between rows.
 */
#include <math.h>
#include <stdint.h>

#include "cuda/cuda_async.cuh"
#include "cuda/cuda_common.cuh"
#include "cuda/cuda_draft.cuh"
#include "cuda/cuda_internal.h"
#include "cuda/cuda_ksum.cuh"

namespace {

using namespace m3draft;

/* Contexts of split_from keys or more are left to the split kernels
 * (cuda_draft_split.cu), launched after this one where the table reaches
 * them (split_from INT64_MAX where it does not). */
template <int D>
__global__ void __launch_bounds__(kDraftThreads) draft_attention_kernel(const DraftArgs all,
                                                                        int64_t split_from) {
    const int per_request = all.rows * all.q_heads, i = blockIdx.x % per_request;
    const DraftArgs a = request_view<D>(all, blockIdx.x / per_request);
    const int64_t p = max(__ldg(a.pos), (int64_t)0);
    if (p - row_lo(a, p, 0) >= split_from)
        return;
    draft_attention_item<D, false>(a, i / a.q_heads, i % a.q_heads);
}

template <int D>
static m3_status launch_draft_attention(m3_cuda *cu, const DraftArgs &a) {
    const unsigned grid = (unsigned)(a.requests * a.rows * a.q_heads);
    const int64_t keys = (int64_t)a.max_blocks * M3_PAGE;
    const int64_t most = a.window > 0 && a.window < keys ? a.window : keys;
    const int64_t from = cu->draft_split_from;
    const bool split = most >= from; /* a position of this table reaches them */
    draft_attention_kernel<D><<<grid, kDraftThreads, 0, cu->stream>>>(a, split ? from : INT64_MAX);
    M3_CUDA_LAUNCHED("draft_attention_kernel");
    return split ? m3_draft_split_launch(cu, a, D, most, from) : M3_OK;
}

__global__ void draft_add_kernel(int vocab, float *row, const float *bias) {
    for (int v = blockIdx.x * blockDim.x + threadIdx.x; v < vocab; v += gridDim.x * blockDim.x)
        row[v] = __fadd_rn(row[v], bias[v]);
}

__global__ void draft_token_kernel(int32_t *token) {
    if (*token < 0)
        *token = 0;
}

/* ---- the Markov head's step in one launch (draft_markov) ---- */

constexpr int kMarkovThreads = 256;
constexpr int kMarkovPieces = 4; /* 32-column pieces of W2 a warp has in flight */

struct MarkovArgs {
    const uint16_t *w1, *w2; /* [V, R] bf16, rows w1_row / w2_row elements apart */
    int64_t w1_row, w2_row;
    const int32_t *prev;     /* [n] */
    float *rows;             /* [n] rows of V, row_stride apart */
    int64_t row_stride;
    int32_t *next;           /* [n] */
    unsigned long long *keys;/* [M3_MAX_MARKOV_REQS]: zero between launches */
    unsigned int *done;      /* CTAs finished: zero between launches */
    int n, vocab, rank, n_chunks;
};

/* A candidate as one 64-bit key whose unsigned order is the sampler's
 * (cuda_sample.cu): the higher value, then the lower id; -0 ties +0. Key 0
 * is no candidate (every value NaN). */
__device__ __forceinline__ unsigned long long markov_key(float v, int64_t id) {
    uint32_t u = __float_as_uint(v);
    u = u == 0x80000000u ? 0u : u;
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return ((unsigned long long)u << 32) | (0xffffffffu - (uint32_t)id);
}

/* Each warp takes 16-row tiles of W2 (a grid-stride loop) and computes
 * them against the n requests' W1 rows exactly as the linear op's tensor
 * core kernel does (cuda_linear.cu: the same fragments, pieces in order
 * within a K chunk, the chunks as ksum's tree), so row += bias gives the
 * bits of gather_rows + linear + draft_argmax's add. Each lane keeps the
 * best key of its two requests; the CTA's bests meet in shared memory,
 * then in global keys by atomicMax, and the last CTA to finish writes the
 * tokens and zeroes the keys and its counter for the next launch. */
__global__ void __launch_bounds__(kMarkovThreads, 2) markov_step_kernel(MarkovArgs a) {
    __shared__ unsigned long long best_s[M3_MAX_MARKOV_REQS];
    __shared__ bool last;
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    if (threadIdx.x < M3_MAX_MARKOV_REQS)
        best_s[threadIdx.x] = 0;
    __syncthreads();
    const bool have_x = g < a.n; /* x row g of the MMA: request g's W1 row */
    const uint16_t *xrow = a.w1 + (have_x ? (int64_t)a.prev[g] : 0) * a.w1_row;
    const int64_t tiles = ((int64_t)a.vocab + 15) / 16;
    const int64_t warps = (int64_t)gridDim.x * (kMarkovThreads / 32);
    const uint64_t pol = l2_evict_first();
    const uint4 z = make_uint4(0, 0, 0, 0);
    unsigned long long best[2] = {0, 0}; /* requests 2q and 2q + 1 */
    for (int64_t tile = (int64_t)blockIdx.x * (kMarkovThreads / 32) + (threadIdx.x >> 5);
         tile < tiles; tile += warps) {
        const int64_t n0 = tile * 16;
        const bool row_a = n0 + g < a.vocab, row_b = n0 + g + 8 < a.vocab;
        const uint16_t *wa = a.w2 + (row_a ? n0 + g : 0) * a.w2_row;
        const uint16_t *wb = a.w2 + (row_b ? n0 + g + 8 : 0) * a.w2_row;
        float lv[4][KSUM_LEVELS];
        for (int c = 0; c < a.n_chunks; c++) {
            int k0, k1;
            ksum_bounds(a.rank, a.n_chunks, c, &k0, &k1);
            float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            for (int p0 = k0; p0 < k1; p0 += 32 * kMarkovPieces) {
                uint4 va[kMarkovPieces], vb[kMarkovPieces], xv[kMarkovPieces];
#pragma unroll
                for (int u = 0; u < kMarkovPieces; u++) {
                    const int k = p0 + u * 32 + q * 8;
                    const bool in = k < k1;
                    va[u] = in && row_a ? ldg16_pol(wa + k, pol) : z;
                    vb[u] = in && row_b ? ldg16_pol(wb + k, pol) : z;
                    xv[u] = in && have_x ? __ldg(reinterpret_cast<const uint4 *>(xrow + k)) : z;
                }
#pragma unroll
                for (int u = 0; u < kMarkovPieces; u++) {
                    if (p0 + u * 32 >= k1) /* warp-uniform: past the chunk */
                        break;
                    const uint32_t lo[4] = {va[u].x, vb[u].x, va[u].y, vb[u].y};
                    const uint32_t hi[4] = {va[u].z, vb[u].z, va[u].w, vb[u].w};
                    mma_bf16(acc, lo, xv[u].x, xv[u].y);
                    mma_bf16(acc, hi, xv[u].z, xv[u].w);
                }
            }
#pragma unroll
            for (int i = 0; i < 4; i++)
                ksum_push(lv[i], c, acc[i]);
        }
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int64_t v = n0 + g + (i >= 2 ? 8 : 0);
            const int t = 2 * q + (i & 1);
            if (v >= a.vocab || t >= a.n)
                continue;
            float *row = a.rows + (int64_t)t * a.row_stride;
            const float x = row[v] + ksum_fold(lv[i], a.n_chunks);
            row[v] = x;
            if (!isnan(x))
                best[i & 1] = max(best[i & 1], markov_key(x, v));
        }
    }
    /* lanes of one q hold the same two requests: reduce over g */
#pragma unroll
    for (int o = 4; o < 32; o <<= 1)
#pragma unroll
        for (int h = 0; h < 2; h++)
            best[h] = max(best[h], __shfl_xor_sync(0xffffffffu, best[h], o));
    if (g == 0)
#pragma unroll
        for (int h = 0; h < 2; h++)
            if (2 * q + h < a.n && best[h])
                atomicMax(&best_s[2 * q + h], best[h]);
    __syncthreads();
    if (threadIdx.x < a.n && best_s[threadIdx.x])
        atomicMax(&a.keys[threadIdx.x], best_s[threadIdx.x]);
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0)
        last = atomicAdd(a.done, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last)
        return;
    __threadfence();
    if (threadIdx.x < a.n) {
        const unsigned long long k = atomicExch(&a.keys[threadIdx.x], 0ull);
        a.next[threadIdx.x] = k ? (int32_t)(0xffffffffu - (uint32_t)k) : 0;
    }
    if (threadIdx.x == 0)
        *a.done = 0u;
}

} // namespace

extern "C" m3_status m3_cuda_draft_argmax(m3_backend *be, int vocab, float *row,
                                          const float *bias, int32_t *token) {
    m3_cuda *cu = m3_cuda_of(be);
    if (vocab < 1 || !row || !token)
        return m3_fail(M3_ERR_INVALID_ARG, "draft argmax: vocab %d, row and token are required",
                       vocab);
    if (bias) {
        const int threads = 256, blocks = (vocab + threads - 1) / threads;
        draft_add_kernel<<<blocks < 1024 ? blocks : 1024, threads, 0, cu->stream>>>(vocab, row,
                                                                                 bias);
        M3_CUDA_LAUNCHED("draft_add_kernel");
    }
    M3_TRY(m3_cuda_sample(be, 1, row, vocab, 0.0f, 0, NULL, token));
    draft_token_kernel<<<1, 1, 0, cu->stream>>>(token);
    M3_CUDA_LAUNCHED("draft_token_kernel");
    return M3_OK;
}

extern "C" m3_status m3_cuda_draft_attention(m3_backend *be, int requests, int rows,
                                             int q_heads, int kv_heads, int dim,
                                             const uint16_t *q, const uint16_t *bk,
                                             const uint16_t *bv, const uint16_t *kcache,
                                             const uint16_t *vcache, const int32_t *pages,
                                             int max_blocks, const int64_t *pos, int64_t window,
                                             float scale, uint16_t *out) {
    m3_cuda *cu = m3_cuda_of(be);
    /* (the positions are in device memory: the caller checked them; a
     * negative one reads no context) */
    if (requests < 1 || rows < 1 || !pos || window < 0 || q_heads < 1 || kv_heads < 1 ||
        q_heads % kv_heads || max_blocks < 0)
        return m3_fail(M3_ERR_INVALID_ARG, "draft attention: %d requests of %d rows, a block "
                       "table of %d pages, window %lld, %d / %d heads, positions %s", requests,
                       rows, max_blocks, (long long)window, q_heads, kv_heads,
                       pos ? "given" : "missing");
    if ((int64_t)requests * rows * q_heads > INT32_MAX)
        return m3_fail(M3_ERR_UNSUPPORTED, "draft attention: %d requests x %d rows x %d heads",
                       requests, rows, q_heads);
    DraftArgs a = {q,    bk,      bv,       kcache, vcache, pages,    pos,       window,
                   rows, q_heads, kv_heads, scale,  out,    requests, max_blocks};
    switch (dim) {
    case 32: return launch_draft_attention<32>(cu, a);
    case 64: return launch_draft_attention<64>(cu, a);
    case 96: return launch_draft_attention<96>(cu, a);
    case 128: return launch_draft_attention<128>(cu, a);
    case 160: return launch_draft_attention<160>(cu, a);
    case 192: return launch_draft_attention<192>(cu, a);
    case 224: return launch_draft_attention<224>(cu, a);
    case 256: return launch_draft_attention<256>(cu, a);
    default:
        return m3_fail(M3_ERR_UNSUPPORTED, "draft attention: head dim %d is not supported "
                       "(multiples of 32 up to 256)", dim);
    }
}

/* The Markov step's state (keys and counter), zeroed here, outside any
 * capture: the kernel leaves it zeroed after every launch. */
static m3_status markov_state(m3_cuda *cu, bool reset, unsigned long long **keys,
                              unsigned int **done) {
    void *ws = NULL;
    const size_t bytes = M3_MAX_MARKOV_REQS * sizeof(unsigned long long) + 256;
    M3_TRY(m3_cuda_workspace(cu, M3_CUDA_WS_MARKOV, bytes, &ws));
    if (reset)
        M3_CUDA_TRY(cudaMemsetAsync(ws, 0, bytes, cu->stream));
    *keys = static_cast<unsigned long long *>(ws);
    *done = reinterpret_cast<unsigned int *>(*keys + M3_MAX_MARKOV_REQS);
    return M3_OK;
}

extern "C" m3_status m3_cuda_draft_markov(m3_backend *be, int n, const m3_tensor *w1,
                                          const m3_tensor *w2, const int32_t *prev, float *rows,
                                          int64_t row_stride, int32_t *next) {
    m3_cuda *cu = m3_cuda_of(be);
    if (!w1 || !w2 || n < 0 || n > M3_MAX_MARKOV_REQS)
        return m3_fail(M3_ERR_INVALID_ARG, "draft markov: %d requests (0 to %d) and both "
                       "weights", n, M3_MAX_MARKOV_REQS);
    const int64_t V = w2->ne[0], R = w2->ne[1];
    const int chunks = m3_k_chunks(R);
    /* the linear op's tensor-core shapes (cuda_linear.cu vector_ok), so the
     * sums are its sums; others run gather_rows + linear + draft_argmax */
    const uintptr_t align = (uintptr_t)w1->data | (uintptr_t)w2->data;
    if (w1->dtype != M3_DT_BF16 || w2->dtype != M3_DT_BF16 || w1->ne[1] != R || R < 1 ||
        V < 1 || V > INT32_MAX || R % (8 * chunks) || align % 16 || w1->nb[0] % 16 ||
        w2->nb[0] % 16)
        return m3_fail(M3_ERR_UNSUPPORTED, "draft markov: W1 %s [%lld, %lld], W2 %s [%lld, %lld] "
                       "(bf16, rank a multiple of %d, 16-byte rows)", m3_dtype_name(w1->dtype),
                       (long long)w1->ne[0], (long long)w1->ne[1], m3_dtype_name(w2->dtype),
                       (long long)V, (long long)R, 8 * chunks);
    unsigned long long *keys = NULL;
    unsigned int *done = NULL;
    if (n == 0) /* the probe: shapes taken, state sized and zeroed */
        return markov_state(cu, !cu->capturing, &keys, &done);
    if (!prev || !rows || !next || row_stride < V)
        return m3_fail(M3_ERR_INVALID_ARG, "draft markov: rows %lld apart for a vocabulary of "
                       "%lld, with the previous and next tokens", (long long)row_stride,
                       (long long)V);
    M3_TRY(markov_state(cu, false, &keys, &done));
    MarkovArgs a = {static_cast<const uint16_t *>(w1->data),
                    static_cast<const uint16_t *>(w2->data),
                    w1->nb[0] / 2, w2->nb[0] / 2, prev, rows, row_stride, next, keys, done, n,
                    (int)V, (int)R, chunks};
    const int64_t tiles = (V + 15) / 16, per_cta = kMarkovThreads / 32;
    int64_t grid = (tiles + per_cta - 1) / per_cta;
    grid = grid < 2 * (int64_t)cu->sm_count ? grid : 2 * (int64_t)cu->sm_count;
    markov_step_kernel<<<(unsigned)grid, kMarkovThreads, 0, cu->stream>>>(a);
    M3_CUDA_LAUNCHED("markov_step_kernel");
    return M3_OK;
}
