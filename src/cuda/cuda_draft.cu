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
#include "cuda/cuda_draft.cuh"
#include "cuda/cuda_internal.h"
#include "cuda/cuda_ksum.cuh"

namespace {

using namespace m3draft;

/* split: the long-context kernels below were launched too, and take the
 * contexts of kSplitFrom keys or more */
template <int D>
__global__ void __launch_bounds__(kDraftThreads) draft_attention_kernel(const DraftArgs a,
                                                                        bool split);

/* ---- long contexts: the keys split over CTAs, every query of a KV group
 * run against a split's keys from shared memory ----
 * The kernel above gives each (row, query head) its own CTA, each walking
 * the whole context: at 32K keys the 7 rows x 16 heads of a KV group read
 * its keys 112 times (1.7 ms a draft layer on an H100, docs/PERF.md,
 * forty-fifth session). Here a CTA takes one split of up to kSplitKeys
 * context keys of one KV head, loads their K and V rows into shared
 * memory once, and runs every query of the group against them (a warp
 * per query at a time: a lane per key for the scores, a lane per D / 32
 * dims for the values), keeping an online softmax per query; it writes
 * (m, l, acc) per (query, split). draft_merge_kernel then takes a query's
 * splits and the block's own keys into one softmax. The grid is fixed by
 * the block table's capacity (so a graph serves every position); splits
 * past the block's position leave at once, and both kernels leave at once
 * where the context is short enough for the kernel above (kSplitFrom
 * keys), which then runs: all three are launched, one does the work. */
constexpr int kSplitFrom = 2048;   /* context keys from which the split kernels run */
constexpr int kSplitMin = 64;      /* fewest keys a split takes */
constexpr int kSplitWide = 128;    /* splits a KV head has at least, where the keys allow */
constexpr int kSplitMax = 8192;    /* most splits of a KV head (2M keys at head dim 128) */

template <int D>
__host__ __device__ constexpr int split_keys() { /* K and V rows of a split: ~128 KB */
    return 32768 / D / 32 * 32;
}

struct SplitArgs {
    DraftArgs a;
    float *part;   /* [splits][rows * q_heads][D + 2]: acc, m, l */
    int splits;    /* the grid's splits a KV head */
};

/* The context every row's range lies in ([lo, p): row 0's, the widest),
 * and how it is split: `per` keys a split (kSplitWide splits where each
 * then has kSplitMin keys or more and fits shared memory), `active`
 * splits (never more than the grid's: the host sized it for the table). */
struct SplitPlan {
    int64_t p, lo;
    int per, active;
};

__device__ __forceinline__ SplitPlan split_plan(const DraftArgs &a, int splits, int max_per) {
    SplitPlan s;
    s.p = max(__ldg(a.pos), (int64_t)0);
    s.lo = row_lo(a, s.p, 0);
    const int64_t n = s.p - s.lo;
    int64_t per = (n + kSplitWide - 1) / kSplitWide;
    per = per < kSplitMin ? kSplitMin : (per + 31) / 32 * 32;
    s.per = (int)(per < max_per ? per : max_per);
    s.active = (int)((n + s.per - 1) / s.per);
    s.active = s.active < splits ? s.active : splits; /* (the host sized splits for n) */
    return s;
}

template <int D>
__global__ void __launch_bounds__(kDraftThreads) draft_split_kernel(const SplitArgs sa) {
    constexpr int E = D / 32, KS = split_keys<D>(), KW = D / 2 + 1; /* K row: words, padded */
    extern __shared__ __align__(16) uint32_t smem[];
    uint32_t *ks = smem;                                   /* [KS][KW] */
    uint16_t *vs = reinterpret_cast<uint16_t *>(smem + KS * KW); /* [KS][D] */
    float *qs = reinterpret_cast<float *>(vs + KS * D);    /* [warps][D] */
    const DraftArgs &a = sa.a;
    const int g = blockIdx.x, s = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const SplitPlan pl = split_plan(a, sa.splits, KS);
    if (pl.p - pl.lo < kSplitFrom || s >= pl.active)
        return;
    const int64_t k0 = pl.lo + (int64_t)s * pl.per, k1 = min(pl.p, k0 + pl.per);
    const int nk = (int)(k1 - k0);
    /* the split's K and V rows, 8 bf16 a load */
    for (int i = threadIdx.x; i < nk * (D / 8); i += kDraftThreads) {
        const int key = i / (D / 8), c = i % (D / 8);
        const int64_t pos = k0 + key, page = __ldg(a.pages + pos / M3_PAGE);
        const int64_t off = ((page * a.kv_heads + g) * M3_PAGE + pos % M3_PAGE) * D + c * 8;
        const uint4 kv = __ldg(reinterpret_cast<const uint4 *>(a.kc + off));
        const uint4 vv = __ldg(reinterpret_cast<const uint4 *>(a.vc + off));
        uint32_t *kr = ks + key * KW + c * 4; /* (4-byte aligned only: the padding) */
        kr[0] = kv.x, kr[1] = kv.y, kr[2] = kv.z, kr[3] = kv.w;
        *reinterpret_cast<uint4 *>(vs + key * D + c * 8) = vv;
    }
    __syncthreads();
    const int G = a.q_heads / a.kv_heads, Q = a.rows * G;
    float *qw = qs + warp * D;
    for (int qi = warp; qi < Q; qi += kDraftWarps) {
        const int t = qi / G, h = g * G + qi % G;
        const int64_t lo_t = row_lo(a, pl.p, t);
        const uint16_t *qrow = a.q + ((int64_t)t * a.q_heads + h) * D;
        for (int d = lane; d < D; d += 32)
            qw[d] = m3_bf(qrow[d]);
        __syncwarp();
        float m = -INFINITY, l = 0.0f, acc[E];
#pragma unroll
        for (int e = 0; e < E; e++)
            acc[e] = 0.0f;
        for (int j0 = 0; j0 < nk; j0 += 32) {
            const int j = j0 + lane;
            const bool valid = j < nk && k0 + j >= lo_t;
            float dot = 0.0f;
            if (j < nk) {
                const uint32_t *kr = ks + j * KW;
#pragma unroll 8
                for (int w = 0; w < D / 2; w++) {
                    const uint32_t kk = kr[w];
                    dot = fmaf(qw[2 * w], __uint_as_float(kk << 16), dot);
                    dot = fmaf(qw[2 * w + 1], __uint_as_float(kk & 0xffff0000u), dot);
                }
            }
            const float sc = valid ? dot * a.scale : -INFINITY;
            const float m_new = fmaxf(m, m3_warp_max(sc));
            if (m_new == -INFINITY) /* no key of this row yet (warp-uniform) */
                continue;
            const float c = m == -INFINITY ? 0.0f : expf(m - m_new);
            const float pr = valid ? expf(sc - m_new) : 0.0f;
            l = l * c + m3_warp_sum(pr);
#pragma unroll
            for (int e = 0; e < E; e++)
                acc[e] *= c;
            const int nj = min(32, nk - j0);
            for (int jj = 0; jj < nj; jj++) {
                const float pj = __shfl_sync(0xffffffffu, pr, jj);
                const uint16_t *vr = vs + (j0 + jj) * D + lane * E;
#pragma unroll
                for (int e = 0; e < E; e++)
                    acc[e] = fmaf(pj, m3_bf(vr[e]), acc[e]);
            }
            m = m_new;
        }
        float *o = sa.part + ((int64_t)s * Q * a.kv_heads + (int64_t)t * a.q_heads + h) * (D + 2);
#pragma unroll
        for (int e = 0; e < E; e++)
            o[lane * E + e] = acc[e];
        if (lane == 0) {
            o[D] = m;
            o[D + 1] = l;
        }
        __syncwarp(); /* qw is this warp's next query's */
    }
}

/* One warp per (row, query head): the splits' partials and the block's
 * own keys (every row of it, no causal order) as one softmax. */
template <int D>
__global__ void __launch_bounds__(kDraftThreads) draft_merge_kernel(const SplitArgs sa) {
    constexpr int E = D / 32;
    const DraftArgs &a = sa.a;
    const int lane = threadIdx.x & 31;
    const int qi = blockIdx.x * kDraftWarps + (threadIdx.x >> 5);
    const SplitPlan pl = split_plan(a, sa.splits, split_keys<D>());
    if (pl.p - pl.lo < kSplitFrom || qi >= a.rows * a.q_heads)
        return;
    const int g = (qi % a.q_heads) / (a.q_heads / a.kv_heads);
    const int64_t Qall = (int64_t)a.rows * a.q_heads;
    float q[E];
#pragma unroll
    for (int e = 0; e < E; e++)
        q[e] = m3_bf(a.q[(int64_t)qi * D + lane * E + e]);
    /* the block's keys' scores (the same in every lane) */
    float sb[M3_CUDA_DRAFT_MAX_ROWS];
    float mx = -INFINITY;
    for (int b = 0; b < a.rows; b++) {
        const uint16_t *kr = a.bk + ((int64_t)b * a.kv_heads + g) * D + lane * E;
        float dot = 0.0f;
#pragma unroll
        for (int e = 0; e < E; e++)
            dot = fmaf(q[e], m3_bf(kr[e]), dot);
        sb[b] = m3_warp_sum(dot) * a.scale;
        mx = fmaxf(mx, sb[b]);
    }
    for (int s = 0; s < pl.active; s++)
        mx = fmaxf(mx, sa.part[((int64_t)s * Qall + qi) * (D + 2) + D]);
    float l = 0.0f, acc[E];
#pragma unroll
    for (int e = 0; e < E; e++)
        acc[e] = 0.0f;
    for (int s = 0; s < pl.active; s++) {
        const float *pp = sa.part + ((int64_t)s * Qall + qi) * (D + 2);
        const float ms = pp[D];
        if (ms == -INFINITY) /* a split with none of this row's keys */
            continue;
        const float f = expf(ms - mx);
        l = fmaf(pp[D + 1], f, l);
#pragma unroll
        for (int e = 0; e < E; e++)
            acc[e] = fmaf(pp[lane * E + e], f, acc[e]);
    }
    for (int b = 0; b < a.rows; b++) {
        const float f = expf(sb[b] - mx);
        const uint16_t *vr = a.bv + ((int64_t)b * a.kv_heads + g) * D + lane * E;
        l += f;
#pragma unroll
        for (int e = 0; e < E; e++)
            acc[e] = fmaf(f, m3_bf(vr[e]), acc[e]);
    }
    uint16_t *out = a.out + (int64_t)qi * D + lane * E;
#pragma unroll
    for (int e = 0; e < E; e++)
        out[e] = m3_to_bf(acc[e] / l);
}

template <int D>
__global__ void __launch_bounds__(kDraftThreads) draft_attention_kernel(const DraftArgs a,
                                                                        bool split) {
    if (split) {
        const SplitPlan pl = split_plan(a, 1, 1);
        if (pl.p - pl.lo >= kSplitFrom)
            return;
    }
    draft_attention_item<D, false>(a, blockIdx.x / a.q_heads, blockIdx.x % a.q_heads);
}

template <int D>
static m3_status launch_draft_attention(m3_cuda *cu, const DraftArgs &a, int max_blocks) {
    const unsigned grid = (unsigned)(a.rows * a.q_heads);
    const int64_t keys = (int64_t)max_blocks * M3_PAGE;
    const int64_t most = a.window > 0 && a.window < keys ? a.window : keys;
    const bool split = most >= kSplitFrom; /* a position of this table reaches them */
    draft_attention_kernel<D><<<grid, kDraftThreads, 0, cu->stream>>>(a, split);
    M3_CUDA_LAUNCHED("draft_attention_kernel");
    if (!split)
        return M3_OK;
    if (a.rows > M3_CUDA_DRAFT_MAX_ROWS)
        return m3_fail(M3_ERR_UNSUPPORTED, "draft attention: %d block rows over a long context "
                       "(at most %d)", a.rows, M3_CUDA_DRAFT_MAX_ROWS);
    /* up to kSplitWide splits of kSplitMin keys or more; past that, as many
     * full splits as the keys need */
    int64_t splits = (most + kSplitMin - 1) / kSplitMin;
    splits = splits < kSplitWide ? splits : kSplitWide;
    const int64_t full = (most + split_keys<D>() - 1) / split_keys<D>();
    splits = splits > full ? splits : full;
    if (splits > kSplitMax)
        return m3_fail(M3_ERR_UNSUPPORTED, "draft attention: %lld context keys at head dim %d "
                       "(at most %lld)", (long long)most, D,
                       (long long)kSplitMax * split_keys<D>());
    SplitArgs sa = {a, nullptr, (int)splits};
    const size_t part = (size_t)splits * a.rows * a.q_heads * (D + 2) * sizeof(float);
    if ((int64_t)a.kv_heads * splits > INT32_MAX || splits > 65535)
        return m3_fail(M3_ERR_UNSUPPORTED, "draft attention: %lld splits", (long long)splits);
    M3_TRY(m3_cuda_workspace(cu, M3_CUDA_WS_DRAFT, part, (void **)&sa.part));
    constexpr int KS = split_keys<D>();
    const size_t smem = ((size_t)KS * (D / 2 + 1)) * 4 + (size_t)KS * D * 2 +
                        (size_t)kDraftWarps * D * 4;
    M3_CUDA_TRY(cudaFuncSetAttribute(draft_split_kernel<D>,
                                     cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    draft_split_kernel<D><<<dim3((unsigned)a.kv_heads, (unsigned)splits), kDraftThreads, smem,
                            cu->stream>>>(sa);
    M3_CUDA_LAUNCHED("draft_split_kernel");
    draft_merge_kernel<D><<<(grid + kDraftWarps - 1) / kDraftWarps, kDraftThreads, 0,
                            cu->stream>>>(sa);
    M3_CUDA_LAUNCHED("draft_merge_kernel");
    return M3_OK;
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
                                             int max_blocks, const int64_t *pos, int64_t window,
                                             float scale, uint16_t *out) {
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
    if (max_blocks < 0)
        return m3_fail(M3_ERR_INVALID_ARG, "draft attention: a block table of %d pages",
                       max_blocks);
    switch (dim) {
    case 32: return launch_draft_attention<32>(cu, a, max_blocks);
    case 64: return launch_draft_attention<64>(cu, a, max_blocks);
    case 96: return launch_draft_attention<96>(cu, a, max_blocks);
    case 128: return launch_draft_attention<128>(cu, a, max_blocks);
    case 160: return launch_draft_attention<160>(cu, a, max_blocks);
    case 192: return launch_draft_attention<192>(cu, a, max_blocks);
    case 224: return launch_draft_attention<224>(cu, a, max_blocks);
    case 256: return launch_draft_attention<256>(cu, a, max_blocks);
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
