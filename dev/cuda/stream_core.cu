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
 *   copy     the read-bandwidth reference: every byte loaded once
 *            (grid-stride 16-byte streaming loads, 512 threads, 16 CTAs per
 *            SM, as m3's bench measures the floor's bandwidth).
 * For each: µs (median over runs, L2 flushed before each) and GB/s, for a
 * small buffer (one o_proj, 25 MB: the ramp and the tail matter) and a
 * large one (the routed experts of a 4-row step, ~300 MB). Every mode's
 * per-CTA sums are checked against a CPU reference (relative error 1e-3)
 * after the output was poisoned.
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
#include <vector>

#include "core/bf16.h"          /* the host's bf16 conversion (the reference) */
#include "cuda/cuda_async.cuh"  /* cp.async */
#include "cuda/cuda_common.cuh" /* bf16 unpack, warp sums */
#include "dev_util.h"           /* DEV_CK, DevRng, dev_median, DevL2Flush */

constexpr int kK = 6144;             /* the activation row (hidden size) */
constexpr int kPiece = 16384;        /* bytes per piece */
constexpr int kPieceEl = kPiece / 2; /* bf16 per piece */
constexpr int kMaxStages = 12;

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
        struct Cfg {
            const char *mode;
            int ctas, threads, stages;
        };
        const Cfg cfgs[] = {
            {"copy", sms * 16, 512, 0}, {"ld", sms * 3, 128, 0},  {"cpasync", sms * 3, 128, 3},
            {"cpasync", sms, 256, 12},  {"tma", sms * 3, 128, 2}, {"tma", sms * 3, 128, 3},
            {"tma", sms, 256, 6},       {"tma", sms, 256, 12},
        };
        for (const Cfg &c : cfgs) {
            const size_t smem = c.stages ? kK * 2 + (size_t)c.stages * kPiece : kK * 2;
            std::vector<double> us;
            for (int run = 0; run < runs; run++) {
                l2.flush(run);
                DEV_CK(cudaMemset(dout, 0xff, 4096 * sizeof(float))); /* poison: NaN */
                timer.start();
                if (!strcmp(c.mode, "copy")) {
                    copy_kernel<<<c.ctas, c.threads>>>(reinterpret_cast<const uint4 *>(dw),
                                                       (long)(bytes / 16), dout);
                } else if (!strcmp(c.mode, "ld")) {
                    ld_kernel<<<c.ctas, c.threads, smem>>>(dw, n_pieces, dx, dout);
                } else if (!strcmp(c.mode, "cpasync")) {
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
                for (int b = 0; b < c.ctas && ok; b++) {
                    long p0 = n_pieces * b / c.ctas, p1 = n_pieces * (b + 1) / c.ctas;
                    double ref = 0.0, mag = 0.0;
                    for (long p = p0; p < p1; p++)
                        ref += elem_dot[p], mag += fabs(elem_dot[p]);
                    /* fp32 sums of ~10^5 products of O(1) values */
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
