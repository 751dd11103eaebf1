/*
 * The mono executor's shared definitions (cuda_mono.cu describes the design):
 * constants, the kernel arguments, the per-CTA control block, the shared
 * memory sizes the host needs, and the entry points of the kernel unit
 * (cuda_mono_kernels.cu) that the host side calls.
 */
#ifndef M3_CUDA_CUDA_MONO_ARGS_CUH
#define M3_CUDA_CUDA_MONO_ARGS_CUH

#include <climits>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/cuda_async.cuh"
#include "cuda/cuda_gemv.cuh"
#include "cuda/cuda_internal.h"
extern "C" {
#include "cache/cache.h"
}
#include "cuda/cuda_mono.h"

namespace m3mono {

/* ================================================================ constants */

constexpr int kThreads = 128;              /* 4 warps per CTA */
constexpr int kWarps = kThreads / 32;
constexpr int kRW = 2;                     /* GEMV output rows per warp */
constexpr int kTile = kWarps * kRW;        /* GEMV output rows per tile */
constexpr int kKC = 1024;                  /* K columns staged per chunk */
constexpr int kKU = kKC / 256;             /* 16-byte loads per lane, row and chunk */
constexpr int kWalkSlotU4 = kWarps * kRW * kKU * 32; /* uint4 per weight ring slot (16 KB) */
constexpr int kMaxT = M3_CUDA_MONO_MAX_ROWS;
constexpr int kHD = 128;                   /* head dim = index dim = page */
constexpr int kMaxHalf = 64;               /* rotary_dim <= 128 */
constexpr int kMaxTopE = 16;               /* experts per token */
constexpr int kMaxAssign = kMaxT * kMaxTopE;
constexpr int kMaxSplits = 64;             /* attention splits = top-k blocks */
constexpr int kHeadTile = 16;              /* query heads per attention item (MMA M) */
constexpr int kCtasPerSm = 3;              /* launch bound; occupancy is queried */
/* The item trace's record (M3_MONO_TRACE): meta, start, end, inputs ready,
 * then, in a build with -DM3_MONO_MARKS (a diagnostic build: CUDAFLAGS),
 * the times of the item's first kMarks mark() points (0: not reached). */
#ifdef M3_MONO_MARKS
constexpr int kMarks = 6;
#else
constexpr int kMarks = 0;
#endif
constexpr int kTraceWords = 4 + kMarks;
/* Kernel variants: the code of the MXFP8 GEMV (V_F8: some weight of the
 * layer is e4m3) and of the in-kernel all-reduces (V_TP: world > 1) is
 * compiled only into the variants that run it. A path that never runs
 * still costs the others registers and instruction fetch: taking both out
 * of the bf16 world-1 kernels made them 2-5% faster (docs/PERF.md,
 * eleventh session). */
enum { V_F8 = 1, V_TP = 2 };
constexpr unsigned kFull = 0xffffffffu;
constexpr unsigned long long kPeerTimeoutNs = 5ull * 1000 * 1000 * 1000;

/* counters (uint32). Each kernel uses its own (the pre kernel's: C_QPRE,
 * C_NORM1, C_IDX and [C_FIXED, o_post); the post kernel's: the other fixed
 * ones and [o_post, n_ctr)) and zeroes the other kernel's at its start,
 * when that kernel has ended and its next launch has not begun (until the
 * twenty-sixth session the last CTA out of each launch zeroed them all, on
 * the launch's tail). Each fixed counter has a 128-byte line of its own
 * (kCtrLine words apart): the queue cursors' atomics and the polls of
 * hundreds of waiting CTAs on the others must not contend for one L2 line.
 * The per-group counters follow. */
constexpr int kCtrLine = 32;
enum {
    C_QPRE = 0 * kCtrLine,   /* the pre kernel's work list cursor */
    C_QPOST = 1 * kCtrLine,  /* the post kernel's */
    C_NORM1 = 2 * kCtrLine,  /* norm1 rows done and the RoPE factors tabled (target T + 1) */
    C_IDX = 3 * kCtrLine,    /* index heads (iq heads + ik) normed and cached (target Ni + 1) */
    C_ATT = 4 * kCtrLine,    /* attention heads merged (target T * Nq) */
    C_OPROJ = 5 * kCtrLine,  /* o_proj tiles done (target H / 8) */
    C_NORM2 = 6 * kCtrLine,  /* norm2 rows done (target T) */
    C_ROUTER = 7 * kCtrLine, /* router tiles done (target router tiles) */
    C_PLAN = 8 * kCtrLine,   /* routing and expert plan published (target 1) */
    C_SHGU = 9 * kCtrLine,   /* shared gate/up tiles done (target Is / 4) */
    C_FIXED = 10 * kCtrLine
};

/* ================================================================ arguments */

struct WMat { /* a weight [n, k]: bf16, or e4m3 + u8 exponents per 32 columns */
    const uint8_t *w, *s;
    int64_t w_row, s_row; /* bytes per row */
    int n, fp8;
};

struct WExp { /* the experts of one kind at a uniform stride */
    const uint8_t *w, *s;
    int64_t w_stride, s_stride, w_row, s_row;
    int fp8;
};

struct MonoArgs {
    /* shapes (the rank's) */
    int T, H, Nq, Nkv, Ni, E, K, I, Is, half, topk, init, local, mb;
    int group, mtiles, S, G, rt_tiles;
    int Ntot, off_ik, off_k, off_v, off_q; /* proj columns; iq at 0 */
    int layer, world, rank, first, sel_staged;
    int smem; /* dynamic shared memory bytes per CTA */
    /* K splits: per projection matrix (iq, ik, k, v, q) with its first item
     * (p_item0[5] = the projection items), s_pmax the partial slots per
     * tile; then o_proj, router, shared gate/up, shared down */
    int s_p[5], p_item0[6], s_pmax;
    int s_o, s_rt, s_shgu, s_shdn;
    int64_t n_pages;
    float eps, scaling, alpha, limit, attn_scale_log2, idx_scale;
    /* weights */
    WMat wiq, wik, wk, wv, wq, wo, shg, shu, shd;
    WExp eg, eu, ed;
    const uint16_t *in_norm, *post_norm, *q_norm, *k_norm, *iq_norm, *ik_norm;
    const float *router, *rbias;
    /* step metadata (device) */
    const int64_t *pos, *slots;
    const int32_t *row_req, *btab;
    /* this layer's caches */
    uint16_t *kc, *vc, *ic;
    /* layer input / output */
    uint16_t *hidden, *residual;
    /* scratch */
    uint16_t *x1, *proj, *attn, *o, *x2, *act, *sh_act;
    float *scores;
    float *rope; /* [kMaxT][kMaxHalf] (cos, sin) of the rows' positions (rope_item) */
    int32_t *sel;
    float2 *att_ml;
    float *att_acc;
    float *logits, *rw;
    int32_t *rids, *uniq, *ufirst, *members, *n_uniq;
    float *eout, *sh_out;
    float *part_proj, *part_o, *part_rt, *part_shgu, *part_shdn;
    unsigned *ctr;
    unsigned *calls; /* layer calls so far (the landing tags; see mono_post_kernel) */
    int n_ctr, o_post; /* the post kernel's counters: [o_post, n_ctr) */
    int o_head, o_sel, o_att, o_otile, o_rtile, o_shgu, o_shdn, o_egu, o_comb;
    int o_idxq; /* [kMaxT] index-score runs claimed per row, then a mask of the rows
                 * whose runs are all taken (M3_MONO_IDX_CLAIM) */
    int *fault;
    uint2 *const *peers; /* [world] landing areas, rank order */
    uint2 *landing;      /* this rank's */
    /* tuning knobs (see cuda_mono.cu) */
    int spin_ns;      /* M3_MONO_SPIN_NS */
    int shdn_early;   /* M3_MONO_SHDN_EARLY: % of the shared down items queued early */
    int edn_sub;      /* M3_MONO_EDN_SUB: 8-column tiles per routed down item (1..8) */
    int shdn_sub;     /* 8-column tiles per shared down item (1: a tile and a K slice each) */
    int egu_sub;      /* 4-neuron tiles per routed gate/up item (bf16 world 1, up to
                       * 8 rows; at 1-2 rows 1: gemv_rows, more: gu_walk) */
    int egu_walk;     /* the 3-8-row bf16 world-1 kernels walk the routed gate/up
                       * (gu_walk, members two at a time): it fits */
    int poll_acquire; /* M3_MONO_POLL_ACQUIRE: every poll an acquire load (else relaxed
                       * polls, then one acquire) */
    int pin;          /* M3_MONO_PIN: 0 every item from the queue; 1 norm2 of row t on
                       * CTA t and the routing plan on CTA 0; 2 also dry runs of both
                       * there first (world 1) */
    int idx_claim;      /* index items: 0 G fixed slices a row; 1 Gc items claiming pages
                         * at run time; 2 the items choose from the rows' real pages */
    int idx_run;        /* M3_MONO_IDX_RUN: at most this many pages per claim */
    int Gc;             /* claiming index items */
    int idx_min_pages;  /* idx_claim 2: claims from this many pages a fixed slice */
    uint16_t *dry_rows; /* pin 2: [kMaxT][3][H] scratch rows the dry norm2s read and write */
    float *dry_logits;  /* pin 2: [kMaxT][E] the dry plan's logits */
    int32_t *dry_plan;  /* pin 2: [6][kMaxAssign + 1] the dry plan's outputs */
    /* item trace (M3_MONO_TRACE): [cap] x kTraceWords {meta, start ns, end ns, inputs
     * ready ns, marks} */
    unsigned long long *trace;
    unsigned *trace_n;
    unsigned trace_cap;
    double inv_freq[kMaxHalf];
};

/* kernel parameters stay within the classic 4 KiB */
static_assert(sizeof(MonoArgs) <= 4096, "MonoArgs must fit the kernel parameter space");

/* ================================================================ shared state */

using SelShared = SelSharedT<kWarps>; /* the selection item (cuda_async.cuh) */

/* Per-CTA control block (static shared memory; kept small so three CTAs
 * fit an SM next to their 72 KiB of dynamic shared memory). */
struct Ctl {
    int cur, faulted, flag, nu, fnow;
    int step; /* the post kernel's items run by this CTA so far (M3_MONO_PIN) */
    /* the post kernel: the step's distinct experts (n_uniq) once this CTA
     * has acquired the published plan (or made it), else -1; the plan is
     * published once per launch, so later items skip the counter's poll
     * and the reload (three dependent L2 round trips each) */
    int plan_nu;
    uint32_t tag_o, tag_f; /* this launch's landing tags (world > 1) */
    double red[kWarps];
    const uint16_t *rowp[kMaxT]; /* GEMV activation rows */
    int mem[kMaxT];              /* MoE members of the current group */
    float fin[kTile][kMaxT];     /* a finished tile: [row][t] */
    int s_count[2];
    float s_red[4][kWarps];
    int rid[kWarps][kMaxTopE];
};


/* ================================================================ shared memory sizes */

constexpr int kIdxHeadsPerPass = 4;
/* index pages claimed at run time (idx_claim 2) where a fixed slice of
 * the longest row would have this many pages or more (measured:
 * docs/PERF.md, seventeenth session); M3_MONO_IDX_MIN_PAGES overrides */
constexpr int kIdxClaimMinPages = 8;
/* ... and only in the kernels for this many rows or more: at 1-2 rows a
 * slice reaches 8 pages only past 400K (200K) tokens, and the claims'
 * code alone, never run, cost the 1- and 2-row kernels 3-4% (register
 * spills: docs/PERF.md, seventeenth session) */
constexpr int kIdxClaimMinRows = 3;

/* gu_walk's shared memory (cuda_mono_ffn.cuh), for the host's choice of
 * the routed gate/up items' size and the items alike: NR whole activation
 * rows of K columns, chunk-major ([chunk][row][kKC], zeros past K), so
 * chunk c's rows sit where chunk_fma reads one staged chunk; then the
 * weight ring, 3 slots where they fit in smem bytes, else 2; the walk
 * applies only where 2 fit (gu_fits). */
template <int NR>
__host__ __device__ __forceinline__ int gu_xs_bytes(int K) {
    return NR * ((K + kKC - 1) / kKC) * kKC * 2;
}
__host__ __device__ __forceinline__ int gu_slots(int xs_bytes, int smem) {
    return xs_bytes + 3 * kWalkSlotU4 * 16 <= smem ? 3 : 2;
}
__host__ __device__ __forceinline__ bool gu_fits(int xs_bytes, int smem) {
    return xs_bytes + 2 * kWalkSlotU4 * 16 <= smem;
}

/* route_and_plan's shared memory: the assignments' experts and their sorted
 * order (2 x kMaxAssign ints), then each warp's staged keys and sigmoids */
__host__ __device__ constexpr size_t plan_key_offset() {
    return (2 * (size_t)kMaxAssign * sizeof(int) + 15) / 16 * 16;
}

__host__ __device__ __forceinline__ int idx_row_bytes() { return kHD * 2 + 16; }

static inline size_t idx_smem(int heads) {
    return (size_t)heads * kHD * sizeof(double) + 2 * (size_t)M3_PAGE * idx_row_bytes();
}

constexpr int kAttnKeys = 64;
constexpr int kRowBytes = kHD * 2 + 16;
constexpr int kTileBytes = kAttnKeys * kRowBytes;
constexpr int kStageBytes = 2 * kTileBytes;
constexpr int kQOffset = 2 * kStageBytes;
constexpr int kAttnSmem = kQOffset + kHeadTile * kRowBytes;
constexpr int kOStride = kHD + 4;
static_assert(kWarps * kHeadTile * (kOStride + 3) * 4 + 3 * kHeadTile * 4 <= kQOffset,
              "attention merge space");

/* ================================================================ kernel unit entry points */

/* The smallest resident CTA count per SM over every kernel instance at
 * `smem` bytes of dynamic shared memory (also sets the attribute). */
m3_status occupancy(size_t smem, int *min_occ);
/* Both launches of one layer on stream s, P CTAs each, in the variant
 * (V_F8, V_TP) the arguments need. */
m3_status launch_layer(cudaStream_t s, int P, size_t smem, const MonoArgs &a);
/* the same for one variant (cuda_mono_kernels.cuh; V_TP variants in
 * cuda_mono_kernels_tp.cu, so the two halves compile in parallel) */
template <int V>
m3_status occupancy_variant(size_t smem, int *min_occ);
template <int V>
m3_status launch_variant(cudaStream_t s, int P, size_t smem, const MonoArgs &a);
m3_status launch_check(cudaStream_t s, const int *fault);
m3_status launch_set(cudaStream_t s, int *fault, int code, int layer);

} // namespace m3mono

#endif
