/*
 * How long is one link of a chain of dependent GEMVs inside one persistent
 * kernel, with the weights streamed from memory when the link starts, or
 * already in shared memory? The fused decode kernels (src/cuda/cuda_mono*)
 * spend most of a one-row step on such a chain (selection -> attention ->
 * o_proj -> norm -> router -> plan: ~90 µs, docs/PERF.md, eighth session),
 * and the structure proposed there holds the weights that do not depend on
 * the step's data in shared memory, loaded when the kernel starts, so that
 * a link costs one activation read, the products and the signal. This
 * program measures that link cost on its own, before anything is built on
 * it (a llm.c dev/cuda style experiment: one file, its CPU reference, a
 * main that checks and times).
 *
 * The chain: x_0 = a random bf16 vector of N values; x_{p+1} = bf16(W_p x_p)
 * for p = 0 .. phases-1, every W_p N x N bf16. One CTA per SM owns R rows of
 * every W_p (N = SMs x R). A link: wait until every CTA has published x_p
 * (a counter, release / acquire), read x_p (N bf16) into shared memory, the
 * CTA's R dot products (fp32, one warp per row at a time), write its R
 * values of x_{p+1}, publish (fence + atomic). Modes:
 *   sync    the links' waits and signals only (no reads, no products);
 *   global  W_p read from global memory inside link p;
 *   l2      the same, after every W_p was asked into L2 when the kernel
 *           started (cp.async.bulk.prefetch.L2);
 *   smem    every CTA copies its rows of every W_p into shared memory when
 *           the kernel starts (cp.async, one commit group per phase; link p
 *           waits for its group only), and link p reads them from there.
 * Reported (medians over runs, L2 flushed before each): the first link
 * (which in the smem and l2 modes includes the weights' arrival), the
 * later links (CTA 0's global timer between seeing one x complete and the
 * next), and the whole kernel. The last x is checked against a
 * CPU reference (relative L2 <= 1e-2; outputs poisoned with NaN first).
 *
 *   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Isrc \
 *        dev/cuda/chain_latency.cu -o /tmp/chain_latency
 *   /tmp/chain_latency [--rows-per-cta 16] [--phases 3] [--runs 20]
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
#include "cuda/cuda_async.cuh"  /* cp.async, counter loads, the global timer */
#include "cuda/cuda_common.cuh" /* bf16 conversion, unpack8, warp sums */
#include "dev_util.h"           /* DEV_CK, DevRng, dev_median, DevL2Flush */

constexpr int kThreads = 256, kWarps = kThreads / 32, kMaxPhases = 8;
enum Mode { SYNC = 0, GLOBAL, L2, SMEM, N_MODES };
static const char *kModeName[N_MODES] = {"sync", "global", "l2", "smem"};

struct Args {
    const uint16_t *w;          /* [phases][N][N] bf16 */
    uint16_t *x;                /* [phases + 1][N] bf16: x_0 .. x_phases */
    unsigned *ctr;              /* [phases] */
    unsigned long long *t_link; /* [phases + 1]: when CTA 0 saw x_p complete (x_0: at start) */
    int n, rows, phases, mode;
};

/* wait for all but the newest `pending` groups (pending < kMaxPhases) */
__device__ __forceinline__ void cp_wait_dyn(int pending) {
    switch (pending) {
    case 0: cp_async_wait<0>(); break;
    case 1: cp_async_wait<1>(); break;
    case 2: cp_async_wait<2>(); break;
    case 3: cp_async_wait<3>(); break;
    case 4: cp_async_wait<4>(); break;
    case 5: cp_async_wait<5>(); break;
    case 6: cp_async_wait<6>(); break;
    default: cp_async_wait<7>(); break;
    }
}

/* one row's dot product over the warp: 8 bf16 per lane and step */
__device__ __forceinline__ float row_dot(const uint16_t *w, const uint16_t *xs, int n, int lane) {
    float acc = 0.0f;
    for (int k = lane * 8; k < n; k += 256) {
        float wf[8], xf[8];
        unpack8(*reinterpret_cast<const uint4 *>(w + k), wf);
        unpack8(*reinterpret_cast<const uint4 *>(xs + k), xf);
#pragma unroll
        for (int j = 0; j < 8; j++)
            acc += wf[j] * xf[j];
    }
    return m3_warp_sum(acc);
}

__global__ void __launch_bounds__(kThreads, 1) chain_kernel(const Args a) {
    extern __shared__ __align__(16) unsigned char smem[];
    uint16_t *xs = reinterpret_cast<uint16_t *>(smem); /* [n] */
    uint16_t *ws = xs + a.n;                           /* [phases][rows][n] */
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int row0 = blockIdx.x * a.rows;
    const size_t wmat = (size_t)a.n * a.n;
    if (a.mode == SMEM) { /* every phase's rows, one commit group per phase */
        const int pieces = a.rows * a.n / 8;
        for (int p = 0; p < a.phases; p++) {
            const uint16_t *src = a.w + p * wmat + (size_t)row0 * a.n;
            uint16_t *dst = ws + (size_t)p * a.rows * a.n;
            for (int i = threadIdx.x; i < pieces; i += kThreads)
                cp_async16(dst + i * 8, src + i * 8, true);
            cp_async_commit();
        }
    } else if (a.mode == L2 && threadIdx.x < a.phases * a.rows) {
        const int p = threadIdx.x / a.rows, r = threadIdx.x % a.rows;
        const uint16_t *src = a.w + p * wmat + (size_t)(row0 + r) * a.n;
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src), "r"(a.n * 2)
                     : "memory");
    }
    for (int p = 0; p < a.phases; p++) {
        if (threadIdx.x == 0) {
            if (p > 0) {
                while (ld_relaxed(&a.ctr[p - 1]) < gridDim.x)
                    __nanosleep(32);
                (void)ld_acquire(&a.ctr[p - 1]);
            }
            if (blockIdx.x == 0)
                a.t_link[p] = gtimer();
        }
        __syncthreads();
        if (a.mode != SYNC) {
            /* this link's x (written by other CTAs: L2 loads), and in smem
             * mode this phase's weights (the commit groups after it are
             * later phases' weights, which may still be on their way) */
            const uint4 *x = reinterpret_cast<const uint4 *>(a.x + (size_t)p * a.n);
            for (int i = threadIdx.x; i < a.n / 8; i += kThreads)
                reinterpret_cast<uint4 *>(xs)[i] = __ldcg(x + i);
            if (a.mode == SMEM)
                cp_wait_dyn(a.phases - 1 - p);
            __syncthreads();
            uint16_t *y = a.x + (size_t)(p + 1) * a.n;
            for (int r = warp; r < a.rows; r += kWarps) {
                const uint16_t *w = a.mode == SMEM ? ws + ((size_t)p * a.rows + r) * a.n
                                                   : a.w + p * wmat + (size_t)(row0 + r) * a.n;
                float v = row_dot(w, xs, a.n, lane);
                if (lane == 0)
                    y[row0 + r] = m3_to_bf(v);
            }
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            __threadfence();
            atomicAdd(&a.ctr[p], 1u);
        }
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) { /* when the last x is complete */
        while (ld_relaxed(&a.ctr[a.phases - 1]) < gridDim.x)
            __nanosleep(32);
        a.t_link[a.phases] = gtimer();
    }
    if (a.mode == SMEM)
        cp_async_wait<0>();
}

int main(int argc, char **argv) {
    int rows = 16, phases = 3, runs = 20;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--rows-per-cta"))
            rows = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--phases"))
            phases = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--runs"))
            runs = atoi(argv[i + 1]);
        else {
            fprintf(stderr, "usage: chain_latency [--rows-per-cta R] [--phases P] [--runs N]\n");
            return 2;
        }
    }
    cudaDeviceProp prop;
    DEV_CK(cudaGetDeviceProperties(&prop, 0));
    const int ctas = prop.multiProcessorCount, n = ctas * rows;
    if (rows < 1 || rows > 256 || phases < 1 || phases > kMaxPhases || runs < 1 || n % 8) {
        fprintf(stderr,
                "chain_latency: rows %d (1..256), phases %d (1..%d), runs %d: N = %d x "
                "%d must be a multiple of 8\n",
                rows, phases, kMaxPhases, runs, ctas, rows);
        return 2;
    }
    const size_t smem_x = (size_t)n * 2, smem_w = (size_t)phases * rows * n * 2;
    const bool smem_ok = smem_x + smem_w <= (size_t)prop.sharedMemPerBlockOptin;
    printf("chain_latency: %s, %d SMs, N = %d, %d rows per CTA, %d links; weights %.1f MB per "
           "link; smem mode needs %.0f KB of %zu KB%s\n",
           prop.name, ctas, n, rows, phases, n * (double)n * 2 / 1e6, (smem_x + smem_w) / 1024.0,
           (size_t)prop.sharedMemPerBlockOptin / 1024, smem_ok ? "" : " (skipped)");

    /* inputs: weights ~ U(-1, 1) / sqrt(N), so the chain's values stay O(1) */
    std::vector<uint16_t> hw((size_t)phases * n * n), hx(n);
    DevRng rng(0x5eedull);
    const float scale = 1.7f / sqrtf((float)n);
    for (auto &v : hw)
        v = m3_f32_to_bf16(rng.uniform() * scale);
    for (auto &v : hx)
        v = m3_f32_to_bf16(rng.uniform());
    /* CPU reference of the chain (double sums, bf16 per link) */
    std::vector<float> ref(n), cur(n);
    for (int i = 0; i < n; i++)
        cur[i] = m3_bf16_to_f32(hx[i]);
    for (int p = 0; p < phases; p++) {
        for (int r = 0; r < n; r++) {
            double acc = 0.0;
            for (int k = 0; k < n; k++)
                acc += (double)m3_bf16_to_f32(hw[((size_t)p * n + r) * n + k]) * cur[k];
            ref[r] = m3_bf16_to_f32(m3_f32_to_bf16((float)acc));
        }
        cur = ref;
    }

    Args a{};
    uint16_t *dw, *dx;
    DEV_CK(cudaMalloc(&dw, hw.size() * 2));
    DEV_CK(cudaMalloc(&dx, (size_t)(phases + 1) * n * 2));
    DEV_CK(cudaMalloc(&a.ctr, phases * sizeof(unsigned)));
    DEV_CK(cudaMalloc(&a.t_link, (phases + 1) * sizeof(unsigned long long)));
    DEV_CK(cudaMemcpy(dw, hw.data(), hw.size() * 2, cudaMemcpyHostToDevice));
    a.w = dw;
    a.x = dx;
    a.n = n;
    a.rows = rows;
    a.phases = phases;
    const size_t smem_max = smem_x + smem_w;
    DEV_CK(cudaFuncSetAttribute(chain_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                (int)std::min(smem_max, (size_t)prop.sharedMemPerBlockOptin)));
    DevL2Flush l2(prop); /* every timed run starts cold */
    DevTimer timer;
    int status = 0;
    printf("| mode | first link µs | later links µs | kernel µs | last x |\n"
           "|---|---|---|---|---|\n");
    for (int mode = 0; mode < N_MODES; mode++) {
        if (mode == SMEM && !smem_ok)
            continue;
        a.mode = mode;
        const size_t sm = mode == SMEM ? smem_max : smem_x;
        std::vector<double> first_us, link_us, kern_us;
        double rel = 0.0;
        for (int run = 0; run < runs; run++) {
            l2.flush(run);
            DEV_CK(cudaMemcpy(dx, hx.data(), (size_t)n * 2, cudaMemcpyHostToDevice));
            DEV_CK(cudaMemset(dx + n, 0xff, (size_t)phases * n * 2)); /* poison: NaN */
            DEV_CK(cudaMemset(a.ctr, 0, phases * sizeof(unsigned)));
            timer.start();
            chain_kernel<<<ctas, kThreads, sm>>>(a);
            kern_us.push_back(timer.stop_us());
            std::vector<unsigned long long> t(phases + 1);
            DEV_CK(cudaMemcpy(t.data(), a.t_link, (phases + 1) * 8, cudaMemcpyDeviceToHost));
            first_us.push_back((t[1] - t[0]) / 1e3); /* includes the weights' arrival */
            for (int p = 1; p < phases; p++)
                link_us.push_back((t[p + 1] - t[p]) / 1e3);
            if (mode != SYNC && run == 0) {
                std::vector<uint16_t> got(n);
                DEV_CK(cudaMemcpy(got.data(), dx + (size_t)phases * n, (size_t)n * 2,
                                  cudaMemcpyDeviceToHost));
                double num = 0.0, den = 0.0;
                for (int i = 0; i < n; i++) {
                    double d = (double)m3_bf16_to_f32(got[i]) - ref[i];
                    num += d * d;
                    den += (double)ref[i] * ref[i];
                }
                rel = std::isfinite(num) ? sqrt(num / (den > 0 ? den : 1.0)) : INFINITY;
                if (!(rel <= 1e-2)) {
                    fprintf(stderr, "chain_latency: mode %s: last x relL2 %.3e > 1e-2\n",
                            kModeName[mode], rel);
                    status = 1;
                }
            }
        }
        printf("| %s | %.2f | %.2f | %.2f | %s |\n", kModeName[mode], dev_median(first_us),
               dev_median(link_us), dev_median(kern_us),
               mode == SYNC ? "-" : (rel <= 1e-2 ? "ok" : "FAIL"));
    }
    return status;
}
