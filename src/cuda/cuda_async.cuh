/*
 * Device helpers shared by the stock kernels (cuda_attention.cu) and the
 * mono path's fused kernels (cuda_mono*), so both compute the same bits
 * with one copy of the code: cp.async (global to shared, bypassing L1), the
 * CPU's first-maximum rule, and the index dot products in the CPU's
 * accumulation order.
 */
#ifndef M3_CUDA_CUDA_ASYNC_CUH
#define M3_CUDA_CUDA_ASYNC_CUH

#include <math.h>
#include <stdint.h>

__device__ __forceinline__ uint32_t smem_u32(const void *p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

/* 16 bytes global -> shared, bypassing L1; with fill false the 16 bytes are
 * zeroed and nothing is read. */
__device__ __forceinline__ void cp_async16(void *dst, const void *src, bool fill) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
                 "r"(fill ? 16 : 0)
                 : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

/* The CPU's running max folded over two consecutive runs of positions:
 * `later` replaces `earlier` only if strictly greater or NaN, and a NaN
 * stays. Keeps the first maximal value (so -0 vs +0 matches the CPU too). */
__device__ __forceinline__ float first_max(float earlier, float later) {
    if (isnan(earlier))
        return earlier;
    return (isnan(later) || later > earlier) ? later : earlier;
}

/* first_max over the warp's lanes in lane (= position) order */
__device__ __forceinline__ float warp_first_max(float v) {
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        float other = __shfl_xor_sync(0xffffffffu, v, o);
        v = (lane & o) ? first_max(other, v) : first_max(v, other);
    }
    return v;
}

/* Dots of one key row (bf16, shared) with HB queries (fp64, shared) as
 * m3_dot_f32 forms them: element i goes to accumulator i % 8 in order,
 * then the tail 4, 2, 1 apart, then one rounding to fp32. Products of fp32
 * values are exact in fp64, so each fma equals the CPU's multiply-then-add
 * and the sums round identically. (Building the doubles from the bf16 bits
 * with integer ops instead of F2F measured slower: more issue slots.) */
template <int HB>
__device__ __forceinline__ void idx_dots(const unsigned char *krow, const double *q, int dim,
                                         float (&d)[HB]) {
    double acc[HB][8];
#pragma unroll
    for (int h = 0; h < HB; h++)
#pragma unroll
        for (int j = 0; j < 8; j++)
            acc[h][j] = 0.0;
#pragma unroll 2
    for (int c = 0; c < dim / 8; c++) {
        uint4 raw = *reinterpret_cast<const uint4 *>(krow + c * 16);
        uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
        double k[8];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            k[2 * i] = (double)__uint_as_float(w[i] << 16);
            k[2 * i + 1] = (double)__uint_as_float(w[i] & 0xffff0000u);
        }
#pragma unroll
        for (int h = 0; h < HB; h++) {
            const double2 *qq = reinterpret_cast<const double2 *>(q + h * dim + c * 8);
#pragma unroll
            for (int i = 0; i < 4; i++) {
                double2 qv = qq[i];
                acc[h][2 * i] = __fma_rn(qv.x, k[2 * i], acc[h][2 * i]);
                acc[h][2 * i + 1] = __fma_rn(qv.y, k[2 * i + 1], acc[h][2 * i + 1]);
            }
        }
    }
#pragma unroll
    for (int h = 0; h < HB; h++) {
#pragma unroll
        for (int j = 0; j < 4; j++)
            acc[h][j] = __dadd_rn(acc[h][j], acc[h][j + 4]);
        acc[h][0] = __dadd_rn(acc[h][0], acc[h][2]);
        acc[h][1] = __dadd_rn(acc[h][1], acc[h][3]);
        d[h] = __double2float_rn(__dadd_rn(acc[h][0], acc[h][1]));
    }
}

#endif
