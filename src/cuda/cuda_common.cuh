/*
 * Device-side helpers shared by the CUDA kernels: bf16 conversions with the
 * rounding the SPEC uses (round to nearest even, NaN kept), warp and block
 * reductions, and the constants of the paged cache layout. Kernels compute
 * in fp32 (accumulation order is theirs; the CPU backend is the reference
 * and tests compare with a tolerance), except where a selection must match
 * the CPU exactly (index scores accumulate in fp64 there).
 */
#ifndef M3_CUDA_CUDA_COMMON_CUH
#define M3_CUDA_CUDA_COMMON_CUH

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#define M3_PAGE 128 /* tokens per page = sparse block */

__device__ __forceinline__ float m3_bf(uint16_t h) {
    return __uint_as_float((uint32_t)h << 16);
}

/* fp32 -> bf16 bits, round to nearest even: the hardware conversion (one
 * F2FP instruction; pack8 converts two values per instruction), the same
 * bits as the CPU backend's m3_f32_to_bf16 for every value but NaN, which
 * comes out as the canonical quiet NaN 0x7fff where the CPU keeps the
 * payload (tests compare values, and a NaN is a NaN). The integer rounding
 * it replaced took ~7 instructions a value, 1,700 of the one-row post
 * kernel's 25,000 (docs/PERF.md, eleventh session). */
__device__ __forceinline__ uint16_t m3_to_bf(float f) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(f));
}

__device__ __forceinline__ float m3_round_bf(float f) { return m3_bf(m3_to_bf(f)); }

/* eight bf16 (one 16-byte vector, element 2k in the low half of word k) */
__device__ __forceinline__ void unpack8(uint4 v, float f[8]) {
    uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 4; k++) {
        f[2 * k] = __uint_as_float(w[k] << 16);
        f[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
    }
}

__device__ __forceinline__ uint4 pack8(const float f[8]) {
    uint32_t w[4];
#pragma unroll
    for (int k = 0; k < 4; k++) { /* .x (the low half) is f[2k] */
        __nv_bfloat162 p = __floats2bfloat162_rn(f[2 * k], f[2 * k + 1]);
        w[k] = *reinterpret_cast<uint32_t *>(&p);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
}

/* the quiet NaN the kernels write for broken metadata (tests look for it) */
__device__ __forceinline__ float m3_qnan() { return __int_as_float(0x7fc00000); }

/* e4m3 (fn) -> fp32 */
__device__ __forceinline__ float m3_e4m3(uint8_t b) {
    int sign = b >> 7, exp = (b >> 3) & 0xf, man = b & 7;
    float v;
    if (exp == 0xf && man == 7)
        return __int_as_float(0x7fc00000);
    if (exp == 0)
        v = ldexpf((float)man, -9);
    else
        v = ldexpf(1.0f + (float)man * 0.125f, exp - 7);
    return sign ? -v : v;
}

/* 2^(s-127); 255 is NaN */
__device__ __forceinline__ float m3_e8m0(uint8_t s) {
    if (s == 255)
        return __int_as_float(0x7fc00000);
    return ldexpf(1.0f, (int)s - 127);
}

__device__ __forceinline__ float m3_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float m3_warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1)
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ double m3_warp_sum_d(double v) {
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* Sum over the block (blockDim.x a multiple of 32, at most 1024); every
 * thread gets the result. scratch: 32 floats of shared memory. */
__device__ __forceinline__ float m3_block_sum(float v, float *scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = m3_warp_sum(v);
    __syncthreads(); /* scratch may still be read by a previous call */
    if (lane == 0)
        scratch[warp] = v;
    __syncthreads();
    v = lane < nwarps ? scratch[lane] : 0.0f;
    return m3_warp_sum(v);
}

/* 1 / (1 + exp(-x)) in fp32 */
__device__ __forceinline__ float m3_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

/* SwiGLU-OAI: g = min(gate, limit), u = clamp(up, +-limit), g sig(alpha g) (u+1);
 * comparisons (not fminf) so a NaN input stays NaN */
__device__ __forceinline__ float m3_swiglu_oai(float gate, float up, float alpha, float limit) {
    float g = gate > limit ? limit : gate;
    float u = up > limit ? limit : (up < -limit ? -limit : up);
    return g * m3_sigmoid(alpha * g) * (u + 1.0f);
}

#endif
