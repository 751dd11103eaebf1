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
 * after the first). The arithmetic is fp32 with its own order, so tests
 * compare it with the CPU's within bf16 tolerance.
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
#include "cuda/cuda_internal.h"
#include "cuda/cuda_ksum.cuh"

namespace {

constexpr int kDraftThreads = 256;
constexpr int kDraftWarps = kDraftThreads / 32;

/* keys a warp has in flight: fewer for wide heads, whose raw rows take
 * twice the registers */
template <int D>
__host__ __device__ constexpr int draft_run() {
    return D <= 128 ? 8 : 4;
}

/* E consecutive bf16 values (a lane's share of a row), raw, two to a word */
template <int E>
struct RawBf16 {
    uint32_t w[(E + 1) / 2];
};

template <int E>
__device__ __forceinline__ void load_raw(RawBf16<E> &r, const uint16_t *p) {
    if constexpr (E % 4 == 0) { /* 8-byte aligned: the row's base and lane * E * 2 */
#pragma unroll
        for (int i = 0; i < E / 4; i++) {
            const uint2 v = __ldg(reinterpret_cast<const uint2 *>(p) + i);
            r.w[2 * i] = v.x;
            r.w[2 * i + 1] = v.y;
        }
    } else if constexpr (E % 2 == 0) {
#pragma unroll
        for (int i = 0; i < E / 2; i++)
            r.w[i] = __ldg(reinterpret_cast<const uint32_t *>(p) + i);
    } else {
#pragma unroll
        for (int i = 0; i < (E + 1) / 2; i++)
            r.w[i] = 0;
#pragma unroll
        for (int e = 0; e < E; e++)
            r.w[e / 2] |= (uint32_t)__ldg(p + e) << (16 * (e % 2));
    }
}

template <int E>
__device__ __forceinline__ float raw_at(const RawBf16<E> &r, int e) {
    return __uint_as_float(e % 2 ? r.w[e / 2] & 0xffff0000u : r.w[e / 2] << 16);
}

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
    constexpr int E = D / 32;            /* dims per lane */
    constexpr int KB = draft_run<D>();   /* a run: keys in flight per warp */
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
    for (int64_t i0 = (int64_t)warp * KB; i0 < n; i0 += (int64_t)kDraftWarps * KB) {
        /* the run's rows: page ids first (one round trip for all), then
         * every K and V row, then the products */
        const uint16_t *kp[KB], *vp[KB];
#pragma unroll
        for (int j = 0; j < KB; j++) {
            const int64_t i = min(i0 + j, n - 1); /* past the end: a valid row, weight 0 */
            kp[j] = draft_key<D>(a, g, lo, n_ctx, i, false) + lane * E;
            vp[j] = draft_key<D>(a, g, lo, n_ctx, i, true) + lane * E;
        }
        RawBf16<E> kr[KB], vr[KB];
#pragma unroll
        for (int j = 0; j < KB; j++) {
            load_raw<E>(kr[j], kp[j]);
            load_raw<E>(vr[j], vp[j]);
        }
        float sc[KB];
        float m_new = m;
#pragma unroll
        for (int j = 0; j < KB; j++) {
            float dot = 0.0f;
#pragma unroll
            for (int e = 0; e < E; e++)
                dot = fmaf(q[e], raw_at<E>(kr[j], e), dot);
            sc[j] = i0 + j < n ? m3_warp_sum(dot) * a.scale : -INFINITY;
            m_new = fmaxf(m_new, sc[j]);
        }
        /* m_new is finite: the run's first key exists (i0 < n) */
        const float c = m == -INFINITY ? 0.0f : expf(m - m_new);
        l *= c;
#pragma unroll
        for (int e = 0; e < E; e++)
            acc[e] *= c;
#pragma unroll
        for (int j = 0; j < KB; j++) {
            const float pr = i0 + j < n ? expf(sc[j] - m_new) : 0.0f;
            l += pr;
#pragma unroll
            for (int e = 0; e < E; e++)
                acc[e] = fmaf(pr, raw_at<E>(vr[j], e), acc[e]);
        }
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
    MarkovArgs a = {static_cast<const uint16_t *>(w1->data), static_cast<const uint16_t *>(w2->data),
                    w1->nb[0] / 2, w2->nb[0] / 2, prev, rows, row_stride, next, keys, done, n,
                    (int)V, (int)R, chunks};
    const int64_t tiles = (V + 15) / 16, per_cta = kMarkovThreads / 32;
    int64_t grid = (tiles + per_cta - 1) / per_cta;
    grid = grid < 2 * (int64_t)cu->sm_count ? grid : 2 * (int64_t)cu->sm_count;
    markov_step_kernel<<<(unsigned)grid, kMarkovThreads, 0, cu->stream>>>(a);
    M3_CUDA_LAUNCHED("markov_step_kernel");
    return M3_OK;
}
