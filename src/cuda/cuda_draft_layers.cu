/*
 * The DSpark drafter's layers in one persistent kernel (SPEC §7's drafter
 * kernels; backend ops draft_layers_*; the stock drafter, draft_forward.c,
 * runs the same math op by op). A draft step's n requests (T = n B rows,
 * up to 8 requests) go through every draft layer and the final norm in one
 * launch instead of ~11 launches a layer.
 *
 * Why: a draft layer's weights are ~166 MB in seven matrices of 1.5-38 MB,
 * each its own launch in the stock drafter, and each launch pays its ramp
 * (the first loads' DRAM latency, the last wave's tail) between the norms,
 * RoPE and attention, which read almost nothing: a draft layer took ~0.18
 * ms against a ~0.05 ms floor on an H100 (docs/PERF.md, forty-second
 * session). Here the work is one ordered list of items, phase by phase
 * (per layer: norm, q/k/v tiles, head norm + RoPE, attention, o_proj
 * tiles, norm, gate/up tiles with SwiGLU, down tiles; then the final norm).
 * A CTA claims the next item from a counter, asks L2 for the first lines of
 * its weight tile, and only then waits for the previous phase to finish,
 * so the weights' first bytes are on their way while the short phases
 * run. Items are claimed in order and wait only on earlier phases, so the
 * kernel cannot deadlock however many CTAs are resident. The counters are
 * left zeroed by the last CTA to leave (a graph replays the launch).
 *
 * Each item is the stock op's device code in the stock op's order: the
 * tiles are cuda_lmma.cuh's chunks combined as the linear op combines
 * them, the norms emulate add_rmsnorm's CTA of up to 1024 threads (its
 * per-thread sums and its warp tree), the heads are cuda_hnr.cuh's units,
 * the attention cuda_draft.cuh's item. So at up to 16 rows, where the
 * stock linear is the MMA kernel too, the drafts and logits are the stock
 * drafter's bits (test_cuda_draft); above 16 rows the stock linear is
 * cuBLAS, and the two agree within bf16 rounding. Activations written in
 * the launch are read through L2 (ld.global.cg): another SM's L1 may hold
 * the previous layer's values of the same buffer.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "cuda/cuda_draft.cuh"
#include "cuda/cuda_hnr.cuh"
#include "cuda/cuda_internal.h"
#include "cuda/cuda_lmma.cuh"

namespace {

using namespace m3draft;

constexpr int kThreads = 256, kWarps = kThreads / 32;
constexpr int kDim = 128;     /* the head dim the kernel is built for (M3's) */
constexpr int kPhases = 8;    /* a layer's */
constexpr int kPfLines = 4;   /* 128-byte lines asked for per (weight row, chunk) */
enum { PH_NORM1, PH_QKV, PH_HNR, PH_ATTN, PH_O, PH_NORM2, PH_GATEUP, PH_DOWN };
enum { W_Q, W_K, W_V, W_O, W_GATE, W_UP, W_DOWN, W_COUNT }; /* W_UP follows W_GATE */

/* One draft layer in device memory (the runner's table). */
struct DLayer {
    const uint16_t *in_norm, *post_norm, *q_norm, *k_norm; /* [H], [H], [D], [D] */
    gemv_weight w[W_COUNT];
    const uint16_t *kc, *vc; /* [pages, Nkv, 128, D] */
};

struct DLArgs {
    const DLayer *layers;
    const double *inv_freq;   /* [half]: the stock op's table */
    const uint16_t *final_norm;
    const int64_t *positions; /* [T] */
    const int32_t *pages;     /* [G, max_blocks] */
    uint16_t *residual, *hidden, *x, *q, *k, *v, *attn, *o, *act, *final;
    unsigned *ctr;            /* [2 + phases]: cursor, each phase's items done, exits */
    int n_layers, H, Nq, Nkv, F, B, n, T, max_blocks, half;
    int chunks_h, chunks_o, chunks_f; /* K chunks of x [H], attn [Nq D], act [F] */
    float eps, scale, alpha, limit;
    int64_t window;
};

__host__ __device__ inline int tiles_of(int64_t N) { return (int)((N + 15) / 16); }

/* items of phase kind k */
__device__ __forceinline__ int phase_items(const DLArgs &a, int k) {
    switch (k) {
    case PH_NORM1:
    case PH_NORM2:
        return a.T;
    case PH_QKV:
        return tiles_of((int64_t)a.Nq * kDim) + 2 * tiles_of((int64_t)a.Nkv * kDim);
    case PH_HNR:
        return (a.T * (a.Nq + a.Nkv) + kWarps - 1) / kWarps;
    case PH_ATTN:
        return a.T * a.Nq;
    case PH_O:
    case PH_DOWN:
        return tiles_of(a.H);
    default: /* PH_GATEUP */
        return tiles_of(a.F);
    }
}

/* ---- counters (thread 0 waits and signals; the CTA follows) ---- */

__device__ __forceinline__ void wait_done(const unsigned *c, unsigned target) {
    __syncthreads();
    if (threadIdx.x == 0) {
        while (ld_relaxed(c) < target)
            __nanosleep(64);
        (void)ld_acquire(c);
        __threadfence();
    }
    __syncthreads();
}

__device__ __forceinline__ void signal_done(unsigned *c) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(c, 1u);
    }
}

/* ---- add + RMSNorm of one row, as add_rmsnorm_vec_kernel computes it ----
 * That kernel runs VB = round_up32(ceil(nvec / ITEMS)) threads, thread v
 * holding vectors v, v + VB, ... (ITEMS of them), summing their squares in
 * that order in double, then a warp butterfly per warp and one over the
 * warps' sums. Here thread tid plays threads tid, tid + 256, ... of that
 * CTA: the same sums in the same order. */
__device__ __forceinline__ void norm_row(const DLArgs &a, int t, const uint16_t *add,
                                         const uint16_t *w, uint16_t *out) {
    __shared__ double scratch[32];
    const int nvec = a.H >> 3, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int items = nvec <= 1024 ? 1 : nvec <= 2048 ? 2 : nvec <= 4096 ? 4 : 8;
    const int vb = ((nvec + items - 1) / items + 31) / 32 * 32;
    uint4 *res = reinterpret_cast<uint4 *>(a.residual + (int64_t)t * a.H);
    const uint4 *addv = add ? reinterpret_cast<const uint4 *>(add + (int64_t)t * a.H) : nullptr;
    for (int m = 0; m * kThreads < vb; m++) {
        const int v0 = threadIdx.x + m * kThreads; /* the virtual thread */
        double ss = 0.0;
        for (int k = 0; k < items && v0 < vb; k++) {
            const int v = v0 + k * vb;
            if (v >= nvec)
                continue;
            float f[8];
            unpack8(__ldcg(res + v), f);
            if (addv) {
                float ad[8];
                unpack8(__ldcg(addv + v), ad);
#pragma unroll
                for (int j = 0; j < 8; j++)
                    f[j] = m3_round_bf(__fadd_rn(ad[j], f[j]));
                res[v] = pack8(f);
            }
#pragma unroll
            for (int j = 0; j < 8; j++)
                ss += (double)f[j] * (double)f[j];
        }
        ss = m3_warp_sum_d(ss); /* the virtual warp is this warp's lanes */
        if (lane == 0 && warp + m * kWarps < vb / 32)
            scratch[warp + m * kWarps] = ss;
    }
    __syncthreads();
    double tot = lane < vb / 32 ? scratch[lane] : 0.0;
    tot = m3_warp_sum_d(tot);
    const float ms = (float)(tot / (double)a.H);
    const float rs = 1.0f / sqrtf(ms + a.eps);
    const uint4 *wv = reinterpret_cast<const uint4 *>(w);
    uint4 *o = reinterpret_cast<uint4 *>(out + (int64_t)t * a.H);
    for (int v = threadIdx.x; v < nvec; v += kThreads) {
        float x[8], wf[8];
        unpack8(__ldcg(res + v), x); /* this thread's own write when add: visible */
        unpack8(__ldg(wv + v), wf);
#pragma unroll
        for (int j = 0; j < 8; j++)
            x[j] = __fmul_rn(__fmul_rn(x[j], rs), __fadd_rn(1.0f, wf[j]));
        o[v] = pack8(x);
    }
    __syncthreads(); /* scratch is reused by the next row */
}

/* ---- one 16-row weight tile, as linear_mma_kernel's non-split CTA ---- */

template <int NT>
struct TileOut {
    float v[NT][4]; /* warp 0's combined sums */
};

/* Warps c < chunks sum their chunk; warp 0 combines them as the tree. */
template <int NT>
__device__ __forceinline__ void tile_sums(const gemv_weight &W, int64_t N, int64_t n0,
                                          const uint16_t *x, int rows, int K, int chunks,
                                          TileOut<NT> &out) {
    constexpr int U = NT <= 2 ? 3 : 2;
    __shared__ float part[kWarps][NT * 4][32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (warp < chunks) {
        int k0, k1;
        ksum_bounds(K, chunks, warp, &k0, &k1);
        float acc[NT][4];
        lmma_chunk<NT, false, U, true>(W, N, n0, x, rows, K, k0, k1, acc);
        lmma_part_put(part, warp, lane, acc);
    }
    __syncthreads();
    if (warp == 0) {
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int i = 0; i < 4; i++)
                out.v[j][i] = lmma_part_sum(part, chunks, j, i, lane);
    }
    __syncthreads(); /* part is reused by the next tile */
}

/* lane (g, q)'s output (j, i): weight row n0 + g (+ 8), x row 8 j + 2 q (+ 1) */
__device__ __forceinline__ int64_t out_n(int64_t n0, int i) {
    return n0 + ((threadIdx.x & 31) >> 2) + (i >= 2 ? 8 : 0);
}
__device__ __forceinline__ int out_t(int j, int i) {
    return j * 8 + 2 * ((threadIdx.x & 31) & 3) + (i & 1);
}

/* The GEMV items: a tile of q, k, v (PH_QKV), o_proj (PH_O) or down
 * (PH_DOWN), bf16 out; or (PH_GATEUP) a tile of gate then the same tile of
 * up, out act = bf16(swiglu(bf16 gate, bf16 up)): the values the linear
 * and swiglu ops give, without the round trip. One call site of the tile
 * code (a loop over the pair), so the kernel holds one copy of it. */
struct GemvJob {
    const gemv_weight *W; /* [pair ? 2 : 1] */
    int64_t N, n0;
    const uint16_t *x;
    int K, chunks;
    uint16_t *out;
    bool pair;
};

__device__ __forceinline__ GemvJob gemv_job(const DLArgs &a, const DLayer &L, int kind, int i) {
    const int qt = tiles_of((int64_t)a.Nq * kDim), kt = tiles_of((int64_t)a.Nkv * kDim);
    GemvJob j = {nullptr, 0, 0, a.x, a.H, a.chunks_h, nullptr, false};
    switch (kind) {
    case PH_QKV: {
        const int w = i < qt ? W_Q : i < qt + kt ? W_K : W_V;
        j.W = &L.w[w];
        j.N = (int64_t)(w == W_Q ? a.Nq : a.Nkv) * kDim;
        j.n0 = (int64_t)(w == W_Q ? i : w == W_K ? i - qt : i - qt - kt) * 16;
        j.out = w == W_Q ? a.q : w == W_K ? a.k : a.v;
        break;
    }
    case PH_O:
        j = {&L.w[W_O], a.H, (int64_t)i * 16, a.attn, a.Nq * kDim, a.chunks_o, a.o, false};
        break;
    case PH_GATEUP:
        j = {&L.w[W_GATE], a.F, (int64_t)i * 16, a.x, a.H, a.chunks_h, a.act, true};
        break;
    default: /* PH_DOWN */
        j = {&L.w[W_DOWN], a.H, (int64_t)i * 16, a.act, a.F, a.chunks_f, a.hidden, false};
        break;
    }
    return j;
}

template <int NT>
__device__ __forceinline__ void gemv_item(const DLArgs &a, const GemvJob &j) {
    __shared__ float s_gate[NT * 4][32]; /* warp 0's bf16-rounded gate sums */
    const int lane = threadIdx.x & 31;
    const bool warp0 = (threadIdx.x >> 5) == 0;
#pragma unroll 1
    for (int p = 0; p < (j.pair ? 2 : 1); p++) {
        TileOut<NT> r;
        tile_sums<NT>(j.W[p], j.N, j.n0, j.x, a.T, j.K, j.chunks, r);
        if (!warp0)
            continue;
#pragma unroll
        for (int jj = 0; jj < NT; jj++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int64_t n = out_n(j.n0, i);
                const int t = out_t(jj, i);
                if (n >= j.N || t >= a.T)
                    continue;
                if (j.pair && p == 0) {
                    s_gate[jj * 4 + i][lane] = m3_round_bf(r.v[jj][i]);
                } else {
                    float y = r.v[jj][i];
                    if (j.pair)
                        y = m3_swiglu_oai(s_gate[jj * 4 + i][lane], m3_round_bf(y), a.alpha,
                                          a.limit);
                    j.out[(int64_t)t * j.N + n] = m3_to_bf(y);
                }
            }
    }
}

/* Ask L2 for the first kPfLines lines of every (row, chunk) of a tile. */
__device__ __forceinline__ void prefetch_tile(const gemv_weight &W, int64_t N, int64_t n0, int K,
                                              int chunks) {
    const int per_row = chunks * kPfLines;
    for (int i = threadIdx.x; i < 16 * per_row; i += kThreads) {
        const int r = i / per_row, c = (i % per_row) / kPfLines, l = i % kPfLines;
        if (n0 + r >= N)
            continue;
        int k0, k1;
        ksum_bounds(K, chunks, c, &k0, &k1);
        const int64_t byte = (int64_t)k0 * 2 + (int64_t)l * 128;
        if (byte < (int64_t)k1 * 2)
            asm volatile("prefetch.global.L2 [%0];" ::"l"(
                __cvta_generic_to_global(W.w + (n0 + r) * W.w_row + byte)));
    }
}

/* ---- head norm + RoPE: a warp per head, as head_norm_rope_kernel ---- */

__device__ __forceinline__ void hnr_item(const DLArgs &a, const DLayer &L, int item) {
    __shared__ __align__(16) uint16_t s_head[kWarps][kDim];
    __shared__ __align__(16) float s_wp1[kWarps][kDim];
    __shared__ __align__(16) float s_cs[kWarps][kDim / 2], s_sn[kWarps][kDim / 2];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int heads = a.Nq + a.Nkv, e = item * kWarps + warp;
    if (e >= a.T * heads)
        return;
    const int t = e / heads, hh = e % heads;
    const bool is_q = hh < a.Nq;
    uint16_t *head = is_q ? a.q + ((int64_t)t * a.Nq + hh) * kDim
                          : a.k + ((int64_t)t * a.Nkv + (hh - a.Nq)) * kDim;
    const uint16_t *w = is_q ? L.q_norm : L.k_norm;
    for (int d = lane; d < kDim; d += 32) {
        s_head[warp][d] = __ldcg(head + d);
        s_wp1[warp][d] = __fadd_rn(1.0f, m3_bf(w[d]));
    }
    const int64_t pos = a.positions[t];
    for (int i = lane; i < a.half; i += 32) {
        double s, c;
        sincos((double)pos * a.inv_freq[i], &s, &c);
        s_cs[warp][i] = (float)c;
        s_sn[warp][i] = (float)s;
    }
    __syncwarp();
    double ss = 0.0;
    for (int d = lane; d < kDim; d += 32) {
        const double v = (double)m3_bf(s_head[warp][d]);
        ss += v * v;
    }
    ss = m3_warp_sum_d(ss);
    const float rn = 1.0f / sqrtf((float)(ss / (double)kDim) + a.eps);
    for (int u = lane; u < kDim / 8; u += 32)
        reinterpret_cast<uint4 *>(head)[u] =
            hnr_unit8(s_head[warp], u * 8, rn, s_wp1[warp], s_cs[warp], s_sn[warp], a.half);
    __syncwarp(); /* the staged head is reused by this warp's next item */
}

/* ---- attention: row t's query head h, over its request's context and block ---- */

__device__ __forceinline__ void attn_item(const DLArgs &a, const DLayer &L, int i) {
    const int t = i / a.Nq, h = i % a.Nq, g = t / a.B;
    const DraftArgs all = {a.q, a.k, a.v, L.kc, L.vc, a.pages, a.positions, a.window,
                           a.B, a.Nq, a.Nkv, a.scale, a.attn, a.n, a.max_blocks};
    draft_attention_item<kDim, true>(request_view<kDim>(all, g), t - g * a.B, h);
}

/* ---- one item ---- */

template <int NT>
__device__ void run_item(const DLArgs &a, int layer, int kind, int i) {
    if (layer == a.n_layers) { /* the final norm */
        norm_row(a, i, a.hidden, a.final_norm, a.final);
        return;
    }
    const DLayer &L = a.layers[layer];
    switch (kind) {
    case PH_NORM1:
        norm_row(a, i, layer ? a.hidden : nullptr, L.in_norm, a.x);
        break;
    case PH_HNR:
        hnr_item(a, L, i);
        break;
    case PH_ATTN:
        attn_item(a, L, i);
        break;
    case PH_NORM2:
        norm_row(a, i, a.o, L.post_norm, a.x);
        break;
    default: /* the GEMV kinds */
        gemv_item<NT>(a, gemv_job(a, L, kind, i));
        break;
    }
}

/* The item's weights, asked into L2 before its wait */
__device__ __forceinline__ void prefetch_item(const DLArgs &a, int layer, int kind, int i) {
    if (layer == a.n_layers || kind == PH_NORM1 || kind == PH_HNR || kind == PH_ATTN ||
        kind == PH_NORM2)
        return;
    const GemvJob j = gemv_job(a, a.layers[layer], kind, i);
    for (int p = 0; p < (j.pair ? 2 : 1); p++)
        prefetch_tile(j.W[p], j.N, j.n0, j.K, j.chunks);
}

template <int NT>
__global__ void __launch_bounds__(kThreads, 1)
    draft_layers_kernel(const __grid_constant__ DLArgs a) {
    __shared__ unsigned s_item;
    int count[kPhases], per_layer = 0;
#pragma unroll
    for (int k = 0; k < kPhases; k++) {
        count[k] = phase_items(a, k);
        per_layer += count[k];
    }
    const unsigned total = (unsigned)(per_layer * a.n_layers + a.T);
    const int phases = kPhases * a.n_layers + 1;
    unsigned *done = a.ctr + 1;
    for (;;) {
        if (threadIdx.x == 0)
            s_item = atomicAdd(a.ctr, 1u);
        __syncthreads();
        const unsigned idx = s_item;
        __syncthreads();
        if (idx >= total)
            break;
        /* the item's phase: layer, kind, index in the phase */
        const int layer = (int)(idx / (unsigned)per_layer);
        int i = (int)(idx % (unsigned)per_layer), kind = 0, prev_count;
        if (layer == a.n_layers) {
            i = (int)(idx - (unsigned)per_layer * a.n_layers);
            prev_count = count[PH_DOWN];
        } else {
            while (i >= count[kind])
                i -= count[kind++];
            prev_count = count[(kind + kPhases - 1) % kPhases];
        }
        const int phase = layer * kPhases + kind;
        prefetch_item(a, layer, kind, i);
        if (phase > 0)
            wait_done(done + phase - 1, (unsigned)prev_count);
        run_item<NT>(a, layer, kind, i);
        signal_done(done + phase);
    }
    /* the last CTA out leaves every counter zeroed for the next launch */
    if (threadIdx.x == 0) {
        __threadfence();
        s_item = atomicAdd(a.ctr + 1 + phases, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (s_item)
        for (int c = threadIdx.x; c < 2 + phases; c += kThreads)
            a.ctr[c] = 0;
}

/* The runner: what a launch needs beyond the step's request count. */
struct Runner {
    DLArgs args;   /* n, T set per launch */
    DLayer *layers;
    double *inv_freq;
    unsigned *ctr;
    int grid[4];   /* CTAs per instantiation */
    int max_reqs;
};

template <int NT>
m3_status grid_of(m3_cuda *cu, int *grid) {
    int per_sm = 0;
    M3_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, draft_layers_kernel<NT>,
                                                              kThreads, 0));
    if (per_sm < 1)
        return m3_fail(M3_ERR_UNSUPPORTED, "draft layers: the kernel for %d rows does not fit "
                       "a multiprocessor", NT * 8);
    *grid = (per_sm < 2 ? per_sm : 2) * cu->sm_count;
    return M3_OK;
}

/* Why a linear is not the kernel's (NULL: it is): bf16, K in whole
 * 8-column pieces of its chunks, 16-byte rows, not a TP rank's slice. */
const char *linear_refusal(const m3_linear *l, int64_t N, int64_t K) {
    if (l->w.dtype != M3_DT_BF16)
        return "weights not bf16";
    if (l->w.ne[0] != N || l->w.ne[1] != K)
        return "a weight's shape";
    if (l->k_chunks > 0 || K % (8 * m3_k_chunks(K)) || l->w.nb[0] % 16 ||
        (uintptr_t)l->w.data % 16)
        return "a weight's row layout";
    return NULL;
}

gemv_weight weight_of(const m3_linear *l) {
    return {static_cast<const uint8_t *>(l->w.data), l->w.nb[0], nullptr, 0};
}

void runner_free(Runner *r) {
    if (!r)
        return;
    cudaFree(r->layers);
    cudaFree(r->inv_freq);
    cudaFree(r->ctr);
    free(r);
}

m3_status runner_check(const m3_draft_layers_args *a) {
    const int D = a->head_dim, H = a->hidden_size;
    const char *why = NULL;
    if (D != kDim)
        why = "head dim";
    else if (H % 8 || H / 8 > 8192 || a->q_heads < 1 || a->kv_heads < 1 ||
             a->q_heads % a->kv_heads)
        why = "hidden size or heads";
    else if (a->rope.rotary_dim % 16 || a->rope.rotary_dim > D || !(a->rope.theta > 0))
        why = "rotary dim";
    else if ((int64_t)a->max_reqs * a->block > 8 * 7 || a->block < 1)
        why = "rows a step";
    if (why)
        return m3_fail(M3_ERR_UNSUPPORTED, "draft layers: %s not supported (head dim %d = %d, "
                       "hidden %d a multiple of 8, %d query heads over %d KV heads, rotary dim "
                       "%d a multiple of 16, up to 56 rows: %d requests of %d)", why, D, kDim, H,
                       a->q_heads, a->kv_heads, a->rope.rotary_dim, a->max_reqs, a->block);
    const int64_t QD = (int64_t)a->q_heads * D, KD = (int64_t)a->kv_heads * D, F = a->ffn;
    for (int i = 0; i < a->n_layers; i++) {
        const m3_draft_layer *L = &a->layers[i];
        const m3_linear *ls[W_COUNT] = {&L->q_proj, &L->k_proj, &L->v_proj, &L->o_proj,
                                        &L->gate, &L->up, &L->down};
        const int64_t ns[W_COUNT] = {QD, KD, KD, H, F, F, H}, ks[W_COUNT] = {H, H, H, QD, H, H, F};
        for (int w = 0; w < W_COUNT; w++)
            if ((why = linear_refusal(ls[w], ns[w], ks[w])))
                return m3_fail(M3_ERR_UNSUPPORTED, "draft layers: layer %d's %s: %s", i,
                               ls[w]->w.name ? ls[w]->w.name : "linear", why);
    }
    return M3_OK;
}

m3_status runner_build(m3_cuda *cu, const m3_draft_layers_args *a, Runner *r) {
    const int L = a->n_layers, half = a->rope.rotary_dim / 2;
    DLayer *host = static_cast<DLayer *>(calloc((size_t)L, sizeof *host));
    if (!host)
        return m3_fail(M3_ERR_NO_MEMORY, "draft layers: a table of %d layers", L);
    for (int i = 0; i < L; i++) {
        const m3_draft_layer *s = &a->layers[i];
        DLayer &d = host[i];
        d.in_norm = static_cast<const uint16_t *>(s->input_norm.data);
        d.post_norm = static_cast<const uint16_t *>(s->post_norm.data);
        d.q_norm = static_cast<const uint16_t *>(s->q_norm.data);
        d.k_norm = static_cast<const uint16_t *>(s->k_norm.data);
        const m3_linear *ls[W_COUNT] = {&s->q_proj, &s->k_proj, &s->v_proj, &s->o_proj,
                                        &s->gate, &s->up, &s->down};
        for (int w = 0; w < W_COUNT; w++)
            d.w[w] = weight_of(ls[w]);
        d.kc = a->k_cache[i];
        d.vc = a->v_cache[i];
    }
    double freq[kDim / 2];
    for (int i = 0; i < half; i++) /* the CPU's m3_rope_table expression, as the op's */
        freq[i] = pow(a->rope.theta, -(double)(2 * i) / (double)a->rope.rotary_dim);
    const int phases = kPhases * L + 1;
    cudaError_t e = cudaMalloc(&r->layers, (size_t)L * sizeof *host);
    if (e == cudaSuccess)
        e = cudaMalloc(&r->inv_freq, sizeof freq);
    if (e == cudaSuccess)
        e = cudaMalloc(&r->ctr, (size_t)(2 + phases) * sizeof(unsigned));
    if (e == cudaSuccess)
        e = cudaMemcpy(r->layers, host, (size_t)L * sizeof *host, cudaMemcpyHostToDevice);
    if (e == cudaSuccess)
        e = cudaMemcpy(r->inv_freq, freq, sizeof freq, cudaMemcpyHostToDevice);
    if (e == cudaSuccess)
        e = cudaMemset(r->ctr, 0, (size_t)(2 + phases) * sizeof(unsigned));
    free(host);
    if (e != cudaSuccess)
        return m3_fail(M3_ERR_DEVICE, "draft layers: %s", cudaGetErrorString(e));
    M3_TRY(grid_of<1>(cu, &r->grid[0]));
    M3_TRY(grid_of<2>(cu, &r->grid[1]));
    M3_TRY(grid_of<4>(cu, &r->grid[2]));
    M3_TRY(grid_of<7>(cu, &r->grid[3]));
    DLArgs &g = r->args;
    g.layers = r->layers;
    g.inv_freq = r->inv_freq;
    g.final_norm = static_cast<const uint16_t *>(a->final_norm->data);
    g.positions = a->positions;
    g.pages = a->pages;
    g.residual = a->residual;
    g.hidden = a->hidden;
    g.x = a->x;
    g.q = a->q;
    g.k = a->k;
    g.v = a->v;
    g.attn = a->attn;
    g.o = a->o;
    g.act = a->act;
    g.final = a->final;
    g.ctr = r->ctr;
    g.n_layers = L;
    g.H = a->hidden_size;
    g.Nq = a->q_heads;
    g.Nkv = a->kv_heads;
    g.F = a->ffn;
    g.B = a->block;
    g.max_blocks = a->max_blocks;
    g.half = half;
    g.chunks_h = m3_k_chunks(a->hidden_size);
    g.chunks_o = m3_k_chunks((int64_t)a->q_heads * kDim);
    g.chunks_f = m3_k_chunks(a->ffn);
    g.eps = a->eps;
    g.scale = a->scale;
    g.alpha = a->swiglu.alpha;
    g.limit = a->swiglu.limit;
    g.window = a->window;
    r->max_reqs = a->max_reqs;
    return M3_OK;
}

} // namespace

extern "C" m3_status m3_cuda_draft_layers_build(m3_backend *be, const m3_draft_layers_args *a,
                                                void **runner) {
    m3_cuda *cu = m3_cuda_of(be);
    *runner = NULL;
    if (cu->capturing)
        return m3_fail(M3_ERR_INVALID_ARG, "draft layers: the runner is built outside a graph "
                       "capture");
    M3_TRY(runner_check(a));
    Runner *r = static_cast<Runner *>(calloc(1, sizeof *r));
    if (!r)
        return m3_fail(M3_ERR_NO_MEMORY, "draft layers: a runner");
    m3_status st = runner_build(cu, a, r);
    if (st) {
        runner_free(r);
        return st;
    }
    *runner = r;
    return M3_OK;
}

extern "C" m3_status m3_cuda_draft_layers_run(m3_backend *be, void *runner, int n) {
    m3_cuda *cu = m3_cuda_of(be);
    Runner *r = static_cast<Runner *>(runner);
    if (!r)
        return m3_fail(M3_ERR_INVALID_ARG, "draft layers: no runner");
    DLArgs a = r->args;
    a.n = n;
    a.T = n * a.B;
    if (n < 1 || n > r->max_reqs)
        return m3_fail(M3_ERR_INVALID_ARG, "draft layers: %d requests (1 to %d)", n,
                       r->max_reqs);
    if (a.T <= 8)
        draft_layers_kernel<1><<<r->grid[0], kThreads, 0, cu->stream>>>(a);
    else if (a.T <= 16)
        draft_layers_kernel<2><<<r->grid[1], kThreads, 0, cu->stream>>>(a);
    else if (a.T <= 32)
        draft_layers_kernel<4><<<r->grid[2], kThreads, 0, cu->stream>>>(a);
    else
        draft_layers_kernel<7><<<r->grid[3], kThreads, 0, cu->stream>>>(a);
    M3_CUDA_LAUNCHED("draft_layers_kernel");
    return M3_OK;
}

extern "C" void m3_cuda_draft_layers_free(m3_backend *be, void *runner) {
    (void)be;
    runner_free(static_cast<Runner *>(runner));
}
