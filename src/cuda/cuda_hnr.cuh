/*
 * One unit of the head norm + RoPE op (cuda_elementwise.cu's
 * head_norm_rope_kernel) as device code, shared with the fused drafter
 * layers (cuda_draft_layers.cu), so both round a head the same way.
 */
#ifndef M3_CUDA_CUDA_HNR_CUH
#define M3_CUDA_CUDA_HNR_CUH

#include "cuda/cuda_common.cuh"

__device__ __forceinline__ void load8f(const float *p, float f[8]) {
    float4 a = reinterpret_cast<const float4 *>(p)[0], b = reinterpret_cast<const float4 *>(p)[1];
    f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w, f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
}

/* The 8 outputs of unit [d0, d0 + 8) of one head when dim and half are
 * multiples of 8: the unit then lies wholly in one RoPE half (or past
 * rotary_dim), its partner is one unit too, and every shared-memory read is
 * a 16-byte vector (2-byte reads at a 16-byte lane stride would conflict
 * on the banks). Same operations, same order as hnr_value. */
__device__ __forceinline__ uint4 hnr_unit8(const uint16_t *hx, int d0, float r, const float *wp1,
                                           const float *cs, const float *sn, int half) {
    float x[8], w[8];
    unpack8(*reinterpret_cast<const uint4 *>(hx + d0), x);
    load8f(wp1 + d0, w);
#pragma unroll
    for (int j = 0; j < 8; j++)
        x[j] = __fmul_rn(__fmul_rn(x[j], r), w[j]);
    if (d0 < 2 * half) {
        bool lo = d0 < half;
        int p0 = lo ? d0 + half : d0 - half, i0 = lo ? d0 : p0;
        float xp[8], wp[8], c[8], sn8[8];
        unpack8(*reinterpret_cast<const uint4 *>(hx + p0), xp);
        load8f(wp1 + p0, wp);
        load8f(cs + i0, c);
        load8f(sn + i0, sn8);
#pragma unroll
        for (int j = 0; j < 8; j++) {
            float yp = __fmul_rn(__fmul_rn(xp[j], r), wp[j]);
            float a = __fmul_rn(x[j], c[j]), b = __fmul_rn(yp, sn8[j]);
            x[j] = lo ? __fsub_rn(a, b) : __fadd_rn(a, b);
        }
    }
    return pack8(x);
}

#endif
