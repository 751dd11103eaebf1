/*
 * The step metadata as the stock attention kernels read it (cuda_index.cu,
 * cuda_attention.cu): device pointers and the capacities a captured graph
 * keeps, one row's view of them (kernels never read past a row's block
 * table or outside the page pool: broken metadata reads nothing and yields
 * NaN), the host-side checks, and one-wave grid sizing. Internal to the two
 * files (an anonymous namespace: each gets its own copy).
 */
#ifndef M3_CUDA_CUDA_STEP_CUH
#define M3_CUDA_CUDA_STEP_CUH

#include <stdint.h>

#include "cuda/cuda_common.cuh"
#include "cuda/cuda_internal.h"

namespace {

constexpr int kSmemPerBlockMax = 227 * 1024; /* sm_90 opt-in shared memory per CTA */
constexpr unsigned kFull = 0xffffffffu;

static inline bool aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

/* ------------------------------------------------------------ step rows */

/* The step metadata the kernels read (device pointers) plus the capacities
 * that stay fixed for a captured graph. */
struct StepView {
    const int64_t *positions, *slots;
    const int32_t *row_req, *block_table;
    int max_blocks;
    int64_t n_pages; /* <= 0: unknown; pages are then only checked for >= 0 */
};

enum { ROW_OK = 0, ROW_PADDED, ROW_BAD };

struct RowView {
    int state;
    int64_t kv_len;       /* position + 1, 0 for a negative position */
    int nblocks;          /* ceil(kv_len / 128), clamped to max_blocks */
    const int32_t *table; /* the request's block table row (ROW_OK only) */
};

__device__ RowView load_row(const StepView &sv, int t) {
    /* three independent loads, issued together (they head every kernel's
     * dependency chain) */
    int64_t slot = sv.slots[t], pos = sv.positions[t], cap = (int64_t)sv.max_blocks * M3_PAGE;
    int32_t req = sv.row_req[t];
    RowView r{ROW_PADDED, 0, 0, nullptr};
    if (slot < 0)
        return r;
    r.kv_len = pos < 0 ? 0 : pos + 1;
    r.state = ROW_OK;
    if (pos >= cap) { /* past the table: cannot be looked up */
        r.kv_len = cap;
        r.state = ROW_BAD;
    }
    r.nblocks = (int)((r.kv_len + M3_PAGE - 1) / M3_PAGE);
    if (req < 0)
        r.state = ROW_BAD;
    if (r.state == ROW_OK)
        r.table = sv.block_table + (int64_t)req * sv.max_blocks;
    return r;
}

__device__ __forceinline__ bool page_ok(const StepView &sv, int64_t page) {
    return page >= 0 && (sv.n_pages <= 0 || page < sv.n_pages);
}

static StepView step_view(const m3_step *st) {
    StepView v;
    v.positions = st->dev.positions;
    v.slots = st->dev.slots;
    v.row_req = st->dev.row_req;
    v.block_table = st->dev.block_table;
    v.max_blocks = st->max_blocks;
    v.n_pages = st->n_pages;
    return v;
}

static m3_status check_step(const m3_step *st, const char *op) {
    if (!st || st->rows < 0 || st->max_blocks < 0)
        return m3_fail(M3_ERR_INVALID_ARG, "%s: bad step metadata", op);
    if (st->rows > 0 && (!st->dev.positions || !st->dev.slots || !st->dev.row_req ||
                         (st->max_blocks > 0 && !st->dev.block_table)))
        return m3_fail(M3_ERR_INVALID_ARG, "%s: step metadata is not on the device", op);
    return M3_OK;
}

/* CTAs of `kernel` that fit on one SM (at least 1): sizes grids to one wave. */
template <typename K>
static int ctas_per_sm(K kernel, int threads, size_t smem) {
    int n = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem) != cudaSuccess) {
        cudaGetLastError(); /* not sticky; keep it from surfacing in a later check */
        n = 1;
    }
    return n < 1 ? 1 : n;
}

} // namespace

#endif
