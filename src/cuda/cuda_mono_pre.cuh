/*
 * The pre kernel's items: norm1, projection tiles (+ head epilogues), index scores.
 * Part of the mono executor's kernel unit (cuda_mono_kernels.cu includes it;
 * cuda_mono.cu describes the design).
 */
#ifndef M3_CUDA_CUDA_MONO_PRE_CUH
#define M3_CUDA_CUDA_MONO_PRE_CUH

namespace m3mono {
namespace { /* internal linkage: cuda_mono_kernels.cu and _tp.cu both compile it */

/* ================================================================ launch 1 */

enum { HK_IQ = 0, HK_IK, HK_K, HK_V, HK_Q };

/* Head hh of the projection (all rows): Gemma norm with its weight, NeoX
 * RoPE at the row's position, rounded once (V: as projected), written back;
 * k, v and ik also to the cache at the row's slot. The stock
 * head_norm_rope arithmetic; one warp per row, lane l owns dims 4l..4l+3.
 * dsm: per warp 128 + 2 * 64 floats. The rows come from a.proj, or from
 * `staged` (shared memory, T x 128 bf16: head_sum's). */
constexpr int kEpiSmem = kWarps * (kHD + 2 * kMaxHalf) * 4;
__device__ void head_epilogue(const MonoArgs &a, unsigned char *dsm, int hh, bool faulted,
                              const uint16_t *staged = nullptr) {
    int kind, g = 0;
    const uint16_t *w = nullptr;
    uint16_t *cache = nullptr;
    if (hh < a.Ni) {
        kind = HK_IQ, w = a.iq_norm;
    } else if (hh == a.Ni) {
        kind = HK_IK, w = a.ik_norm, cache = a.ic;
    } else if (hh < a.Ni + 1 + a.Nkv) {
        kind = HK_K, g = hh - a.Ni - 1, w = a.k_norm, cache = a.kc;
    } else if (hh < a.Ni + 1 + 2 * a.Nkv) {
        kind = HK_V, g = hh - a.Ni - 1 - a.Nkv, cache = a.vc;
    } else {
        kind = HK_Q, w = a.q_norm;
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float *sy = reinterpret_cast<float *>(dsm) + warp * (kHD + 2 * kMaxHalf);
    float *scs = sy + kHD, *ssn = scs + kMaxHalf;
    float wp1[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (w)
        for (int j = 0; j < 4; j++)
            wp1[j] = __fadd_rn(1.0f, m3_bf(w[lane * 4 + j]));
    const int64_t limit = a.n_pages * M3_PAGE;
    for (int t = warp; t < a.T; t += kWarps) {
        uint16_t *row = a.proj + (size_t)t * a.Ntot + (size_t)hh * kHD;
        uint2 raw = staged ? reinterpret_cast<const uint2 *>(staged + (size_t)t * kHD)[lane]
                           : __ldcg(reinterpret_cast<const uint2 *>(row) + lane);
        float x[4] = {__uint_as_float(raw.x << 16), __uint_as_float(raw.x & 0xffff0000u),
                      __uint_as_float(raw.y << 16), __uint_as_float(raw.y & 0xffff0000u)};
        uint2 outv = raw;
        /* the RoPE factors tabled by rope_item (this item's GEMV waited
         * for its signal with norm1's), asked for with the row: two a lane */
        static_assert(kMaxHalf <= 64, "a lane loads factors lane and lane + 32");
        const float2 *f = reinterpret_cast<const float2 *>(a.rope) + t * kMaxHalf;
        float2 cs0 = make_float2(0.0f, 0.0f), cs1 = cs0;
        if (kind != HK_V && lane < a.half)
            cs0 = __ldcg(f + lane);
        if (kind != HK_V && lane + 32 < a.half)
            cs1 = __ldcg(f + lane + 32);
        mark(); /* (warp 0, row 0) the head's row loaded */
        if (kind != HK_V) {
            double ss = 0.0;
            for (int j = 0; j < 4; j++)
                ss += (double)x[j] * (double)x[j];
            ss = m3_warp_sum_d(ss);
            float r = 1.0f / sqrtf((float)(ss / (double)kHD) + a.eps);
            float y[4], o[4];
            for (int j = 0; j < 4; j++) {
                y[j] = __fmul_rn(__fmul_rn(x[j], r), wp1[j]);
                sy[lane * 4 + j] = y[j];
            }
            scs[lane] = cs0.x, ssn[lane] = cs0.y;
            scs[lane + 32] = cs1.x, ssn[lane + 32] = cs1.y;
            __syncwarp();
            mark(); /* normed, and the RoPE factors computed */
            for (int j = 0; j < 4; j++) {
                int d = lane * 4 + j;
                o[j] = y[j];
                if (d < 2 * a.half) {
                    bool lo = d < a.half;
                    int i = lo ? d : d - a.half, p = lo ? d + a.half : d - a.half;
                    float av = __fmul_rn(y[j], scs[i]), bv = __fmul_rn(sy[p], ssn[i]);
                    o[j] = lo ? __fsub_rn(av, bv) : __fadd_rn(av, bv);
                }
            }
            __syncwarp(); /* sy / scs are rewritten for the next row */
            outv.x = (uint32_t)m3_to_bf(o[0]) | ((uint32_t)m3_to_bf(o[1]) << 16);
            outv.y = (uint32_t)m3_to_bf(o[2]) | ((uint32_t)m3_to_bf(o[3]) << 16);
            reinterpret_cast<uint2 *>(row)[lane] = outv;
        }
        if (!cache || faulted)
            continue;
        int64_t slot = a.slots[t];
        if (slot < 0)
            continue; /* padded row: writes nothing */
        if (slot >= limit) {
            if (lane == 0)
                fault_set(a.fault, a.ctr + C_QPRE, M3_MONO_FAULT_SLOT, a.layer, t, slot);
            continue;
        }
        int64_t page = slot / M3_PAGE, off = slot % M3_PAGE;
        uint16_t *dst = kind == HK_IK ? cache + (page * M3_PAGE + off) * kHD
                                      : cache + ((page * a.Nkv + g) * M3_PAGE + off) * kHD;
        reinterpret_cast<uint2 *>(dst)[lane] = outv;
    }
    mark(); /* the rows written (and cached) */
}

/* The RoPE factors of every row's position (the stock path's double
 * expression, rounded once), tabled by one item while the others wait for
 * norm1: the head epilogues on the chain read them instead of computing
 * double sincos (cold code) there. It counts as one of norm1's signals. */
__device__ void rope_item(const MonoArgs &a, Ctl &ctl, bool faulted) {
    if (!faulted) {
        float2 *f = reinterpret_cast<float2 *>(a.rope);
        for (int i = threadIdx.x; i < a.T * a.half; i += kThreads) {
            const int t = i / a.half, k = i % a.half;
            double s, c;
            sincos((double)a.pos[t] * a.inv_freq[k], &s, &c);
            f[t * kMaxHalf + k] = make_float2((float)c, (float)s);
        }
    }
    signal_count(&a.ctr[C_NORM1]);
}

__device__ void norm1_item(const MonoArgs &a, Ctl &ctl, unsigned char *dsm, int t,
                           bool faulted) {
    if (!faulted) {
        auto none = [](int, float *) {};
        norm_row(a, ctl, a.residual + (size_t)t * a.H, !a.first, a.hidden + (size_t)t * a.H, none,
                 a.in_norm, a.x1 + (size_t)t * a.H, dsm);
    }
    signal_count(&a.ctr[C_NORM1]);
}

/* Head hh of a split matrix, every row: each output the sum of its tile's
 * s slot partials in slice order (split_reduce's sums, the same bits),
 * rounded to bf16 into `rows` (shared memory, T x 128). */
static_assert(kEpiSmem + kMaxT * kHD * 2 <= kAttnSmem, "head_sum's rows after the epilogue's");
__device__ void head_sum(const MonoArgs &a, int hh, int s, uint16_t *rows) {
    const int tile0 = hh * (kHD / kTile), stride = a.s_pmax; /* slots per tile (>= s) */
    for (int i = threadIdx.x; i < kHD * a.T; i += kThreads) {
        const int d = i / a.T, t = i % a.T, tile = tile0 + d / kTile, r = d % kTile;
        const float *src = a.part_proj + (size_t)tile * stride * (kTile * kMaxT) + r * kMaxT + t;
        rows[t * kHD + d] = m3_to_bf(slots_sum(src, s, kTile * kMaxT));
    }
    __syncthreads();
}

/* Projection item: a tile of the virtual matrix [iq; ik; k; v; q] (the
 * columns of a.proj) and a K slice, in matrix order (iq and ik first: the
 * indexer waits for them), in a.s_p[matrix] K slices: the stock GEMV's
 * split (its values up to fp32 summation order), or by default q, k and v
 * unsplit and iq, ik in a few slices (cuda_mono.cu plan_splits). */
template <int NR, int V>
__device__ void proj_item(const MonoArgs &a, Ctl &ctl, unsigned char *dsm, int item,
                          bool faulted) {
    int mi = 0;
    while (mi < 4 && item >= a.p_item0[mi + 1])
        mi++;
    const WMat *m = mi == 0 ? &a.wiq : mi == 1 ? &a.wik : mi == 2 ? &a.wk : mi == 3 ? &a.wv : &a.wq;
    const int base = mi == 0 ? 0 : mi == 1 ? a.off_ik : mi == 2 ? a.off_k : mi == 3 ? a.off_v
                                                                                   : a.off_q;
    const int s = a.s_p[mi], local = item - a.p_item0[mi];
    const int slice = local % s, tile = base / kTile + local / s;
    int k0, k1;
    k_slice(a.H, s, slice, &k0, &k1);
    set_rows(ctl, a.x1, a.H, a.T);
    const int warp = threadIdx.x >> 5;
    const int vr = tile * kTile + warp * kRW; /* this warp's first virtual row */
    float acc[kRW][NR];
    /* norm1 waited for inside, once the first chunk's weights are asked for
     * (the first wave of items waits ~6 us for it at one row); at one row
     * and 3-4 rows q, k and v (unsplit, bf16) through the ring (gemv_chain) */
    gemv_chain<NR, V>(acc, *m, vr - base, m->n, a.H, k0, k1, ctl.rowp, a.T, dsm, faulted,
                      &a.ctr[C_NORM1], (unsigned)a.T + 1u);
    mark(); /* the slice's products summed (warp sums) */
    const int hh = tile * kTile / kHD;
    if (s > 1) {
        /* split (iq, ik): the partial to its slot and one arrival a head
         * (16 tiles x s slices); the head's last arriver sums its slots into
         * the epilogue: no per-tile arrival, tile write and row reload (two
         * round trips on the index heads' chain) */
        partial_put<NR>(acc, a.part_proj + ((size_t)tile * a.s_pmax + slice) *
                                               (kTile * kMaxT));
        if (!arrive(a.ctr + a.o_head + hh, (unsigned)(kHD / kTile * s), ctl))
            return;
        uint16_t *rows = reinterpret_cast<uint16_t *>(dsm + kEpiSmem);
        head_sum(a, hh, s, rows);
        mark(); /* the head's slots summed; its epilogue next */
        head_epilogue(a, dsm, hh, fault_now(a, ctl), rows);
        if (hh <= a.Ni)
            signal_count(&a.ctr[C_IDX]);
        return;
    }
    /* unsplit: the CTA holds the tile's sums */
    acc_to_fin<NR>(acc, ctl);
    mark(); /* the tile's sums in ctl.fin */
    for (int i = threadIdx.x; i < kTile * a.T; i += kThreads) {
        int r = i / a.T, t = i % a.T;
        a.proj[(size_t)t * a.Ntot + tile * kTile + r] = m3_to_bf(ctl.fin[r][t]);
    }
    if (!arrive(a.ctr + a.o_head + hh, kHD / kTile, ctl))
        return;
    /* no cache writes once a fault is set (read again: this CTA may have
     * started its tile before another one set it) */
    mark(); /* the tile written; the head's last tile: its epilogue next */
    head_epilogue(a, dsm, hh, fault_now(a, ctl));
    if (hh <= a.Ni)
        signal_count(&a.ctr[C_IDX]);
}

/* ---------------------------------------------------------------- index scores
 * (cuda_index.cu index_scores_kernel, one (row, slice) per item) */

template <int HB>
__device__ void idx_pass(const MonoArgs &a, Ctl &ctl, const unsigned char *tile,
                         const double *qd, int h0, int count, int b, float *out_row) {
    const unsigned char *krow = tile + threadIdx.x * idx_row_bytes();
    const double *q = qd + (size_t)h0 * kHD;
    float d[HB];
    if ((int)threadIdx.x < count) {
        idx_dots<HB>(krow, q, kHD, d);
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
            ctl.s_red[h][warp] = v;
    }
    __syncthreads();
    if ((int)threadIdx.x < HB) {
        int h = threadIdx.x;
        float v = ctl.s_red[h][0];
        for (int w = 1; w < kWarps; w++)
            v = first_max(v, ctl.s_red[h][w]);
        out_row[(int64_t)(h0 + h) * a.mb + b] = v * a.idx_scale;
    }
    __syncthreads();
}

/* count keys of index cache page `page` into a staged tile at dst (row
 * stride idx_row_bytes()), cp.async, every thread its share (every lane of
 * the CTA calls it: the shuffle). Evict-first, as the weights: a step
 * reads each page once, up to 32 MB a row at 128K, and at normal priority
 * they evict what the weights' policy keeps. */
__device__ __forceinline__ void idx_copy_page(const MonoArgs &a, int64_t page, int count,
                                              unsigned char *dst) {
    const unsigned char *src = reinterpret_cast<const unsigned char *>(a.ic + page * M3_PAGE * kHD);
    cp_async_rows_ef(dst, idx_row_bytes(), src, kHD * 2, count, kHD / 8, kThreads);
}

__device__ void idx_load(const MonoArgs &a, const RowView &rv, int t, int b, unsigned char *dst,
                         int *s_count) {
    int64_t first = (int64_t)b * M3_PAGE;
    int count = (int)min((int64_t)M3_PAGE, rv.kv_len - first);
    int64_t page = rv.table[b];
    bool ok = page_ok(a, page);
    if (threadIdx.x == 0) {
        *s_count = ok ? count : -1;
        if (!ok)
            fault_set(a.fault, a.ctr + C_QPRE, M3_MONO_FAULT_PAGE, a.layer, t, page);
    }
    if (ok)
        idx_copy_page(a, page, count, dst);
}

__device__ void idx_tile(const MonoArgs &a, Ctl &ctl, const unsigned char *tile,
                         const double *qd, int count, int b, float *out_row) {
    if (count < 0) {
        for (int h = threadIdx.x; h < a.Ni; h += kThreads)
            out_row[(int64_t)h * a.mb + b] = m3_qnan();
        return;
    }
    for (int h0 = 0; h0 < a.Ni; h0 += kIdxHeadsPerPass) {
        int hb = min(kIdxHeadsPerPass, a.Ni - h0);
        if (hb == 4)
            idx_pass<4>(a, ctl, tile, qd, h0, count, b, out_row);
        else if (hb == 3)
            idx_pass<3>(a, ctl, tile, qd, h0, count, b, out_row);
        else if (hb == 2)
            idx_pass<2>(a, ctl, tile, qd, h0, count, b, out_row);
        else
            idx_pass<1>(a, ctl, tile, qd, h0, count, b, out_row);
    }
}

/* Is index cache page `page` free of this step's writes (no row's slot in
 * it)? Such a page can be loaded before the index heads are cached. */
__device__ __forceinline__ bool idx_page_clean(const MonoArgs &a, int64_t page) {
    for (int t = 0; t < a.T; t++) {
        const int64_t slot = a.slots[t];
        if (slot >= 0 && slot / M3_PAGE == page)
            return false;
    }
    return true;
}

/* Scores of row t's blocks j, j + G, ..., items numbered j-major (item
 * t + T j), so the items with pages come first at any context. Blocks past
 * a good row's keys are left alone (the selection reads a row's scores
 * below its block count only); a bad row's are filled with NaN. The first
 * page is asked for before the wait for the index heads when no row of the
 * step writes it (it does not depend on this step's projections), so an
 * item without pages never waits. */
__device__ void idx_item(const MonoArgs &a, Ctl &ctl, unsigned char *dsm, int item,
                         bool faulted) {
    const int G = a.G, MB = a.mb;
    const int t = item % a.T, j = item / a.T;
    RowView rv = load_row(a, t);
    if (rv.state == ROW_PADDED || faulted)
        return;
    float *out_row = a.scores + (int64_t)t * a.Ni * MB;
    if (rv.state == ROW_BAD) {
        if (threadIdx.x == 0 && j == 0)
            fault_set(a.fault, a.ctr + C_QPRE, M3_MONO_FAULT_PAGE, a.layer, t, a.pos[t]);
        const int owned = j < MB ? (MB - 1 - j) / G + 1 : 0;
        for (int64_t k = threadIdx.x; k < (int64_t)owned * a.Ni; k += kThreads)
            out_row[(k % a.Ni) * MB + j + (k / a.Ni) * G] = m3_qnan();
        return;
    }
    const int nb = rv.nblocks;
    const int mine = nb > j ? (nb - 1 - j) / G + 1 : 0;
    if (mine == 0)
        return;
    double *qd = reinterpret_cast<double *>(dsm);
    unsigned char *tiles = dsm + (size_t)a.Ni * kHD * sizeof(double);
    const size_t stage = (size_t)M3_PAGE * idx_row_bytes();
    const bool early = idx_page_clean(a, rv.table[j]);
    if (early)
        idx_load(a, rv, t, j, tiles, &ctl.s_count[0]);
    wait_count(&a.ctr[C_IDX], (unsigned)(a.Ni + 1));
    const uint16_t *iq = a.proj + (size_t)t * a.Ntot; /* iq heads at column 0 */
    for (int e = threadIdx.x; e < a.Ni * kHD; e += kThreads)
        qd[e] = (double)m3_bf(__ldcg(iq + e));
    if (!early)
        idx_load(a, rv, t, j, tiles, &ctl.s_count[0]);
    cp_async_commit();
    for (int i = 0; i < mine; i++) {
        if (i + 1 < mine)
            idx_load(a, rv, t, j + (i + 1) * G, tiles + ((i + 1) & 1) * stage,
                     &ctl.s_count[(i + 1) & 1]);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        idx_tile(a, ctl, tiles + (i & 1) * stage, qd, ctl.s_count[i & 1], j + i * G, out_row);
        __syncthreads();
    }
    cp_async_wait<0>();
}

/* ---------------------------------------------------------------- index scores, claimed
 * (idx_claim 1, or 2 at long contexts) A fixed slice of a row per item
 * makes few, long items at long contexts, and the ones taken late, by
 * CTAs that ran projections first, end late (docs/PERF.md, sixteenth
 * session). Here each of a.Gc items (one per CTA at most) claims runs of
 * pages of one row from that row's counter, starting at row (item mod T)
 * and moving to the next row when a row's runs are gone, so the pages go
 * to whichever CTAs are free. A run is a.idx_run pages at most, fewer
 * where the rows' pages would not reach every item. The next run is
 * claimed while the current run's last page is scored, and the next page
 * is loaded while the current one is scored, across runs and rows. The
 * blocks no page covers (past a row's count, every block of a bad row)
 * are filled by all items together. */

struct IdxGen { /* thread 0's page stream */
    int v;          /* rows visited */
    int t;          /* the current row, -1 none */
    int nb, nrun;   /* its blocks and runs */
    int run;        /* pages per claim */
    int b, end;     /* the current run's next page and end */
    unsigned ahead; /* the row's claim after the current run */
    int64_t kv_len;
    const int32_t *table;
};

/* A page of the stream as thread 0 publishes it in ctl.mem[8 s ..]: row
 * (-1: the stream has ended), block, key count (-1: a bad page) and page. */
struct IdxPage {
    int t, b, count;
    int64_t page;
};
/* ctl.mem holds two published pages (8 ints apart); the done mask a bit per row */
static_assert(kMaxT >= 13 && kMaxT <= 32, "kMaxT out of the index claims' range");

__device__ __forceinline__ void idx_put(int *slot, const IdxPage &p) {
    slot[0] = p.t, slot[1] = p.b, slot[2] = p.count;
    slot[3] = (int)(p.page & 0xffffffff), slot[4] = (int)(p.page >> 32);
}

__device__ __forceinline__ IdxPage idx_get(const int *slot) {
    return {slot[0], slot[1], slot[2],
            (int64_t)(((uint64_t)(unsigned)slot[4] << 32) | (unsigned)slot[3])};
}

/* Thread 0: the next page of item w's stream. */
__device__ IdxPage idx_next(const MonoArgs &a, int w, IdxGen &g) {
    unsigned *runs = a.ctr + a.o_idxq;
    for (;;) {
        if (g.t >= 0 && g.b < g.end) {
            const int b = g.b++;
            /* the next run claimed as this run's last page is handed out:
             * its round trip hides behind a page's scores, and a CTA holds
             * no run it will not start for a while (claimed a whole run
             * ahead, early CTAs took two runs to the late ones' none:
             * docs/PERF.md, seventeenth session) */
            if (g.b == g.end)
                g.ahead = atomicAdd(&runs[g.t], 1u);
            const int64_t page = g.table[b];
            int count = (int)min((int64_t)M3_PAGE, g.kv_len - (int64_t)b * M3_PAGE);
            if (!page_ok(a, page)) {
                fault_set(a.fault, a.ctr + C_QPRE, M3_MONO_FAULT_PAGE, a.layer, g.t, page);
                count = -1;
            }
            return {g.t, b, count, page};
        }
        if (g.t >= 0) {
            const unsigned k = g.ahead; /* claimed at the last run's last page (or the row's start) */
            if (k < (unsigned)g.nrun) {
                g.b = (int)k * g.run;
                g.end = min(g.b + g.run, g.nb);
                continue;
            }
            atomicOr(&runs[kMaxT], 1u << g.t); /* the row's runs are all taken */
            g.t = -1;
        }
        if (g.v >= a.T)
            return {-1, 0, 0, 0};
        /* skip the rows others found done (one load, instead of a claim
         * round trip per row at the end of the phase) */
        const unsigned done = *reinterpret_cast<volatile unsigned *>(&runs[kMaxT]);
        while (g.v < a.T && (done >> ((w + g.v) % a.T) & 1u))
            g.v++;
        if (g.v >= a.T)
            return {-1, 0, 0, 0};
        const int t = (w + g.v++) % a.T;
        const RowView rv = load_row(a, t);
        if (rv.state != ROW_OK || rv.nblocks == 0)
            continue; /* padded: nothing; bad: idx_fill's */
        g.t = t;
        g.nb = rv.nblocks;
        g.nrun = (rv.nblocks + g.run - 1) / g.run;
        g.b = g.end = 0;
        g.kv_len = rv.kv_len;
        g.table = rv.table;
        g.ahead = atomicAdd(&runs[t], 1u);
    }
}

/* The scores no page writes, item w's share of them: -inf past a row's
 * blocks, NaN (and the fault) for every block of a bad row. */
__device__ void idx_fill(const MonoArgs &a, int w) {
    const int64_t per_row = (int64_t)a.Ni * a.mb, n = (int64_t)a.T * per_row;
    for (int64_t k = (int64_t)w * kThreads + threadIdx.x; k < n; k += (int64_t)a.Gc * kThreads) {
        const int t = (int)(k / per_row);
        const int b = (int)((k - t * per_row) % a.mb);
        const RowView rv = load_row(a, t);
        if (rv.state == ROW_BAD) {
            if (k == t * per_row)
                fault_set(a.fault, a.ctr + C_QPRE, M3_MONO_FAULT_PAGE, a.layer, t, a.pos[t]);
            a.scores[k] = m3_qnan();
        } else if (rv.state == ROW_OK && b >= rv.nblocks) {
            a.scores[k] = -INFINITY;
        }
    }
}

__device__ void idx_issue(const MonoArgs &a, const IdxPage &p, unsigned char *dst) {
    if (p.t >= 0 && p.count > 0)
        idx_copy_page(a, p.page, p.count, dst);
}

/* (not inlined: its page stream's state stays out of the projection
 * items' registers) */
__device__ __noinline__ void idx_claim_item(const MonoArgs &a, Ctl &ctl, unsigned char *dsm,
                                            int w, bool faulted, int pages) {
    /* the run length from the rows' real pages, so a short context's
     * pages still spread over every item; the first claim before the wait
     * for the index query (the step's rows and tables are inputs) */
    IdxGen g{0, -1, 0, 0, 0, 0, 0, 0u, 0, nullptr};
    if (threadIdx.x == 0) {
        g.run = max(1, min(a.idx_run, (pages + a.Gc - 1) / a.Gc));
        idx_put(ctl.mem, idx_next(a, w, g));
    }
    wait_count(&a.ctr[C_IDX], (unsigned)(a.Ni + 1));
    if (faulted)
        return;
    double *qd = reinterpret_cast<double *>(dsm);
    unsigned char *tiles = dsm + (size_t)a.Ni * kHD * sizeof(double);
    const size_t stage = (size_t)M3_PAGE * idx_row_bytes();
    IdxPage cur = idx_get(ctl.mem);
    idx_issue(a, cur, tiles);
    cp_async_commit();
    idx_fill(a, w); /* while the first page loads */
    int q_row = -1;
    for (int i = 0; cur.t >= 0; i++) {
        int *nslot = ctl.mem + 8 * ((i + 1) & 1);
        if (threadIdx.x == 0)
            idx_put(nslot, idx_next(a, w, g));
        __syncthreads();
        const IdxPage nxt = idx_get(nslot);
        idx_issue(a, nxt, tiles + ((i + 1) & 1) * stage);
        cp_async_commit();
        if (cur.t != q_row) { /* the row's index query (the last tile is done with qd) */
            const uint16_t *iq = a.proj + (size_t)cur.t * a.Ntot; /* iq heads at column 0 */
            for (int e = threadIdx.x; e < a.Ni * kHD; e += kThreads)
                qd[e] = (double)m3_bf(__ldcg(iq + e));
            q_row = cur.t;
        }
        cp_async_wait<1>();
        __syncthreads();
        idx_tile(a, ctl, tiles + (i & 1) * stage, qd, cur.count, cur.b,
                 a.scores + (int64_t)cur.t * a.Ni * a.mb);
        __syncthreads();
        cur = nxt;
    }
    cp_async_wait<0>();
}

/* Index item i of the launch in the mode a.idx_claim names; mode 2 sums the
 * rows' real pages (a claim's run length) and takes their longest (whether
 * claims pay), which every item computes alike, so all choose one mode. */
__device__ void idx_any_item(const MonoArgs &a, Ctl &ctl, unsigned char *dsm, int i,
                             bool faulted) {
    if (a.idx_claim == 0) {
        idx_item(a, ctl, dsm, i, faulted);
        return;
    }
    if (threadIdx.x < 32) {
        int nb = 0;
        if ((int)threadIdx.x < a.T) {
            const RowView rv = load_row(a, (int)threadIdx.x);
            nb = rv.state == ROW_OK ? rv.nblocks : 0;
        }
        int sum = nb, longest = nb;
        for (int o = 16; o > 0; o >>= 1) {
            sum += __shfl_xor_sync(0xffffffffu, sum, o);
            longest = max(longest, __shfl_xor_sync(0xffffffffu, longest, o));
        }
        if (threadIdx.x == 0)
            ctl.s_count[0] = sum, ctl.s_count[1] = longest;
    }
    __syncthreads();
    const int pages = ctl.s_count[0], longest = ctl.s_count[1];
    __syncthreads(); /* idx_item rewrites s_count */
    if (a.idx_claim == 1 || (longest + a.G - 1) / a.G >= a.idx_min_pages) {
        if (i < a.Gc)
            idx_claim_item(a, ctl, dsm, i, faulted, pages);
    } else if (i < a.T * a.G) {
        idx_item(a, ctl, dsm, i, faulted);
    }
}

/* The pre kernel's index items: the kernels for fewer than
 * kIdxClaimMinRows rows hold fixed slices only (the host sets idx_claim 0
 * for them) */
template <int NR> __device__ __forceinline__ int idx_items(const MonoArgs &a) {
    if constexpr (NR < kIdxClaimMinRows)
        return a.T * a.G;
    else
        return a.idx_claim == 0   ? a.T * a.G
               : a.idx_claim == 1 ? a.Gc
                                  : max(a.T * a.G, a.Gc);
}

template <int NR>
__device__ __forceinline__ void idx_item_of(const MonoArgs &a, Ctl &ctl, unsigned char *dsm,
                                            int i, bool faulted) {
    if constexpr (NR < kIdxClaimMinRows)
        idx_item(a, ctl, dsm, i, faulted);
    else
        idx_any_item(a, ctl, dsm, i, faulted);
}

} // namespace
} // namespace m3mono

#endif
