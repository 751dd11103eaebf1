/*
 * The post kernel's later items: o_proj, norm2, router + routing plan, the experts.
 * Part of the mono executor's kernel unit (cuda_mono_kernels.cu includes it;
 * cuda_mono.cu describes the design).
 */
#ifndef M3_CUDA_CUDA_MONO_FFN_CUH
#define M3_CUDA_CUDA_MONO_FFN_CUH

namespace m3mono {
namespace { /* internal linkage: cuda_mono_kernels.cu and _tp.cu both compile it */

/* ---------------------------------------------------------------- o_proj, norm2 */

template <int NR, int V>
__device__ void oproj_item(const MonoArgs &a, Ctl &ctl, unsigned char *dsm, int item,
                           bool faulted) {
    const int tile = item / a.s_o, slice = item % a.s_o;
    const int KQ = a.Nq * kHD;
    int k0, k1;
    k_slice(KQ, a.s_o, slice, &k0, &k1);
    set_rows(ctl, a.attn, KQ, a.T);
    const int warp = threadIdx.x >> 5;
    float acc[kRW][NR];
    /* attention waited for inside, once the first chunk's weights are asked
     * for (not in the item loop: post_dep); at one row and 3-4 rows through
     * the ring (gemv_chain: the first wave's second chunk landed 5 us after
     * its first at 4 rows, twenty-eighth session's marks) */
    gemv_chain<NR, V>(acc, a.wo, tile * kTile + warp * kRW, a.H, KQ, k0, k1, ctl.rowp, a.T, dsm,
                      faulted, &a.ctr[C_ATT], (unsigned)(a.T * a.Nq));
    mark(); /* the slice's products summed (warp sums) */
    const bool last = split_reduce<NR>(acc, a.s_o, slice, tile, a.part_o, a.ctr + a.o_otile, ctl);
    mark(); /* the partial written and arrived (the last arriver: summed) */
    if (!last)
        return;
    for (int i = threadIdx.x; i < kTile * a.T; i += kThreads) {
        int r = i / a.T, t = i % a.T, n = tile * kTile + r;
        if (!(V & V_TP))
            a.o[(size_t)t * a.H + n] = m3_to_bf(ctl.fin[r][t]); /* rounding point */
        else
            ll_push(a, 0, t, n, ctl.fin[r][t], ctl.tag_o); /* a partial sum: not rounded */
    }
    signal_count(&a.ctr[C_OPROJ]);
}

/* Row t's norm2; t < 0: the dry run (M3_MONO_PIN=2, world 1, CTAs 0..T-1)
 * on the CTA's scratch rows, so the real one runs with its code cached; it
 * signals nothing. */
template <int V>
__device__ void norm2_item(const MonoArgs &a, Ctl &ctl, unsigned char *dsm, int t,
                           bool faulted) {
    /* (the kernel's loop waited for o_proj: post_dep) */
    const bool dry = t < 0;
    if (dry && (V & V_TP))
        return; /* (the host never asks: a dry all-reduce would wait for peers) */
    if (!faulted) {
        if (!(V & V_TP)) {
            auto none = [](int, float *) {};
            uint16_t *dr = a.dry_rows + (size_t)blockIdx.x * 3 * a.H; /* this CTA's */
            uint16_t *res = dry ? dr : a.residual + (size_t)t * a.H;
            const uint16_t *add = dry ? dr + a.H : a.o + (size_t)t * a.H;
            uint16_t *out = dry ? dr + 2 * (size_t)a.H : a.x2 + (size_t)t * a.H;
            norm_row(a, ctl, res, true, add, none, a.post_norm, out, dsm);
        } else {
            /* the all-reduce: every rank's partial, in rank order, rounded once */
            auto add8 = [&](int v, float f[8]) {
                for (int j = 0; j < 8; j++) {
                    float s = 0.0f;
                    for (int src = 0; src < a.world; src++)
                        s += ll_read(a, a.landing + land_idx(a, 0, src, t, v * 8 + j), ctl.tag_o,
                                     t, src);
                    f[j] = m3_round_bf(s);
                }
            };
            norm_row(a, ctl, a.residual + (size_t)t * a.H, true, (const uint16_t *)nullptr, add8,
                     a.post_norm, a.x2 + (size_t)t * a.H, dsm);
        }
    }
    if (!dry)
        signal_count(&a.ctr[C_NORM2]);
}

/* ---------------------------------------------------------------- router, routing, plan */

/* 8-column tiles per routed down item (see edn_item) */
constexpr int kEdnSubMax = 8; /* a.edn_sub <= this (M3_MONO_EDN_SUB) */

template <int V>
__device__ void combine_tiles(const MonoArgs &a, const Ctl &ctl, int tile0, int mask);

/* Where the routing plan reads its logits and writes its outputs: the
 * step's buffers, or (dry) scratch that nothing reads. */
struct PlanIO {
    const float *logits;
    int32_t *rids;
    float *rw;
    int32_t *uniq, *ufirst, *members, *n_uniq;
};

/* Every real row's top-K experts (m3_route_row / moe_route_kernel: keys
 * sigmoid(l) + bias, NaN lowest, ties to the lower id; weights s / sum s),
 * then the distinct experts in ascending id with their members (assignment
 * m = t * K + s) in assignment order, as moe_plan_kernel groups them.
 * Padded rows route nowhere. One CTA. dry (M3_MONO_PIN=2): the same code on
 * scratch, publishing nothing, so the real plan runs with its code cached. */
template <int V>
__device__ void route_and_plan(const MonoArgs &a, Ctl &ctl, unsigned char *dsm, bool dry) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int E = a.E, K = a.K, n = a.T * K;
    const int dn = kMaxAssign + 1; /* a.dry_plan: [6][dn] */
    const PlanIO io =
        dry ? PlanIO{a.dry_logits, a.dry_plan, reinterpret_cast<float *>(a.dry_plan) + dn,
                     a.dry_plan + 2 * dn, a.dry_plan + 3 * dn, a.dry_plan + 4 * dn,
                     a.dry_plan + 5 * dn}
            : PlanIO{a.logits, a.rids, a.rw, a.uniq, a.ufirst, a.members, a.n_uniq};
    /* the assignments' experts (shared memory; INT_MAX: a padded row's) */
    int *pid = reinterpret_cast<int *>(dsm); /* [n] */
    int *sorted = pid + kMaxAssign;          /* [n] */
    for (int m = threadIdx.x; m < n; m += kThreads)
        pid[m] = INT_MAX;
    __syncthreads();
    /* each warp's row keys and sigmoids [2][E], staged once per row
     * (instead of K rounds of dependent global loads; m3_cuda_mono_create
     * sizes the shared memory for them) */
    float *wkey = reinterpret_cast<float *>(dsm + plan_key_offset()) + (size_t)warp * 2 * E;
    float *wsig = wkey + E;
    for (int t = warp; t < a.T; t += kWarps) {
        /* the slot's load and the keys' in flight together (a padded row's
         * logits are written too, so staging them is harmless) */
        const bool padded = a.slots[t] < 0;
        const float *l = io.logits + (size_t)t * E;
#pragma unroll 1 /* once per step: small code beats unrolled code here */
        for (int e = lane; e < E; e += 32) {
            float sg = m3_sigmoid(__ldcg(l + e));
            float key = sg + (a.rbias ? __ldg(a.rbias + e) : 0.0f);
            wkey[e] = isnan(key) ? -INFINITY : key;
            wsig[e] = sg;
        }
        __syncwarp();
        if (padded)
            continue;
        /* K rounds of a warp argmax. Staged keys taken in an earlier round
         * are overwritten with NaN, which no comparison below lets win (a
         * NaN logit's key is staged as -inf, so NaN only marks "taken"):
         * no per-key scan of the earlier rounds' picks. */
        for (int round = 0; round < K; round++) {
            float bk = -INFINITY;
            int bi = INT_MAX;
            for (int e = lane; e < E; e += 32) {
                const float key = wkey[e];
                if (key > bk || (key == bk && e < bi)) {
                    bk = key;
                    bi = e;
                }
            }
            for (int o = 16; o > 0; o >>= 1) {
                float ok = __shfl_xor_sync(kFull, bk, o);
                int oi = __shfl_xor_sync(kFull, bi, o);
                if (ok > bk || (ok == bk && oi < bi)) {
                    bk = ok;
                    bi = oi;
                }
            }
            if (lane == 0) {
                ctl.rid[warp][round] = bi;
                wkey[bi] = m3_qnan();
            }
            __syncwarp();
        }
        /* weights s_i / sum s: every lane sums in pick order (the same bits
         * as one lane would get), lane i writes pick i */
        float sum = 0.0f;
        for (int i = 0; i < K; i++) {
            const int id = ctl.rid[warp][i];
            sum += wsig[id];
        }
        if (lane < K) {
            const int id = ctl.rid[warp][lane];
            const float sg = wsig[id];
            io.rids[t * K + lane] = id;
            io.rw[t * K + lane] = sg / sum;
            pid[t * K + lane] = id;
        }
        __syncwarp();
    }
    __syncthreads();
    /* plan: sort the real assignments by (expert, m) */
    for (int m = threadIdx.x; m < n; m += kThreads) {
        int e = pid[m];
        if (e == INT_MAX)
            continue;
        int rank = 0;
        for (int j = 0; j < n; j++)
            rank += pid[j] < e || (pid[j] == e && j < m);
        sorted[rank] = m;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int nreal = 0;
        for (int m = 0; m < n; m++)
            nreal += pid[m] != INT_MAX;
        int u = 0;
        for (int p = 0; p < nreal; p++) {
            int m = sorted[p], e = pid[m];
            if (p == 0 || e != pid[sorted[p - 1]]) {
                io.uniq[u] = e;
                io.ufirst[u] = p;
                u++;
            }
            io.members[p] = m;
        }
        io.ufirst[u] = nreal;
        *io.n_uniq = u;
        ctl.nu = u;
        if (!dry)
            ctl.plan_nu = u; /* this CTA made the plan: no need to acquire it */
    }
    if (dry) {
        __syncthreads(); /* dsm is free again */
        return;
    }
    signal_count(&a.ctr[C_PLAN]);
    __syncthreads();
    /* nothing will arrive at the combine counters: combine here (zeros) */
    if (ctl.nu == 0 && a.Is == 0)
        for (int tile = 0; tile < a.H / kTile; tile += kEdnSubMax)
            combine_tiles<V>(a, ctl, tile, (1 << min(kEdnSubMax, a.H / kTile - tile)) - 1);
}

/* Ask L2 for router item `item`'s weights when the item is taken, before
 * it waits for norm2 (3 MB, read once per layer). */
__device__ __forceinline__ void router_prefetch(const MonoArgs &a, int item) {
    int k0, k1;
    k_slice(a.H, a.s_rt, item % a.s_rt, &k0, &k1);
    prefetch_rows_f32(a.router, a.H, (int64_t)(item / a.s_rt) * kTile, kTile, a.E, k0, k1);
}

/* True in the CTA whose tile completes the router (it then sees every
 * logit; the kernel's loop runs the routing plan there unless CTA 0 holds
 * it, M3_MONO_PIN). */
template <int NR, int V>
__device__ bool router_item(const MonoArgs &a, Ctl &ctl, unsigned char *dsm, int item,
                            bool faulted) {
    const int tile = item / a.s_rt, slice = item % a.s_rt;
    int k0, k1;
    k_slice(a.H, a.s_rt, slice, &k0, &k1);
    /* (the kernel's loop prefetched the tile and waited for norm2: post_dep) */
    set_rows(ctl, a.x2, a.H, a.T);
    const int warp = threadIdx.x >> 5;
    float acc[kRW][NR];
    gemv_rows_f32<NR>(acc, a.router, tile * kTile + warp * kRW, a.E, a.H, k0, k1, ctl.rowp, a.T,
                      reinterpret_cast<uint16_t *>(dsm), faulted);
    mark(); /* the slice's products summed (warp sums) */
    const bool last = split_reduce<NR>(acc, a.s_rt, slice, tile, a.part_rt, a.ctr + a.o_rtile, ctl);
    mark(); /* the partial written and arrived (the last arriver: summed) */
    if (!last)
        return false;
    for (int i = threadIdx.x; i < kTile * a.T; i += kThreads) {
        int r = i / a.T, t = i % a.T, e = tile * kTile + r;
        if (e < a.E)
            a.logits[(size_t)t * a.E + e] = ctl.fin[r][t]; /* fp32: no rounding */
    }
    return arrive(&a.ctr[C_ROUTER], (unsigned)a.rt_tiles, ctl);
}

/* ---------------------------------------------------------------- experts */

/* The staged rows (bf16 activations in xs, K columns, K <= kKC) through
 * this warp's two output rows of each of tiles [tile0, tile0 + ntile) of
 * bf16 weights W; out(t, n, v) takes each sum. Each tile's weights are
 * copied into a ring slot (cp.async, no registers) SLOTS - 1 tiles ahead,
 * so a tile's products and sums run while the next tiles' loads are in
 * flight. gemv_rows issues a tile's loads only after the tile before it is
 * summed and written: a DRAM round trip per 12 KB tile, and the routed down
 * phase ran at 1.4-1.7 TB/s (twenty-first session's trace); a second
 * register buffer spills. A lane reads back only the pieces it copied
 * itself, so its own cp.async wait orders them. Each output is the same
 * warp's sum of the same products in the same order as gemv_rows over one
 * chunk: the same bits. */
template <int NR, bool ROUTED, typename Out>
__device__ void down_walk(const WRow &W, int64_t N, int K, const uint16_t *xs, uint4 *ring,
                          int tile0, int ntile, int rows, Out out) {
    constexpr int SLOTS = walk_slots<NR>();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    uint4 *mine = ring + warp * (kRW * kKU * 32) + lane; /* + slot, row and piece */
    auto issue = [&](int j) {
        ring_issue(mine + (j % SLOTS) * kWalkSlotU4, W,
                   (int64_t)(tile0 + j) * kTile + warp * kRW, N, 0, K, lane);
    };
    for (int j = 0; j < SLOTS - 1 && j < ntile; j++)
        issue(j);
#pragma unroll 1
    for (int j = 0; j < ntile; j++) {
        /* its slot held tile j - 1, read into registers in the last pass */
        if (j + SLOTS - 1 < ntile)
            issue(j + SLOTS - 1);
        ring_wait(min(ntile - 1 - j, SLOTS - 1)); /* the groups issued after tile j */
        const WBuf<false> cur = ring_read(mine + (j % SLOTS) * kWalkSlotU4);
        float acc[kRW][NR];
        acc_zero<NR>(acc);
        chunk_fma<NR, false, ROUTED>(acc, cur, K, xs, lane, rows);
        const int64_t n0 = (int64_t)(tile0 + j) * kTile + warp * kRW;
#pragma unroll
        for (int r = 0; r < kRW; r++)
#pragma unroll
            for (int t = 0; t < NR; t++)
                if (t == 0 || t < rows) {
                    const float v = m3_warp_sum(acc[r][t]);
                    if (t < rows && lane == r * NR + t && n0 + r < N)
                        out(t, n0 + r, v);
                }
    }
}

/* y for columns [tile * 8, tile * 8 + 8) of every row, for the tiles
 * tile0 + j (j < kEdnSubMax) with bit j of mask: world 1 rounds the expert
 * and shared outputs (SPEC rounding points) and y once; world > 1 pushes
 * the rank's unrounded partial. The tiles in one pass over the CTA's
 * threads (index: row, tile slot, column; no divisions): at 1-4 rows a
 * tile is 8-32 outputs, and a loop over the tiles paid a round of
 * dependent loads per tile (-1.3 to -3.6% at 1-4 rows: docs/PERF.md,
 * twenty-seventh session). */
template <int V>
__device__ void combine_tiles(const MonoArgs &a, const Ctl &ctl, int tile0, int mask) {
    static_assert(kTile == 8 && kEdnSubMax == 8, "the index's shifts");
    constexpr bool TP = (V & V_TP) != 0;
    for (int i = threadIdx.x; i < 64 * a.T; i += kThreads) {
        const int j = i >> 3 & 7;
        if (!(mask >> j & 1))
            continue;
        int t = i >> 6, n = (tile0 + j) * kTile + (i & 7);
        float acc = 0.0f;
        const float sv = a.Is ? __ldcg(a.sh_out + (size_t)t * a.H + n) : 0.0f;
        if (a.slots[t] >= 0) {
            /* four slots' loads in flight at a time, summed in slot order
             * (K is 4 on M3; a loop over kMaxTopE unrolled put 16 slots'
             * code at every call site) */
            for (int s0 = 0; s0 < a.K; s0 += 4) {
                float ev[4], wv[4];
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    const int m = t * a.K + s0 + j;
                    ev[j] = s0 + j < a.K ? __ldcg(a.eout + (size_t)m * a.H + n) : 0.0f;
                    wv[j] = s0 + j < a.K ? __ldcg(a.rw + m) : 0.0f;
                }
#pragma unroll
                for (int j = 0; j < 4; j++)
                    if (s0 + j < a.K)
                        acc += wv[j] * (!TP ? m3_round_bf(ev[j]) : ev[j]);
            }
        }
        float y = a.scaling * acc;
        if (a.Is)
            y += !TP ? m3_round_bf(sv) : sv;
        if (!TP)
            a.hidden[(size_t)t * a.H + n] = m3_to_bf(y);
        else
            ll_push(a, 1, t, n, y, ctl.tag_f);
    }
}

/* One contribution (the shared expert or one routed expert) to each of
 * output tiles [tile0, tile0 + n) (n <= kEdnSubMax) is complete; the last
 * of n_uniq + shared to arrive at a tile combines it. One fence for all of
 * them; the count is known once the plan is published (a shared down item
 * may finish before it and waits here). */
template <int V>
__device__ void combine_arrive_n(const MonoArgs &a, Ctl &ctl, int tile0, int n, bool faulted) {
    __syncthreads();
    if (threadIdx.x == 0) {
        int nu = ctl.plan_nu;
        if (nu < 0) { /* a shared down item before this CTA saw the plan */
            spin_until(&a.ctr[C_PLAN], 1u);
            nu = __ldcg(a.n_uniq);
            ctl.plan_nu = nu;
        }
        const unsigned total = (unsigned)nu + (a.Is ? 1u : 0u);
        __threadfence();
        /* the n atomics in flight together (a loop over n waited for each) */
        unsigned prev[kEdnSubMax];
#pragma unroll
        for (int j = 0; j < kEdnSubMax; j++)
            prev[j] = j < n ? atomicAdd(&a.ctr[a.o_comb + tile0 + j], 1u) : 0u;
        int mask = 0;
#pragma unroll
        for (int j = 0; j < kEdnSubMax; j++)
            mask |= (j < n && prev[j] + 1u == total) << j;
        __threadfence();
        ctl.flag = mask;
    }
    __syncthreads();
    mark(); /* arrived at the combine counters */
    const int mask = ctl.flag;
    if (!faulted && mask)
        combine_tiles<V>(a, ctl, tile0, mask);
}

template <int NR, int V>
__device__ void shgu_item(const MonoArgs &a, Ctl &ctl, unsigned char *dsm, int item,
                          bool faulted) {
    const int tile = item / a.s_shgu, slice = item % a.s_shgu;
    int k0, k1;
    k_slice(a.H, a.s_shgu, slice, &k0, &k1);
    /* (the kernel's loop waited for norm2: post_dep) */
    set_rows(ctl, a.x2, a.H, a.T);
    const int warp = threadIdx.x >> 5;
    /* warps 0-1: gate rows tile*4 .. +3, warps 2-3: the same up rows */
    const WMat &m = warp < 2 ? a.shg : a.shu;
    float acc[kRW][NR];
    gemv_rows<NR, V>(acc, wrow_of(m), tile * 4 + (warp & 1) * kRW, a.Is, k0, k1, ctl.rowp, a.T,
                  reinterpret_cast<uint16_t *>(dsm), faulted);
    if (!split_reduce<NR>(acc, a.s_shgu, slice, tile, a.part_shgu, a.ctr + a.o_shgu, ctl))
        return;
    for (int i = threadIdx.x; i < 4 * a.T; i += kThreads) {
        int j = i / a.T, t = i % a.T;
        float v = m3_swiglu_oai(m3_round_bf(ctl.fin[j][t]), m3_round_bf(ctl.fin[4 + j][t]),
                                a.alpha, a.limit);
        a.sh_act[(size_t)t * a.Is + tile * 4 + j] = m3_to_bf(v);
    }
    signal_count(&a.ctr[C_SHGU]);
}

/* Tiles per shared down item in this kernel: a.shdn_sub (all of K, bf16:
 * cuda_mono.cu), except in the world > 1 kernels at 16 rows, where the
 * walk's registers spilled (ptxas), which keep a tile per item. The item
 * count (mono_post_kernel) and the items use this same value. */
template <int NR, int V>
__device__ __forceinline__ int shdn_sub_of(const MonoArgs &a) {
    return (!(V & V_TP) || NR <= 8) ? a.shdn_sub : 1;
}

template <int NR, int V>
__device__ void shdn_item(const MonoArgs &a, Ctl &ctl, unsigned char *dsm, int item,
                          bool faulted) {
    const int sub = shdn_sub_of<NR, V>(a);
    if (sub > 1) {
        const int tiles = a.H / kTile, tile0 = item * sub;
        const int ntile = min(sub, tiles - tile0);
        /* (the kernel's loop waited for the shared gate/up: post_dep) */
        if (!faulted) {
            set_rows(ctl, a.sh_act, a.Is, a.T);
            uint16_t *xs = reinterpret_cast<uint16_t *>(dsm);
            __syncthreads(); /* rowp published */
            stage_x<NR>(xs, ctl.rowp, a.T, 0, a.Is);
            __syncthreads();
            mark(); /* the rows' activations staged */
            down_walk<NR, false>(wrow_of(a.shd), a.H, a.Is, xs,
                                 reinterpret_cast<uint4 *>(dsm + walk_xs_bytes<NR>()), tile0,
                                 ntile, a.T, [&](int t, int64_t n, float v) {
                                     a.sh_out[(size_t)t * a.H + n] = v;
                                 });
        }
        mark(); /* the tiles' outputs written (thread 0's share: its warp's) */
        combine_arrive_n<V>(a, ctl, tile0, ntile, faulted);
        return;
    }
    const int tile = item / a.s_shdn, slice = item % a.s_shdn;
    int k0, k1;
    k_slice(a.Is, a.s_shdn, slice, &k0, &k1);
    /* (the kernel's loop waited for the shared gate/up: post_dep) */
    set_rows(ctl, a.sh_act, a.Is, a.T);
    const int warp = threadIdx.x >> 5;
    float acc[kRW][NR];
    gemv_rows<NR, V>(acc, wrow_of(a.shd), tile * kTile + warp * kRW, a.H, k0, k1, ctl.rowp, a.T,
                  reinterpret_cast<uint16_t *>(dsm), faulted);
    if (!split_reduce<NR>(acc, a.s_shdn, slice, tile, a.part_shdn, a.ctr + a.o_shdn, ctl))
        return;
    for (int i = threadIdx.x; i < kTile * a.T; i += kThreads) {
        int r = i / a.T, t = i % a.T;
        a.sh_out[(size_t)t * a.H + tile * kTile + r] = ctl.fin[r][t];
    }
    combine_arrive_n<V>(a, ctl, tile, 1, faulted);
}

/* Member rows per routed group in the NR-row kernels. */
__host__ __device__ constexpr int enr_of(int NR) { return NR <= 1 ? 1 : (NR <= 2 ? 2 : 4); }

/* The kernels whose routed gate/up items may walk (gu_walk): bf16,
 * world 1, up to 8 rows (egu_sub_of, kWalkGroups). */
template <int NR, int V>
constexpr bool kWalkKernel = NR <= 8 && !(V & (V_F8 | V_TP));

/* 4-neuron tiles per routed gate/up item in the NR-row kernel: a.egu_sub
 * (the host sets 1 where gu_walk does not apply: fp8 weights, or whole
 * rows and two ring slots over the shared memory) in the bf16 world-1
 * kernels up to 8 rows; 1 in the 16-row kernel (its 4-row groups stream
 * through gemv_ring: the walk was +2% at 16 rows, thirty-first session)
 * and in the fp8 and world > 1 kernels (the walk's code spilled 40-116
 * bytes there, ptxas). The item count (mono_post_kernel), the items and
 * the routed down items' wait use it. */
template <int NR, int V>
__device__ __forceinline__ int egu_sub_of(const MonoArgs &a) {
    return kWalkKernel<NR, V> ? a.egu_sub : 1;
}
/* The 3-8-row bf16 world-1 kernels walk every routed gate/up item
 * (a.egu_walk: where it fits), their members two at a time: at 4 rows an
 * expert has one member in most steps, and one-tile items through
 * gemv_ring paid a ring fill and the item's start for 98 KB each (2,880
 * items of 10.9 us at 4 rows, thirty-first session's trace). */
template <int NR, int V>
constexpr bool kWalkGroups = NR > 2 && kWalkKernel<NR, V>;
__host__ __device__ __forceinline__ int egu_groups(int I, int sub) {
    return (I / 4 + sub - 1) / sub;
}

/* The routed gate/up of ntile consecutive 4-neuron tiles from tile0 for
 * one member group: every chunk of every tile through one weight ring
 * (ring_issue), `slots` deep, so the next tile's first weights are in
 * flight while this tile's last products and its SwiGLU run; the rows'
 * activations staged once, whole (gu_xs_bytes), not per chunk and tile.
 * At 1-2 rows an item of one tile (6 chunks of 16 KB on M3) spent much of
 * its ~11 us filling and draining one chunk in flight, and 768 of them ran
 * in two waves on 396 CTAs (twenty-first session). fin(i, acc) gets tile
 * i's warp sums; every thread calls it. The products and sums are
 * gemv_rows' over the same chunks in the same order: the same bits. */
template <int NR, typename Fin>
__device__ void gu_walk(const WRow &W, int64_t N, int K, const uint16_t *const *rowp, int rows,
                        uint16_t *xs, uint4 *ring, int slots, int tile0, int ntile, Fin fin) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nch = (K + kKC - 1) / kKC, total = ntile * nch;
    uint4 *mine = ring + warp * (kRW * kKU * 32) + lane;
    auto issue = [&](int j) {
        const int i = j / nch, kc = (j % nch) * kKC;
        ring_issue(mine + (j % slots) * kWalkSlotU4, W,
                   (int64_t)(tile0 + i) * 4 + (warp & 1) * kRW, N, kc, min(kKC, K - kc), lane);
    };
    for (int j = 0; j < slots - 1 && j < total; j++)
        issue(j);
    __syncthreads(); /* rowp published, the last group's xs consumed */
    for (int i = threadIdx.x; i < NR * nch * (kKC / 8); i += kThreads) {
        const int c = i / (NR * (kKC / 8)), t = i / (kKC / 8) % NR, col = i % (kKC / 8) * 8;
        const bool in = t < rows && c * kKC + col < K;
        cp_async16(xs + (c * NR + t) * kKC + col, in ? rowp[t] + c * kKC + col : rowp[0], in);
    }
    cp_async_commit();
    cp_async_wait<0>(); /* (and the ring's first chunks) */
    __syncthreads();
    float acc[kRW][NR];
    acc_zero<NR>(acc);
#pragma unroll 1
    for (int j = 0; j < total; j++) {
        if (j + slots - 1 < total)
            issue(j + slots - 1); /* its slot held chunk j - 1, read in the last pass */
        ring_wait(min(total - 1 - j, slots - 1));
        const int c = j % nch;
        const WBuf<false> cur = ring_read(mine + (j % slots) * kWalkSlotU4);
        chunk_fma<NR, false, true>(acc, cur, min(kKC, K - c * kKC), xs + c * NR * kKC, lane,
                                   rows);
        if (c == nch - 1) {
            acc_warp_sums<NR>(acc, rows);
            fin(j / nch, acc);
            acc_zero<NR>(acc);
        }
    }
}

/* A routed gate/up item's member group [g0, g0 + rows): its members and
 * their x rows into ctl (published by the GEMV's first barrier). */
__device__ __forceinline__ void egu_group(const MonoArgs &a, Ctl &ctl, int g0, int rows) {
    if ((int)threadIdx.x < rows) {
        int m = __ldcg(a.members + g0 + threadIdx.x);
        ctl.mem[threadIdx.x] = m;
        ctl.rowp[threadIdx.x] = a.x2 + (size_t)(m / a.K) * a.H;
    }
}

/* SwiGLU of a finished gate/up tile (ctl.fin: 4 gate rows, then the 4 up
 * rows) into the members' activations, neurons [tile*4, tile*4 + 4). */
__device__ __forceinline__ void egu_tile_out(const MonoArgs &a, const Ctl &ctl, int tile,
                                             int rows) {
    for (int i = threadIdx.x; i < 4 * rows; i += kThreads) {
        int j = i / rows, t = i % rows;
        float v = m3_swiglu_oai(m3_round_bf(ctl.fin[j][t]), m3_round_bf(ctl.fin[4 + j][t]),
                                a.alpha, a.limit);
        a.act[(size_t)ctl.mem[t] * a.I + tile * 4 + j] = m3_to_bf(v);
    }
}

/* egu_item's gu_walk path: tiles [tile0, tile0 + ntile) of slot u's
 * expert, its members ENR at a time (each further group walks the same
 * weights again). */
template <int ENR>
__device__ void egu_walk_item(const MonoArgs &a, Ctl &ctl, unsigned char *dsm, int u,
                              int tile0, int ntile) {
    const int warp = threadIdx.x >> 5;
    const int e = __ldcg(a.uniq + u), f0 = __ldcg(a.ufirst + u), f1 = __ldcg(a.ufirst + u + 1);
    const WRow W = wrow_expert(warp < 2 ? a.eg : a.eu, e);
    const int xs_bytes = gu_xs_bytes<ENR>(a.H);
    const int slots = gu_slots(xs_bytes, a.smem);
    uint16_t *xs = reinterpret_cast<uint16_t *>(dsm);
    uint4 *ring = reinterpret_cast<uint4 *>(dsm + xs_bytes);
    for (int g0 = f0; g0 < f1; g0 += ENR) {
        const int rows = min(ENR, f1 - g0);
        egu_group(a, ctl, g0, rows);
        gu_walk<ENR>(W, a.I, a.H, ctl.rowp, rows, xs, ring, slots, tile0, ntile,
                     [&](int i, const float(&acc)[kRW][ENR]) {
                         acc_to_fin<ENR>(acc, ctl);
                         egu_tile_out(a, ctl, tile0 + i, rows);
                         __syncthreads(); /* fin is rewritten by the next tile */
                     });
        __syncthreads(); /* mem / rowp are rewritten by the next group */
    }
}

/* Routed gate + up + SwiGLU of slot u's expert, neurons [tile*4, tile*4+4)
 * (egu_sub_of tiles from there: gu_walk), its members ENR at a time (their
 * x rows gathered). */
template <int NR, int V>
__device__ void egu_item(const MonoArgs &a, Ctl &ctl, unsigned char *dsm, int item,
                         bool faulted) {
    constexpr int ENR = enr_of(NR);
    const int sub = egu_sub_of<NR, V>(a);
    const int warp = threadIdx.x >> 5;
    constexpr bool kGroups = kWalkGroups<NR, V>;
    if (kGroups ? a.egu_walk != 0 : sub > 1) {
        const int groups = egu_groups(a.I, sub), u = item / groups;
        const int tile0 = item % groups * sub, ntile = min(sub, a.I / 4 - tile0);
        if (!faulted)
            egu_walk_item<kGroups ? 2 : ENR>(a, ctl, dsm, u, tile0, ntile);
        signal_count(&a.ctr[a.o_egu + u]);
        return;
    }
    const int tiles = a.I / 4, u = item / tiles, tile = item % tiles;
    if (!faulted) {
        const int e = __ldcg(a.uniq + u), f0 = __ldcg(a.ufirst + u), f1 = __ldcg(a.ufirst + u + 1);
        const WRow W = wrow_expert(warp < 2 ? a.eg : a.eu, e);
        const int64_t n0 = tile * 4 + (warp & 1) * kRW;
        for (int g0 = f0; g0 < f1; g0 += ENR) {
            const int rows = min(ENR, f1 - g0);
            egu_group(a, ctl, g0, rows);
            float acc[kRW][ENR];
            /* the ring from 4-row groups (8-16 rows: -2% a layer); at 1-2
             * rows it made the items slower (+2.6% at one row; twenty-first
             * session) */
            bool ring = false;
            if constexpr (ENR >= 4 && !kGroups) {
                ring = !((V & V_F8) && W.fp8);
                if (ring)
                    gemv_ring<ENR, true>(acc, W, n0, a.I, a.H, ctl.rowp, rows,
                                         reinterpret_cast<uint16_t *>(dsm),
                                         reinterpret_cast<uint4 *>(dsm + walk_xs_bytes<ENR>()));
            }
            if (!ring)
                gemv_rows<ENR, V, true>(acc, W, n0, a.I, 0, a.H, ctl.rowp, rows,
                                        reinterpret_cast<uint16_t *>(dsm), false);
            acc_to_fin<ENR>(acc, ctl);
            egu_tile_out(a, ctl, tile, rows);
            __syncthreads(); /* mem / rowp / fin are rewritten by the next group */
        }
    }
    signal_count(&a.ctr[a.o_egu + u]);
}

/* Routed down of slot u's expert, output columns [tile*8, tile*8 + 8) for
 * a.edn_sub consecutive tiles (fewer, larger items: at 16 rows the 8-column
 * items numbered n_uniq x H/8, each paying the item overhead for 12 KB):
 * fp32 (rounded by the combine for world 1, a partial for world > 1). Each
 * item arrives at its tiles' combine counters once, after all of them. */
__host__ __device__ __forceinline__ int edn_groups(int H, int sub) {
    return (H / kTile + sub - 1) / sub;
}

template <int NR, int V>
__device__ void edn_item(const MonoArgs &a, Ctl &ctl, unsigned char *dsm, int item,
                         bool faulted) {
    constexpr int ENR = enr_of(NR);
    const int tiles = a.H / kTile, groups = edn_groups(a.H, a.edn_sub);
    const int u = item / groups, tile0 = (item % groups) * a.edn_sub;
    const int ntile = min(a.edn_sub, tiles - tile0);
    const int warp = threadIdx.x >> 5;
    int e = 0, f0 = 0, f1 = 0;
    if (!faulted) { /* the plan is published: this item exists */
        e = __ldcg(a.uniq + u);
        f0 = __ldcg(a.ufirst + u);
        f1 = __ldcg(a.ufirst + u + 1);
    }
    wait_count(&a.ctr[a.o_egu + u], (unsigned)egu_groups(a.I, egu_sub_of<NR, V>(a)));
    if (a.I <= kKC && !((V & V_F8) && a.ed.fp8)) { /* one staged chunk (M3: 768), bf16 */
        if (!faulted) {
            const WRow W = wrow_expert(a.ed, e);
            uint16_t *xs = reinterpret_cast<uint16_t *>(dsm);
            uint4 *ring = reinterpret_cast<uint4 *>(dsm + walk_xs_bytes<ENR>());
            for (int g0 = f0; g0 < f1; g0 += ENR) {
                const int rows = min(ENR, f1 - g0);
                __syncthreads(); /* the previous group's xs and members are consumed */
                if ((int)threadIdx.x < rows) {
                    int m = __ldcg(a.members + g0 + threadIdx.x);
                    ctl.mem[threadIdx.x] = m;
                    ctl.rowp[threadIdx.x] = a.act + (size_t)m * a.I;
                }
                __syncthreads();
                stage_x<ENR>(xs, ctl.rowp, rows, 0, a.I);
                __syncthreads();
                mark(); /* the group's activations staged */
                down_walk<ENR, true>(W, a.H, a.I, xs, ring, tile0, ntile, rows,
                                     [&](int t, int64_t n, float v) {
                                         a.eout[(size_t)ctl.mem[t] * a.H + n] = v;
                                     });
            }
        }
        mark(); /* the tiles' outputs written */
        combine_arrive_n<V>(a, ctl, tile0, ntile, faulted);
        return;
    }
    for (int j = 0; j < ntile; j++) {
        const int tile = tile0 + j;
        if (!faulted) {
            const WRow W = wrow_expert(a.ed, e);
            const int64_t n0 = tile * kTile + warp * kRW;
            for (int g0 = f0; g0 < f1; g0 += ENR) {
                const int rows = min(ENR, f1 - g0);
                if ((int)threadIdx.x < rows) {
                    int m = __ldcg(a.members + g0 + threadIdx.x);
                    ctl.mem[threadIdx.x] = m;
                    ctl.rowp[threadIdx.x] = a.act + (size_t)m * a.I;
                }
                float acc[kRW][ENR];
                gemv_rows<ENR, V, true>(acc, W, n0, a.H, 0, a.I, ctl.rowp, rows,
                                        reinterpret_cast<uint16_t *>(dsm), false);
                acc_to_fin<ENR>(acc, ctl);
                for (int i = threadIdx.x; i < kTile * rows; i += kThreads) {
                    int r = i / rows, t = i % rows;
                    a.eout[(size_t)ctl.mem[t] * a.H + tile * kTile + r] = ctl.fin[r][t];
                }
                __syncthreads();
            }
        }
    }
    mark(); /* the tiles' outputs written */
    combine_arrive_n<V>(a, ctl, tile0, ntile, faulted);
}

/* world > 1: hidden = bf16(sum over ranks, in rank order, of the FFN
 * partials) for row t, columns [c*1024, c*1024 + 1024). */
template <int V>
__device__ void final_item(const MonoArgs &a, const Ctl &ctl, int item, bool faulted) {
    const int chunks = (a.H + 1023) / 1024, t = item / chunks, c = item % chunks;
    if (faulted || !(V & V_TP)) /* no final sums at world 1 (no such items) */
        return;
    for (int n = c * 1024 + threadIdx.x; n < min(a.H, (c + 1) * 1024); n += kThreads) {
        float s = 0.0f;
        for (int src = 0; src < a.world; src++)
            s += ll_read(a, a.landing + land_idx(a, 1, src, t, n), ctl.tag_f, t, src);
        a.hidden[(size_t)t * a.H + n] = m3_to_bf(s);
    }
}


} // namespace
} // namespace m3mono

#endif
