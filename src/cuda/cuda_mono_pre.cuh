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
 * dsm: per warp 128 + 2 * 64 floats. */
__device__ void head_epilogue(const MonoArgs &a, unsigned char *dsm, int hh, bool faulted) {
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
        uint2 raw = __ldcg(reinterpret_cast<const uint2 *>(row) + lane);
        float x[4] = {__uint_as_float(raw.x << 16), __uint_as_float(raw.x & 0xffff0000u),
                      __uint_as_float(raw.y << 16), __uint_as_float(raw.y & 0xffff0000u)};
        uint2 outv = raw;
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
            int64_t pos = a.pos[t];
            for (int i = lane; i < a.half; i += 32) {
                double s, c;
                sincos((double)pos * a.inv_freq[i], &s, &c);
                scs[i] = (float)c;
                ssn[i] = (float)s;
            }
            __syncwarp();
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
                fault_set(a.fault, M3_MONO_FAULT_SLOT, a.layer, t, slot);
            continue;
        }
        int64_t page = slot / M3_PAGE, off = slot % M3_PAGE;
        uint16_t *dst = kind == HK_IK ? cache + (page * M3_PAGE + off) * kHD
                                      : cache + ((page * a.Nkv + g) * M3_PAGE + off) * kHD;
        reinterpret_cast<uint2 *>(dst)[lane] = outv;
    }
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

/* Projection item: a tile of the virtual matrix [iq; ik; k; v; q] (the
 * columns of a.proj) and a K slice, in matrix order (iq and ik first: the
 * indexer waits for them). Every matrix keeps the stock GEMV's K split (the
 * sums within a slice are not cut into the stock path's chunks: the
 * projections are its values up to fp32 summation order). */
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
     * (the first wave of items waits ~6 us for it at one row) */
    gemv_rows<NR, V>(acc, wrow_of(*m), vr - base, m->n, k0, k1, ctl.rowp, a.T,
                     reinterpret_cast<uint16_t *>(dsm), faulted, &a.ctr[C_NORM1],
                     (unsigned)a.T);
    /* partial slots: s_pmax per tile whatever the matrix's own split */
    if (!split_reduce<NR>(acc, s, slice, tile, a.part_proj, a.ctr + a.o_ptile, ctl, a.s_pmax))
        return;
    for (int i = threadIdx.x; i < kTile * a.T; i += kThreads) {
        int r = i / a.T, t = i % a.T;
        a.proj[(size_t)t * a.Ntot + tile * kTile + r] = m3_to_bf(ctl.fin[r][t]);
    }
    const int hh = tile * kTile / kHD;
    if (!arrive(a.ctr + a.o_head + hh, kHD / kTile, ctl))
        return;
    /* no cache writes once a fault is set (read again: this CTA may have
     * started its tile before another one set it) */
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

__device__ void idx_load(const MonoArgs &a, const RowView &rv, int t, int b, unsigned char *dst,
                         int *s_count) {
    int64_t first = (int64_t)b * M3_PAGE;
    int count = (int)min((int64_t)M3_PAGE, rv.kv_len - first);
    int64_t page = rv.table[b];
    bool ok = page_ok(a, page);
    if (threadIdx.x == 0) {
        *s_count = ok ? count : -1;
        if (!ok)
            fault_set(a.fault, M3_MONO_FAULT_PAGE, a.layer, t, page);
    }
    if (!ok)
        return;
    const unsigned char *src = reinterpret_cast<const unsigned char *>(a.ic + page * M3_PAGE * kHD);
    const int cpr = kHD / 8, rb = idx_row_bytes();
    for (int c = threadIdx.x; c < count * cpr; c += kThreads) {
        int r = c / cpr, k = c - r * cpr;
        cp_async16(dst + r * rb + k * 16, src + ((int64_t)r * kHD + k * 8) * 2, true);
    }
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

/* Scores of row t's blocks j, j + G, ... */
__device__ void idx_item(const MonoArgs &a, Ctl &ctl, unsigned char *dsm, int item,
                         bool faulted) {
    const int G = a.G, MB = a.mb;
    const int t = item / G, j = item % G;
    RowView rv = load_row(a, t);
    if (rv.state == ROW_PADDED)
        return;
    wait_count(&a.ctr[C_IDX], (unsigned)(a.Ni + 1));
    if (faulted)
        return;
    if (rv.state == ROW_BAD && threadIdx.x == 0 && j == 0)
        fault_set(a.fault, M3_MONO_FAULT_PAGE, a.layer, t, a.pos[t]);
    float *out_row = a.scores + (int64_t)t * a.Ni * MB;
    int nb = rv.state == ROW_OK ? rv.nblocks : 0;
    int mine = nb > j ? (nb - 1 - j) / G + 1 : 0;
    int owned = j < MB ? (MB - 1 - j) / G + 1 : 0;
    float fill = rv.state == ROW_BAD ? m3_qnan() : -INFINITY;
    for (int64_t k = (int64_t)mine * a.Ni + threadIdx.x; k < (int64_t)owned * a.Ni;
         k += kThreads) {
        int64_t i = k / a.Ni, h = k % a.Ni;
        out_row[h * MB + j + i * G] = fill;
    }
    if (mine == 0)
        return;
    double *qd = reinterpret_cast<double *>(dsm);
    unsigned char *tiles = dsm + (size_t)a.Ni * kHD * sizeof(double);
    const size_t stage = (size_t)M3_PAGE * idx_row_bytes();
    const uint16_t *iq = a.proj + (size_t)t * a.Ntot; /* iq heads at column 0 */
    for (int e = threadIdx.x; e < a.Ni * kHD; e += kThreads)
        qd[e] = (double)m3_bf(__ldcg(iq + e));
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

} // namespace
} // namespace m3mono

#endif
