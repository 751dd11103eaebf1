/*
 * The post kernel's first items: block selection and sparse attention.
 * Part of the mono executor's kernel unit (cuda_mono_kernels.cu includes it;
 * cuda_mono.cu describes the design).
 */
#ifndef M3_CUDA_CUDA_MONO_ATTN_CUH
#define M3_CUDA_CUDA_MONO_ATTN_CUH

namespace m3mono {
namespace { /* internal linkage: cuda_mono_kernels.cu and _tp.cu both compile it */

/* ================================================================ launch 2 */

/* ---------------------------------------------------------------- selection
 * (cuda_index.cu select_kernel for one (row, head), 128 threads; the
 * radix select itself is shared: cuda_async.cuh) */

__device__ void select_one(const MonoArgs &a, unsigned char *dsm, int t, int item,
                           int32_t *out) {
    SelShared &sh = *reinterpret_cast<SelShared *>(dsm);
    RowView rv = load_row(a, t);
    int nb = rv.state == ROW_PADDED ? 0 : rv.nblocks;
    if (rv.state == ROW_PADDED || nb <= a.topk) {
        for (int i = threadIdx.x; i < a.topk; i += kThreads)
            out[i] = i < nb ? i : -1;
        return;
    }
    int init_end = min(a.init, nb);
    int local_begin = max(nb - a.local, init_end);
    int room = a.topk - init_end - (nb - local_begin);
    const float *sc = a.scores + (int64_t)item * a.mb;
    if (a.sel_staged && room > 0) {
        float *st = reinterpret_cast<float *>(dsm + (sizeof(SelShared) + 15) / 16 * 16);
        for (int b = init_end + threadIdx.x; b < local_begin; b += kThreads)
            st[b] = __ldcg(sc + b);
        __syncthreads();
        sc = st;
    }
    mark(); /* selection: the scores staged */
    if (room > 0) {
        /* mark: the threshold (on the filtered path, with the ids) */
        const int got = sel_top<kThreads>(sc, init_end, local_begin, (unsigned)room,
                                          out + init_end, sh, [] { mark(); });
        mark(); /* selection: the ids compacted */
        for (int i = got + threadIdx.x; i < room; i += kThreads)
            out[init_end + i] = -1;
    }
    for (int i = threadIdx.x; i < init_end; i += kThreads)
        out[i] = i;
    for (int i = threadIdx.x; i < nb - local_begin; i += kThreads)
        out[init_end + room + i] = local_begin + i;
}

__device__ void sel_item(const MonoArgs &a, unsigned char *dsm, int item, bool faulted) {
    const int t = item / a.Ni;
    if (!faulted)
        select_one(a, dsm, t, item, a.sel + (size_t)item * a.topk);
    signal_count(&a.ctr[a.o_sel + item]);
}

/* ---------------------------------------------------------------- attention
 * (cuda_attention.cu attn_kernel: 4 warps, 64-key tiles, bf16 mma.sync; one
 * split = one selected block; every split writes a partial, merged per
 * head by merge_item) */



struct AttnCta {
    int t, g, h0, nh, split;
    RowView rv;
    const int32_t *sel;
    int tile0, ntiles;
    bool poisoned;
};


__device__ int sel_count(const int32_t *sel, int topk) {
    const int lane = threadIdx.x & 31;
    for (int base = 0; base < topk; base += 32) {
        int i = base + lane;
        unsigned end = __ballot_sync(kFull, i < topk && __ldcg(sel + i) < 0);
        if (end)
            return base + __ffs(end) - 1;
    }
    return topk;
}

__device__ AttnCta attn_cta(const MonoArgs &a, int t, int g, int mt, int split) {
    AttnCta c;
    c.split = split;
    c.g = g;
    c.t = t;
    c.h0 = g * a.group + mt * kHeadTile;
    c.nh = min(kHeadTile, a.group - mt * kHeadTile);
    c.rv = load_row(a, t);
    c.sel = nullptr;
    c.tile0 = 0;
    c.ntiles = 0;
    c.poisoned = c.rv.state == ROW_BAD;
    if (c.rv.state != ROW_OK)
        return c;
    c.sel = a.sel + ((int64_t)t * a.Ni + g) * a.topk;
    int n = sel_count(c.sel, a.topk);
    int64_t n2 = 2 * (int64_t)n;
    int64_t t0 = (int64_t)split * n2 / a.S, t1 = (int64_t)(split + 1) * n2 / a.S;
    c.tile0 = (int)t0;
    c.ntiles = (int)(t1 - t0);
    return c;
}

__device__ int attn_tile(const MonoArgs &a, const AttnCta &c, int i, int64_t *elem) {
    int u = (c.tile0 + i) >> 1, half = (c.tile0 + i) & 1;
    int b = __ldcg(c.sel + u);
    int64_t rem = c.rv.kv_len - ((int64_t)b * M3_PAGE + half * kAttnKeys);
    if (rem <= 0)
        return 0;
    if (b >= a.mb)
        return -1;
    int64_t page = c.rv.table[b];
    if (!page_ok(a, page)) {
        if (threadIdx.x == 0)
            fault_set(a.fault, a.ctr + C_QPOST, M3_MONO_FAULT_PAGE, a.layer, c.t, page);
        return -1;
    }
    *elem = ((page * a.Nkv + c.g) * M3_PAGE + half * kAttnKeys) * kHD;
    return rem < kAttnKeys ? (int)rem : kAttnKeys;
}

__device__ void attn_load(const MonoArgs &a, const AttnCta &c, int i, unsigned char *stage,
                          int *s_count) {
    int64_t elem = 0;
    int count = attn_tile(a, c, i, &elem);
    if (threadIdx.x == 0)
        *s_count = count;
    if (count <= 0)
        return;
    cp_async_kv_ef<kHD>(stage, kRowBytes, kTileBytes, a.kc + elem, a.vc + elem, count, kAttnKeys,
                        kThreads);
}

__device__ void attn_load_q(const MonoArgs &a, const AttnCta &c, unsigned char *sq) {
    constexpr int kCpr = kHD / 8;
    const uint16_t *q = a.proj + (size_t)c.t * a.Ntot + a.off_q + (size_t)c.h0 * kHD;
    for (int x = threadIdx.x; x < kHeadTile * kCpr; x += kThreads) {
        int r = x / kCpr, k = x % kCpr;
        bool in = r < c.nh;
        cp_async16(sq + r * kRowBytes + k * 16, q + (in ? (int64_t)r * kHD + k * 8 : 0), in);
    }
}

/* Merge the warps' states and write the split's partial (max, sum, acc). */
__device__ void attn_partial(const MonoArgs &a, const AttnCta &c, WarpAttn<kHD> &w,
                             unsigned char *smem) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
    float *s_o = reinterpret_cast<float *>(smem);
    float *s_m = s_o + kWarps * kHeadTile * kOStride, *s_l = s_m + kWarps * kHeadTile;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        w.l[r] += __shfl_xor_sync(kFull, w.l[r], 1);
        w.l[r] += __shfl_xor_sync(kFull, w.l[r], 2);
    }
    float *o0 = s_o + (warp * kHeadTile + g) * kOStride, *o1 = o0 + 8 * kOStride;
#pragma unroll
    for (int n = 0; n < kHD / 8; n++) {
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
    attn_merge_warps<kHD, kWarps, kThreads, kHeadTile>(
        s_o, kOStride, s_m, s_l, s_l + kWarps * kHeadTile, c.nh, c.poisoned,
        [&](int r, int d, float acc, float M, float L, bool any) {
            int64_t head = (int64_t)c.t * a.Nq + c.h0 + r;
            int64_t p = head * a.S + c.split;
            a.att_acc[p * kHD + d] = acc;
            if (d == 0)
                a.att_ml[p] = make_float2(any ? M : -INFINITY, any ? L : 0.0f);
        });
}

/* One head's S partials, in split order, into its bf16 output (zeros when
 * no split saw a key): one item per (row, query head), after every split
 * of the head's group has arrived (post_dep). The partials are copied to
 * shared memory at once (one round trip: a single merging CTA that walked
 * all 16 heads took ~10 us on the one-row chain, docs/PERF.md); then each
 * thread owns one dim and sums the splits in order, with the factors every
 * thread recomputes: the same operations in the same order as the
 * group-wide merge this replaced, so the same bits. (The stock path's
 * attn_combine_kernel sums strided split groups, then the groups: its
 * values differ from these by fp32 summation order, as before.) smem:
 * S x 128 floats + S (max, sum) pairs. */
static_assert(kMaxSplits * (kHD * 4 + 8) <= kAttnSmem, "merge partials in shared memory");

__device__ void merge_item(const MonoArgs &a, unsigned char *smem, int item, bool faulted) {
    const int64_t head = item; /* t * Nq + h */
    const int S = a.S, d = threadIdx.x;
    if (!faulted) {
        float *sacc = reinterpret_cast<float *>(smem);                    /* [S][kHD] */
        float2 *sml = reinterpret_cast<float2 *>(sacc + (size_t)S * kHD); /* [S] */
        const float *src = a.att_acc + head * S * kHD;
        for (int i = threadIdx.x; i < S * (kHD / 4); i += kThreads)
            cp_async16(sacc + 4 * i, src + 4 * i, true);
        cp_async_commit();
        if (threadIdx.x < S)
            sml[threadIdx.x] = __ldcg(a.att_ml + head * S + threadIdx.x);
        cp_async_wait<0>();
        __syncthreads();
        float M = -INFINITY;
        bool any = false;
        for (int s = 0; s < S; s++) {
            const float2 v = sml[s];
            if (v.y != 0.0f) {
                any = true;
                M = fmaxf(M, v.x);
            }
        }
        const float ref = M == -INFINITY ? 0.0f : M;
        float L = 0.0f, acc = 0.0f;
        for (int s = 0; s < S; s++) {
            const float2 v = sml[s];
            if (v.y != 0.0f) {
                const float f = exp2f(v.x - ref);
                L += f * v.y;
                acc += f * sacc[s * kHD + d];
            }
        }
        static_assert(kThreads == kHD, "one thread per dim");
        a.attn[head * kHD + d] = any ? m3_to_bf(acc / L) : (uint16_t)0;
    }
    signal_count(&a.ctr[C_ATT]);
}

/* An attention item's place: row t, KV head g, head tile mt, split (the
 * queue's order: splits fastest); att_item and post_dep both read it. */
struct AttPos {
    int t, g, mt, split;
};

__device__ __forceinline__ AttPos att_pos(const MonoArgs &a, int item) {
    AttPos p;
    p.split = item % a.S;
    int id = item / a.S;
    p.mt = id % a.mtiles;
    id /= a.mtiles;
    p.g = id % a.Nkv;
    p.t = id / a.Nkv;
    return p;
}

__device__ void att_item(const MonoArgs &a, Ctl &ctl, unsigned char *smem, int item,
                         bool faulted) {
    const AttPos p = att_pos(a, item);
    const int t = p.t, g = p.g, mt = p.mt;
    /* (the kernel's loop waited for the selection: post_dep) */
    AttnCta c = attn_cta(a, t, g, mt, p.split);
    if (!faulted) {
        unsigned char *sq = smem + kQOffset;
        const int warp = threadIdx.x >> 5;
        WarpAttn<kHD> w;
        attn_reset(w);
        if (c.ntiles > 0) {
            attn_load_q(a, c, sq);
            attn_load(a, c, 0, smem, &ctl.s_count[0]);
        }
        cp_async_commit();
        for (int i = 0; i < c.ntiles; i++) {
            if (i + 1 < c.ntiles)
                attn_load(a, c, i + 1, smem + ((i + 1) & 1) * kStageBytes,
                          &ctl.s_count[(i + 1) & 1]);
            cp_async_commit();
            cp_async_wait<1>();
            __syncthreads();
            int count = ctl.s_count[i & 1];
            if (count < 0)
                c.poisoned = true;
            const unsigned char *st = smem + (i & 1) * kStageBytes + warp * 16 * kRowBytes;
            if (count > warp * 16)
                attn_warp_tile(w, sq, st, st + kTileBytes, count - warp * 16, a.attn_scale_log2);
            __syncthreads();
        }
        cp_async_wait<0>();
        __syncthreads();
        attn_partial(a, c, w, smem);
    }
    /* the group's merge items wait for all S splits (post_dep) */
    signal_count(a.ctr + a.o_att + (t * a.Nkv + g) * a.mtiles + mt);
}


} // namespace
} // namespace m3mono

#endif
