/*
 * The DSpark drafter's attention as device code (cuda_draft.cu describes
 * it): the arguments and one (row, query head) item, shared by the
 * draft_attention op's kernel and the fused drafter layers
 * (cuda_draft_layers.cu), so both compute an item the same way.
 */
#ifndef M3_CUDA_CUDA_DRAFT_CUH
#define M3_CUDA_CUDA_DRAFT_CUH

#include <math.h>
#include <stdint.h>

#include "cuda/cuda_common.cuh"
#include "cuda/cuda_internal.h"

namespace m3draft {

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

template <typename T>
__device__ __forceinline__ T ld_ro(const T *p, bool cg) {
    return cg ? __ldcg(p) : __ldg(p);
}

template <int E, bool CG>
__device__ __forceinline__ void load_raw(RawBf16<E> &r, const uint16_t *p) {
    if constexpr (E % 4 == 0) { /* 8-byte aligned: the row's base and lane * E * 2 */
#pragma unroll
        for (int i = 0; i < E / 4; i++) {
            const uint2 v = ld_ro(reinterpret_cast<const uint2 *>(p) + i, CG);
            r.w[2 * i] = v.x;
            r.w[2 * i + 1] = v.y;
        }
    } else if constexpr (E % 2 == 0) {
#pragma unroll
        for (int i = 0; i < E / 2; i++)
            r.w[i] = ld_ro(reinterpret_cast<const uint32_t *>(p) + i, CG);
    } else {
#pragma unroll
        for (int i = 0; i < (E + 1) / 2; i++)
            r.w[i] = 0;
#pragma unroll
        for (int e = 0; e < E; e++)
            r.w[e / 2] |= (uint32_t)ld_ro(p + e, CG) << (16 * (e % 2));
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
    int requests;   /* the op's: request r's arrays at the strides of request_view */
    int max_blocks; /* pages a request's block table holds */
};

/* Request r's arguments (the op's layout, backend.h draft_attention:
 * rows of q, out, bk, bv, positions and block tables one request after
 * another), a request of one. */
template <int D>
__device__ __forceinline__ DraftArgs request_view(const DraftArgs &a, int r) {
    DraftArgs v = a;
    const int64_t qn = (int64_t)r * a.rows * a.q_heads * D;
    const int64_t kn = (int64_t)r * a.rows * a.kv_heads * D;
    v.q += qn;
    v.out += qn;
    v.bk += kn;
    v.bv += kn;
    v.pages += (int64_t)r * a.max_blocks;
    v.pos += (int64_t)r * a.rows;
    v.requests = 1;
    return v;
}

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

/* The first context key row t of a block at position p sees: the
 * window's, or 0 (never past p). */
__device__ __forceinline__ int64_t row_lo(const DraftArgs &a, int64_t p, int t) {
    int64_t lo = 0;
    if (a.window > 0 && p + t - a.window + 1 > 0)
        lo = p + t - a.window + 1;
    return lo < p ? lo : p;
}

/* Row t's query head h over its keys (the CTA's kDraftThreads threads;
 * the kernel below is one item a CTA, the fused drafter layers run many
 * items a CTA, a barrier between them). CG: the block's q, k and v were
 * written in this launch (loads through L2). */
template <int D, bool CG>
__device__ __forceinline__ void draft_attention_item(const DraftArgs &a, int t, int h) {
    constexpr int E = D / 32;            /* dims per lane */
    constexpr int KB = draft_run<D>();   /* a run: keys in flight per warp */
    __shared__ float s_m[kDraftWarps], s_l[kDraftWarps];
    __shared__ float s_acc[kDraftWarps][D];
    const int g = h / (a.q_heads / a.kv_heads);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t p = max(__ldg(a.pos), (int64_t)0);
    const int64_t lo = row_lo(a, p, t);
    const int64_t n_ctx = p - lo, n = n_ctx + a.rows;
    float q[E], acc[E];
    const uint16_t *qrow = a.q + ((int64_t)t * a.q_heads + h) * D + lane * E;
#pragma unroll
    for (int e = 0; e < E; e++) {
        q[e] = m3_bf(CG ? __ldcg(qrow + e) : qrow[e]);
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
            load_raw<E, CG>(kr[j], kp[j]);
            load_raw<E, CG>(vr[j], vp[j]);
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


} // namespace m3draft

/* The long-context kernels (cuda_draft_split.cu) for the op's arguments:
 * the split kernel and the merge, sized for `most` context keys, doing
 * the work at positions with split_from context keys or more (the
 * short-context kernel, launched before, leaves those). */
m3_status m3_draft_split_launch(m3_cuda *cu, const m3draft::DraftArgs &a, int dim, int64_t most,
                                int64_t split_from);

#endif
