/*
 * The decode GEMV for 1-16 activation rows: y[t][n] = sum_k W[n][k] x[t][k]
 * (W bf16 [N][K], x bf16 [T][K], fp32 sums), on CUDA cores as the mono
 * kernels do it against tensor cores. At 8-16 rows the fused kernels'
 * GEMV phases issue ~280 instructions per 16 weight bytes (8 conversions,
 * and per row a shared load, 8 unpacks and 8 FMAs) and run at ~1.5 IPC per
 * SM (docs/PERF.md, fourth and ninth sessions), so they are instruction
 * bound where the floor says memory; one mma.sync m16n8k16 does 16 x 8 x
 * 16 multiply-adds. This program times both on one weight matrix for each
 * row count and checks both against a CPU reference (double sums; relative
 * L2 error <= 1e-3; outputs poisoned with NaN first):
 *   v1 cuda-core  the mono core's shape: a CTA tile of 8 output rows (4
 *                 warps x 2 rows), lanes over K (8 columns per 16-byte
 *                 load, 4 loads per row and 1024-column chunk), the rows'
 *                 activations staged in shared memory per chunk, warp sums;
 *   v2 mma        each warp owns 8 output rows; per 32 columns a lane loads
 *                 16 bytes of one row (row lane / 4, columns 8 x (lane % 4)
 *                 on), two m16n8k16 products with the activations as A (16
 *                 rows: the step's rows, zero past T) and the weights as B.
 *                 The 32 columns are paired with the MMA's k slots by a
 *                 fixed permutation (the same for A and B, so the products
 *                 are the same), which lets every operand come from one
 *                 16-byte load. Sums: fp32 in the tensor core's order.
 *
 *   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Isrc \
 *        dev/cuda/gemv_rows.cu -o /tmp/gemv_rows && /tmp/gemv_rows
 */
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "core/bf16.h"          /* the host's bf16 conversion (the reference) */
#include "cuda/cuda_async.cuh"  /* cp.async, mma_bf16 */
#include "cuda/cuda_common.cuh" /* unpack8, warp sums */
#include "dev_util.h"           /* DEV_CK, DevRng, dev_median, DevL2Flush, DevTimer */

constexpr int kThreads = 128; /* 4 warps */
constexpr int kKC = 1024;            /* columns staged per chunk */
constexpr int kXStride = kKC + 8;    /* bf16 per staged row: +16 bytes, no bank conflicts */
constexpr int kMaxT = 16;

/* rows [0, T) of x's chunk [kc, kc + kKC) into xs (rows T .. NT - 1 zero) */
template <int NT>
__device__ __forceinline__ void stage_chunk(uint16_t *xs, const uint16_t *x, int K, int T,
                                            int kc) {
    for (int i = threadIdx.x; i < NT * (kKC / 8); i += kThreads) {
        const int t = i / (kKC / 8), c = (i % (kKC / 8)) * 8;
        const bool in = t < T && kc + c < K;
        cp_async16(xs + t * kXStride + c, in ? x + (size_t)t * K + kc + c : x, in);
    }
    cp_async_commit();
    cp_async_wait<0>();
}

/* v1: tiles of 8 rows per CTA, a warp's 2 rows over each chunk */
template <int NR>
__global__ void __launch_bounds__(kThreads) v1_kernel(const uint16_t *W, const uint16_t *x,
                                                      float *y, int N, int K, int T) {
    __shared__ __align__(16) uint16_t xs[NR * kXStride];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int tile = blockIdx.x; tile < N / 8; tile += gridDim.x) {
        const int n0 = tile * 8 + warp * 2;
        float acc[2][NR] = {};
        for (int kc = 0; kc < K; kc += kKC) {
            uint4 wv[2][4];
#pragma unroll
            for (int r = 0; r < 2; r++)
#pragma unroll
                for (int u = 0; u < 4; u++)
                    wv[r][u] = __ldg(reinterpret_cast<const uint4 *>(
                        W + (size_t)(n0 + r) * K + kc + lane * 8 + u * 256));
            __syncthreads(); /* the previous chunk is consumed */
            stage_chunk<NR>(xs, x, K, T, kc);
            __syncthreads();
#pragma unroll
            for (int u = 0; u < 4; u++) {
                const int k = lane * 8 + u * 256;
                float wf[2][8];
                unpack8(wv[0][u], wf[0]);
                unpack8(wv[1][u], wf[1]);
#pragma unroll
                for (int t = 0; t < NR; t++) {
                    float xf[8];
                    unpack8(*reinterpret_cast<const uint4 *>(xs + t * kXStride + k), xf);
#pragma unroll
                    for (int r = 0; r < 2; r++)
#pragma unroll
                        for (int j = 0; j < 8; j++)
                            acc[r][t] += wf[r][j] * xf[j];
                }
            }
        }
#pragma unroll
        for (int r = 0; r < 2; r++)
#pragma unroll
            for (int t = 0; t < NR; t++) {
                const float v = m3_warp_sum(acc[r][t]);
                if (lane == 0 && t < T)
                    y[(size_t)t * N + n0 + r] = v;
            }
    }
}

/* v2: a warp's 8 rows on tensor cores (NT = 8: rows g only; 16: g and g + 8) */
template <int NT>
__global__ void __launch_bounds__(kThreads) v2_kernel(const uint16_t *W, const uint16_t *x,
                                                      float *y, int N, int K, int T) {
    __shared__ __align__(16) uint16_t xs[NT * kXStride];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
    for (int tile = blockIdx.x; tile < N / 32; tile += gridDim.x) {
        const int n = tile * 32 + warp * 8 + g; /* the weight row this lane loads */
        float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};   /* (token g, rows 2tq, 2tq+1), (g + 8, ...) */
        const uint16_t *wrow = W + (size_t)n * K + 8 * tq;
        for (int kc = 0; kc < K; kc += kKC) {
            /* the chunk's 1024 columns: 32 steps of 32, 8 loads in flight */
            __syncthreads();
            stage_chunk<NT>(xs, x, K, T, kc);
            __syncthreads();
#pragma unroll 1
            for (int s0 = 0; s0 < kKC / 32; s0 += 8) {
                uint4 wv[8];
#pragma unroll
                for (int u = 0; u < 8; u++)
                    wv[u] = __ldg(reinterpret_cast<const uint4 *>(wrow + kc + (s0 + u) * 32));
#pragma unroll
                for (int u = 0; u < 8; u++) {
                    const int k = (s0 + u) * 32 + 8 * tq;
                    const uint4 xg = *reinterpret_cast<const uint4 *>(xs + g * kXStride + k);
                    uint4 xh = make_uint4(0u, 0u, 0u, 0u);
                    if (NT == 16)
                        xh = *reinterpret_cast<const uint4 *>(xs + (g + 8) * kXStride + k);
                    const uint32_t a1[4] = {xg.x, xh.x, xg.y, xh.y};
                    const uint32_t a2[4] = {xg.z, xh.z, xg.w, xh.w};
                    mma_bf16(d, a1, wv[u].x, wv[u].y);
                    mma_bf16(d, a2, wv[u].z, wv[u].w);
                }
            }
        }
        const int r0 = tile * 32 + warp * 8 + 2 * tq;
        if (g < T) {
            y[(size_t)g * N + r0] = d[0];
            y[(size_t)g * N + r0 + 1] = d[1];
        }
        if (g + 8 < T) {
            y[(size_t)(g + 8) * N + r0] = d[2];
            y[(size_t)(g + 8) * N + r0 + 1] = d[3];
        }
    }
}

static void launch(int version, int T, int ctas, const uint16_t *W, const uint16_t *x, float *y,
                   int N, int K) {
    if (version == 1) {
        switch (T <= 1 ? 1 : T <= 2 ? 2 : T <= 4 ? 4 : T <= 8 ? 8 : 16) {
        case 1: v1_kernel<1><<<ctas, kThreads>>>(W, x, y, N, K, T); break;
        case 2: v1_kernel<2><<<ctas, kThreads>>>(W, x, y, N, K, T); break;
        case 4: v1_kernel<4><<<ctas, kThreads>>>(W, x, y, N, K, T); break;
        case 8: v1_kernel<8><<<ctas, kThreads>>>(W, x, y, N, K, T); break;
        default: v1_kernel<16><<<ctas, kThreads>>>(W, x, y, N, K, T); break;
        }
    } else if (T <= 8) {
        v2_kernel<8><<<ctas, kThreads>>>(W, x, y, N, K, T);
    } else {
        v2_kernel<16><<<ctas, kThreads>>>(W, x, y, N, K, T);
    }
}

int main(int argc, char **argv) {
    int runs = 15;
    if (!dev_runs_arg(argc, argv, "gemv_rows", &runs))
        return 2;
    cudaDeviceProp prop;
    DEV_CK(cudaGetDeviceProperties(&prop, 0));
    const int N = 12288, K = 6144; /* 151 MB of bf16 weights: more than L2 */
    DevRng rng(0x5eedull);
    std::vector<uint16_t> hw((size_t)N * K), hx((size_t)kMaxT * K);
    const float scale = 1.0f / sqrtf((float)K);
    for (auto &v : hw)
        v = m3_f32_to_bf16(rng.uniform() * scale);
    for (auto &v : hx)
        v = m3_f32_to_bf16(rng.uniform());
    uint16_t *dw, *dx;
    float *dy;
    DEV_CK(cudaMalloc(&dw, hw.size() * 2));
    DEV_CK(cudaMalloc(&dx, hx.size() * 2));
    DEV_CK(cudaMalloc(&dy, (size_t)kMaxT * N * 4));
    DEV_CK(cudaMemcpy(dw, hw.data(), hw.size() * 2, cudaMemcpyHostToDevice));
    DEV_CK(cudaMemcpy(dx, hx.data(), hx.size() * 2, cudaMemcpyHostToDevice));
    /* the reference for all 16 rows (a row's sums do not depend on T) */
    std::vector<double> ref((size_t)kMaxT * N);
    {
        std::vector<float> wf(K), xf((size_t)kMaxT * K);
        for (size_t i = 0; i < xf.size(); i++)
            xf[i] = m3_bf16_to_f32(hx[i]);
        for (int n = 0; n < N; n++) {
            for (int k = 0; k < K; k++)
                wf[k] = m3_bf16_to_f32(hw[(size_t)n * K + k]);
            for (int t = 0; t < kMaxT; t++) {
                double s = 0.0;
                for (int k = 0; k < K; k++)
                    s += (double)wf[k] * xf[(size_t)t * K + k];
                ref[(size_t)t * N + n] = s;
            }
        }
    }
    DevL2Flush l2(prop);
    DevTimer timer;
    const int ctas = prop.multiProcessorCount * 3;
    printf("gemv_rows: %s, %d SMs; W %d x %d bf16 (%.0f MB), %d CTAs of %d threads; median of %d "
           "runs, L2 flushed before each\n",
           prop.name, prop.multiProcessorCount, N, K, (double)N * K * 2 / 1e6, ctas, kThreads,
           runs);
    printf("| rows | v1 cuda-core µs (GB/s) | v2 mma µs (GB/s) | v1 / v2 | rel. L2 error v1, v2 |\n"
           "|---|---|---|---|---|\n");
    int status = 0;
    const int rows_list[] = {1, 2, 4, 8, 16};
    for (int T : rows_list) {
        double us[3] = {0, 0, 0}, err[3] = {0, 0, 0};
        for (int v = 1; v <= 2; v++) {
            std::vector<double> t_us;
            for (int run = 0; run < runs; run++) {
                l2.flush(run);
                DEV_CK(cudaMemset(dy, 0xff, (size_t)kMaxT * N * 4)); /* poison: NaN */
                timer.start();
                launch(v, T, ctas, dw, dx, dy, N, K);
                t_us.push_back(timer.stop_us());
            }
            us[v] = dev_median(t_us);
            std::vector<float> got((size_t)T * N);
            DEV_CK(cudaMemcpy(got.data(), dy, got.size() * 4, cudaMemcpyDeviceToHost));
            double num = 0.0, den = 0.0;
            for (size_t i = 0; i < got.size(); i++) {
                const double dlt = (double)got[i] - ref[i];
                num += dlt * dlt;
                den += ref[i] * ref[i];
            }
            err[v] = std::isfinite(num) ? sqrt(num / (den > 0 ? den : 1.0)) : INFINITY;
            if (!(err[v] <= 1e-3)) {
                fprintf(stderr, "gemv_rows: v%d rows %d: relative L2 error %.3e > 1e-3\n", v, T,
                        err[v]);
                status = 1;
            }
        }
        const double gb = (double)N * K * 2 / 1e3;
        printf("| %d | %.1f (%.0f) | %.1f (%.0f) | %.2f | %.1e, %.1e |\n", T, us[1], gb / us[1],
               us[2], gb / us[2], us[1] / us[2], err[1], err[2]);
    }
    return status;
}
