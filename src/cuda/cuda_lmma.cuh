/*
 * The decode linear's tensor-core core (cuda_linear.cu's linear_mma_kernel;
 * the fused drafter layers, cuda_draft_layers.cu): one warp's partial sums
 * of a 16-row weight tile over one K chunk, for up to 8 NT rows of x (NT
 * 1, 2 or 4). Kept
 * in one place so that every kernel built on it sums a chunk in the same
 * order, and so gives the same bits.
 */
#ifndef M3_CUDA_CUDA_LMMA_CUH
#define M3_CUDA_CUDA_LMMA_CUH

#include "cuda/cuda_gemv.cuh"
#include "cuda/cuda_ksum.cuh"

/* The decode linear on tensor cores. A warp owns one 16-row tile of the
 * weight and one of its K chunks (cuda_ksum.cuh): a CTA is the n_chunks
 * warps of one tile, or (SPLIT) one warp. A warp walks its
 * chunk in pieces of 32 columns, each lane loading 8 consecutive columns
 * of rows g and g + 8 (g = lane / 4) and the same 8 columns of x's row g
 * of each 8-row tile, and feeds them to two bf16 m16n8k16 MMAs as their
 * fragments with K permuted alike in A and B (lane q = lane % 4 holds
 * columns 8q..8q+7, which the MMA reads as k 2q, 2q + 1, 2q + 8, 2q + 9
 * of each half), so no shuffle or shared memory sits between the loads
 * and the products. Each x row is one MMA column, summed by the same
 * hardware steps whatever the other columns hold: a row's sums do not
 * depend on how many rows share the step (1 to 16) or on anything but its
 * chunk (a TP rank's chunks are summed as TP 1's), and the chunks are
 * combined as ksum's tree. MXFP8 weights are widened to bf16 on the way
 * (e4m3 times a power of two is exact in bf16 but for values under
 * 2^-133). Where the FFMA GEMV this replaces spent its issue slots on 8-16
 * rows' products and shared-memory reads of x (~1 TB/s on an H200 at 8
 * rows), the MMA does 16 x 8 x 16 of them in one instruction
 * (docs/PERF.md, forty-second session). */
#define LMMA_MAX_NC 8 /* chunks = warps a CTA (M3_K_CHUNKS) */
/* Pieces of 32 columns a stage (two stages in flight). Wide CTAs (3-8
 * warps) run two a multiprocessor, so 128 registers a thread: 3 pieces at
 * 1-16 rows, 2 at 17-32 (LMMA_WIDE_U; a few bytes spill at 9-32 rows).
 * One CTA of 8 warps a multiprocessor (142 registers at 9-16 rows) left
 * the 200K-row lm_head at 2.2 TB/s: two take 16 rows 17% less time, 13%
 * less at 32 (docs/PERF.md, forty-eighth session). LMMA_DEEP where a CTA
 * is one or two warps and each must keep more in flight itself: 6 pieces
 * at 1-16 rows, 4 at 17-32 (238-250 registers, no spills; with 4 and 2 a
 * narrow weight's 9-32 rows took 5-16% longer). The order of the sums
 * does not depend on it. */
#define LMMA_DEEP(NT) ((NT) == 4 ? 4 : 6)
#define LMMA_WIDE_U(NT) ((NT) == 4 ? 2 : 3)
/* The weight loads ask L2 for 256 bytes of a row at a time (ldg16_na_pol's
 * PF_BYTES) at 1-16 rows: 1-22% less time for most of the linear's shapes,
 * the 16-row lm_head 15% less (a load is 64 bytes of each of 8 rows, a
 * stage 192). At 17-32 rows (M3_LINEAR_MMA_ROWS=32 only) a stage is two
 * pieces, 128 bytes of a row: 256 was mixed there, −9% to +15% by shape
 * (fiftieth session), 128 took 0.6-3.3% off every shape (fifty-first):
 * M3_LMMA_PF_WIDE is 128 by default (0: none; 256 by hand). */
#ifndef M3_LMMA_PF_WIDE
#define M3_LMMA_PF_WIDE 128
#endif
#define LMMA_PF_BYTES(NT) ((NT) <= 2 ? 256 : M3_LMMA_PF_WIDE)

template <int NT, bool FP8, int U>
struct lmma_stage {
    uint4 wa[U], wb[U];                   /* rows g, g + 8: bf16, or e4m3 in .x, .y */
    uint32_t sa[FP8 ? U : 1], sb[FP8 ? U : 1]; /* e8m0 scales (MXFP8) */
    uint4 xv[U][NT];                      /* x row (8 j + g)'s 8 columns */
};

/* Eight e4m3 (times 2^(s - 127)) as four bf16 pairs, in column order. */
__device__ __forceinline__ uint4 lmma_widen(uint4 v, uint32_t s) {
    const float scale = m3_e8m0((uint8_t)s);
    const uint32_t words[2] = {v.x, v.y};
    uint32_t o[4];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 2; j++) {
            __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(
                (__nv_fp8x2_storage_t)(words[i] >> (16 * j)), __NV_E4M3);
            float2 f = __half22float2(*reinterpret_cast<__half2 *>(&h));
            __nv_bfloat162 b = __floats2bfloat162_rn(f.x * scale, f.y * scale);
            o[i * 2 + j] = *reinterpret_cast<uint32_t *>(&b);
        }
    return make_uint4(o[0], o[1], o[2], o[3]);
}

/* One warp's sums of weight rows [n0, n0 + 16) of W (N rows) over
 * columns [k0, k1) for the rows of x ([rows, K], rows <= 8 NT). The
 * weights, read once, bypass L1 (no_allocate), which then keeps x for the
 * other tiles (a further −5% at the 16-row lm_head). acc[j][i]
 * is lane (g, q)'s output for weight row n0 + g (+ 8 for i >= 2) and x row
 * 8 j + 2 q + (i & 1). CG: x was written in this launch by other CTAs, so
 * its loads go through L2 (ld.global.cg), not the read-only cache, which
 * may hold an earlier launch's values; the sums do not depend on it. */
template <int NT, bool FP8, int U, bool CG>
__device__ __forceinline__ void lmma_chunk(const gemv_weight &W, int64_t N, int64_t n0,
                                           const uint16_t *__restrict__ x, int rows, int K,
                                           int k0, int k1, float (&acc)[NT][4]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const int pieces = (k1 - k0 + 31) / 32, stages = (pieces + U - 1) / U;
    const bool row_a = n0 + g < N, row_b = n0 + g + 8 < N;
    const uint8_t *wa_row = W.w + (row_a ? n0 + g : 0) * W.w_row;
    const uint8_t *wb_row = W.w + (row_b ? n0 + g + 8 : 0) * W.w_row;
    const uint64_t pol = l2_evict_first();

    auto load = [&](lmma_stage<NT, FP8, U> &s, int stage) {
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int k = k0 + (stage * U + u) * 32 + q * 8;
            const bool in = k < k1;
            const uint4 z = make_uint4(0, 0, 0, 0);
            constexpr int PF = LMMA_PF_BYTES(NT);
            if constexpr (FP8) {
                uint2 a = in && row_a ? ldg8_na_pol<PF>(wa_row + k, pol) : make_uint2(0, 0);
                uint2 b = in && row_b ? ldg8_na_pol<PF>(wb_row + k, pol) : make_uint2(0, 0);
                s.wa[u] = make_uint4(a.x, a.y, 0, 0);
                s.wb[u] = make_uint4(b.x, b.y, 0, 0);
                s.sa[u] = in && row_a ? W.s[(n0 + g) * W.s_row + k / 32] : 0;
                s.sb[u] = in && row_b ? W.s[(n0 + g + 8) * W.s_row + k / 32] : 0;
            } else {
                s.wa[u] = in && row_a ? ldg16_na_pol<PF>(wa_row + (size_t)k * 2, pol) : z;
                s.wb[u] = in && row_b ? ldg16_na_pol<PF>(wb_row + (size_t)k * 2, pol) : z;
            }
#pragma unroll
            for (int j = 0; j < NT; j++) {
                const int t = j * 8 + g;
                const uint4 *xp = reinterpret_cast<const uint4 *>(x + (int64_t)t * K + k);
                s.xv[u][j] = in && t < rows ? (CG ? __ldcg(xp) : __ldg(xp)) : z;
            }
        }
    };
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
        for (int i = 0; i < 4; i++)
            acc[j][i] = 0.0f;
    auto compute = [&](const lmma_stage<NT, FP8, U> &s, int stage) {
#pragma unroll
        for (int u = 0; u < U; u++) {
            if (stage * U + u >= pieces) /* warp-uniform: past the chunk */
                break;
            uint4 a = s.wa[u], b = s.wb[u];
            if constexpr (FP8) {
                a = lmma_widen(a, s.sa[u]);
                b = lmma_widen(b, s.sb[u]);
            }
            const uint32_t lo[4] = {a.x, b.x, a.y, b.y}, hi[4] = {a.z, b.z, a.w, b.w};
#pragma unroll
            for (int j = 0; j < NT; j++) {
                mma_bf16(acc[j], lo, s.xv[u][j].x, s.xv[u][j].y);
                mma_bf16(acc[j], hi, s.xv[u][j].z, s.xv[u][j].w);
            }
        }
    };
    /* two stages in registers: the next one's loads fly while this one's
     * products run */
    lmma_stage<NT, FP8, U> s0, s1;
    if (stages > 0)
        load(s0, 0);
    for (int st = 0; st < stages; st += 2) {
        if (st + 1 < stages)
            load(s1, st + 1);
        compute(s0, st);
        if (st + 1 >= stages)
            break;
        if (st + 2 < stages)
            load(s0, st + 2);
        compute(s1, st + 1);
    }
}

/* A CTA's chunk sums meeting in shared memory (part: [warps][NT * 4][32],
 * a slot a chunk): lmma_part_put stores a warp's accumulators in its
 * slot; after a barrier, lmma_part_sum gives this lane's element (j, i)
 * summed over the chunks as cuda_ksum.cuh's tree, the bits the split-K
 * path gives from L2. The linear kernel and the fused drafter layers'
 * tiles both combine this way. */
template <int NT, int W>
__device__ __forceinline__ void lmma_part_put(float (&part)[W][NT * 4][32], int warp, int lane,
                                              const float (&acc)[NT][4]) {
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
        for (int i = 0; i < 4; i++)
            part[warp][j * 4 + i][lane] = acc[j][i];
}

template <int W, int E>
__device__ __forceinline__ float lmma_part_sum(const float (&part)[W][E][32], int chunks, int j,
                                               int i, int lane) {
    return ksum_tree<float>(chunks, [&](int c) { return part[c][j * 4 + i][lane]; });
}

#endif
