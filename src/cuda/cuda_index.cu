/*
 * The indexer on the GPU (SPEC §2.3 step 5, §3): the block scores and the
 * per-head block selection, with the contracts of backend.h and the capture
 * rules of cuda_internal.h (cu->stream only; no sync, allocation or host
 * copy; step metadata read on the device; grids sized by capacities, CTAs
 * past a row's work return). Attention itself is in cuda_attention.cu.
 *
 * - index_scores: one CTA per (row, slice of the row's blocks), blocks
 *   j, j+G, ... so every row's real work spreads over its G CTAs whatever
 *   its length. The CTA holds the row's index queries in fp64 in shared
 *   memory and streams key blocks through a two-stage cp.async pipeline;
 *   one thread per position forms the dot in fp64 with the CPU's eight
 *   interleaved accumulators and its pairwise tail (m3_dot_f32), so every
 *   score is bit-identical to the CPU's, and the max over positions keeps
 *   the CPU's sequential rule (first maximal value, NaN sticky).
 * - select_blocks: one CTA per (row, head); the best non-forced blocks are
 *   found by a radix select over 64-bit keys (score order with NaN lowest,
 *   then block id, so ties go to the higher id: m3_select_row's total
 *   order), then compacted in ascending block order.
 *
 * Measured on an H200 (1 row, TP1 shapes, 1M-token context): index scores
 * ~1.8 TB/s (fp64 FMA + F2F bound with 4 heads; ~3 TB/s with 1 head),
 * select ~27 us at 8192 blocks.
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

/* ============================================================ index scores */

constexpr int kIdxThreads = 128; /* one thread per position of a block */
constexpr int kIdxWarps = kIdxThreads / 32;
constexpr int kIdxHeadsPerPass = 4; /* fp64 accumulators: 8 per head per thread */

struct IndexArgs {
    StepView sv;
    int heads, dim, ctas_per_row;
    const uint16_t *iq, *icache;
    float scale;
    float *scores;
};

/* padded shared row: 16 more bytes make the per-thread row reads of a
 * quarter warp fall in distinct banks */
__host__ __device__ __forceinline__ int idx_row_bytes(int dim) { return dim * 2 + 16; }

static size_t idx_smem(int heads, int dim) {
    return (size_t)heads * dim * sizeof(double) + 2 * (size_t)M3_PAGE * idx_row_bytes(dim);
}

extern "C" bool m3_cuda_index_fits(int heads, int dim) {
    return idx_smem(heads, dim) <= (size_t)kSmemPerBlockMax;
}

/* Scores of block b for heads [h0, h0 + HB): every thread its position's
 * dots (positions >= count: -inf, which never wins), then the ordered max
 * over the block and one fp32 multiply by scale. */
template <int HB>
__device__ void idx_pass(const IndexArgs &a, const unsigned char *tile, const double *qd, int h0,
                         int count, int b, float *out_row, float (*s_red)[kIdxWarps]) {
    const unsigned char *krow = tile + threadIdx.x * idx_row_bytes(a.dim);
    const double *q = qd + (size_t)h0 * a.dim;
    float d[HB];
    if ((int)threadIdx.x < count) {
        idx_dots<HB>(krow, q, a.dim, d);
    } else {
#pragma unroll
        for (int h = 0; h < HB; h++)
            d[h] = -INFINITY;
    }
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
    for (int h = 0; h < HB; h++) {
        float v = warp_first_max(d[h]);
        if (lane == 0)
            s_red[h][warp] = v;
    }
    __syncthreads();
    if ((int)threadIdx.x < HB) {
        int h = threadIdx.x;
        float v = s_red[h][0];
        for (int w = 1; w < kIdxWarps; w++)
            v = first_max(v, s_red[h][w]);
        out_row[(int64_t)(h0 + h) * a.sv.max_blocks + b] = v * a.scale;
    }
    __syncthreads(); /* s_red is reused by the next pass */
}

/* Issue the copy of block b's visible key rows into dst; records the row
 * count (or -1 for an invalid page: nothing is read) in *s_count. */
__device__ void idx_load(const IndexArgs &a, const RowView &rv, int b, unsigned char *dst,
                         int *s_count) {
    int64_t first = (int64_t)b * M3_PAGE;
    int count = (int)min((int64_t)M3_PAGE, rv.kv_len - first);
    int64_t page = rv.table[b];
    bool ok = page_ok(a.sv, page);
    if (threadIdx.x == 0)
        *s_count = ok ? count : -1;
    if (!ok)
        return;
    const unsigned char *src =
        reinterpret_cast<const unsigned char *>(a.icache + page * M3_PAGE * a.dim);
    cp_async_rows_ef(dst, idx_row_bytes(a.dim), src, (int64_t)a.dim * 2, count, a.dim / 8,
                     kIdxThreads);
}

__device__ void idx_tile(const IndexArgs &a, const unsigned char *tile, const double *qd,
                         int count, int b, float *out_row, float (*s_red)[kIdxWarps]) {
    if (count < 0) { /* invalid page: the block's score is NaN */
        for (int h = threadIdx.x; h < a.heads; h += kIdxThreads)
            out_row[(int64_t)h * a.sv.max_blocks + b] = m3_qnan();
        return;
    }
    for (int h0 = 0; h0 < a.heads; h0 += kIdxHeadsPerPass) {
        int hb = min(kIdxHeadsPerPass, a.heads - h0);
        if (hb == 4)
            idx_pass<4>(a, tile, qd, h0, count, b, out_row, s_red);
        else if (hb == 3)
            idx_pass<3>(a, tile, qd, h0, count, b, out_row, s_red);
        else if (hb == 2)
            idx_pass<2>(a, tile, qd, h0, count, b, out_row, s_red);
        else
            idx_pass<1>(a, tile, qd, h0, count, b, out_row, s_red);
    }
}

/* Grid: rows x ctas_per_row; CTA j of a row owns blocks j, j+G, ... */
__global__ void __launch_bounds__(kIdxThreads) index_scores_kernel(IndexArgs a) {
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ int s_count[2];
    __shared__ float s_red[kIdxHeadsPerPass][kIdxWarps];
    const int G = a.ctas_per_row, MB = a.sv.max_blocks;
    const int t = blockIdx.x / G, j = blockIdx.x % G;
    float *out_row = a.scores + (int64_t)t * a.heads * MB;
    RowView rv = load_row(a.sv, t);
    int nb = rv.state == ROW_OK ? rv.nblocks : 0;
    int mine = nb > j ? (nb - 1 - j) / G + 1 : 0; /* visible blocks owned */
    int owned = j < MB ? (MB - 1 - j) / G + 1 : 0;
    /* the owned blocks past the visible ones: -inf (NaN for a broken row) */
    float fill = rv.state == ROW_BAD ? m3_qnan() : -INFINITY;
    for (int64_t k = (int64_t)mine * a.heads + threadIdx.x; k < (int64_t)owned * a.heads;
         k += kIdxThreads) {
        int64_t i = k / a.heads, h = k % a.heads;
        out_row[h * MB + j + i * G] = fill;
    }
    if (mine == 0)
        return;
    double *qd = reinterpret_cast<double *>(smem);
    unsigned char *tiles = smem + (size_t)a.heads * a.dim * sizeof(double);
    const size_t stage = (size_t)M3_PAGE * idx_row_bytes(a.dim);
    const uint16_t *iq = a.iq + (int64_t)t * a.heads * a.dim;
    for (int e = threadIdx.x; e < a.heads * a.dim; e += kIdxThreads)
        qd[e] = (double)m3_bf(iq[e]);
    idx_load(a, rv, j, tiles, &s_count[0]);
    cp_async_commit();
    for (int i = 0; i < mine; i++) {
        if (i + 1 < mine)
            idx_load(a, rv, j + (i + 1) * G, tiles + ((i + 1) & 1) * stage, &s_count[(i + 1) & 1]);
        cp_async_commit();
        cp_async_wait<1>(); /* block i has landed (block i + 1 may be in flight) */
        __syncthreads();
        idx_tile(a, tiles + (i & 1) * stage, qd, s_count[i & 1], j + i * G, out_row, s_red);
        __syncthreads(); /* the stage is refilled next iteration */
    }
}

/* ============================================================ selection */

constexpr int kSelThreads = 512;
constexpr int kSelWarps = kSelThreads / 32;
constexpr size_t kSelStageMax = 96 * 1024; /* stage a row's scores when they fit */

struct SelectArgs {
    StepView sv;
    int heads, topk, init, local;
    bool staged;
    const float *scores;
    int32_t *selected;
};

using SelShared = SelSharedT<kSelWarps>;

/* Grid: rows x heads, one CTA each (m3_select_row per (row, head)). */
__global__ void __launch_bounds__(kSelThreads) select_kernel(SelectArgs a) {
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ SelShared sh;
    const int item = blockIdx.x, t = item / a.heads;
    int32_t *out = a.selected + (int64_t)item * a.topk;
    RowView rv = load_row(a.sv, t);
    int nb = rv.state == ROW_PADDED ? 0 : rv.nblocks;
    if (rv.state == ROW_PADDED || nb <= a.topk) { /* all visible blocks (none if padded) */
        for (int i = threadIdx.x; i < a.topk; i += kSelThreads)
            out[i] = i < nb ? i : -1;
        return;
    }
    /* forced: init blocks [0, init_end), local blocks [local_begin, nb) */
    int init_end = min(a.init, nb);
    int local_begin = max(nb - a.local, init_end);
    int room = a.topk - init_end - (nb - local_begin); /* >= 0: init + local <= topk */
    const float *sc = a.scores + (int64_t)item * a.sv.max_blocks;
    if (a.staged && room > 0) {
        float *st = reinterpret_cast<float *>(smem);
        for (int b = init_end + threadIdx.x; b < local_begin; b += kSelThreads)
            st[b] = sc[b];
        __syncthreads();
        sc = st;
    }
    if (room > 0) {
        uint64_t thr = sel_threshold<kSelThreads>(sc, init_end, local_begin, (unsigned)room, sh);
        int got =
            sel_compact<kSelThreads>(sc, init_end, local_begin, thr, room, out + init_end, sh);
        for (int i = got + threadIdx.x; i < room; i += kSelThreads) /* unreachable */
            out[init_end + i] = -1;
    }
    for (int i = threadIdx.x; i < init_end; i += kSelThreads)
        out[i] = i;
    for (int i = threadIdx.x; i < nb - local_begin; i += kSelThreads)
        out[init_end + room + i] = local_begin + i;
}

} // namespace

/* ============================================================ entry points */

extern "C" m3_status m3_cuda_index_scores(m3_backend *be, const m3_step *step, int heads, int dim,
                                          const uint16_t *iq, const uint16_t *icache, float scale,
                                          float *scores) {
    m3_cuda *cu = m3_cuda_of(be);
    M3_TRY(check_step(step, "index_scores"));
    if (heads <= 0)
        return m3_fail(M3_ERR_INVALID_ARG, "index_scores: %d heads", heads);
    if (dim <= 0 || dim % 8 != 0 || dim > M3_CUDA_INDEX_DIM_MAX)
        return m3_fail(M3_ERR_UNSUPPORTED,
                       "index_scores: index dim %d is not a multiple of 8 in [8, %d]", dim,
                       M3_CUDA_INDEX_DIM_MAX);
    if (step->rows == 0 || step->max_blocks == 0)
        return M3_OK;
    if (!iq || !icache || !scores)
        return m3_fail(M3_ERR_INVALID_ARG, "index_scores: NULL tensor");
    if (!aligned16(iq) || !aligned16(icache))
        return m3_fail(M3_ERR_INVALID_ARG, "index_scores: queries / cache not 16-byte aligned");
    size_t smem = idx_smem(heads, dim);
    if (smem > (size_t)kSmemPerBlockMax)
        return m3_fail(M3_ERR_UNSUPPORTED, "index_scores: %d heads x %d dims is too wide", heads,
                       dim);
    M3_CUDA_TRY(cudaFuncSetAttribute(index_scores_kernel,
                                     cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    /* at most one wave: G CTAs per row, each a strided share of the row's blocks */
    int per_sm = ctas_per_sm(index_scores_kernel, kIdxThreads, smem);
    int64_t target = (int64_t)(cu->sm_count > 0 ? cu->sm_count : 1) * per_sm;
    int64_t G = target / step->rows; /* floor: a partial second wave doubles the time */
    if (G > step->max_blocks)
        G = step->max_blocks;
    if (G < 1)
        G = 1;
    if ((int64_t)step->rows * G > INT32_MAX)
        return m3_fail(M3_ERR_UNSUPPORTED, "index_scores: %d rows is too many", step->rows);
    IndexArgs a = {step_view(step), heads, dim, (int)G, iq, icache, scale, scores};
    index_scores_kernel<<<(unsigned)(step->rows * G), kIdxThreads, smem, cu->stream>>>(a);
    M3_CUDA_LAUNCHED("index_scores");
    return M3_OK;
}

extern "C" m3_status m3_cuda_select_blocks(m3_backend *be, const m3_step *step, int heads,
                                           const float *scores, const m3_select_params *p,
                                           int32_t *selected) {
    m3_cuda *cu = m3_cuda_of(be);
    M3_TRY(check_step(step, "select_blocks"));
    if (!p || heads <= 0)
        return m3_fail(M3_ERR_INVALID_ARG, "select_blocks: bad parameters");
    if (p->topk < 1 || p->init_blocks < 0 || p->local_blocks < 0 ||
        (int64_t)p->init_blocks + p->local_blocks > p->topk)
        return m3_fail(M3_ERR_INVALID_ARG,
                       "select_blocks: top-%d with %d init and %d local blocks (forced blocks "
                       "must fit in the top-k)",
                       p->topk, p->init_blocks, p->local_blocks);
    if (step->rows == 0)
        return M3_OK;
    if (!selected || (!scores && step->max_blocks > 0))
        return m3_fail(M3_ERR_INVALID_ARG, "select_blocks: NULL tensor");
    int64_t grid = (int64_t)step->rows * heads;
    if (grid > INT32_MAX)
        return m3_fail(M3_ERR_UNSUPPORTED, "select_blocks: %d rows x %d heads is too many",
                       step->rows, heads);
    size_t stage_bytes = (size_t)step->max_blocks * sizeof(float);
    bool staged = stage_bytes <= kSelStageMax;
    size_t smem = staged ? stage_bytes : 0;
    M3_CUDA_TRY(cudaFuncSetAttribute(select_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     (int)smem));
    SelectArgs a = {step_view(step), heads,  p->topk, p->init_blocks, p->local_blocks,
                    staged,          scores, selected};
    select_kernel<<<(unsigned)grid, kSelThreads, smem, cu->stream>>>(a);
    M3_CUDA_LAUNCHED("select_blocks");
    return M3_OK;
}
