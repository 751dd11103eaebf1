/*
 * The DSpark drafter's attention on the GPU (backend op draft_attention,
 * docs/DSPARK.md; the CPU's is cpu/cpu_draft.c): each block row's query
 * heads over the context keys of the drafter's paged cache (positions
 * below the anchor's, optionally windowed) and then every row of the block,
 * with no causal order inside the block.
 *
 * A first version for correctness, not the fused drafter kernels: one CTA
 * per (row, query head), four warps taking every fourth key, each lane
 * holding D / 32 of the head's dims; a warp keeps an online softmax (fp32)
 * over its keys, and the four merge at the end. Every query head of a KV
 * group reads the group's keys again (16 times on M3), and a warp has one
 * key's K, then its V, in flight: over a 1K context this takes ~0.25 ms of
 * a draft layer's ~0.45 on an H100 (docs/PERF.md, forty-first session).
 * The arithmetic is fp32 with its own order, so tests compare it with the
 * CPU's within bf16 tolerance.
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

#include "cuda/cuda_common.cuh"
#include "cuda/cuda_internal.h"

namespace {

constexpr int kDraftThreads = 128;
constexpr int kDraftWarps = kDraftThreads / 32;

struct DraftArgs {
    const uint16_t *q, *bk, *bv, *kc, *vc;
    const int32_t *pages;
    const int64_t *pos; /* pos[0]: the block's first position */
    int64_t window;
    int rows, q_heads, kv_heads;
    float scale;
    uint16_t *out;
};

/* Key (or value) i of row t's list, KV head g: context position lo + i
 * while i < n_ctx, else block row i - n_ctx. */
template <int D>
__device__ __forceinline__ const uint16_t *draft_key(const DraftArgs &a, int g, int64_t lo,
                                                     int64_t n_ctx, int64_t i, bool value) {
    if (i < n_ctx) {
        int64_t pos = lo + i;
        int64_t page = a.pages[pos / M3_PAGE];
        return (value ? a.vc : a.kc) + ((page * a.kv_heads + g) * M3_PAGE + pos % M3_PAGE) * D;
    }
    return (value ? a.bv : a.bk) + ((i - n_ctx) * a.kv_heads + g) * D;
}

template <int D>
__global__ void __launch_bounds__(kDraftThreads) draft_attention_kernel(const DraftArgs a) {
    constexpr int E = D / 32; /* dims per lane */
    __shared__ float s_m[kDraftWarps], s_l[kDraftWarps];
    __shared__ float s_acc[kDraftWarps][D];
    const int t = blockIdx.x / a.q_heads, h = blockIdx.x % a.q_heads;
    const int g = h / (a.q_heads / a.kv_heads);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t p = max(__ldg(a.pos), (int64_t)0);
    int64_t lo = 0;
    if (a.window > 0 && p + t - a.window + 1 > 0)
        lo = p + t - a.window + 1;
    if (lo > p)
        lo = p;
    const int64_t n_ctx = p - lo, n = n_ctx + a.rows;
    float q[E], acc[E];
    const uint16_t *qrow = a.q + ((int64_t)t * a.q_heads + h) * D + lane * E;
#pragma unroll
    for (int e = 0; e < E; e++) {
        q[e] = m3_bf(qrow[e]);
        acc[e] = 0.0f;
    }
    float m = -INFINITY, l = 0.0f;
    for (int64_t i = warp; i < n; i += kDraftWarps) {
        const uint16_t *k = draft_key<D>(a, g, lo, n_ctx, i, false) + lane * E;
        float dot = 0.0f;
#pragma unroll
        for (int e = 0; e < E; e++)
            dot = fmaf(q[e], m3_bf(k[e]), dot);
        const float s = m3_warp_sum(dot) * a.scale;
        const float m_new = fmaxf(m, s);
        const float c = m == -INFINITY ? 0.0f : expf(m - m_new), pr = expf(s - m_new);
        l = l * c + pr;
        const uint16_t *v = draft_key<D>(a, g, lo, n_ctx, i, true) + lane * E;
#pragma unroll
        for (int e = 0; e < E; e++)
            acc[e] = acc[e] * c + pr * m3_bf(v[e]);
        m = m_new;
    }
    if (lane == 0) {
        s_m[warp] = m;
        s_l[warp] = l;
    }
#pragma unroll
    for (int e = 0; e < E; e++)
        s_acc[warp][lane * E + e] = acc[e];
    __syncthreads();
    float m_all = -INFINITY;
    for (int w = 0; w < kDraftWarps; w++)
        m_all = fmaxf(m_all, s_m[w]);
    float l_all = 0.0f, f[kDraftWarps];
    for (int w = 0; w < kDraftWarps; w++) {
        f[w] = s_m[w] == -INFINITY ? 0.0f : expf(s_m[w] - m_all); /* a warp with no key: 0 */
        l_all += s_l[w] * f[w];
    }
    uint16_t *out = a.out + ((int64_t)t * a.q_heads + h) * D;
    for (int d = threadIdx.x; d < D; d += kDraftThreads) {
        float o = 0.0f;
        for (int w = 0; w < kDraftWarps; w++)
            o += s_acc[w][d] * f[w];
        out[d] = m3_to_bf(o / l_all);
    }
}

__global__ void draft_add_kernel(int vocab, float *row, const float *bias) {
    for (int v = blockIdx.x * blockDim.x + threadIdx.x; v < vocab; v += gridDim.x * blockDim.x)
        row[v] = __fadd_rn(row[v], bias[v]);
}

__global__ void draft_token_kernel(int32_t *token) {
    if (*token < 0)
        *token = 0;
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

extern "C" m3_status m3_cuda_draft_attention(m3_backend *be, int rows, int q_heads, int kv_heads,
                                             int dim, const uint16_t *q, const uint16_t *bk,
                                             const uint16_t *bv, const uint16_t *kcache,
                                             const uint16_t *vcache, const int32_t *pages,
                                             const int64_t *pos, int64_t window, float scale,
                                             uint16_t *out) {
    m3_cuda *cu = m3_cuda_of(be);
    /* (pos[0] is in device memory: the caller checked it; a negative one
     * reads no context) */
    if (rows < 1 || !pos || window < 0 || q_heads < 1 || kv_heads < 1 || q_heads % kv_heads)
        return m3_fail(M3_ERR_INVALID_ARG, "draft attention: %d rows, window %lld, %d / %d "
                       "heads, positions %s", rows, (long long)window, q_heads, kv_heads,
                       pos ? "given" : "missing");
    if ((int64_t)rows * q_heads > INT32_MAX)
        return m3_fail(M3_ERR_UNSUPPORTED, "draft attention: %d rows x %d heads", rows, q_heads);
    DraftArgs a = {q, bk, bv, kcache, vcache, pages, pos, window, rows, q_heads, kv_heads, scale,
                   out};
    const unsigned grid = (unsigned)(rows * q_heads);
    switch (dim) {
    case 32: draft_attention_kernel<32><<<grid, kDraftThreads, 0, cu->stream>>>(a); break;
    case 64: draft_attention_kernel<64><<<grid, kDraftThreads, 0, cu->stream>>>(a); break;
    case 96: draft_attention_kernel<96><<<grid, kDraftThreads, 0, cu->stream>>>(a); break;
    case 128: draft_attention_kernel<128><<<grid, kDraftThreads, 0, cu->stream>>>(a); break;
    case 160: draft_attention_kernel<160><<<grid, kDraftThreads, 0, cu->stream>>>(a); break;
    case 192: draft_attention_kernel<192><<<grid, kDraftThreads, 0, cu->stream>>>(a); break;
    case 224: draft_attention_kernel<224><<<grid, kDraftThreads, 0, cu->stream>>>(a); break;
    case 256: draft_attention_kernel<256><<<grid, kDraftThreads, 0, cu->stream>>>(a); break;
    default:
        return m3_fail(M3_ERR_UNSUPPORTED, "draft attention: head dim %d is not supported "
                       "(multiples of 32 up to 256)", dim);
    }
    M3_CUDA_LAUNCHED("draft_attention_kernel");
    return M3_OK;
}
