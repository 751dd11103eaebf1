/*
 * Device helpers of the mono kernels: counters, step rows, the GEMV core, norms.
 * Part of the mono executor's kernel unit (cuda_mono_kernels.cu includes it;
 * cuda_mono.cu describes the design).
 */
#ifndef M3_CUDA_CUDA_MONO_DEV_CUH
#define M3_CUDA_CUDA_MONO_DEV_CUH

namespace m3mono {
namespace { /* internal linkage: cuda_mono_kernels.cu and _tp.cu both compile it */

/* ================================================================ helpers */

__device__ __forceinline__ int ld_vol(const int *p) { return *(const volatile int *)p; }

__device__ __forceinline__ uint2 ld_vol_v2(const uint2 *p) {
    uint2 v;
    asm volatile("ld.volatile.global.v2.u32 {%0, %1}, [%2];"
                 : "=r"(v.x), "=r"(v.y)
                 : "l"(p)
                 : "memory");
    return v;
}

__device__ __forceinline__ void st_vol_v2(uint2 *p, uint2 v) {
    asm volatile("st.volatile.global.v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(v.x), "r"(v.y)
                 : "memory");
}

/* A work list cursor's top bit: a fault was set during this launch
 * (fault_set). Every reservation returns it with the item's index, so the
 * item loops learn of a fault without a load of the fault word per item. */
constexpr unsigned kQueueFault = 0x80000000u;

/* The first fault wins; [1..3] are written after the code, before the step's
 * check kernel (a later launch) reads them; then the running kernel's
 * cursor (`queue`) is marked. Not inlined: a path that only runs on bad
 * input, kept out of the hot items' code. */
__device__ __noinline__ void fault_set(int *f, unsigned *queue, int code, int layer, int row,
                                       long long value) {
    if (atomicCAS(f, 0, code) == 0) {
        f[1] = layer;
        f[2] = row;
        f[3] = value > INT_MAX ? INT_MAX : (value < INT_MIN ? INT_MIN : (int)value);
        __threadfence();
        atomicOr(queue, kQueueFault);
    }
}

/* ---- counters: every thread of the CTA calls these ---- */

/* Per-CTA copies of the launch's knobs (set by the kernels' prologue) and
 * the time the current item's last wait ended (the item trace). */
__shared__ int s_spin_ns, s_poll_acquire;
__shared__ unsigned long long s_t_ready;
#ifdef M3_MONO_MARKS
__shared__ unsigned long long s_marks[kMarks];
__shared__ int s_nmark;
#endif

/* A point inside an item, for the trace (M3_MONO_MARKS builds only: the
 * timer reads and their code would slow every item). Thread 0 only, so a
 * mark after a barrier is the CTA's time there. */
__device__ __forceinline__ void mark() {
#ifdef M3_MONO_MARKS
    if (threadIdx.x == 0 && s_nmark < kMarks)
        s_marks[s_nmark++] = gtimer();
#endif
}

/* The GEMV's per-chunk marks; M3_MONO_MARKS_EPI builds leave them out so
 * that the marks of a projection item's head epilogue fit in kMarks. */
__device__ __forceinline__ void mark_chunk() {
#ifndef M3_MONO_MARKS_EPI
    mark();
#endif
}

__device__ __forceinline__ void knobs_init(const MonoArgs &a) {
    if (threadIdx.x == 0) {
        s_spin_ns = a.spin_ns;
        s_poll_acquire = a.poll_acquire;
    }
    __syncthreads();
}

/* Thread 0 only: spin until *c >= target, then acquire (the producers'
 * writes before their release are visible to this thread, and through the
 * caller's barrier to the CTA). Polls are relaxed loads and only the last
 * load acquires: an acquire load invalidates the SM's L1 each time, which
 * a spinning CTA would otherwise do every few hundred ns to its neighbours
 * (M3_MONO_POLL_ACQUIRE=1 restores acquire polling, for measurements). */
__device__ __forceinline__ void spin_until(const unsigned *c, unsigned target) {
    if (s_poll_acquire) {
        while (ld_acquire(c) < target)
            __nanosleep(s_spin_ns);
        return;
    }
    while (ld_relaxed(c) < target)
        __nanosleep(s_spin_ns);
    (void)ld_acquire(c); /* counters only grow within a launch: still >= target */
}

/* Wait until *c >= target; afterwards the CTA sees what the producers
 * wrote before their release (reads of such data use ld.cg, never L1). */
__device__ __forceinline__ void wait_count(const unsigned *c, unsigned target) {
    if (threadIdx.x == 0) {
        spin_until(c, target);
        s_t_ready = gtimer();
    }
    __syncthreads();
}

/* Publish the CTA's writes and bump *c. */
__device__ __forceinline__ void signal_count(unsigned *c) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(c, 1u);
    }
}

/* Publish, bump *c; true in the CTA whose bump completes `total` (it then
 * sees every earlier arriver's writes). */
__device__ __forceinline__ bool arrive(unsigned *c, unsigned total, Ctl &ctl) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        ctl.flag = atomicAdd(c, 1u) + 1u == total;
        __threadfence();
    }
    __syncthreads();
    return ctl.flag != 0;
}

/* The fault word now, the same answer in every thread of the CTA. */
__device__ __forceinline__ bool fault_now(const MonoArgs &a, Ctl &ctl) {
    __syncthreads();
    if (threadIdx.x == 0)
        ctl.fnow = ld_vol(a.fault) != 0; /* its own field: ctl.faulted is the item loop's */
    __syncthreads();
    return ctl.fnow != 0;
}

__device__ __forceinline__ double block_sum_d(double v, Ctl &ctl) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = m3_warp_sum_d(v);
    __syncthreads();
    if (lane == 0)
        ctl.red[warp] = v;
    __syncthreads();
    double s = 0.0;
#pragma unroll
    for (int w = 0; w < kWarps; w++)
        s += ctl.red[w];
    return s;
}

/* index of value (which, src rank, row, column) in a landing area */
__device__ __forceinline__ size_t land_idx(const MonoArgs &a, int which, int src, int t, int n) {
    return (((size_t)which * a.world + src) * kMaxT + t) * (size_t)a.H + n;
}

/* A peer's pushed value: spin on its tag, bounded. */
__device__ float ll_read(const MonoArgs &a, const uint2 *p, uint32_t tag, int row, int src) {
    uint2 v = ld_vol_v2(p);
    if (v.y == tag)
        return __uint_as_float(v.x);
    unsigned long long t0 = gtimer();
    for (;;) {
        __nanosleep(100);
        v = ld_vol_v2(p);
        if (v.y == tag)
            return __uint_as_float(v.x);
        if (ld_vol(a.fault) != 0)
            return m3_qnan();
        if (gtimer() - t0 > kPeerTimeoutNs) {
            fault_set(a.fault, a.ctr + C_QPOST, M3_MONO_FAULT_PEER_WAIT, a.layer, row, src);
            return m3_qnan();
        }
    }
}

__device__ __forceinline__ void ll_push(const MonoArgs &a, int which, int t, int n, float v,
                                        uint32_t tag) {
    uint2 pair = make_uint2(__float_as_uint(v), tag);
    for (int dst = 0; dst < a.world; dst++)
        st_vol_v2(a.peers[dst] + land_idx(a, which, a.rank, t, n), pair);
}

/* ================================================================ step rows */

enum { ROW_OK = 0, ROW_PADDED, ROW_BAD };

struct RowView {
    int state;
    int64_t kv_len;
    int nblocks;
    const int32_t *table;
};

/* cuda_step.cuh load_row on the mono arguments */
__device__ RowView load_row(const MonoArgs &a, int t) {
    int64_t slot = a.slots[t], pos = a.pos[t], cap = (int64_t)a.mb * M3_PAGE;
    int32_t req = a.row_req[t];
    RowView r{ROW_PADDED, 0, 0, nullptr};
    if (slot < 0)
        return r;
    r.kv_len = pos < 0 ? 0 : pos + 1;
    r.state = ROW_OK;
    if (pos >= cap) {
        r.kv_len = cap;
        r.state = ROW_BAD;
    }
    r.nblocks = (int)((r.kv_len + M3_PAGE - 1) / M3_PAGE);
    if (req < 0)
        r.state = ROW_BAD;
    if (r.state == ROW_OK)
        r.table = a.btab + (int64_t)req * a.mb;
    return r;
}

__device__ __forceinline__ bool page_ok(const MonoArgs &a, int64_t page) {
    return page >= 0 && page < a.n_pages;
}

/* ================================================================ GEMV core */

struct WRow { /* one warp's weight rows */
    const uint8_t *w, *s;
    int64_t w_row, s_row;
    int fp8;
};

__device__ __forceinline__ WRow wrow_of(const WMat &m) {
    WRow r = {m.w, m.s, m.w_row, m.s_row, m.fp8};
    return r;
}

__device__ __forceinline__ WRow wrow_expert(const WExp &x, int e) {
    WRow r = {x.w + (int64_t)e * x.w_stride, x.s ? x.s + (int64_t)e * x.s_stride : nullptr,
              x.w_row, x.s_row, x.fp8};
    return r;
}

/* Rows [0, NR) of the activations' chunk [kc, kc + kn) into xs [NR][kKC]
 * (rows >= rows and columns >= kn are zero) with cp.async: every piece in
 * flight at once, no registers (a load + shared store loop waits for each
 * load before its store: 6% slower at 16 rows, docs/PERF.md). L2 reads:
 * the rows were written by other CTAs of this launch. */
template <int NR>
__device__ __forceinline__ void stage_x(uint16_t *xs, const uint16_t *const *rowp, int rows,
                                        int kc, int kn) {
    for (int i = threadIdx.x; i < NR * (kKC / 8); i += kThreads) {
        int t = i / (kKC / 8), c = (i % (kKC / 8)) * 8;
        bool in = t < rows && c < kn;
        cp_async16(xs + t * kKC + c, in ? rowp[t] + kc + c : rowp[0], in);
    }
    cp_async_commit();
    cp_async_wait<0>();
}

/* L2 prefetch of [p, p + bytes) (one bulk request, no registers, nothing
 * waits for it); p and bytes must be multiples of 16. */
__device__ __forceinline__ void l2_prefetch(const void *p, uint32_t bytes) {
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
}

/* Ask L2 for the router tile's fp32 rows [n0, n0 + nr) (those < N) over
 * columns [k0, k1), one request per row, when the item starts (before it
 * waits for norm2): 3 MB, read once per layer. */
__device__ __forceinline__ void prefetch_rows_f32(const float *w, int64_t K, int64_t n0, int nr,
                                                  int64_t N, int k0, int k1) {
    const int i = threadIdx.x;
    if (i < nr && n0 + i < N && k1 > k0)
        l2_prefetch(w + (n0 + i) * K + k0, (uint32_t)((k1 - k0) * 4));
}

/* cuda_gemv.cuh gemv_chunk, split in two: the weight loads of this warp's
 * rows over the chunk (registers), then acc[r][t] += w[n0 + r, kc + k]
 * x[t, k] over this lane's k of the chunk. The loads are issued before the
 * activations are staged, so the two round trips overlap. */
template <bool FP8>
struct WBuf;
template <>
struct WBuf<true> {
    uint2 wv[kRW][kKU];
    float sc[kRW][kKU];
};
template <>
struct WBuf<false> {
    uint4 wv[kRW][kKU];
};

template <bool FP8>
__device__ __forceinline__ void chunk_load(WBuf<FP8> &b, const WRow &W, int64_t n0, int64_t N,
                                           int kc, int kn, int lane) {
#pragma unroll
    for (int r = 0; r < kRW; r++)
#pragma unroll
        for (int u = 0; u < kKU; u++) {
            int k = lane * 8 + u * 256;
            bool ok = n0 + r < N && k < kn;
            if constexpr (FP8) {
                const uint8_t *row = W.w + (n0 + r) * W.w_row + kc + k;
                b.wv[r][u] = ok ? ldg8_pol(row, l2_evict_first()) : make_uint2(0, 0);
                b.sc[r][u] = ok ? m3_e8m0(W.s[(n0 + r) * W.s_row + (kc + k) / 32]) : 0.0f;
            } else {
                const uint8_t *row = W.w + (n0 + r) * W.w_row + (int64_t)(kc + k) * 2;
                b.wv[r][u] = ok ? ldg16_pol(row, l2_evict_first()) : make_uint4(0, 0, 0, 0);
            }
        }
}

/* One piece u of the chunk: acc[r][t] += w[r][piece u] . x[t][piece u]
 * for the real rows t < rows (the row bucket's others are zeros nobody
 * reads: a routed expert at 2-16 rows mostly has one member in a bucket of
 * 2-4), the weights at b.wv[r][u] (scales b.sc[r][u]). */
template <int NR, bool FP8>
__device__ __forceinline__ void piece_fma(float (&acc)[kRW][NR], const WBuf<FP8> &b, int u,
                                          int k, const uint16_t *xs, int rows) {
    float wf[kRW][8];
#pragma unroll
    for (int r = 0; r < kRW; r++) {
        if constexpr (FP8)
            e4m3x8_to_f32(b.wv[r][u], b.sc[r][u], wf[r]);
        else
            unpack8(b.wv[r][u], wf[r]);
    }
#pragma unroll
    for (int t = 0; t < NR; t++) {
        if (t > 0 && t >= rows) /* (a GEMV has at least one row) */
            break;
        float xf[8];
        unpack8(*reinterpret_cast<const uint4 *>(xs + t * kKC + k), xf);
#pragma unroll
        for (int r = 0; r < kRW; r++)
#pragma unroll
            for (int j = 0; j < 8; j++)
                acc[r][t] += wf[r][j] * xf[j];
    }
}

/* Row counts from which a chunk's pieces run in a loop instead of
 * unrolled: at 16 rows the unrolled chunk is ~1,000 FMAs per lane, and
 * every CTA starting a 16-row GEMV phase fetched that code cold (the first
 * chunk's products 8-10 us, the later ones 2.3-2.6), and it spilled; rolled
 * from 8 rows, the layer is 4% faster at 8 rows and 8% at 16, the same at
 * 1-4 (docs/PERF.md, fourteenth session). */
#ifndef M3_MONO_ROLL_NR
#define M3_MONO_ROLL_NR 8
#endif
constexpr int kRollNR = M3_MONO_ROLL_NR;
/* Row counts from which the chain's GEMVs (every item but the routed
 * experts': projections, o_proj, the shared expert) roll their pieces too.
 * A chain item runs once per layer on its SM, so its products' code is
 * fetched cold on the step's critical path (at 4 rows o_proj's first
 * chunk's products took 2.3 us, later chunks 0.9: twenty-eighth session's
 * marks); the routed items run many times an SM and stay unrolled (rolled
 * too, they made 8-16 rows 2.5-3.6% slower: fourteenth session). From 4:
 * -0.5 / -0.7% at 4 rows, 4K / 128K; from 2: +0.8% at 2 rows (docs/PERF.md,
 * twenty-ninth session). */
#ifndef M3_MONO_ROLL_CHAIN_NR
#define M3_MONO_ROLL_CHAIN_NR 4
#endif
constexpr int kRollChainNR = M3_MONO_ROLL_CHAIN_NR;

/* ROUTED: a routed expert's item (rolled only from kRollNR rows) */
template <int NR, bool FP8, bool ROUTED = false>
__device__ __forceinline__ void chunk_fma(float (&acc)[kRW][NR], const WBuf<FP8> &b, int kn,
                                          const uint16_t *xs, int lane, int rows) {
    if constexpr (NR >= kRollNR || (!ROUTED && NR >= kRollChainNR)) {
        /* one piece's code, the next piece's weights moved into place 0
         * after each: the same products in the same order */
        WBuf<FP8> w = b;
#pragma unroll 1
        for (int u = 0; u < kKU; u++) {
            const int k = lane * 8 + u * 256;
            if (k < kn)
                piece_fma<NR, FP8>(acc, w, 0, k, xs, rows);
#pragma unroll
            for (int r = 0; r < kRW; r++)
#pragma unroll
                for (int v = 0; v + 1 < kKU; v++) {
                    w.wv[r][v] = w.wv[r][v + 1];
                    if constexpr (FP8)
                        w.sc[r][v] = w.sc[r][v + 1];
                }
        }
    } else {
#pragma unroll
        for (int u = 0; u < kKU; u++) {
            const int k = lane * 8 + u * 256;
            if (k < kn)
                piece_fma<NR, FP8>(acc, b, u, k, xs, rows);
        }
    }
}

/* A GEMV's accumulators: zeroed before its products, and each summed over
 * the warp after them (every lane then holds the sums) for the real rows
 * t < rows (row 0 always: a GEMV has one) -- the bucket's other rows:
 * nobody reads them. */
template <int NR>
__device__ __forceinline__ void acc_zero(float (&acc)[kRW][NR]) {
#pragma unroll
    for (int r = 0; r < kRW; r++)
#pragma unroll
        for (int t = 0; t < NR; t++)
            acc[r][t] = 0.0f;
}

template <int NR>
__device__ __forceinline__ void acc_warp_sums(float (&acc)[kRW][NR], int rows) {
#pragma unroll
    for (int r = 0; r < kRW; r++)
#pragma unroll
        for (int t = 0; t < NR; t++)
            if (t == 0 || t < rows)
                acc[r][t] = m3_warp_sum(acc[r][t]);
}

template <int NR, bool FP8, bool ROUTED>
__device__ __forceinline__ void gemv_kloop(float (&acc)[kRW][NR], const WRow &W, int64_t n0,
                                           int64_t N, int k0, int k1,
                                           const uint16_t *const *rowp, int rows, uint16_t *xs,
                                           int lane, const unsigned *wait_c, unsigned wait_n) {
    for (int kc = k0; kc < k1; kc += kKC) {
        int kn = min(kKC, k1 - kc);
        WBuf<FP8> b;
        chunk_load<FP8>(b, W, n0, N, kc, kn, lane); /* zeros past N: nothing read */
        if (wait_c && kc == k0)
            wait_count(wait_c, wait_n); /* the first chunk's weights in flight meanwhile */
        __syncthreads(); /* the previous chunk (or item) is consumed */
        stage_x<NR>(xs, rowp, rows, kc, kn);
        __syncthreads();
        mark_chunk(); /* the chunk's activations staged */
        if (n0 < N)
            chunk_fma<NR, FP8, ROUTED>(acc, b, kn, xs, lane, rows);
        mark_chunk(); /* warp 0's products of the chunk done (thread 0's time) */
    }
}

/* This warp's rows n0, n0 + 1 (of N) over K columns [k0, k1) for activation
 * rows ctl.rowp[0, rows); sums reduced over the warp. Every thread of the
 * CTA calls it (it synchronises the CTA), each warp with its own rows.
 * skip (CTA-uniform): zeros, nothing read. wait_c (optional): the
 * activations' counter, waited for at wait_n after the first chunk's weight
 * loads are issued (the loads do not depend on it). */
template <int NR, int V, bool ROUTED = false>
__device__ void gemv_rows(float (&acc)[kRW][NR], const WRow &W, int64_t n0, int64_t N, int k0,
                          int k1, const uint16_t *const *rowp, int rows, uint16_t *xs,
                          bool skip, const unsigned *wait_c = nullptr, unsigned wait_n = 0) {
    const int lane = threadIdx.x & 31;
    acc_zero<NR>(acc);
    if (skip || k1 <= k0) {
        if (wait_c)
            wait_count(wait_c, wait_n);
        return;
    }
    if ((V & V_F8) && W.fp8)
        gemv_kloop<NR, true, ROUTED>(acc, W, n0, N, k0, k1, rowp, rows, xs, lane, wait_c,
                                     wait_n);
    else
        gemv_kloop<NR, false, ROUTED>(acc, W, n0, N, k0, k1, rowp, rows, xs, lane, wait_c,
                                      wait_n);
    acc_warp_sums<NR>(acc, rows);
}

/* A weight ring in shared memory for the streaming items (gemv_ring, and
 * cuda_mono_ffn.cuh down_walk): SLOTS chunks of this CTA's 8 output rows
 * (each warp its two, each lane its own pieces) after the staged
 * activations of NR rows, in the shared memory the attention items size. */
template <int NR>
__host__ __device__ constexpr int walk_xs_bytes() { return NR * kKC * 2; }
template <int NR>
__host__ __device__ constexpr int walk_slots() {
    return walk_xs_bytes<NR>() + 3 * kWalkSlotU4 * 16 <= kAttnSmem ? 3 : 2;
}
static_assert(walk_xs_bytes<kMaxT>() + 2 * kWalkSlotU4 * 16 <= kAttnSmem,
              "the down walk's ring fits the attention items' shared memory");

/* The ring's slot j: this lane's pieces of this warp's rows [n0, n0 + 2)
 * of W over columns [kc, kc + kn) (zeros past N and kn), one cp.async
 * group. */
__device__ __forceinline__ void ring_issue(uint4 *mine, const WRow &W, int64_t n0, int64_t N,
                                           int kc, int kn, int lane) {
#pragma unroll
    for (int r = 0; r < kRW; r++)
#pragma unroll
        for (int u = 0; u < kKU; u++) {
            const int k = lane * 8 + u * 256;
            const bool ok = n0 + r < N && k < kn;
            cp_async16_pol(mine + (r * kKU + u) * 32,
                           ok ? W.w + (n0 + r) * W.w_row + (int64_t)(kc + k) * 2 : W.w, ok,
                           l2_evict_first());
        }
    cp_async_commit();
}

/* This lane's pieces of a ring slot (ring_issue's layout) into registers. */
__device__ __forceinline__ WBuf<false> ring_read(const uint4 *mine_slot) {
    WBuf<false> b;
#pragma unroll
    for (int r = 0; r < kRW; r++)
#pragma unroll
        for (int u = 0; u < kKU; u++)
            b.wv[r][u] = mine_slot[(r * kKU + u) * 32];
    return b;
}

/* gemv_rows over all K for bf16 weights (no split), with the
 * weights in a ring of SLOTS chunks in shared memory, SLOTS - 1 chunks
 * ahead, and the next chunk's activations in registers while this one's
 * products run: gemv_kloop has one chunk's weights in flight per warp and
 * stages each chunk's activations after its weights are asked for, so every
 * chunk is a DRAM round trip (the routed gate/up items, 6 chunks of 16 KB,
 * ran at 2.1-3.0 TB/s: twenty-first session's trace). The same products in
 * the same order: the same bits. Every thread of the CTA calls it. wait_c
 * (optional): the activations' counter, waited for at wait_n once the
 * ring's first chunks are asked for (as gemv_rows). */
template <int NR, bool ROUTED = false>
__device__ void gemv_ring(float (&acc)[kRW][NR], const WRow &W, int64_t n0, int64_t N, int K,
                          const uint16_t *const *rowp, int rows, uint16_t *xs, uint4 *ring,
                          const unsigned *wait_c = nullptr, unsigned wait_n = 0) {
    static_assert(kKC / 8 == kThreads, "a chunk's row is one 16-byte piece per thread");
    constexpr int SLOTS = walk_slots<NR>();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    uint4 *mine = ring + warp * (kRW * kKU * 32) + lane;
    const int nch = (K + kKC - 1) / kKC;
    acc_zero<NR>(acc);
    for (int j = 0; j < SLOTS - 1 && j < nch; j++)
        ring_issue(mine + j * kWalkSlotU4, W, n0, N, j * kKC, min(kKC, K - j * kKC), lane);
    if (wait_c)
        wait_count(wait_c, wait_n);
    __syncthreads(); /* rowp published */
    /* this thread's piece (8 columns) of each row of a chunk */
    const int col = threadIdx.x * 8;
    uint4 xr[NR];
    auto load_x = [&](int kc) {
#pragma unroll
        for (int t = 0; t < NR; t++)
            xr[t] = t < rows && kc + col < K
                        ? __ldcg(reinterpret_cast<const uint4 *>(rowp[t] + kc + col))
                        : make_uint4(0, 0, 0, 0);
    };
    load_x(0);
#pragma unroll 1
    for (int c = 0; c < nch; c++) {
        const int kc = c * kKC, kn = min(kKC, K - kc);
        if (c + SLOTS - 1 < nch) /* its slot held chunk c - 1, read in the last pass */
            ring_issue(mine + ((c + SLOTS - 1) % SLOTS) * kWalkSlotU4, W, n0, N,
                       kc + (SLOTS - 1) * kKC, min(kKC, K - kc - (SLOTS - 1) * kKC), lane);
        __syncthreads(); /* every warp is done with the last chunk's xs */
#pragma unroll
        for (int t = 0; t < NR; t++)
            *reinterpret_cast<uint4 *>(xs + t * kKC + col) = xr[t];
        if (c + 1 < nch)
            load_x(kc + kKC);
        ring_wait(min(nch - 1 - c, SLOTS - 1));
        __syncthreads();
        mark(); /* the chunk's activations staged */
        const WBuf<false> cur = ring_read(mine + (c % SLOTS) * kWalkSlotU4);
        if (n0 < N)
            chunk_fma<NR, false, ROUTED>(acc, cur, kn, xs, lane, rows);
        mark(); /* warp 0's products of the chunk done (thread 0's time) */
    }
    acc_warp_sums<NR>(acc, rows);
}

/* A chain item's GEMV (the projections, o_proj): gemv_rows, or in the
 * one-row and 3-4-row kernels (NR 1, 4) gemv_ring where it applies -- the
 * item's slice is all of K ([k0, k1) = [0, K)), bf16 weights, not faulted
 * -- so the next chunks are asked for before the wait: there a chunk's
 * products no longer hide behind the one chunk gemv_rows has in flight
 * (twenty-eighth and twenty-ninth sessions; at one row it is o_proj's
 * first wave that gains, −2% at 32K-128K; at 2 rows the ring was +0.5 to
 * +1.2%: thirty-second session). xs and the ring share dsm. wait_c,
 * wait_n: the activations' counter, as both. */
template <int NR, int V>
__device__ __forceinline__ void gemv_chain(float (&acc)[kRW][NR], const WMat &m, int64_t n0,
                                           int64_t N, int K, int k0, int k1,
                                           const uint16_t *const *rowp, int rows,
                                           unsigned char *dsm, bool faulted,
                                           const unsigned *wait_c, unsigned wait_n) {
    if constexpr (NR == 1 || NR == 4) {
        if (!faulted && k0 == 0 && k1 == K && !((V & V_F8) && m.fp8)) {
            gemv_ring<NR>(acc, wrow_of(m), n0, N, K, rowp, rows,
                          reinterpret_cast<uint16_t *>(dsm),
                          reinterpret_cast<uint4 *>(dsm + walk_xs_bytes<NR>()), wait_c, wait_n);
            return;
        }
    }
    gemv_rows<NR, V>(acc, wrow_of(m), n0, N, k0, k1, rowp, rows,
                     reinterpret_cast<uint16_t *>(dsm), faulted, wait_c, wait_n);
}

/* The fp32-weight GEMV (the router): linear_f32w_kernel's inner loop, two
 * rows per warp. */
template <int NR>
__device__ void gemv_rows_f32(float (&acc)[kRW][NR], const float *w, int64_t n0, int64_t N,
                              int K, int k0, int k1, const uint16_t *const *rowp, int rows,
                              uint16_t *xs, bool skip) {
    const int lane = threadIdx.x & 31;
    acc_zero<NR>(acc);
    if (skip)
        return;
    for (int kc = k0; kc < k1; kc += kKC) {
        int kn = min(kKC, k1 - kc);
        /* both rows' weights first (in flight while x is staged) */
        float4 wv[kRW][kKC / 128];
#pragma unroll
        for (int r = 0; r < kRW; r++) {
            int64_t n = n0 + r;
#pragma unroll
            for (int u = 0; u < kKC / 128; u++) {
                int k = u * 128 + lane * 4;
                wv[r][u] = n < N && k < kn
                               ? ldg16f_pol(w + n * K + kc + k, l2_evict_first())
                               : make_float4(0, 0, 0, 0);
            }
        }
        __syncthreads();
        stage_x<NR>(xs, rowp, rows, kc, kn);
        __syncthreads();
        mark_chunk(); /* the chunk's activations staged */
        /* each row's four activations read once (one 8-byte shared load,
         * converted once) for both weight rows; every acc[r][t] still sums
         * its terms in the same order */
#pragma unroll
        for (int u = 0; u < kKC / 128; u++) {
            int k = u * 128 + lane * 4;
            if (k >= kn)
                continue;
#pragma unroll
            for (int t = 0; t < NR; t++) {
                if (t > 0 && t >= rows)
                    break;
                const uint2 xv = *reinterpret_cast<const uint2 *>(xs + t * kKC + k);
                const float x0 = __uint_as_float(xv.x << 16);
                const float x1 = __uint_as_float(xv.x & 0xffff0000u);
                const float x2 = __uint_as_float(xv.y << 16);
                const float x3 = __uint_as_float(xv.y & 0xffff0000u);
#pragma unroll
                for (int r = 0; r < kRW; r++)
                    if (n0 + r < N)
                        acc[r][t] += wv[r][u].x * x0 + wv[r][u].y * x1 + wv[r][u].z * x2 +
                                     wv[r][u].w * x3;
            }
        }
    }
    acc_warp_sums<NR>(acc, rows);
}

/* A tile's sums (acc: every lane holds its warp's), each stored once:
 * store(row of the tile, t, value) by one lane of the row's warp. */
template <int NR, class Store>
__device__ __forceinline__ void acc_each(const float (&acc)[kRW][NR], Store store) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int r = 0; r < kRW; r++)
#pragma unroll
        for (int t = 0; t < NR; t++)
            if ((r * NR + t) % 32 == lane)
                store(warp * kRW + r, t, acc[r][t]);
}

/* acc -> a K slice's partial slot (kTile x kMaxT floats, [row][t]) */
template <int NR>
__device__ __forceinline__ void partial_put(const float (&acc)[kRW][NR], float *slot) {
    acc_each<NR>(acc, [&](int row, int t, float v) { slot[row * kMaxT + t] = v; });
}

/* acc -> ctl.fin[warp * 2 + r][t], for the whole CTA */
template <int NR>
__device__ __forceinline__ void acc_to_fin(const float (&acc)[kRW][NR], Ctl &ctl) {
    acc_each<NR>(acc, [&](int row, int t, float v) { ctl.fin[row][t] = v; });
    __syncthreads();
}

/* The sum of s slot values src[k * stride] (k < s) in slot order, 8 loads
 * in flight: a tile's or a head's K slices (split_reduce, head_sum). */
__device__ __forceinline__ float slots_sum(const float *src, int s, size_t stride) {
    float v = 0.0f;
    for (int k0 = 0; k0 < s; k0 += 8) {
        float pv[8];
#pragma unroll
        for (int k = 0; k < 8; k++)
            pv[k] = k0 + k < s ? __ldcg(src + (size_t)(k0 + k) * stride) : 0.0f;
#pragma unroll
        for (int k = 0; k < 8; k++)
            if (k0 + k < s)
                v += pv[k];
    }
    return v;
}

/* K slice `slice` of s of a tile: with s == 1 the sums go to ctl.fin; else
 * to the tile's partial slot, and the tile's last slice sums all slots in
 * slice order into ctl.fin. Returns true in the CTA holding ctl.fin. */
template <int NR>
__device__ bool split_reduce(const float (&acc)[kRW][NR], int s, int slice, int tile,
                             float *part, unsigned *tile_ctr, Ctl &ctl) {
    if (s == 1) {
        acc_to_fin<NR>(acc, ctl);
        return true;
    }
    partial_put<NR>(acc, part + ((size_t)tile * s + slice) * (kTile * kMaxT));
    if (!arrive(tile_ctr + tile, (unsigned)s, ctl))
        return false;
    for (int i = threadIdx.x; i < kTile * NR; i += kThreads) {
        int r = i / NR, t = i % NR;
        const float *src = part + (size_t)tile * s * (kTile * kMaxT) + r * kMaxT + t;
        ctl.fin[r][t] = slots_sum(src, s, kTile * kMaxT);
    }
    __syncthreads();
    return true;
}

/* The K range of slice `slice` of s (whole 1024-column chunks, as the stock
 * split-K GEMV cuts them). */
__device__ __forceinline__ void k_slice(int K, int s, int slice, int *k0, int *k1) {
    int chunks = (K + kKC - 1) / kKC;
    int ksl = (chunks + s - 1) / s * kKC;
    *k0 = min(K, slice * ksl);
    *k1 = min(K, *k0 + ksl);
}

/* rowp[t] = base + t * stride for the step's rows (before a GEMV: its first
 * barrier publishes them) */
__device__ __forceinline__ void set_rows(Ctl &ctl, const uint16_t *base, int64_t stride,
                                         int rows) {
    if ((int)threadIdx.x < rows)
        ctl.rowp[threadIdx.x] = base + (int64_t)threadIdx.x * stride;
}

/* ================================================================ norms */

/* One row: with add, residual = bf16(add + residual) (the addend: the bf16
 * row addp, or add8 giving 8 values of it when addp is null); out =
 * bf16(gemma_norm(residual) * (1 + w)). The stock add_rmsnorm arithmetic
 * (squares summed in double, each thread over its vectors v = tid, tid +
 * 128, ... in order, then the CTA's sum; the mean rounded once).
 *
 * Latency: the residual, the addend and the norm weight are copied into
 * shared memory (dsm: 3 x H bf16, which m3_cuda_mono_create sizes the
 * launch for) with cp.async, all in flight at once (one memory round trip
 * for the whole row), and both passes work from there. (A second path for
 * rows that did not fit, never taken at real widths, was removed: the code
 * the kernels carry costs time even where it does not run, docs/PERF.md,
 * eleventh session.) */
template <typename Add8>
__device__ void norm_row(const MonoArgs &a, Ctl &ctl, uint16_t *res, bool has_add,
                         const uint16_t *addp, Add8 add8, const uint16_t *w, uint16_t *out,
                         unsigned char *dsm) {
    const int nvec = a.H / 8;
    uint4 *rv = reinterpret_cast<uint4 *>(res);
    const uint4 *wv = reinterpret_cast<const uint4 *>(w);
    const uint4 *av = reinterpret_cast<const uint4 *>(addp);
    uint4 *ov = reinterpret_cast<uint4 *>(out);
    double ss = 0.0;
    uint4 *sr = reinterpret_cast<uint4 *>(dsm), *sw = sr + nvec, *sa = sw + nvec;
    for (int v = threadIdx.x; v < nvec; v += kThreads) {
        cp_async16(sr + v, rv + v, true);
        cp_async16(sw + v, wv + v, true);
        if (has_add && addp)
            cp_async16(sa + v, av + v, true);
    }
    cp_async_commit();
    cp_async_wait<0>();
    mark(); /* norm: thread 0's copies landed */
    /* each thread reads back only what it copied itself until the sum's
     * barriers */
    for (int v = threadIdx.x; v < nvec; v += kThreads) {
        float f[8];
        unpack8(sr[v], f);
        if (has_add) {
            float ad[8];
            if (addp)
                unpack8(sa[v], ad);
            else
                add8(v, ad);
#pragma unroll
            for (int j = 0; j < 8; j++)
                f[j] = m3_round_bf(__fadd_rn(ad[j], f[j]));
            uint4 r = pack8(f);
            sr[v] = r;
            rv[v] = r;
        }
#pragma unroll
        for (int j = 0; j < 8; j++)
            ss += (double)f[j] * (double)f[j];
    }
    ss = block_sum_d(ss, ctl);
    mark(); /* norm: the sum of squares */
    float ms = (float)(ss / (double)a.H);
    float rs = 1.0f / sqrtf(ms + a.eps);
    for (int v = threadIdx.x; v < nvec; v += kThreads) {
        float x[8], wf[8];
        unpack8(sr[v], x);
        unpack8(sw[v], wf);
#pragma unroll
        for (int j = 0; j < 8; j++)
            x[j] = __fmul_rn(__fmul_rn(x[j], rs), __fadd_rn(1.0f, wf[j]));
        ov[v] = pack8(x);
    }
    __syncthreads(); /* dsm is free again for the next item */
    mark(); /* norm: written */
}

} // namespace
} // namespace m3mono

#endif
