/*
 * The DSpark drafter's attention over long contexts (backend op
 * draft_attention; cuda_draft.cu runs the short ones and launches these):
 * the context keys split over CTAs, each CTA streaming its split's K and V
 * rows through shared memory once for every query of its KV group, scores
 * and P V on tensor cores; then a merge of the splits' softmax states
 * with the block's own keys.
 *
 * Why: the short-context kernel gives each (row, query head) a CTA that
 * walks the whole context, so at 32K keys the 7 rows x 16 heads of a KV
 * group read its keys 112 times (1.7 ms a draft layer on an H100); the
 * forty-fifth session's first split kernel read them once but ran the
 * products as scalar fp32 with a lane per key (~0.27 ms a layer at 32K,
 * 250 GB/s: bound by its instructions, docs/PERF.md). Here a CTA of eight
 * warps takes one KV head's split and up to 128 of its group's queries,
 * a 16-query tile a warp (the m16 of mma.sync m16n8k16, bf16 in, fp32
 * accumulation); 32-key chunks of K and V arrive through a four-stage
 * cp.async ring (the split's page ids read once into shared memory first,
 * so no copy waits on a page lookup), and each warp keeps an online
 * softmax per query row (FlashAttention-2's layout: the scores' accumulator
 * fragments are the A fragments of P V). The SPEC's drafter keeps p in
 * fp32 (cpu_draft.c), so P enters P V as two bf16 terms, hi = bf16(p) and
 * lo = bf16(p - hi): ~2^-16 relative, where one bf16 term would be 2^-9.
 * Each CTA writes (acc, m, l) per (query, split), m in log2 units;
 * draft_merge_kernel then takes a query's splits and the block's keys into
 * one softmax, a CTA a query.
 *
 * Graphs: the grid is sized by the block table's capacity (the host's
 * `most` keys), the split length computed on the device from the block's
 * position, so one graph serves every position; splits past the context
 * leave at once, and both kernels leave at once below `split_from` keys,
 * where the short-context kernel does the work.
 */
#include <math.h>
#include <stdint.h>

#include "cuda/cuda_async.cuh"
#include "cuda/cuda_common.cuh"
#include "cuda/cuda_draft.cuh"
#include "cuda/cuda_internal.h"

namespace {

using namespace m3draft;

constexpr int kChunk = 32;                    /* keys a ring stage holds */
constexpr int kStages = 4;                    /* ring depth */
constexpr int kTileQ = 16;                    /* queries a warp (MMA m) */
constexpr int kPassQ = kDraftWarps * kTileQ;  /* queries a CTA */
constexpr int kMinPer = 128;                  /* fewest keys a split takes */
constexpr int kMaxPer = 32768;                /* most keys a split takes (its page ids) */
constexpr float kLog2e = 1.4426950408889634f;

template <int D>
struct SplitLayout {
    static constexpr int kRow = D * 2 + 16;   /* bytes a row: +16, conflict-free ldmatrix */
    static constexpr int kQ = kPassQ * kRow;  /* the CTA's queries */
    static constexpr int kStage = kChunk * kRow; /* K (or V) rows of a stage */
    static constexpr int kFixed = kQ + 2 * kStages * kStage; /* + page ids */
};

/* Whether the split kernel has a build for two CTAs a multiprocessor
 * (__launch_bounds__(.., 2): 128 registers a thread). At head dim 128 one
 * CTA takes 180 registers, and its eight warps left the tensor pipe 26%
 * busy (ncu, docs/PERF.md forty-seventh session); at 96 the bound spills,
 * and wider heads' accumulators need more. */
template <int D>
constexpr bool kHasTwoCtas = D == 128 || D <= 64;

struct SplitArgs {
    DraftArgs a;         /* every request's (request_view takes one's) */
    float *part;         /* [requests][splits][rows * q_heads][D + 2]: acc, m (log2 units), l */
    int splits;          /* the grid's splits a KV head */
    int passes;          /* the grid's query passes a request */
    int64_t split_from;  /* context keys from which these kernels run */
};

/* The context every row's range lies in ([lo, p): row 0's, the widest)
 * and how it is split: `per` keys a split (a multiple of kChunk, at least
 * kMinPer, at most what the host sized the page ids for), `active` splits
 * (at most the grid's). on: the context is long enough for these kernels. */
struct SplitPlan {
    int64_t p, lo, per;
    int active;
    bool on;
};

__device__ __forceinline__ SplitPlan split_plan(const SplitArgs &sa, const DraftArgs &a) {
    SplitPlan s;
    s.p = max(__ldg(a.pos), (int64_t)0);
    s.lo = row_lo(a, s.p, 0);
    const int64_t n = s.p - s.lo;
    s.on = n >= sa.split_from;
    int64_t per = (n + sa.splits - 1) / sa.splits;
    per = (per + kChunk - 1) / kChunk * kChunk;
    s.per = per < kMinPer ? kMinPer : per;
    s.active = (int)((n + s.per - 1) / s.per);
    return s;
}

/* Chunk c of the split (its keys c * kChunk, ..., those at or past nk
 * zero-filled, nothing read) into ring stage c % kStages. skip: the
 * split's first key's place in its page (spg[0]); key offsets stay 32-bit
 * so that the tile code fits 128 registers. */
template <int D>
__device__ __forceinline__ void load_chunk(const DraftArgs &a, int g, int skip, int nk,
                                           const int32_t *spg, int c, unsigned char *sk,
                                           unsigned char *sv) {
    using L = SplitLayout<D>;
    constexpr int kCpr = D / 8; /* 16-byte pieces a row */
    const int stage = (c % kStages) * L::kStage;
    for (int x = threadIdx.x; x < kChunk * kCpr; x += kDraftThreads) {
        const int key = x / kCpr, piece = x % kCpr, j = c * kChunk + key;
        const bool ok = j < nk;
        const int at = skip + j; /* from spg[0]'s first key */
        const int64_t page = ok ? spg[at / M3_PAGE] : 0;
        const int64_t off = ((page * a.kv_heads + g) * M3_PAGE + at % M3_PAGE) * D + piece * 8;
        const int dst = stage + key * L::kRow + piece * 16;
        cp_async16(sk + dst, ok ? a.kc + off : a.kc, ok);
        cp_async16(sv + dst, ok ? a.vc + off : a.vc, ok);
    }
}

/* One warp's 16 queries against a 32-key chunk: S = Q K^T on tensor
 * cores, masked (keys past the split, or before a query row's window),
 * the online softmax, O += (P_hi + P_lo) V. j0: the chunk's first key in
 * the split; lo: the first key of the split the lane's two query rows see
 * (0 to nk + 1, nk + 1: none; 32-bit offsets, so that the tile code fits
 * 128 registers). */
template <int D>
__device__ __forceinline__ void chunk_tile(WarpAttn<D> &w, const unsigned char *sq,
                                           const unsigned char *sk, const unsigned char *sv,
                                           int j0, int valid, const int (&lo)[2],
                                           float scale_log2) {
    constexpr int R = SplitLayout<D>::kRow;
    const int lane = threadIdx.x & 31, tq = lane & 3, mi = lane >> 3, r8 = lane & 7;
    float s[4][4] = {};
#pragma unroll
    for (int ks = 0; ks < D / 16; ks++) {
        uint32_t qa[4];
        ldsm_x4(qa, sq + (r8 + (mi & 1) * 8) * R + (ks * 16 + (mi >> 1) * 8) * 2);
#pragma unroll
        for (int kh = 0; kh < 2; kh++) { /* keys 0-15, 16-31 */
            uint32_t kb[4];
            ldsm_x4(kb, sk + (kh * 16 + r8 + (mi >> 1) * 8) * R + (ks * 16 + (mi & 1) * 8) * 2);
            mma_bf16(s[2 * kh], qa, kb[0], kb[1]);
            mma_bf16(s[2 * kh + 1], qa, kb[2], kb[3]);
        }
    }
#pragma unroll
    for (int nt = 0; nt < 4; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int j = nt * 8 + 2 * tq + (e & 1);
            s[nt][e] = j < valid && j0 + j >= lo[e >> 1] ? s[nt][e] * scale_log2 : -INFINITY;
        }
    float ref[2];
    attn_rescale<D, 4>(w, s, ref);
#pragma unroll
    for (int kk = 0; kk < 2; kk++) { /* keys 16 kk .. 16 kk + 15 */
        uint32_t hi[4], lo16[4];
#pragma unroll
        for (int h = 0; h < 2; h++)
#pragma unroll
            for (int r = 0; r < 2; r++) {
                const float p0 = exp2f(s[2 * kk + h][2 * r] - ref[r]);
                const float p1 = exp2f(s[2 * kk + h][2 * r + 1] - ref[r]);
                w.l[r] += p0 + p1;
                const __nv_bfloat162 ph = __floats2bfloat162_rn(p0, p1);
                const __nv_bfloat162 pl =
                    __floats2bfloat162_rn(p0 - __low2float(ph), p1 - __high2float(ph));
                hi[h * 2 + r] = (uint32_t)__bfloat16_as_ushort(ph.x) |
                                ((uint32_t)__bfloat16_as_ushort(ph.y) << 16);
                lo16[h * 2 + r] = (uint32_t)__bfloat16_as_ushort(pl.x) |
                                  ((uint32_t)__bfloat16_as_ushort(pl.y) << 16);
            }
#pragma unroll
        for (int dp = 0; dp < D / 16; dp++) {
            uint32_t vb[4]; /* transposed: keys +0-7 / +8-15 x dims +0 / +8 */
            ldsm_x4_t(vb, sv + (kk * 16 + r8 + (mi & 1) * 8) * R + (dp * 16 + (mi >> 1) * 8) * 2);
            mma_bf16(w.o[2 * dp], hi, vb[0], vb[1]);
            mma_bf16(w.o[2 * dp + 1], hi, vb[2], vb[3]);
            mma_bf16(w.o[2 * dp], lo16, vb[0], vb[1]);
            mma_bf16(w.o[2 * dp + 1], lo16, vb[2], vb[3]);
        }
    }
}

/* grid (kv_heads, splits, requests x query passes of kPassQ); dynamic
 * shared memory: SplitLayout<D>::kFixed plus the split's page ids. Ctas:
 * the CTAs a multiprocessor is built to hold (1, or 2 where kHasTwoCtas). */
template <int D, int Ctas>
__global__ void __launch_bounds__(kDraftThreads, Ctas) draft_split_kernel(const SplitArgs sa) {
    using L = SplitLayout<D>;
    constexpr int R = L::kRow;
    extern __shared__ __align__(16) unsigned char smem[];
    unsigned char *sq = smem, *sk = smem + L::kQ, *sv = sk + kStages * L::kStage;
    int32_t *spg = reinterpret_cast<int32_t *>(smem + L::kFixed);
    const int req = blockIdx.z / sa.passes;
    const DraftArgs a = request_view<D>(sa.a, req);
    const int g = blockIdx.x, s = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const SplitPlan pl = split_plan(sa, a);
    const int G = a.q_heads / a.kv_heads, Q = a.rows * G;
    const int q0 = (blockIdx.z % sa.passes) * kPassQ;
    if (!pl.on || s >= pl.active || q0 >= Q)
        return;
    const int64_t k0 = pl.lo + (int64_t)s * pl.per, k1 = min(pl.p, k0 + pl.per);
    const int nk = (int)(k1 - k0), nc = (nk + kChunk - 1) / kChunk;
    const int64_t pg0 = k0 / M3_PAGE;
    const int skip = (int)(k0 - pg0 * M3_PAGE);
    for (int64_t i = threadIdx.x; i <= (k1 - 1) / M3_PAGE - pg0; i += kDraftThreads)
        spg[i] = __ldg(a.pages + pg0 + i);
    /* the pass's queries (rows past Q zero) join the first chunk's group */
    for (int x = threadIdx.x; x < kPassQ * (D / 8); x += kDraftThreads) {
        const int qq = x / (D / 8), piece = x % (D / 8), qi = q0 + qq;
        const bool ok = qi < Q;
        const int64_t t = ok ? qi / G : 0, h = (int64_t)g * G + qi % G;
        cp_async16(sq + qq * R + piece * 16, ok ? a.q + (t * a.q_heads + h) * D + piece * 8 : a.q,
                   ok);
    }
    __syncthreads(); /* spg */
#pragma unroll
    for (int c = 0; c < kStages - 1; c++) {
        if (c < nc)
            load_chunk<D>(a, g, skip, nk, spg, c, sk, sv);
        cp_async_commit();
    }
    /* the lane's two query rows (accumulator rows lane / 4 and + 8) */
    const int wq = q0 + warp * kTileQ;
    const bool busy = wq < Q; /* warp-uniform */
    int lo[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int qi = wq + lane / 4 + r * 8;
        const int64_t first = qi < Q ? row_lo(a, pl.p, qi / G) - k0 : (int64_t)nk + 1;
        lo[r] = (int)min(max(first, (int64_t)0), (int64_t)nk + 1);
    }
    WarpAttn<D> w;
    attn_reset(w);
    const float scale_log2 = a.scale * kLog2e;
    for (int c = 0; c < nc; c++) {
        cp_async_wait<kStages - 2>();
        __syncthreads(); /* chunk c landed for all; stage (c - 1) % kStages is free */
        if (c + kStages - 1 < nc)
            load_chunk<D>(a, g, skip, nk, spg, c + kStages - 1, sk, sv);
        cp_async_commit();
        if (busy) {
            const int st = (c % kStages) * L::kStage;
            chunk_tile<D>(w, sq + warp * kTileQ * R, sk + st, sv + st, c * kChunk,
                          min(kChunk, nk - c * kChunk), lo, scale_log2);
        }
    }
    if (!busy)
        return;
    const int64_t Qall = (int64_t)a.rows * a.q_heads;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        float l = w.l[r];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const int qi = wq + lane / 4 + r * 8;
        if (qi >= Q)
            continue;
        const int64_t row = (int64_t)(qi / G) * a.q_heads + (int64_t)g * G + qi % G;
        float *o = sa.part + (((int64_t)req * sa.splits + s) * Qall + row) * (D + 2);
#pragma unroll
        for (int n = 0; n < D / 8; n++)
            *reinterpret_cast<float2 *>(o + n * 8 + 2 * (lane & 3)) =
                make_float2(w.o[n][2 * r], w.o[n][2 * r + 1]);
        if ((lane & 3) == 0) {
            o[D] = w.m[r];
            o[D + 1] = l;
        }
    }
}

/* One CTA per (row, query head): the splits' partials and the block's
 * own keys (every row of it, no causal order) as one softmax, in log2
 * units as the splits' maxima. The threads take the splits' maxima
 * together, then warp w the splits w, w + 8, ... four at a time (their
 * loads in flight together) and the block rows w, w + 8, ...; the warps'
 * sums meet in shared memory in warp order. A warp a query walking every
 * split in turn was latency-bound: ~40 µs a layer at 128 splits
 * (docs/PERF.md, forty-sixth session). */
template <int D>
__global__ void __launch_bounds__(kDraftThreads) draft_merge_kernel(const SplitArgs sa) {
    constexpr int E = D / 32, U = 4; /* U: splits a warp has in flight */
    __shared__ float s_m[kDraftWarps], s_l[kDraftWarps], s_sb[M3_CUDA_DRAFT_MAX_ROWS];
    __shared__ float s_acc[kDraftWarps][D];
    const int64_t Qall = (int64_t)sa.a.rows * sa.a.q_heads;
    const int req = (int)(blockIdx.x / Qall), qi = (int)(blockIdx.x % Qall);
    const DraftArgs a = request_view<D>(sa.a, req);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const SplitPlan pl = split_plan(sa, a);
    if (!pl.on)
        return;
    const int g = (qi % a.q_heads) / (a.q_heads / a.kv_heads);
    const float scale_log2 = a.scale * kLog2e;
    /* split s: + s * Qall * (D + 2) */
    const float *part = sa.part + ((int64_t)req * sa.splits * Qall + qi) * (D + 2);
    float mx = -INFINITY;
    for (int s = threadIdx.x; s < pl.active; s += kDraftThreads)
        mx = fmaxf(mx, part[(int64_t)s * Qall * (D + 2) + D]);
    /* the block's keys' scores, a warp a row */
    float q[E];
#pragma unroll
    for (int e = 0; e < E; e++)
        q[e] = m3_bf(a.q[(int64_t)qi * D + lane * E + e]);
    for (int b = warp; b < a.rows; b += kDraftWarps) {
        const uint16_t *kr = a.bk + ((int64_t)b * a.kv_heads + g) * D + lane * E;
        float dot = 0.0f;
#pragma unroll
        for (int e = 0; e < E; e++)
            dot = fmaf(q[e], m3_bf(kr[e]), dot);
        dot = m3_warp_sum(dot) * scale_log2;
        if (lane == 0)
            s_sb[b] = dot;
        mx = fmaxf(mx, dot);
    }
    mx = m3_warp_max(mx);
    if (lane == 0)
        s_m[warp] = mx;
    __syncthreads();
    mx = s_m[0];
    for (int w = 1; w < kDraftWarps; w++)
        mx = fmaxf(mx, s_m[w]);
    /* mx is finite: every row has the block's keys (a split with none of
     * a row's keys has m = -inf, l = 0, acc = 0, so its factor is 0) */
    float l = 0.0f, acc[E];
#pragma unroll
    for (int e = 0; e < E; e++)
        acc[e] = 0.0f;
    for (int s0 = warp; s0 < pl.active; s0 += U * kDraftWarps) {
        float ms[U], ls[U], av[U][E];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int s = s0 + u * kDraftWarps;
            const float *pp = part + (int64_t)s * Qall * (D + 2);
            const bool in = s < pl.active;
            ms[u] = in ? pp[D] : -INFINITY;
            ls[u] = in ? pp[D + 1] : 0.0f;
#pragma unroll
            for (int e = 0; e < E; e++)
                av[u][e] = in ? pp[lane * E + e] : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            const float f = exp2f(ms[u] - mx);
            l = fmaf(ls[u], f, l);
#pragma unroll
            for (int e = 0; e < E; e++)
                acc[e] = fmaf(av[u][e], f, acc[e]);
        }
    }
    for (int b = warp; b < a.rows; b += kDraftWarps) {
        const float f = exp2f(s_sb[b] - mx);
        const uint16_t *vr = a.bv + ((int64_t)b * a.kv_heads + g) * D + lane * E;
        l += f;
#pragma unroll
        for (int e = 0; e < E; e++)
            acc[e] = fmaf(f, m3_bf(vr[e]), acc[e]);
    }
    if (lane == 0)
        s_l[warp] = l;
#pragma unroll
    for (int e = 0; e < E; e++)
        s_acc[warp][lane * E + e] = acc[e];
    __syncthreads();
    float L = 0.0f;
    for (int w = 0; w < kDraftWarps; w++)
        L += s_l[w];
    for (int d = threadIdx.x; d < D; d += kDraftThreads) {
        float o = 0.0f;
        for (int w = 0; w < kDraftWarps; w++)
            o += s_acc[w][d];
        a.out[(int64_t)qi * D + d] = m3_to_bf(o / L);
    }
}

/* dynamic shared memory of a split of `per` keys: the fixed layout and
 * its page ids (one more for a split that starts mid-page, one spare) */
template <int D>
size_t page_smem(int64_t per) {
    return (size_t)SplitLayout<D>::kFixed + (size_t)(per / M3_PAGE + 2) * sizeof(int32_t);
}

/* The split and merge kernels for `groups` = KV heads x query passes x
 * requests, with the Ctas build of the split kernel. */
template <int D, int Ctas>
m3_status launch_split_as(m3_cuda *cu, const DraftArgs &a, int64_t most, int64_t split_from,
                          int passes, int64_t groups) {
    auto kernel = draft_split_kernel<D, Ctas>;
    /* CTAs a multiprocessor holds, asked with the largest page-id table a
     * split could need (one split over `most` keys, within kMinPer and
     * kMaxPer): more splits only shorten it, so the answer holds */
    int64_t per_most = most < kMinPer ? kMinPer : most < kMaxPer ? most : kMaxPer;
    per_most = (per_most + kChunk - 1) / kChunk * kChunk;
    const size_t smem_most = page_smem<D>(per_most);
    M3_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     (int)smem_most));
    /* the ring, not the L1 cache, is what these CTAs keep on chip */
    M3_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                     cudaSharedmemCarveoutMaxShared));
    int per_sm = 0;
    M3_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kDraftThreads,
                                                              smem_most));
    if (per_sm < 1)
        return m3_fail(M3_ERR_UNSUPPORTED, "draft attention: the split kernel for head dim %d "
                       "does not fit a multiprocessor (%zu bytes of shared memory)", D,
                       smem_most);
    /* one wave: the CTA slots divided among the groups, rounded down
     * (rounded up, eight requests' 17 splits made 136 CTAs for 132 slots,
     * a second wave for four: +28% on the drafter's layers at 32K,
     * docs/PERF.md forty-seventh session), each split at most kMaxPer keys */
    int64_t splits = (int64_t)cu->sm_count * per_sm / groups;
    const int64_t few = (most + kMaxPer - 1) / kMaxPer;
    splits = splits > few ? splits : few;
    splits = splits > 1 ? splits : 1;
    if (splits > 65535)
        return m3_fail(M3_ERR_UNSUPPORTED, "draft attention: %lld context keys in %lld splits "
                       "(at most 65535)", (long long)most, (long long)splits);
    int64_t per = (most + splits - 1) / splits;
    per = (per + kChunk - 1) / kChunk * kChunk;
    per = per < kMinPer ? kMinPer : per;
    SplitArgs sa = {a, nullptr, (int)splits, passes, split_from};
    const size_t part =
        (size_t)a.requests * splits * a.rows * a.q_heads * (D + 2) * sizeof(float);
    M3_TRY(m3_cuda_workspace(cu, M3_CUDA_WS_DRAFT, part, (void **)&sa.part));
    kernel<<<dim3((unsigned)a.kv_heads, (unsigned)splits, (unsigned)(groups / a.kv_heads)),
             kDraftThreads, page_smem<D>(per), cu->stream>>>(sa);
    M3_CUDA_LAUNCHED("draft_split_kernel");
    draft_merge_kernel<D><<<(unsigned)(a.requests * a.rows * a.q_heads), kDraftThreads, 0,
                            cu->stream>>>(sa);
    M3_CUDA_LAUNCHED("draft_merge_kernel");
    return M3_OK;
}

template <int D>
m3_status launch_split(m3_cuda *cu, const DraftArgs &a, int64_t most, int64_t split_from) {
    if (a.rows > M3_CUDA_DRAFT_MAX_ROWS)
        return m3_fail(M3_ERR_UNSUPPORTED, "draft attention: %d block rows over a long context "
                       "(at most %d)", a.rows, M3_CUDA_DRAFT_MAX_ROWS);
    const int64_t Q = (int64_t)a.rows * (a.q_heads / a.kv_heads);
    const int64_t passes = (Q + kPassQ - 1) / kPassQ, z = passes * a.requests;
    if (z > 65535 || a.kv_heads > 65535)
        return m3_fail(M3_ERR_UNSUPPORTED, "draft attention: %d KV heads, %d requests of %lld "
                       "queries a KV head", a.kv_heads, a.requests, (long long)Q);
    /* Two CTAs a multiprocessor from cu->draft_split_two_from group keys
     * (groups times the table's keys: the work the splits share out). On an
     * H100 the two-CTA build (128 registers, twice the CTAs) took 5-10% less
     * at 8 requests over 32K-128K and 4 at 128K, 1% more at 4 requests over
     * 32K and 4-6% more at 4-8 over 1K; with one request at 32K 2.4% more
     * (docs/PERF.md, forty-seventh and forty-eighth sessions) */
    const int64_t groups = (int64_t)a.kv_heads * z;
    const int64_t two_from = cu->draft_split_two_from;
    if constexpr (kHasTwoCtas<D>) {
        if (two_from > 0 && groups * most >= two_from)
            return launch_split_as<D, 2>(cu, a, most, split_from, (int)passes, groups);
    }
    return launch_split_as<D, 1>(cu, a, most, split_from, (int)passes, groups);
}

} // namespace

m3_status m3_draft_split_launch(m3_cuda *cu, const m3draft::DraftArgs &a, int dim, int64_t most,
                                int64_t split_from) {
    switch (dim) {
    case 32: return launch_split<32>(cu, a, most, split_from);
    case 64: return launch_split<64>(cu, a, most, split_from);
    case 96: return launch_split<96>(cu, a, most, split_from);
    case 128: return launch_split<128>(cu, a, most, split_from);
    case 160: return launch_split<160>(cu, a, most, split_from);
    case 192: return launch_split<192>(cu, a, most, split_from);
    case 224: return launch_split<224>(cu, a, most, split_from);
    case 256: return launch_split<256>(cu, a, most, split_from);
    default:
        return m3_fail(M3_ERR_UNSUPPORTED, "draft attention: head dim %d is not supported "
                       "(multiples of 32 up to 256)", dim);
    }
}
