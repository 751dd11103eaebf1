/*
 * Attention on the GPU (SPEC §2.3 step 5, §3): paged dense / block-sparse
 * attention, with the contracts of backend.h and the capture rules of
 * cuda_internal.h (cu->stream only; no sync, allocation or host copy; step
 * metadata read on the device; grids sized by capacities, CTAs past a row's
 * work return). The indexer's block scores and the block selection are in
 * cuda_index.cu; the step metadata view both use is cuda_step.cuh.
 *
 * - attention: flash-decoding. One CTA per (row, KV head, tile of up to 16
 *   query heads, split); the row's blocks (dense) or selected blocks
 *   (sparse) form a list of 64-key half-block tiles, split evenly over the
 *   CTAs of the row by its real length; a CTA streams its tiles through a
 *   two-stage cp.async pipeline and runs all query heads of the group on
 *   tensor cores (bf16 mma.sync, fp32 accumulation; P is rounded to bf16
 *   for the P.V product as FlashAttention does), so each K/V byte is read
 *   once per row. With 16 query heads per KV head the op is ~128 flop per
 *   byte: CUDA-core fp32 could not keep up with HBM, tensor cores can.
 *   Each warp keeps its own online softmax over 16 keys of every tile; the
 *   four warps merge at the end, then either write the bf16 output (one
 *   split) or a partial (max, sum, acc) that a combine kernel merges.
 *   The number of splits depends on capacities only (rows past 16, the
 *   whole model's KV heads, max_blocks or topk, the SM count): at most one
 *   wave of TP 1's CTAs for one row, so a TP rank splits each head's keys
 *   as TP 1 does, and a decode row's keys are split alike at 1-16 rows
 *   (up to the backend's exact_rows, where M3_LINEAR_MMA_ROWS raises it).
 *
 * Measured on an H200 (1 row, TP1 shapes, 1M-token context): dense
 * attention ~4.0 TB/s, sparse attention ~15 us (latency: a chain of
 * dependent loads plus the combine launch).
 *
 * Broken metadata never causes a wild access: a row whose request id is
 * negative or whose position lies past the block table, and a block whose
 * page is outside the pool, read nothing and yield NaN (scores, attention
 * output) so tests see them.
 */

#include <math.h>
#include <stdint.h>

#include "cuda/cuda_async.cuh"
#include "cuda/cuda_common.cuh"
#include "cuda/cuda_internal.h"
#include "cuda/cuda_step.cuh"

namespace {

/* ============================================================ attention */

constexpr int kAttnThreads = 128; /* 4 warps; each takes 16 keys of a tile */
constexpr int kAttnWarps = kAttnThreads / 32;
constexpr int kAttnKeys = 64;     /* keys per tile: half a page */
constexpr int kHeadTile = 16;     /* query heads per CTA: the MMA's M */

template <int D>
struct AttnCfg {
    static constexpr int kRowBytes = D * 2 + 16; /* +16: conflict-free ldmatrix */
    static constexpr int kTileBytes = kAttnKeys * kRowBytes;
    static constexpr int kStageBytes = 2 * kTileBytes; /* K tile, then V tile */
    static constexpr int kQOffset = 2 * kStageBytes;   /* two stages */
    static constexpr int kSmem = kQOffset + kHeadTile * kRowBytes;
    static constexpr int kOStride = D + 4; /* the merge's fp32 rows */
    /* the merge reuses the stages: 4 warps x 16 rows x kOStride + m, l,
     * and attn_merge_warps' factors and per-head sums */
    static_assert(kAttnWarps * kHeadTile * (kOStride + 3) * 4 + 3 * kHeadTile * 4 <= kQOffset,
                  "merge space");
};

struct AttnArgs {
    StepView sv;
    const uint16_t *q, *kc, *vc;
    const int32_t *sel; /* NULL: dense */
    int topk, q_heads, kv_heads, group, mtiles, splits;
    float scale_log2; /* scale * log2(e): scores in log2 units */
    uint16_t *out;
    float2 *part_ml; /* [rows, q_heads, splits] (max, sum) when splits > 1 */
    float *part_acc; /* [rows, q_heads, splits, D] */
};

/* What one CTA works on: tiles [tile0, tile0 + ntiles) of the row's list,
 * where tiles 2u and 2u + 1 are the halves of block u (dense) or of the
 * block in selection entry u (sparse). */
struct AttnCta {
    int t, g, h0, nh, split;
    RowView rv;
    const int32_t *sel;
    int tile0, ntiles;
    bool poisoned;
};


/* Entries before the selection's first -1 (of topk). Every warp counts
 * for itself with one coalesced load per 32 entries (no serial chain of
 * dependent loads, no barrier). */
__device__ int sel_count(const int32_t *sel, int topk) {
    const int lane = threadIdx.x & 31;
    for (int base = 0; base < topk; base += 32) {
        int i = base + lane;
        unsigned end = __ballot_sync(kFull, i < topk && sel[i] < 0);
        if (end)
            return base + __ffs(end) - 1;
    }
    return topk;
}

__device__ AttnCta attn_cta(const AttnArgs &a) {
    AttnCta c;
    int id = blockIdx.x;
    c.split = id % a.splits;
    id /= a.splits;
    int mt = id % a.mtiles;
    id /= a.mtiles;
    c.g = id % a.kv_heads;
    c.t = id / a.kv_heads;
    c.h0 = c.g * a.group + mt * kHeadTile;
    c.nh = min(kHeadTile, a.group - mt * kHeadTile);
    c.rv = load_row(a.sv, c.t);
    c.sel = nullptr;
    c.tile0 = 0;
    c.ntiles = 0;
    c.poisoned = c.rv.state == ROW_BAD;
    if (c.rv.state != ROW_OK)
        return c;
    int n = c.rv.nblocks;
    if (a.sel) { /* the selection ends at its first -1 */
        c.sel = a.sel + ((int64_t)c.t * a.kv_heads + c.g) * a.topk;
        n = sel_count(c.sel, a.topk);
    }
    /* a balanced contiguous share of the row's 2n tiles */
    int64_t n2 = 2 * (int64_t)n;
    int64_t t0 = (int64_t)c.split * n2 / a.splits, t1 = (int64_t)(c.split + 1) * n2 / a.splits;
    c.tile0 = (int)t0;
    c.ntiles = (int)(t1 - t0);
    return c;
}

/* Visible keys of tile i (> 0), none (0), or -1 for a block outside the
 * table or an invalid page; *elem: the tile's first element in the cache. */
template <int D>
__device__ int attn_tile(const AttnArgs &a, const AttnCta &c, int i, int64_t *elem) {
    int u = (c.tile0 + i) >> 1, half = (c.tile0 + i) & 1;
    int b = c.sel ? c.sel[u] : u;
    int64_t rem = c.rv.kv_len - ((int64_t)b * M3_PAGE + half * kAttnKeys);
    if (rem <= 0)
        return 0;
    if (b >= a.sv.max_blocks)
        return -1;
    int64_t page = c.rv.table[b];
    if (!page_ok(a.sv, page))
        return -1;
    *elem = ((page * a.kv_heads + c.g) * M3_PAGE + half * kAttnKeys) * D;
    return rem < kAttnKeys ? (int)rem : kAttnKeys;
}

/* Issue tile i's K and V rows into a stage; rows past the visible keys
 * are zero-filled (a masked key's p is 0, and 0 x stale NaN would not be). */
template <int D>
__device__ void attn_load(const AttnArgs &a, const AttnCta &c, int i, unsigned char *stage,
                          int *s_count) {
    using C = AttnCfg<D>;
    constexpr int kCpr = D / 8;
    int64_t elem = 0;
    int count = attn_tile<D>(a, c, i, &elem);
    if (threadIdx.x == 0)
        *s_count = count;
    if (count <= 0)
        return;
    /* plain copies: evict-first here (cp_async_kv_ef, as the mono path's)
     * made the stock layer 1.3% slower at one row, 4K-32K, and gained
     * nothing elsewhere (docs/PERF.md, thirty-fourth session) */
    const uint16_t *ks = a.kc + elem, *vs = a.vc + elem;
    for (int x = threadIdx.x; x < kAttnKeys * kCpr; x += kAttnThreads) {
        int r = x / kCpr, k = x % kCpr;
        bool in = r < count;
        int64_t off = in ? (int64_t)r * D + k * 8 : 0;
        unsigned char *dst = stage + r * C::kRowBytes + k * 16;
        cp_async16(dst, ks + off, in);
        cp_async16(dst + C::kTileBytes, vs + off, in);
    }
}

/* the CTA's query heads as a 16-row tile (rows past nh zero) */
template <int D>
__device__ void attn_load_q(const AttnArgs &a, const AttnCta &c, unsigned char *sq) {
    constexpr int kCpr = D / 8;
    const uint16_t *q = a.q + ((int64_t)c.t * a.q_heads + c.h0) * D;
    for (int x = threadIdx.x; x < kHeadTile * kCpr; x += kAttnThreads) {
        int r = x / kCpr, k = x % kCpr;
        bool in = r < c.nh;
        cp_async16(sq + r * AttnCfg<D>::kRowBytes + k * 16, q + (in ? (int64_t)r * D + k * 8 : 0),
                   in);
    }
}

/* Merge the four warps' softmax states (a state takes part iff its sum is
 * not 0: NaN takes part) and write the bf16 output (one split) or the
 * split's partial. smem: the stages, no longer in use. */
template <int D>
__device__ void attn_finish(const AttnArgs &a, const AttnCta &c, WarpAttn<D> &w,
                            unsigned char *smem) {
    using C = AttnCfg<D>;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
    float *s_o = reinterpret_cast<float *>(smem);
    float *s_m = s_o + kAttnWarps * kHeadTile * C::kOStride, *s_l = s_m + kAttnWarps * kHeadTile;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        w.l[r] += __shfl_xor_sync(kFull, w.l[r], 1);
        w.l[r] += __shfl_xor_sync(kFull, w.l[r], 2);
    }
    float *o0 = s_o + (warp * kHeadTile + g) * C::kOStride, *o1 = o0 + 8 * C::kOStride;
#pragma unroll
    for (int n = 0; n < D / 8; n++) {
        o0[n * 8 + 2 * tq] = w.o[n][0];
        o0[n * 8 + 2 * tq + 1] = w.o[n][1];
        o1[n * 8 + 2 * tq] = w.o[n][2];
        o1[n * 8 + 2 * tq + 1] = w.o[n][3];
    }
    if (tq == 0)
        for (int r = 0; r < 2; r++) {
            s_m[warp * kHeadTile + g + 8 * r] = w.m[r];
            s_l[warp * kHeadTile + g + 8 * r] = w.l[r];
        }
    __syncthreads();
    attn_merge_warps<D, kAttnWarps, kAttnThreads, kHeadTile>(
        s_o, C::kOStride, s_m, s_l, s_l + kAttnWarps * kHeadTile, c.nh, c.poisoned,
        [&](int r, int d, float acc, float M, float L, bool any) {
            int64_t head = (int64_t)c.t * a.q_heads + c.h0 + r;
            if (a.splits == 1) {
                a.out[head * D + d] = any ? m3_to_bf(acc / L) : (uint16_t)0;
            } else {
                int64_t p = head * a.splits + c.split;
                a.part_acc[p * D + d] = acc;
                if (d == 0)
                    a.part_ml[p] = make_float2(any ? M : -INFINITY, any ? L : 0.0f);
            }
        });
}

/* Grid: rows x kv_heads x mtiles x splits (split fastest). */
template <int D>
__global__ void __launch_bounds__(kAttnThreads) attn_kernel(AttnArgs a) {
    using C = AttnCfg<D>;
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ int s_count[2];
    AttnCta c = attn_cta(a);
    if (c.rv.state == ROW_PADDED) { /* zeros; with splits the combine writes them */
        if (a.splits == 1)
            for (int x = threadIdx.x; x < c.nh * D; x += kAttnThreads)
                a.out[((int64_t)c.t * a.q_heads + c.h0 + x / D) * D + x % D] = 0;
        return;
    }
    unsigned char *sq = smem + C::kQOffset;
    const int warp = threadIdx.x >> 5;
    WarpAttn<D> w;
    attn_reset(w);
    if (c.ntiles > 0) {
        attn_load_q<D>(a, c, sq);
        attn_load<D>(a, c, 0, smem, &s_count[0]);
    }
    cp_async_commit();
    for (int i = 0; i < c.ntiles; i++) {
        if (i + 1 < c.ntiles)
            attn_load<D>(a, c, i + 1, smem + ((i + 1) & 1) * C::kStageBytes, &s_count[(i + 1) & 1]);
        cp_async_commit();
        cp_async_wait<1>(); /* tile i (and the Q tile) have landed */
        __syncthreads();
        int count = s_count[i & 1];
        if (count < 0)
            c.poisoned = true;
        const unsigned char *st = smem + (i & 1) * C::kStageBytes + warp * 16 * C::kRowBytes;
        if (count > warp * 16) /* warp-uniform: this warp has visible keys */
            attn_warp_tile<D>(w, sq, st, st + C::kTileBytes, count - warp * 16, a.scale_log2);
        __syncthreads(); /* the stage is refilled next iteration */
    }
    cp_async_wait<0>();
    __syncthreads();
    attn_finish<D>(a, c, w, smem);
}

struct CombineArgs {
    const int64_t *slots;
    int rows, q_heads, dim, splits;
    const float2 *part_ml;
    const float *part_acc;
    uint16_t *out;
};

constexpr int kCombThreads = 128;

/* max over the CTA (every thread gets it); red: kCombThreads / 32 floats */
__device__ float comb_block_max(float v, float *red) {
    v = m3_warp_max(v);
    if ((threadIdx.x & 31) == 0)
        red[threadIdx.x >> 5] = v;
    __syncthreads();
    v = red[0];
    for (int w = 1; w < kCombThreads / 32; w++)
        v = fmaxf(v, red[w]);
    return v;
}

/* One CTA per (row, query head): merges the splits that saw keys (sum not
 * 0, NaN included; empty splits contribute nothing and their unwritten
 * accumulators are never used), writes bf16; padded rows and rows without
 * keys get zeros. Threads are (split group, 4 dims): the loads of a split
 * group do not depend on each other, so they are all in flight at once. */
__global__ void __launch_bounds__(kCombThreads) attn_combine_kernel(CombineArgs a) {
    __shared__ float s_red[kCombThreads / 32];
    __shared__ float s_part[kCombThreads * 4]; /* [groups][dim] */
    __shared__ float s_l[kCombThreads];        /* [groups] */
    const int64_t item = blockIdx.x;
    const int t = (int)(item / a.q_heads), D = a.dim;
    uint16_t *out = a.out + item * D;
    const float2 *ml = a.part_ml + item * a.splits;
    const float *acc = a.part_acc + item * a.splits * D;
    float M = -INFINITY;
    int any = 0;
    if (a.slots[t] >= 0)
        for (int s = threadIdx.x; s < a.splits; s += kCombThreads) {
            float2 v = ml[s];
            if (v.y != 0.0f) {
                any = 1;
                M = fmaxf(M, v.x);
            }
        }
    any = __syncthreads_or(any);
    M = comb_block_max(M, s_red);
    const int quads = D / 4, groups = kCombThreads / quads;
    const int grp = threadIdx.x / quads, qd = threadIdx.x % quads;
    const float ref = M == -INFINITY ? 0.0f : M;
    float4 o = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    float L = 0.0f;
    if (any && grp < groups) {
#pragma unroll 4
        for (int s = grp; s < a.splits; s += groups) {
            float2 v = ml[s];
            float4 x = *reinterpret_cast<const float4 *>(acc + (int64_t)s * D + qd * 4);
            if (v.y != 0.0f) {
                float f = exp2f(v.x - ref);
                L += f * v.y;
                o.x += f * x.x;
                o.y += f * x.y;
                o.z += f * x.z;
                o.w += f * x.w;
            }
        }
        float *p = s_part + grp * D + qd * 4;
        p[0] = o.x;
        p[1] = o.y;
        p[2] = o.z;
        p[3] = o.w;
        if (qd == 0)
            s_l[grp] = L;
    }
    __syncthreads();
    for (int d = threadIdx.x; d < D; d += kCombThreads) {
        uint16_t r = 0;
        if (any) {
            float sum = 0.0f, lsum = 0.0f;
            for (int g = 0; g < groups; g++) {
                sum += s_part[g * D + d];
                lsum += s_l[g];
            }
            r = m3_to_bf(sum / lsum);
        }
        out[d] = r;
    }
}

/* Row counts whose splits are one row's (decode and verify steps): at
 * least these, and up to the backend's exact_rows where that is more. */
#define M3_ATTN_INVARIANT_ROWS 16

/* Split policy: at most one wave of CTAs (a partial second wave would
 * double the time). splits = floor(SMs x CTAs per SM / (rows x the whole
 * model's kv_heads x head tiles)), at least 1, at most the capacity in tiles (dense: 2 x
 * max_blocks, sparse: 2 x topk), so it depends on capacities only. */
static int attn_splits(const m3_cuda *cu, int per_sm, int64_t base, int64_t units) {
    int64_t target = (int64_t)(cu->sm_count > 0 ? cu->sm_count : 1) * per_sm;
    int64_t s = target / base;
    if (s > units)
        s = units;
    return s < 1 ? 1 : (int)s;
}

template <int D>
static m3_status attn_run(m3_cuda *cu, AttnArgs a, int rows, bool sparse, int max_blocks,
                          int64_t row_ctas, int invariant_rows) {
    const int smem = AttnCfg<D>::kSmem;
    M3_CUDA_TRY(cudaFuncSetAttribute(attn_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     smem));
    int per_sm = ctas_per_sm(attn_kernel<D>, kAttnThreads, smem);
    int64_t base = (int64_t)rows * a.kv_heads * a.mtiles;
    /* splits from the whole model's CTAs per row (a TP rank's grid is then
     * a share of one wave), so every world splits a head's keys alike; for
     * decode row counts (<= invariant_rows: 16, or the backend's
     * exact_rows) those of one row, so a row's output is the same bits
     * alone or batched (a 16-row step runs up to 16 waves) and a
     * speculative verify step's rows are plain decode steps' rows */
    const int64_t wave_rows = rows <= invariant_rows ? 1 : rows;
    a.splits = attn_splits(cu, per_sm, wave_rows * row_ctas,
                           2 * (int64_t)(sparse ? a.topk : max_blocks));
    int64_t grid = base * a.splits, items = (int64_t)rows * a.q_heads;
    if (grid > INT32_MAX || items > INT32_MAX)
        return m3_fail(M3_ERR_UNSUPPORTED, "attention: %d rows x %d heads is too many", rows,
                       a.q_heads);
    if (a.splits > 1) {
        size_t ml_bytes = ((size_t)items * a.splits * sizeof(float2) + 255) / 256 * 256;
        size_t acc_bytes = (size_t)items * a.splits * D * sizeof(float);
        void *ws = NULL;
        M3_TRY(m3_cuda_workspace(cu, M3_CUDA_WS_ATTENTION, ml_bytes + acc_bytes, &ws));
        a.part_ml = reinterpret_cast<float2 *>(ws);
        a.part_acc = reinterpret_cast<float *>(static_cast<char *>(ws) + ml_bytes);
    }
    attn_kernel<D><<<(unsigned)grid, kAttnThreads, smem, cu->stream>>>(a);
    M3_CUDA_LAUNCHED("attention");
    if (a.splits > 1) {
        CombineArgs cb = {a.sv.slots, rows, a.q_heads, D, a.splits, a.part_ml, a.part_acc, a.out};
        attn_combine_kernel<<<(unsigned)items, kCombThreads, 0, cu->stream>>>(cb);
        M3_CUDA_LAUNCHED("attention combine");
    }
    return M3_OK;
}

} // namespace

/* ============================================================ entry point */

extern "C" m3_status m3_cuda_attention(m3_backend *be, const m3_step *step, int q_heads,
                                       int kv_heads, int dim, const uint16_t *q,
                                       const uint16_t *kcache, const uint16_t *vcache,
                                       const int32_t *selected, int topk, float scale,
                                       uint16_t *out) {
    m3_cuda *cu = m3_cuda_of(be);
    M3_TRY(check_step(step, "attention"));
    if (q_heads <= 0 || kv_heads <= 0 || q_heads % kv_heads != 0)
        return m3_fail(M3_ERR_INVALID_ARG, "attention: %d query heads over %d KV heads", q_heads,
                       kv_heads);
    if (dim < 32 || dim > M3_CUDA_ATTN_DIM_MAX || dim % 32 != 0)
        return m3_fail(M3_ERR_UNSUPPORTED,
                       "attention: head dim %d is not supported (multiples of 32 up to %d)", dim,
                       M3_CUDA_ATTN_DIM_MAX);
    if (selected && topk < 1)
        return m3_fail(M3_ERR_INVALID_ARG, "attention: sparse with top-%d", topk);
    if (step->rows == 0)
        return M3_OK;
    if (!q || !kcache || !vcache || !out)
        return m3_fail(M3_ERR_INVALID_ARG, "attention: NULL tensor");
    if (!aligned16(q) || !aligned16(kcache) || !aligned16(vcache))
        return m3_fail(M3_ERR_INVALID_ARG, "attention: q / K / V not 16-byte aligned");
    AttnArgs a;
    a.sv = step_view(step);
    a.q = q;
    a.kc = kcache;
    a.vc = vcache;
    a.sel = selected;
    a.topk = selected ? topk : 0;
    a.q_heads = q_heads;
    a.kv_heads = kv_heads;
    a.group = q_heads / kv_heads;
    a.mtiles = (a.group + kHeadTile - 1) / kHeadTile;
    a.splits = 1;
    a.scale_log2 = (float)((double)scale * 1.4426950408889634);
    a.out = out;
    a.part_ml = NULL;
    a.part_acc = NULL;
    bool sparse = selected != NULL;
    int rows = step->rows, mb = step->max_blocks;
    /* CTAs per row of the whole model (TP 1's grid), else this op's */
    int64_t row_ctas = (int64_t)kv_heads * a.mtiles;
    int fq = be->full_q_heads, fkv = be->full_kv_heads;
    if (fq > 0 && fkv > 0 && fq % fkv == 0)
        row_ctas = (int64_t)fkv * ((fq / fkv + kHeadTile - 1) / kHeadTile);
    const int inv = be->exact_rows > M3_ATTN_INVARIANT_ROWS ? be->exact_rows
                                                            : M3_ATTN_INVARIANT_ROWS;
    switch (dim) {
    case 32: return attn_run<32>(cu, a, rows, sparse, mb, row_ctas, inv);
    case 64: return attn_run<64>(cu, a, rows, sparse, mb, row_ctas, inv);
    case 96: return attn_run<96>(cu, a, rows, sparse, mb, row_ctas, inv);
    case 128: return attn_run<128>(cu, a, rows, sparse, mb, row_ctas, inv);
    case 160: return attn_run<160>(cu, a, rows, sparse, mb, row_ctas, inv);
    case 192: return attn_run<192>(cu, a, rows, sparse, mb, row_ctas, inv);
    case 224: return attn_run<224>(cu, a, rows, sparse, mb, row_ctas, inv);
    default: return attn_run<256>(cu, a, rows, sparse, mb, row_ctas, inv);
    }
}
