/*
 * Sums over K that do not depend on the TP world. A dot product over the
 * full K of a weight is taken as n = m3_k_chunks(K) fixed chunks
 * (core/tensor.h: 8, 4 or 2 chunks of a multiple of 256 columns where K
 * allows); each chunk is summed in fp32 by the same code whatever the
 * world, and the chunks are combined as a pairwise tree, for 8:
 * ((c0 + c1) + (c2 + c3)) + ((c4 + c5) + (c6 + c7)). A row-parallel rank of
 * a world W dividing n holds n / W whole chunks, sums them as the same
 * subtree, and the all-reduce combines the ranks' partials as the tree's
 * top levels over rank ids (cuda_comm.cu). So TP 1, 2, 4 (and 8 where n is
 * 8) give the same bits (docs/ARCHITECTURE.md, "Sums that do not depend
 * on the world"). Column-parallel linears hold the full K: their chunks
 * are the same on every rank, and how many output rows a rank owns
 * changes nothing in them.
 *
 * Chunk c of n over K columns is [c * K / n, (c + 1) * K / n) (floors), so
 * a rank's slice of n / W chunks has the same bounds as the global chunks.
 */
#ifndef M3_CUDA_CUDA_KSUM_CUH
#define M3_CUDA_CUDA_KSUM_CUH

#include "cuda/cuda_common.cuh"

#define KSUM_LEVELS 4 /* a tree over at most 8 leaves */

/* Columns of chunk c of n over K. */
__host__ __device__ __forceinline__ void ksum_bounds(int64_t K, int n, int c, int *k0, int *k1) {
    *k0 = (int)((int64_t)c * K / n);
    *k1 = (int)((int64_t)(c + 1) * K / n);
}

/* Push leaf i (0-based, i < 8) of a pairwise tree: lv[l] holds the pending
 * left subtree of 2^l leaves. After a power of two g of pushes the whole
 * sum is lv[log2 g]; ksum_fold gives it for any count. (Spelled out, not
 * a loop: lv must stay in registers.) */
template <typename F>
__device__ __forceinline__ void ksum_push(F (&lv)[KSUM_LEVELS], int i, F v) {
    if (!(i & 1)) {
        lv[0] = v;
        return;
    }
    v = lv[0] + v; /* left (earlier) subtree + right */
    if (!(i & 2)) {
        lv[1] = v;
        return;
    }
    v = lv[1] + v;
    if (!(i & 4)) {
        lv[2] = v;
        return;
    }
    lv[3] = lv[2] + v;
}

/* The tree's sum after n pushes (1 <= n <= 8): the pending subtrees, larger
 * (earlier) ones on the left. For a power of two that is lv[log2 n]. */
template <typename F>
__device__ __forceinline__ F ksum_fold(const F (&lv)[KSUM_LEVELS], int n) {
    if (n == 8)
        return lv[3];
    F v = 0;
    bool have = false;
    if (n & 4) {
        v = lv[2];
        have = true;
    }
    if (n & 2) {
        v = have ? v + lv[1] : lv[1];
        have = true;
    }
    if (n & 1)
        v = have ? v + lv[0] : lv[0];
    return v;
}

/* The pairwise tree of n values p[0], p[stride], ... (n <= 8). */
template <typename F, typename Load>
__device__ __forceinline__ F ksum_tree(int n, Load load) {
    F lv[KSUM_LEVELS];
#pragma unroll
    for (int i = 0; i < 8; i++)
        if (i < n)
            ksum_push(lv, i, load(i));
    return ksum_fold(lv, n);
}

/* Reduce the NV = R * T values v[j / T][j % T] of each lane over the warp
 * so each value's sum ends in a lane: value j's total lands in lanes
 * [j * 32 / NV, (j + 1) * 32 / NV) (NV a power of two, 2..32). A reduce-scatter: NV - 1 + log2(32 / NV)
 * shuffles instead of NV * 5 for a butterfly per value. Each addition is
 * own + partner's, which both lanes of a pair form alike (addition
 * commutes), so the order is fixed by the code alone. */
/* One level of ksum_warp_scatter: values [0, 2H) -> [0, H) over lane bit M;
 * a template per level, so every index is a constant (v stays in
 * registers). */
template <int H, int M, int R, int T>
__device__ __forceinline__ void ksum_scatter_level(float (&v)[R][T], bool up) {
#pragma unroll
    for (int i = 0; i < H; i++) {
        const float lo = v[i / T][i % T], hi = v[(H + i) / T][(H + i) % T];
        v[i / T][i % T] = (up ? hi : lo) + __shfl_xor_sync(0xffffffffu, up ? lo : hi, M);
    }
    if constexpr (H > 1)
        ksum_scatter_level<H / 2, M / 2>(v, ((threadIdx.x & 31) & (M / 2)) != 0);
}

template <int R, int T>
__device__ __forceinline__ float ksum_warp_scatter(float (&v)[R][T]) {
    constexpr int NV = R * T;
    static_assert(NV >= 2 && NV <= 32 && (NV & (NV - 1)) == 0, "R * T: a power of two, 2..32");
    ksum_scatter_level<NV / 2, 16>(v, ((threadIdx.x & 31) & 16) != 0);
    float s = v[0][0];
#pragma unroll
    for (int m = 16 * 2 / NV / 2; m >= 1; m /= 2) /* the lane bits below the levels' */
        s += __shfl_xor_sync(0xffffffffu, s, m);
    return s;
}

/* Which value of NV this lane holds after ksum_warp_scatter, and whether it
 * is the first lane holding it (the one that stores). */
template <int NV>
__device__ __forceinline__ int ksum_lane_value(bool *first) {
    const int lane = threadIdx.x & 31;
    *first = lane % (32 / NV) == 0;
    return lane / (32 / NV);
}

#endif
