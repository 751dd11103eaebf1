/*
 * Which way of moving weights into an SM streams a one-row GEMV fastest?
 * Every GEMV of the decode step (the stock kernels and the mono path's
 * fused items alike) reads its weights at 45-61% of the measured DRAM
 * bandwidth (docs/PERF.md, eighth session), and a link of a dependent chain
 * with its weights read inside the link took 7 µs for 8.9 MB (1.3 TB/s;
 * dev/cuda/chain_latency.cu). This program streams one weight buffer,
 * split into contiguous pieces of 16 KB over the CTAs, through the product
 * with one activation row (the one-row GEMV's arithmetic: 8 bf16 per lane
 * and step, fp32 sums), in four ways:
 *   ld       registers: each lane loads 8 x 16 B of a piece, then the FMAs
 *            (the mono GEMV core's shape: 128 threads, 3 CTAs per SM);
 *   cpasync  a ring of S pieces in shared memory filled with 16-byte
 *            cp.async (commit group per piece);
 *   tma      the same ring filled with one bulk copy per piece
 *            (cp.async.bulk + mbarrier, the Hopper copy engine);
 *   tile...  the routed gate/up item's shape (8 rows of 12 KB, a chunk
 *            is 1,024 columns of every row): tile / tilec (the chunk's
 *            bytes as 8 rows' segments / one contiguous range), tileN and
 *            tmmaN (N activation rows' products on FMAs / tensor cores),
 *            tileg4 and tiled4 (the activations staged per chunk between
 *            barriers, as gemv_ring does; one buffer / two), and the same
 *            with the fused kernels' 72 KB of shared memory (suffix s);
 *   dwalk / gwalk  the fused kernels' per-warp rings (down_walk: 12 KB
 *            down tiles; gu_walk: 16 KB gate/up chunks), suffix s as above;
 *   copy     the read-bandwidth reference: every byte loaded once
 *            (grid-stride 16-byte streaming loads, 512 threads, 16 CTAs per
 *            SM, as m3's bench measures the floor's bandwidth).
 * For each: µs (median over runs, L2 flushed before each) and GB/s, for a
 * small buffer (one o_proj, 25 MB: the ramp and the tail matter) and a
 * large one (the routed experts of a 4-row step, ~300 MB). Every mode's
 * per-CTA sums are checked against a CPU reference (relative error 1e-3)
 * after the output was poisoned.
 *
 * STREAM_CORE_ONLY=mode,... runs only those modes (under a profiler).
 *
 *   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Isrc \
 *        dev/cuda/stream_core.cu -o /tmp/stream_core && /tmp/stream_core
 */
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "core/bf16.h"          /* the host's bf16 conversion (the reference) */
#include "cuda/cuda_async.cuh"  /* cp.async */
#include "cuda/cuda_common.cuh" /* bf16 unpack, warp sums */
#include "dev_util.h"           /* DEV_CK, DevRng, dev_median, DevL2Flush */

constexpr int kK = 6144;             /* the activation row (hidden size) */
constexpr int kPiece = 16384;        /* bytes per piece */
constexpr int kPieceEl = kPiece / 2; /* bf16 per piece */
constexpr int kMaxStages = 12;
constexpr int kFusedSmem = 73984; /* the mono kernels' dynamic shared memory per CTA (kAttnSmem) */

/* the tile modes' kernels: weights, items, x, per-CTA sums */
using ItemKernel = void (*)(const uint16_t *, long, const uint16_t *, float *);

/* the CTA's pieces [p0, p1) of n_pieces */
__device__ __forceinline__ void cta_range(long n_pieces, long *p0, long *p1) {
    *p0 = n_pieces * blockIdx.x / gridDim.x;
    *p1 = n_pieces * (blockIdx.x + 1) / gridDim.x;
}

/* x (kK bf16) into shared memory */
__device__ __forceinline__ void load_x(uint16_t *xs, const uint16_t *x) {
    for (int i = threadIdx.x; i < kK / 8; i += blockDim.x)
        reinterpret_cast<uint4 *>(xs)[i] = reinterpret_cast<const uint4 *>(x)[i];
    __syncthreads();
}

/* w (8 bf16 at element e of the buffer) . x */
__device__ __forceinline__ float dot8(uint4 wv, const uint16_t *xs, long e) {
    float wf[8], xf[8];
    unpack8(wv, wf);
    unpack8(*reinterpret_cast<const uint4 *>(xs + e % kK), xf);
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; j++)
        s += wf[j] * xf[j];
    return s;
}

__device__ __forceinline__ void cta_out(float acc, float *out) {
    __shared__ float red[32];
    acc = m3_warp_sum(acc);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0)
        red[warp] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        float s = 0.0f;
        for (int w = 0; w < (int)(blockDim.x >> 5); w++)
            s += red[w];
        out[blockIdx.x] = s;
    }
}

/* ld: the mono core's registers; a warp takes pieces in turn, 8 x 16 B per
 * lane in flight per step (4 steps per piece) */
__global__ void __launch_bounds__(128, 3)
    ld_kernel(const uint16_t *w, long n_pieces, const uint16_t *x, float *out) {
    extern __shared__ __align__(16) unsigned char smem[];
    uint16_t *xs = reinterpret_cast<uint16_t *>(smem);
    load_x(xs, x);
    long p0, p1;
    cta_range(n_pieces, &p0, &p1);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    float acc = 0.0f;
    for (long p = p0 + warp; p < p1; p += nw) {
        const uint4 *src = reinterpret_cast<const uint4 *>(w + p * kPieceEl);
#pragma unroll 1
        for (int step = 0; step < 4; step++) {
            uint4 v[8];
#pragma unroll
            for (int u = 0; u < 8; u++)
                v[u] = __ldg(src + step * 256 + u * 32 + lane);
#pragma unroll
            for (int u = 0; u < 8; u++)
                acc += dot8(v[u], xs, p * kPieceEl + (long)(step * 256 + u * 32 + lane) * 8);
        }
    }
    cta_out(acc, out);
}

/* tile / tilec: the routed gate/up item's shape. The buffer is a matrix of
 * rows of kK bf16; an item is 8 consecutive rows (6 pieces, 96 KB), a CTA
 * takes a contiguous range of items. tile reads an item as the mono GEMV
 * core does: chunk c is columns [c * 1024, c * 1024 + 1024) of all 8 rows,
 * warp w rows 2w and 2w + 1, each lane 4 x 16 B of each (8 x 16 B in
 * flight): 8 segments of 2 KB, 12 KB apart, per chunk. tilec reads the
 * same 16 KB per chunk as one contiguous range of the item. If tile streams
 * slower than tilec, the fused items' access pattern (not their loads in
 * flight) holds the routed experts' phase. */
template <bool CONTIG>
__global__ void __launch_bounds__(128, 3)
    tile_kernel(const uint16_t *w, long n_items, const uint16_t *x, float *out) {
    extern __shared__ __align__(16) unsigned char smem[];
    uint16_t *xs = reinterpret_cast<uint16_t *>(smem);
    load_x(xs, x);
    long i0, i1;
    cta_range(n_items, &i0, &i1);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float acc = 0.0f;
    for (long it = i0; it < i1; it++) {
        const long base = it * 8 * kK; /* the item's first element */
#pragma unroll 1
        for (int c = 0; c < kK / 1024; c++) {
            long e[8];
#pragma unroll
            for (int v = 0; v < 8; v++) {
                if (CONTIG)
                    e[v] = base + (long)c * 8192 + (warp * 8 + v) * 256 + lane * 8;
                else
                    e[v] = base + (long)(warp * 2 + (v >> 2)) * kK + c * 1024 + (v & 3) * 256 +
                           lane * 8;
            }
            uint4 vv[8];
#pragma unroll
            for (int v = 0; v < 8; v++)
                vv[v] = __ldg(reinterpret_cast<const uint4 *>(w + e[v]));
#pragma unroll
            for (int v = 0; v < 8; v++)
                acc += dot8(vv[v], xs, e[v]);
        }
    }
    cta_out(acc, out);
}

/* rows activation rows into shared memory (cp.async; a load-store loop
 * measured the same), row t at xs + t * (kK + XPAD) (XPAD 32: a quarter
 * warp's 16-byte loads of 4 rows in distinct banks, which 12 KB apart
 * conflict 4-way). x: one row, staged rows times; PRIV: rows rows for
 * each CTA (x + blockIdx.x * rows * kK), so no line is read by every CTA. */
template <int XPAD, bool PRIV>
__device__ __forceinline__ void stage_rows(uint16_t *xs, const uint16_t *x, int rows) {
    if (PRIV)
        x += (size_t)blockIdx.x * rows * kK;
    for (int i = threadIdx.x; i < rows * kK / 8; i += blockDim.x)
        cp_async16(reinterpret_cast<uint4 *>(xs + (i / (kK / 8)) * XPAD) + i,
                   reinterpret_cast<const uint4 *>(x) + (PRIV ? i : i % (kK / 8)), true);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
}

/* One chunk's products of a lane's two weight rows (vv[r][u]: 8 bf16 at
 * column u * 256 + lane * 8 of the chunk) with NR activation rows (row t
 * at x + t * stride, the chunk's first column at x), as piece_fma: each
 * row's 8 activations unpacked once per piece, shared by both weight rows. */
template <int NR>
__device__ __forceinline__ void chunk_fma_nr(float (&acc)[2][NR], const uint4 (&vv)[2][4],
                                             const uint16_t *x, int stride, int lane) {
#pragma unroll
    for (int u = 0; u < 4; u++) {
        const int k = u * 256 + lane * 8;
        float wf[2][8];
        unpack8(vv[0][u], wf[0]);
        unpack8(vv[1][u], wf[1]);
#pragma unroll
        for (int t = 0; t < NR; t++) {
            float xf[8];
            unpack8(*reinterpret_cast<const uint4 *>(x + t * stride + k), xf);
#pragma unroll
            for (int r = 0; r < 2; r++)
#pragma unroll
                for (int jj = 0; jj < 8; jj++)
                    acc[r][t] += wf[r][jj] * xf[jj];
        }
    }
}

template <int NR>
__device__ __forceinline__ float acc_total(const float (&acc)[2][NR]) {
    float s = 0.0f;
#pragma unroll
    for (int r = 0; r < 2; r++)
#pragma unroll
        for (int t = 0; t < NR; t++)
            s += acc[r][t];
    return s;
}

/* tileN: tile's reads with the mono core's products for NR activation
 * rows (piece_fma's shape: a lane's two weight rows share each row's 8
 * activations, unpacked once per piece and row; 2 x NR sums), the rows
 * staged whole in shared memory (NR copies of x: the CTA's sum is NR times
 * tile's). tile4 against tile1: what 4 rows' products and 48 KB staged
 * cost together (tmma1xN takes the staging apart). PIPE (tilep4): the
 * next chunk's loads issued before this chunk's products. */
template <int NR, bool PIPE = false>
__global__ void __launch_bounds__(128, 3)
    tile_nr_kernel(const uint16_t *w, long n_items, const uint16_t *x, float *out) {
    extern __shared__ __align__(16) unsigned char smem[];
    uint16_t *xs = reinterpret_cast<uint16_t *>(smem);
    stage_rows<0, false>(xs, x, NR);
    long i0, i1;
    cta_range(n_items, &i0, &i1);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float acc[2][NR] = {};
    const long n_ch = (i1 - i0) * (kK / 1024);
    auto load = [&](long j, uint4 (&vv)[2][4]) {
        const long it = i0 + j / (kK / 1024);
        const int c = (int)(j % (kK / 1024));
        const uint16_t *rows = w + it * 8 * kK + (long)warp * 2 * kK;
#pragma unroll
        for (int r = 0; r < 2; r++)
#pragma unroll
            for (int u = 0; u < 4; u++)
                vv[r][u] = __ldg(reinterpret_cast<const uint4 *>(rows + (long)r * kK + c * 1024 +
                                                                 u * 256 + lane * 8));
    };
    uint4 nx[2][4];
    if (PIPE && n_ch > 0)
        load(0, nx);
#pragma unroll 1
    for (long j = 0; j < n_ch; j++) {
        uint4 vv[2][4];
        if (PIPE) {
#pragma unroll
            for (int r = 0; r < 2; r++)
#pragma unroll
                for (int u = 0; u < 4; u++)
                    vv[r][u] = nx[r][u];
            if (j + 1 < n_ch)
                load(j + 1, nx);
        } else {
            load(j, vv);
        }
        const int c = (int)(j % (kK / 1024));
        chunk_fma_nr<NR>(acc, vv, xs + c * 1024, kK, lane);
    }
    cta_out(acc_total<NR>(acc), out);
}

/* a weight load that allocates no L1 line (NOALLOC modes) */
__device__ __forceinline__ uint4 ld_noalloc(const void *p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

/* tmmaN: the same item and chunk bytes on tensor cores (mma m16n8k16,
 * bf16 in, fp32 sums): the activations are A (the step's rows as m, the
 * rest zero), the item's 8 weight rows B (n); each warp takes a quarter of
 * every chunk's columns of all 8 rows, each lane 8 columns of its row g per
 * 16-byte load (the two MMAs' k order permuted alike in A and B). The
 * warps' partial sums would need one cross-warp sum per item. STAGE rows
 * are staged (tmma1xN: more than the products read), PRIV and XPAD as
 * stage_rows, NOALLOC: the weights through ld_noalloc. */

template <int NR, int XPAD = 0, int STAGE = NR, bool PRIV = false, bool NOALLOC = false>
__global__ void __launch_bounds__(128, 3)
    tile_mma_kernel(const uint16_t *w, long n_items, const uint16_t *x, float *out) {
    extern __shared__ __align__(16) unsigned char smem[];
    uint16_t *xs = reinterpret_cast<uint16_t *>(smem);
    stage_rows<XPAD, PRIV>(xs, x, STAGE);
    long i0, i1;
    cta_range(n_items, &i0, &i1);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, cq = lane & 3;
    float d[8][4] = {}; /* one accumulator per load: no chain of dependent MMAs */
    const uint16_t *xrow = xs + (size_t)(g < NR ? g : 0) * (kK + XPAD);
    for (long it = i0; it < i1; it++) {
        const uint16_t *row = w + (it * 8 + g) * kK;
#pragma unroll 1
        for (int c = 0; c < kK / 1024; c++) {
            const int kb = c * 1024 + warp * 256 + cq * 8;
            uint4 vv[8];
#pragma unroll
            for (int v = 0; v < 8; v++)
                vv[v] = NOALLOC ? ld_noalloc(row + kb + v * 32)
                                : __ldg(reinterpret_cast<const uint4 *>(row + kb + v * 32));
#pragma unroll
            for (int v = 0; v < 8; v++) {
                uint4 xv = make_uint4(0, 0, 0, 0);
                if (g < NR)
                    xv = *reinterpret_cast<const uint4 *>(xrow + kb + v * 32);
                const uint32_t a0[4] = {xv.x, 0u, xv.y, 0u}, a1[4] = {xv.z, 0u, xv.w, 0u};
                mma_bf16(d[v], a0, vv[v].x, vv[v].y);
                mma_bf16(d[v], a1, vv[v].z, vv[v].w);
            }
        }
    }
    float sum = 0.0f;
#pragma unroll
    for (int v = 0; v < 8; v++)
        sum += d[v][0] + d[v][1];
    cta_out(g < NR ? sum : 0.0f, out);
}

/* tileg4: tile4's products with the fused items' staging: the CTA stages
 * each chunk's 4 activation rows (4 x 2 KB, one 16-byte load per thread
 * and row, from global memory: L2) into shared memory between two
 * barriers, the next chunk's loaded into registers before this chunk's
 * products (gemv_ring's order). Against tile4 (x staged once): what the
 * per-chunk activations and barriers cost the stream. */
template <bool DBL>
__global__ void __launch_bounds__(128, 3)
    tile_stage_kernel(const uint16_t *w, long n_items, const uint16_t *x, float *out) {
    constexpr int NR = 4;
    /* DBL: two chunk buffers, one barrier a chunk (chunk j's buffer was
     * last read in chunk j - 2's products, before chunk j - 1's barrier) */
    __shared__ __align__(16) uint16_t xs2[2][NR * 1024];
    long i0, i1;
    cta_range(n_items, &i0, &i1);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float acc[2][NR] = {};
    const long n_ch = (i1 - i0) * (kK / 1024);
    uint4 xn[NR];
    auto xload = [&](long j) {
        const int c = (int)(j % (kK / 1024));
#pragma unroll
        for (int t = 0; t < NR; t++) /* row t: x again (the real rows differ per expert) */
            xn[t] = __ldcg(reinterpret_cast<const uint4 *>(x + c * 1024 + threadIdx.x * 8));
    };
    if (n_ch > 0)
        xload(0);
#pragma unroll 1
    for (long j = 0; j < n_ch; j++) {
        const long it = i0 + j / (kK / 1024);
        const int c = (int)(j % (kK / 1024));
        const uint16_t *rows = w + it * 8 * kK + (long)warp * 2 * kK;
        uint4 vv[2][4];
#pragma unroll
        for (int r = 0; r < 2; r++)
#pragma unroll
            for (int u = 0; u < 4; u++)
                vv[r][u] = __ldg(reinterpret_cast<const uint4 *>(rows + (long)r * kK + c * 1024 +
                                                                 u * 256 + lane * 8));
        uint16_t *xs = xs2[DBL ? (int)(j & 1) : 0];
        if (!DBL)
            __syncthreads(); /* the last chunk's xs consumed */
#pragma unroll
        for (int t = 0; t < NR; t++)
            reinterpret_cast<uint4 *>(xs + t * 1024)[threadIdx.x] = xn[t];
        __syncthreads();
        if (j + 1 < n_ch)
            xload(j + 1);
        chunk_fma_nr<NR>(acc, vv, xs, 1024, lane);
    }
    cta_out(acc_total<NR>(acc), out);
}

/* dwalk / gwalk: the fused kernels' per-warp weight ring (mono
 * down_walk / gu_walk): each warp copies its own 2 rows' pieces of a step
 * into its part of a 16 KB slot with 16-byte cp.async (ring_issue's layout:
 * 4 pieces a row and lane, those past the step's columns zero-filled), S -
 * 1 steps ahead, and reads back only what it copied (no barrier). A step
 * is 8 rows of ROWLEN 768 (a routed down tile: 12 KB) or the 1,024 columns
 * of a chunk of 8 rows of ROWLEN 6,144 (a gate/up chunk: 16 KB); an item
 * is 96 KB (8 down tiles, 6 gate/up chunks); the warp sums after every
 * down tile (down_walk) and after an item's 6 chunks (gu_walk's tile). Do
 * the two shapes stream alike? In the layer the down items read 7.7 GB/s
 * a CTA and the walked gate/up 9.65 (docs/PERF.md, thirty-first session).
 * x is staged whole; element e of the buffer is multiplied by x[e % kK],
 * as in every mode. */
template <int ROWLEN, int S>
__global__ void __launch_bounds__(128, 3)
    walk_kernel(const uint16_t *w, long n_items, const uint16_t *x, float *out) {
    static_assert(ROWLEN == 768 || ROWLEN == kK, "a down tile or a gate/up chunk");
    static_assert(S == 3, "the waits below");
    extern __shared__ __align__(16) unsigned char smem[];
    uint16_t *xs = reinterpret_cast<uint16_t *>(smem);
    uint4 *ring = reinterpret_cast<uint4 *>(smem + kK * 2);
    constexpr int KN = ROWLEN < 1024 ? ROWLEN : 1024; /* columns a step */
    constexpr int STEPS = ROWLEN == 768 ? 8 : 6;      /* steps an item */
    constexpr int SUMS = ROWLEN == 768 ? 1 : 6;       /* steps between warp sums */
    constexpr int SLOT = kPiece / 16;                 /* uint4 a slot */
    stage_rows<0, false>(xs, x, 1);
    long i0, i1;
    cta_range(n_items, &i0, &i1);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    uint4 *mine = ring + warp * (2 * 4 * 32) + lane;
    const long n_steps = (i1 - i0) * STEPS;
    auto first = [&](long j, long *r0, int *c0) { /* this warp's rows, the step's column */
        const long it = i0 + j / STEPS;
        const int st = (int)(j % STEPS);
        *r0 = ROWLEN == 768 ? it * 64 + st * 8 + warp * 2 : it * 8 + warp * 2;
        *c0 = ROWLEN == 768 ? 0 : st * 1024;
    };
    auto issue = [&](long j) {
        long r0;
        int c0;
        first(j, &r0, &c0);
        uint4 *dst = mine + (j % S) * SLOT;
#pragma unroll
        for (int r = 0; r < 2; r++)
#pragma unroll
            for (int u = 0; u < 4; u++) {
                const int k = lane * 8 + u * 256;
                const bool ok = k < KN;
                cp_async16(dst + (r * 4 + u) * 32, ok ? w + (r0 + r) * ROWLEN + c0 + k : w, ok);
            }
        cp_async_commit();
    };
    for (long j = 0; j < S - 1 && j < n_steps; j++)
        issue(j);
    float acc[2] = {0.0f, 0.0f}, total = 0.0f;
#pragma unroll 1
    for (long j = 0; j < n_steps; j++) {
        if (j + S - 1 < n_steps)
            issue(j + S - 1); /* its slot held step j - 1, read in the last pass */
        ring_wait((int)min(n_steps - 1 - j, (long)S - 1));
        long r0;
        int c0;
        first(j, &r0, &c0);
        const uint4 *src = mine + (j % S) * SLOT;
        uint4 v[2][4];
#pragma unroll
        for (int r = 0; r < 2; r++)
#pragma unroll
            for (int u = 0; u < 4; u++)
                v[r][u] = src[(r * 4 + u) * 32];
#pragma unroll
        for (int r = 0; r < 2; r++)
#pragma unroll
            for (int u = 0; u < 4; u++) {
                const int k = lane * 8 + u * 256;
                if (k < KN)
                    acc[r] += dot8(v[r][u], xs, (r0 + r) * ROWLEN + c0 + k);
            }
        if ((j + 1) % SUMS == 0) {
#pragma unroll
            for (int r = 0; r < 2; r++) {
                const float ws = m3_warp_sum(acc[r]); /* as down_walk's outputs */
                total += lane == 0 ? ws : 0.0f;
                acc[r] = 0.0f;
            }
        }
    }
    cta_out(total, out);
}

/* the product of one staged piece (shared memory) */
__device__ __forceinline__ float piece_dot(const uint16_t *st, const uint16_t *xs, long e0) {
    float acc = 0.0f;
    for (int i = threadIdx.x; i < kPieceEl / 8; i += blockDim.x)
        acc += dot8(reinterpret_cast<const uint4 *>(st)[i], xs, e0 + (long)i * 8);
    return acc;
}

/* cpasync: a ring of S pieces filled with 16-byte cp.async, one commit
 * group per piece; the wait is for the oldest group only (S - 1 stay in
 * flight; wait_group takes an immediate, so one instance per S) */
template <int S>
__global__ void cpasync_ring_kernel(const uint16_t *w, long n_pieces, const uint16_t *x,
                                    float *out) {
    extern __shared__ __align__(16) unsigned char smem[];
    uint16_t *xs = reinterpret_cast<uint16_t *>(smem);
    unsigned char *ring = smem + kK * 2;
    long p0, p1;
    cta_range(n_pieces, &p0, &p1);
    auto issue = [&](long p) {
        if (p < p1) {
            const unsigned char *src = reinterpret_cast<const unsigned char *>(w + p * kPieceEl);
            unsigned char *dst = ring + (size_t)((p - p0) % S) * kPiece;
            for (int i = threadIdx.x; i < kPiece / 16; i += blockDim.x)
                cp_async16(dst + i * 16, src + i * 16, true);
        }
        cp_async_commit();
    };
    for (int s = 0; s < S; s++)
        issue(p0 + s);
    load_x(xs, x);
    float acc = 0.0f;
    for (long p = p0; p < p1; p++) {
        cp_async_wait<S - 1>();
        __syncthreads();
        acc += piece_dot(reinterpret_cast<const uint16_t *>(ring + (size_t)((p - p0) % S) * kPiece),
                         xs, p * kPieceEl);
        __syncthreads();
        issue(p + S);
    }
    cp_async_wait<0>();
    cta_out(acc, out);
}

/* ---- TMA: cp.async.bulk into shared memory, completion on an mbarrier ---- */

__device__ __forceinline__ void mbar_init(uint64_t *bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count)
                 : "memory");
}

__device__ __forceinline__ void mbar_expect_tx(uint64_t *bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)),
                 "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ void bulk_g2s(void *dst, const void *src, unsigned bytes,
                                         uint64_t *bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], "
                 "%2, [%3];" ::"r"(smem_u32(dst)),
                 "l"(src), "r"(bytes), "r"(smem_u32(bar))
                 : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t *bar, unsigned parity) {
    asm volatile("{\n .reg .pred p;\n W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
                 " @!p bra W;\n}" ::"r"(smem_u32(bar)),
                 "r"(parity)
                 : "memory");
}

__global__ void tma_kernel(const uint16_t *w, long n_pieces, const uint16_t *x, float *out, int S) {
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ __align__(8) uint64_t bars[kMaxStages];
    uint16_t *xs = reinterpret_cast<uint16_t *>(smem);
    unsigned char *ring = smem + kK * 2;
    long p0, p1;
    cta_range(n_pieces, &p0, &p1);
    if (threadIdx.x == 0) {
        for (int s = 0; s < S; s++)
            mbar_init(&bars[s], 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    auto issue = [&](long p) { /* thread 0 */
                               if (p < p1) {
                                   int s = (int)((p - p0) % S);
                                   mbar_expect_tx(&bars[s], kPiece);
                                   bulk_g2s(ring + (size_t)s * kPiece, w + p * kPieceEl, kPiece,
                                            &bars[s]);
                               }
    };
    if (threadIdx.x == 0)
        for (int s = 0; s < S; s++)
            issue(p0 + s);
    load_x(xs, x);
    float acc = 0.0f;
    for (long p = p0; p < p1; p++) {
        const long i = p - p0;
        const int s = (int)(i % S);
        mbar_wait(&bars[s], (unsigned)((i / S) & 1));
        acc += piece_dot(reinterpret_cast<const uint16_t *>(ring + (size_t)s * kPiece), xs,
                         p * kPieceEl);
        __syncthreads(); /* every thread is done with slot s */
        if (threadIdx.x == 0)
            issue(p + S);
    }
    cta_out(acc, out);
}

/* copy: every 16 bytes loaded once, streaming (the floor's bandwidth) */
__global__ void copy_kernel(const uint4 *w, long n16, float *out) {
    uint32_t acc = 0;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n16;
         i += (long)gridDim.x * blockDim.x) {
        uint4 v = __ldcs(w + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x12345678u) /* never in practice; keeps the loads */
        out[0] = 1.0f;
}

struct Result {
    double us, gbs;
    bool ok;
};

int main(int argc, char **argv) {
    int runs = 15;
    if (!dev_runs_arg(argc, argv, "stream_core", &runs))
        return 2;
    cudaDeviceProp prop;
    DEV_CK(cudaGetDeviceProperties(&prop, 0));
    const int sms = prop.multiProcessorCount;
    const size_t sizes[2] = {(size_t)1536 * kPiece, (size_t)18432 * kPiece}; /* 25, 302 MB */
    const size_t max_bytes = sizes[1];
    /* weights ~ U(-1, 1), x ~ U(-1, 1): bf16 */
    std::vector<uint16_t> hw(max_bytes / 2), hx(kK);
    DevRng rng(0x5eedull);
    for (auto &v : hw)
        v = m3_f32_to_bf16(rng.uniform());
    for (auto &v : hx)
        v = m3_f32_to_bf16(rng.uniform());
    uint16_t *dw, *dx;
    float *dout;
    DEV_CK(cudaMalloc(&dw, max_bytes));
    DEV_CK(cudaMalloc(&dx, kK * 2));
    DEV_CK(cudaMalloc(&dout, 4096 * sizeof(float)));
    DEV_CK(cudaMemcpy(dw, hw.data(), max_bytes, cudaMemcpyHostToDevice));
    DEV_CK(cudaMemcpy(dx, hx.data(), kK * 2, cudaMemcpyHostToDevice));
    /* x again, 4 rows for each of up to 3 CTAs per SM (tmma1x4p) */
    uint16_t *dxp;
    const size_t xp_rows = (size_t)sms * 3 * 4;
    DEV_CK(cudaMalloc(&dxp, xp_rows * kK * 2));
    for (size_t r = 0; r < xp_rows; r++)
        DEV_CK(cudaMemcpy(dxp + r * kK, hx.data(), kK * 2, cudaMemcpyHostToDevice));
    DevL2Flush l2(prop); /* every timed run starts cold */
    DevTimer timer;

    printf("stream_core: %s, %d SMs, %.0f MB L2; pieces of %d KB; median of %d runs, L2 "
           "flushed before each\n",
           prop.name, sms, prop.l2CacheSize / 1e6, kPiece / 1024, runs);
    printf("| mode | CTAs x threads | stages (KB per CTA) | MB | µs | GB/s | check |\n"
           "|---|---|---|---|---|---|---|\n");
    int status = 0;
    for (size_t bytes : sizes) {
        const long n_pieces = (long)(bytes / kPiece);
        /* CPU reference per CTA count: sum over the CTA's pieces */
        std::vector<double> elem_dot(n_pieces);
        for (long p = 0; p < n_pieces; p++) {
            double d = 0.0;
            for (long e = p * kPieceEl; e < (p + 1) * kPieceEl; e++)
                d += (double)m3_bf16_to_f32(hw[e]) * m3_bf16_to_f32(hx[e % kK]);
            elem_dot[p] = d;
        }
        /* item: a tile mode's kernel (all take the weights, the item count,
         * x and the per-CTA sums), launched with smem bytes of dynamic
         * shared memory; its reference is rows times the CTA's items' dot
         * products (rows copies of x); priv: x from dxp, a copy per CTA.
         * smem without item: the cpasync ring in that much shared memory. */
        struct Cfg {
            const char *mode;
            int ctas, threads, stages;
            ItemKernel item;
            int smem, rows;
            bool priv;
        };
        auto tile = [&](const char *m, ItemKernel k, int smem, int rows, bool priv = false) {
            return Cfg{m, sms * 3, 128, 0, k, smem, rows, priv};
        };
        const int x1 = kK * 2; /* one staged row's bytes */
        const Cfg cfgs[] = {
            {"copy", sms * 16, 512, 0}, {"ld", sms * 3, 128, 0},  {"cpasync", sms * 3, 128, 3},
            {"cpasync", sms, 256, 12},  {"tma", sms * 3, 128, 2}, {"tma", sms * 3, 128, 3},
            {"tma", sms, 256, 6},       {"tma", sms, 256, 12},
            tile("tile", tile_kernel<false>, x1, 1),
            tile("tilec", tile_kernel<true>, x1, 1),
            tile("tile1", tile_nr_kernel<1>, x1, 1),
            tile("tile2", tile_nr_kernel<2>, 2 * x1, 2),
            tile("tile4", tile_nr_kernel<4>, 4 * x1, 4),
            tile("tmma1", tile_mma_kernel<1>, x1, 1),
            tile("tmma4", tile_mma_kernel<4>, 4 * x1, 4),
            tile("tilep4", tile_nr_kernel<4, true>, 4 * x1, 4),
            tile("tmmap4", tile_mma_kernel<4, 32>, 4 * (kK + 32) * 2, 4),
            /* the fused kernels' shared memory per CTA (72 KB: 3 CTAs leave
             * the SM ~23 KB of L1, ncu's carve-out of 233 KB) */
            tile("tile1s", tile_nr_kernel<1>, kFusedSmem, 1),
            tile("tile4s", tile_nr_kernel<4>, kFusedSmem, 4),
            tile("tmma4s", tile_mma_kernel<4>, kFusedSmem, 4),
            {"cpasyncs", sms * 3, 128, 3, nullptr, kFusedSmem},
            /* one row's products with 4 / 2 / 3 rows staged, 4 from a copy
             * per CTA */
            tile("tmma1x4", tile_mma_kernel<1, 0, 4>, 4 * x1, 1),
            tile("tmma1x2", tile_mma_kernel<1, 0, 2>, 2 * x1, 1),
            tile("tmma1x3", tile_mma_kernel<1, 0, 3>, 3 * x1, 1),
            tile("tmma1x4p", tile_mma_kernel<1, 0, 4, true>, 4 * x1, 1, true),
            /* the weights' loads allocating no L1 line: 1 / 4 rows staged */
            tile("tmma1n", tile_mma_kernel<1, 0, 1, false, true>, x1, 1),
            tile("tmma1x4n", tile_mma_kernel<1, 0, 4, false, true>, 4 * x1, 1),
            tile("tileg4", tile_stage_kernel<false>, 0, 4),
            tile("tiled4", tile_stage_kernel<true>, 0, 4),
            /* the fused kernels' per-warp rings: down tiles / gate/up
             * chunks, in 60 KB (x and three slots) and in the fused 72 KB */
            tile("dwalk", walk_kernel<768, 3>, x1 + 3 * kPiece, 1),
            tile("gwalk", walk_kernel<kK, 3>, x1 + 3 * kPiece, 1),
            tile("dwalks", walk_kernel<768, 3>, kFusedSmem, 1),
            tile("gwalks", walk_kernel<kK, 3>, kFusedSmem, 1),
        };
        /* STREAM_CORE_ONLY=mode[,mode...]: only those modes (for a profiler) */
        const char *only = getenv("STREAM_CORE_ONLY");
        for (const Cfg &c : cfgs) {
            if (only) {
                std::string list = std::string(",") + only + ",";
                if (list.find(std::string(",") + c.mode + ",") == std::string::npos)
                    continue;
            }
            const size_t smem =
                c.smem ? c.smem : c.stages ? kK * 2 + (size_t)c.stages * kPiece : kK * 2;
            if (c.item)
                DEV_CK(cudaFuncSetAttribute((const void *)c.item,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            (int)smem));
            std::vector<double> us;
            for (int run = 0; run < runs; run++) {
                l2.flush(run);
                DEV_CK(cudaMemset(dout, 0xff, 4096 * sizeof(float))); /* poison: NaN */
                timer.start();
                if (c.item) {
                    c.item<<<c.ctas, c.threads, smem>>>(dw, n_pieces / 6, c.priv ? dxp : dx,
                                                        dout);
                } else if (!strcmp(c.mode, "copy")) {
                    copy_kernel<<<c.ctas, c.threads>>>(reinterpret_cast<const uint4 *>(dw),
                                                       (long)(bytes / 16), dout);
                } else if (!strcmp(c.mode, "ld")) {
                    ld_kernel<<<c.ctas, c.threads, smem>>>(dw, n_pieces, dx, dout);
                } else if (!strncmp(c.mode, "cpasync", 7)) {
                    if (c.stages == 3) {
                        DEV_CK(cudaFuncSetAttribute(cpasync_ring_kernel<3>,
                                                    cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                    (int)smem));
                        cpasync_ring_kernel<3><<<c.ctas, c.threads, smem>>>(dw, n_pieces, dx, dout);
                    } else {
                        DEV_CK(cudaFuncSetAttribute(cpasync_ring_kernel<12>,
                                                    cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                    (int)smem));
                        cpasync_ring_kernel<12>
                            <<<c.ctas, c.threads, smem>>>(dw, n_pieces, dx, dout);
                    }
                } else {
                    DEV_CK(cudaFuncSetAttribute(
                        tma_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
                    tma_kernel<<<c.ctas, c.threads, smem>>>(dw, n_pieces, dx, dout, c.stages);
                }
                us.push_back(timer.stop_us());
            }
            bool ok = true;
            if (strcmp(c.mode, "copy") != 0) {
                std::vector<float> got(c.ctas);
                DEV_CK(
                    cudaMemcpy(got.data(), dout, c.ctas * sizeof(float), cudaMemcpyDeviceToHost));
                const bool items = c.item != nullptr; /* 6 pieces an item */
                const long units = items ? n_pieces / 6 : n_pieces, per = items ? 6 : 1;
                for (int b = 0; b < c.ctas && ok; b++) {
                    long p0 = units * b / c.ctas * per, p1 = units * (b + 1) / c.ctas * per;
                    double ref = 0.0, mag = 0.0;
                    for (long p = p0; p < p1; p++)
                        ref += elem_dot[p], mag += fabs(elem_dot[p]);
                    /* fp32 sums of ~10^5 products of O(1) values */
                    if (items) { /* rows copies of x */
                        ref *= c.rows;
                        mag *= c.rows;
                    }
                    double tol = 1e-3 * (mag + 1.0) + 1e-2;
                    ok = std::isfinite(got[b]) && fabs(got[b] - ref) <= tol;
                    if (!ok)
                        fprintf(stderr, "stream_core: %s S=%d CTA %d: %g, reference %g\n", c.mode,
                                c.stages, b, got[b], ref);
                }
                if (!ok)
                    status = 1;
            }
            const double med = dev_median(us);
            char st[32] = "-";
            if (c.stages)
                snprintf(st, sizeof st, "%d (%d)", c.stages, c.stages * kPiece / 1024);
            printf("| %s | %d x %d | %s | %.1f | %.2f | %.0f | %s |\n", c.mode, c.ctas, c.threads,
                   st, bytes / 1e6, med, bytes / med / 1e3,
                   strcmp(c.mode, "copy") ? (ok ? "ok" : "FAIL") : "-");
        }
    }
    return status;
}
